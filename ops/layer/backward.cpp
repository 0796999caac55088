// MoE layer backward: the experts op's backward (ops/experts/backward.cpp)
// with the router path around it: dL/dw from the experts, the router's
// backward into dz, then the router linear's gradients and its share of dx.
// Every output element has one writer and a fixed summation order: the same
// bits for any thread count.
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "contracts/engine/clauses.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/layer/layer.hpp"
#include "contracts/layer/router_linear_probe.hpp"
#include "moecert/router.hpp"
#include "ops/core/task.hpp"
#include "ops/core/views.hpp"
#include "ops/gemm/row_sums.hpp"
#include "ops/layer/router_linear.hpp"
#include "ops/layer/state.hpp"
#include "ops/router/kinds.hpp"
#include "ops/workspace/planner.hpp"

namespace moecert::layer {

void backward(const MoeConfig& cfg, const Weights& w, MatView<const bf16> x,
              MatView<const float> dy, Saved& saved, const Gradients& grads,
              const BackwardOptions& opt) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  detail::Checker chk{"layer.backward"};
  contracts::layer_backward_pre(chk, cfg, w, x, dy, saved_view(saved), grads);
  if (chk.stop()) return;
  Saved::Impl& s = saved.impl();
  s.logits_kept = s.router_grads = false;  // the backward's buffers reuse the logits' bytes
  const std::size_t T = x.rows, K = static_cast<std::size_t>(cfg.topk);
  const std::size_t R = router_width(cfg);
  const gemm::KernelInfo& kernel = gemm::kernel_info(s.isa);
  workspace::Arena& arena = s.arena;

  // saved_finite, saved_intact and grad_finite are judged inside the passes
  // that read the saved rows and write the gradients (dL/dw stays in the
  // workspace).
  std::optional<contracts::SavedFiniteScan> saved_judge;
  std::optional<contracts::GradFiniteScan> grads_judge;
  MOECERT_CONTRACT(chk, clauses::layer::kBwdSavedFinite) {
    saved_judge.emplace(chk, clauses::layer::kBwdSavedFinite, saved_view(saved).train,
                        static_cast<std::size_t>(cfg.inter), s.logits, R);
  }
  MOECERT_CONTRACT(chk, clauses::layer::kBwdGradFinite) {
    grads_judge.emplace(contracts::layer_grad_outputs(cfg, grads));
  }
  std::optional<contracts::BackwardProbe> probe;
  if (chk.will_check(clauses::layer::kBwdProbe))
    probe.emplace(*w.experts, cfg.lora_rank ? w.lora : experts::Lora{}, s.probe_sums);
  std::optional<contracts::SavedIntactScan> intact;
  experts::judge_saved_intact<clauses::layer::kBwdSavedIntact>(s, chk, intact);
  if (intact && saved_judge) saved_judge->c1_by_row();
  const experts::BackwardJudges judges{saved_judge ? &*saved_judge : nullptr,
                                       grads_judge ? &*grads_judge : nullptr,
                                       probe ? &*probe : nullptr, intact ? &*intact : nullptr};

  // 1. The experts op's first part: dy rows, dh; router path: dL/dw.
  arena.enter(workspace::b_gather, chk);
  if (judges.saved) judges.saved->begin();
  if (chk.stop()) return;
  const MatView<float> dw(arena.get<float>("router.dw", T * K), T, K, K);
  const auto d = experts::backward_dh(*w.experts, s, dy, opt.expert_path,
                                      opt.router_path ? dw : MatView<float>{}, judges, chk);
  if (!opt.router_path) detail::fill_zero(dw);
  if (judges.saved) {  // before the router's backward reads dL/dw
    judges.saved->report();
    if (chk.stop()) return;
  }

  // 2. Router path: the router's backward from dL/dw, into dz.
  arena.enter(workspace::b_router, chk);
  float* const dz_rows = arena.get<float>("router.dz", T * R);
  const linear::Dz dz{dz_rows, T, R, contracts::router_kind(cfg.router).split_dz};
  if (opt.router_path)
    router::router_ops(cfg.router)
        .backward(contracts::router_settings(cfg), MatView<const float>(s.logits, T, R, R),
                  saved.idx(), dw, dz_rows);
  else
    std::fill(dz_rows, dz_rows + T * R, 0.0f);

  // 3. The experts op's expert path: dx (its part), LoRA and base-weight
  //    gradients, statistics.
  experts::backward_expert(*w.experts, s, x, dy, d, expert_gradients(grads), opt.expert_path,
                           judges, chk);
  if (chk.stop()) return;

  // 4. Router path: dx += dz W_r, the router linear's gradients.
  std::optional<contracts::RouterLinearProbe> linear_probe;
  if (opt.router_path && chk.will_check(clauses::layer::kBwdProbe) &&
      contracts::RouterLinearProbe::due_in_layer())
    linear_probe.emplace(w.router_w, grads.dx);
  if (!grads.dx.empty() && opt.router_path) {
    if (judges.grads) judges.grads->reopen(grads.dx.data);  // dx is written again
    linear::router_dx(kernel, dz, w.router_w, grads.dx, judges.grads);
  }
  if (opt.router_path) {
    linear::router_linear_grads(kernel, dz, x, grads.router_w, grads.router_b);
    if (linear_probe)
      linear_probe->judge(x, linear::dz_planes(dz), {grads.dx, grads.router_w, grads.router_b});
  } else {
    if (!grads.router_w.empty()) detail::fill_zero(grads.router_w);
    if (!grads.router_b.empty())
      std::fill(grads.router_b.data, grads.router_b.data + grads.router_b.size, 0.0f);
  }
  arena.leave(chk);
  contracts::layer_backward_post(chk, cfg, w, x, dy, saved_view(saved), grads, opt, judges.grads,
                                 judges.probe, linear_probe ? &*linear_probe : nullptr);
  s.router_grads = opt.router_path && !chk.stop();
}

}  // namespace moecert::layer
