// MoE layer forward: router linear, router, experts with LoRA; saves what the
// backward needs in the planned arena.
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "contracts/engine/clauses.hpp"
#include "contracts/experts/experts.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/layer/layer.hpp"
#include "moecert/isa.hpp"
#include "moecert/router.hpp"
#include "ops/core/task.hpp"
#include "ops/layer/router_linear.hpp"
#include "ops/layer/state.hpp"
#include "ops/router/kinds.hpp"
#include "ops/workspace/planner.hpp"

namespace moecert::layer {

Saved::Saved() : impl_(std::make_unique<Impl>()) {}
Saved::~Saved() = default;
Saved::Saved(Saved&&) noexcept = default;
Saved& Saved::operator=(Saved&&) noexcept = default;
bool Saved::valid() const { return impl_->valid; }
std::size_t Saved::bytes() const { return impl_->arena.capacity(); }
MatView<const std::int32_t> Saved::idx() const { return impl_->idx_view(); }
MatView<const float> Saved::weights() const { return impl_->weights_view(); }
MatView<const float> Saved::logits() const {
  const Impl& s = *impl_;
  const std::size_t R = router_width(s.cfg);
  return s.valid && s.logits_kept ? MatView<const float>{s.logits, s.tokens, R, R}
                                  : MatView<const float>{};
}
MatView<const float> Saved::router_dw() const {
  const Impl& s = *impl_;
  if (!s.valid || !s.router_grads) return {};
  return {s.arena.get<float>("router.dw", s.tokens * s.topk), s.tokens, s.topk, s.topk};
}
MatView<const float> Saved::router_dz() const {
  const Impl& s = *impl_;
  if (!s.valid || !s.router_grads) return {};
  const std::size_t R = router_width(s.cfg);
  return {s.arena.get<float>("router.dz", s.tokens * R), s.tokens, R, R};
}

Weights Weights::stacked(const MoeConfig& cfg, const experts::PackedExperts& experts,
                         const float* router_w, const float* router_b, const float* router_bias,
                         const Lora& lora) {
  const auto R = router_width(cfg), H = static_cast<std::size_t>(cfg.hidden);
  Weights w;
  w.experts = &experts;
  w.router_w = {router_w, R, H};
  w.router_b = {router_b, R};
  if (static_cast<std::size_t>(cfg.router) < kRouterKinds &&
      contracts::router_kind(cfg.router).expert_bias)
    w.router_bias = {router_bias, static_cast<std::size_t>(cfg.experts)};
  if (cfg.lora_rank) w.lora = lora;
  return w;
}

void forward(const MoeConfig& cfg, const Weights& w, MatView<const bf16> x, MatView<float> y,
             Saved& saved, const ForwardOptions& opt) {
  validate(cfg);
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  detail::Checker chk{"layer.forward"};
  Saved::Impl& s = saved.impl();
  s.valid = false;  // a forward that fails a precondition under observe saves nothing
  s.logits_kept = s.router_grads = false;
  contracts::layer_forward_pre(chk, cfg, w, x, y);
  if (chk.stop()) return;
  s.cfg = cfg;
  s.tokens = x.rows, s.topk = static_cast<std::size_t>(cfg.topk);
  const std::size_t t_count = x.rows, k = static_cast<std::size_t>(cfg.topk);
  const std::size_t outs = router_width(cfg);
  const workspace::Plan plan =
      workspace::plan(cfg, static_cast<std::int64_t>(t_count),
                      {.training = opt.training, .memory_cap = opt.memory_cap});
  if (plan.buffers.empty()) return;  // a plan clause failed under observe
  const auto E = static_cast<std::size_t>(cfg.experts), H = static_cast<std::size_t>(cfg.hidden);
  const auto I = static_cast<std::size_t>(cfg.inter);
  const experts::Lora lora = cfg.lora_rank ? w.lora : experts::Lora{};
  if (!experts::pack_lora<clauses::layer::kFwdLoraFinite, clauses::layer::kFwdLoraRange,
                          clauses::layer::kFwdLoraPadding>(lora, E, H, I, opt.training, s.lora,
                                                           chk))
    return;
  s.arena.bind(plan, chk);
  s.arena.enter(workspace::f_route, chk);
  s.logits = s.arena.get<float>("router.logits", t_count * outs);
  s.idx = s.arena.get<std::int32_t>("router.idx", t_count * k);
  s.weights = s.arena.get<float>("router.weights", t_count * k);
  const MatView<float> z(s.logits, t_count, outs, outs);
  s.isa = opt.isa.value_or(default_isa());
  linear::router_linear(gemm::kernel_info(s.isa), x, w.router_w, w.router_b, z);
  router::router_ops(cfg.router)
      .forward(contracts::router_settings(cfg), z, w.router_bias,
               MatView<std::int32_t>(s.idx, t_count, k, k),
               MatView<float>(s.weights, t_count, k, k));
  std::optional<contracts::ExpertsProbe> probe;
  if (chk.will_check(clauses::layer::kFwdProbe)) probe.emplace(*w.experts, s.probe_sums, &lora);
  experts::train_forward_steps(*w.experts, s, x, y, opt.training, probe ? &*probe : nullptr);
  s.arena.leave(chk);
  contracts::LayerSaved view = saved_view(s);
  view.train.rows.probe = probe ? &*probe : nullptr;
  contracts::layer_forward_post(chk, cfg, w, x, y, view);
  s.logits_kept = opt.training;  // router.logits live until the backward's router phase
}

}  // namespace moecert::layer
