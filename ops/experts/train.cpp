// The experts training op with the caller's routing: forward_train and
// backward over a planned arena (the layer runs the same steps around its
// router).
#include "ops/experts/train.hpp"

#include <algorithm>
#include <optional>

#include "contracts/engine/clauses.hpp"
#include "contracts/experts/experts.hpp"
#include "contracts/experts/train.hpp"
#include "moecert/isa.hpp"
#include "ops/core/task.hpp"
#include "ops/workspace/planner.hpp"

namespace moecert::experts {

Saved::Saved() : impl_(std::make_unique<Impl>()) {}
Saved::~Saved() = default;
Saved::Saved(Saved&&) noexcept = default;
Saved& Saved::operator=(Saved&&) noexcept = default;
bool Saved::valid() const { return impl_->valid; }
std::size_t Saved::bytes() const { return impl_->arena.capacity(); }

void train_forward_steps(const PackedExperts& w, TrainState& s, MatView<const bf16> x,
                         MatView<float> y, bool training, contracts::ExpertsProbe* probe) {
  s.digests.valid = false;
  if (probe && training) probe->record_digests(s.digests);
  forward_impl(w, s.lora.rank ? &s.lora : nullptr, x, s.idx_view(), s.weights_view(), y,
               gemm::kernel_info(s.isa), s.arena, s.st, training,  // c1: read by the backward only
               probe);
  s.training = training;
  s.valid = true;
  ++s.generation;
}

void forward_train(const PackedExperts& w, const Lora& lora, MatView<const bf16> x,
                   MatView<const std::int32_t> idx, MatView<const float> weights, MatView<float> y,
                   Saved& saved, const TrainOptions& opt) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  detail::Checker chk{"experts.forward_train"};
  Saved::Impl& s = saved.impl();
  s.valid = false;  // a forward that fails a precondition under observe saves nothing
  contracts::experts_train_forward_pre(chk, w, lora, x, idx, weights, y);
  if (chk.stop()) return;
  s.tokens = x.rows, s.topk = idx.cols;
  s.experts = w.experts(), s.hidden = w.hidden(), s.inter = w.inter(), s.rank = lora.rank,
  s.alpha = lora.alpha;
  const workspace::Plan plan =
      workspace::plan_shape({s.experts, s.hidden, s.inter, s.topk, s.rank, s.tokens, 0},
                            opt.training, opt.memory_cap, chk);
  if (plan.buffers.empty()) return;  // a plan clause failed under observe
  namespace k = clauses::experts_train;
  if (!pack_lora<k::kFwdLoraFinite, k::kFwdLoraRange, k::kFwdLoraPadding>(
          lora, s.experts, s.hidden, s.inter, opt.training, s.lora, chk))
    return;
  s.arena.bind(plan, chk);
  s.arena.enter(workspace::f_route, chk);
  const std::size_t tk = s.tokens * s.topk;
  s.idx = s.arena.get<std::int32_t>("router.idx", tk);
  s.weights = s.arena.get<float>("router.weights", tk);
  for (std::size_t t = 0; t < s.tokens; ++t) {
    std::copy(idx.row(t), idx.row(t) + s.topk, s.idx + t * s.topk);
    std::copy(weights.row(t), weights.row(t) + s.topk, s.weights + t * s.topk);
  }
  s.isa = opt.isa.value_or(default_isa());
  std::optional<contracts::ExpertsProbe> probe;
  if (chk.will_check(k::kFwdProbe)) probe.emplace(w, s.probe_sums, &lora);
  train_forward_steps(w, s, x, y, opt.training, probe ? &*probe : nullptr);
  s.arena.leave(chk);
  contracts::TrainSaved view = saved_view(s);
  view.rows.probe = probe ? &*probe : nullptr;
  contracts::experts_train_forward_post(chk, w, lora, x, y, view);
}

void backward(const PackedExperts& w, const Lora& lora, MatView<const bf16> x,
              MatView<const float> dy, Saved& saved, const Gradients& grads) {
  const moecert::detail::FpDefaults fp;
  detail::Checker chk{"experts.backward"};
  contracts::experts_backward_pre(chk, w, lora, x, dy, saved_view(saved.impl()), grads);
  if (chk.stop()) return;
  Saved::Impl& s = saved.impl();
  namespace k = clauses::experts_train;
  // saved_finite, saved_intact and grad_finite are judged inside the passes
  // that read the saved rows and write the gradients; dL/dw is formed in
  // the workspace and copied out once saved_finite has passed.
  std::optional<contracts::SavedFiniteScan> saved_judge;
  std::optional<contracts::GradFiniteScan> grads_judge;
  MOECERT_CONTRACT(chk, k::kBwdSavedFinite) {
    saved_judge.emplace(chk, k::kBwdSavedFinite, saved_view(s), w.inter(), nullptr, 0);
  }
  MOECERT_CONTRACT(chk, k::kBwdGradFinite) {
    grads_judge.emplace(
        contracts::experts_grad_outputs(grads, w.experts(), w.hidden(), w.inter(), lora.rank));
  }
  std::optional<contracts::BackwardProbe> probe;
  if (chk.will_check(k::kBwdProbe)) probe.emplace(w, lora, s.probe_sums);
  std::optional<contracts::SavedIntactScan> intact;
  judge_saved_intact<k::kBwdSavedIntact>(s, chk, intact);
  if (intact && saved_judge) saved_judge->c1_by_row();
  const BackwardJudges judges{saved_judge ? &*saved_judge : nullptr,
                              grads_judge ? &*grads_judge : nullptr, probe ? &*probe : nullptr,
                              intact ? &*intact : nullptr};
  s.arena.enter(workspace::b_gather, chk);
  if (judges.saved) judges.saved->begin();
  if (chk.stop()) return;
  const bool expert_path = wants_expert_path(grads);
  const MatView<float> dw = grads.dweights.empty()
                                ? MatView<float>{}
                                : MatView<float>(s.arena.get<float>("router.dw", s.tokens * s.topk),
                                                 s.tokens, s.topk, s.topk);
  const DyRows d = backward_dh(w, s, dy, expert_path, dw, judges, chk);
  backward_expert(w, s, x, dy, d, grads, expert_path, judges, chk);
  if (chk.stop()) return;
  for (std::size_t t = 0; t < dw.rows; ++t)
    std::copy(dw.row(t), dw.row(t) + dw.cols, grads.dweights.row(t));
  s.arena.leave(chk);
  contracts::experts_backward_post(chk, w, lora, x, dy, saved_view(s), grads,
                                   grads_judge ? &*grads_judge : nullptr,
                                   probe ? &*probe : nullptr);
}

}  // namespace moecert::experts
