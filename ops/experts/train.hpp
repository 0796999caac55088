// The experts training op's state and steps on a bound arena: the bodies of
// experts::forward_train/backward and of the layer, which runs its router
// around the same steps.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "contracts/experts/backward_probe.hpp"
#include "contracts/experts/train.hpp"
#include "moecert/experts.hpp"
#include "ops/experts/forward.hpp"
#include "ops/experts/lora.hpp"
#include "ops/workspace/arena.hpp"

namespace moecert::experts {

/// What a training forward keeps for the backward. idx and weights point
/// into the arena ("router.idx", "router.weights").
struct TrainState {
  bool valid = false;
  bool training = false;
  std::size_t tokens = 0, topk = 0;
  std::uint64_t generation = 0;  // distinguishes forwards (for tests)
  ForwardState st;               // grouping, layouts, c1, h, xa, ha (saved)
  workspace::Arena arena;
  PackedLora lora;
  Isa isa = Isa::scalar;
  std::int32_t* idx = nullptr;
  float* weights = nullptr;
  MatView<const std::int32_t> idx_view() const { return {idx, tokens, topk, topk}; }
  MatView<const float> weights_view() const { return {weights, tokens, topk, topk}; }
  contracts::ProbeStorage probe_sums;  // the audit probes' sums
  contracts::SavedDigests digests;     // c1's, where an audited forward recorded them
};

struct Saved::Impl : TrainState {
  std::size_t experts = 0, hidden = 0, inter = 0, rank = 0;
  double alpha = 0;
};

/// The forward's steps f_gather .. f_combine on `s` (its arena bound, idx
/// and weights in it, s.lora packed, s.isa set); afterwards s is valid.
/// `probe` (audit) takes the gate/up GEMM's blocks as forward_impl's does.
void train_forward_steps(const PackedExperts& w, TrainState& s, MatView<const bf16> x,
                         MatView<float> y, bool training, contracts::ExpertsProbe* probe = nullptr);

/// What the backward's first part leaves for the rest (arena buffers).
struct DyRows {
  float* dh = nullptr;   // dy W_d (+ the LoRA term with the expert path) (bwd.dh)
  float* dyb = nullptr;  // dy B_d [rows x r] (lora.dyb)
};

/// The backward's contract judges that run inside its passes (either null
/// when its clause is off): saved_finite on the saved rows as they are
/// read, grad_finite on output blocks as they are written.
struct BackwardJudges {
  contracts::SavedFiniteScan* saved = nullptr;
  contracts::GradFiniteScan* grads = nullptr;
  contracts::BackwardProbe* probe = nullptr;     // audit: takes dh and the dx rows as formed
  contracts::SavedIntactScan* intact = nullptr;  // audit: c1's rows as the SwiGLU pass reads them
};

/// Steps b_gather and b_dh: dy rows, dh' = dy W_d, dyb = dy B_d; when `dw`
/// is not empty, dL/dw [T x K] = <dh', h> + <dyb, lb_d> (0 at -1 slots);
/// with the expert path, dh += bf16(s dyb) A_d. dy rows and dh are formed
/// only when either part runs.
DyRows backward_dh(const PackedExperts& w, TrainState& s, MatView<const float> dy, bool expert_path,
                   MatView<float> dw, const BackwardJudges& judges, detail::Checker& chk);

/// Steps b_swiglu .. b_scatter of the expert path: dg, du, dx rows, then
/// grads.dx = sum_j dx rows in slot order, the LoRA and base-weight
/// gradients and M_A, M_G. Without the expert path, the requested outputs
/// are written with 0. grads.dweights is not touched. judges.saved reports
/// after dg, du, before the first output is written: when a precondition
/// failed under observe, it returns with chk.stop() and writes nothing.
void backward_expert(const PackedExperts& w, TrainState& s, MatView<const bf16> x,
                     MatView<const float> dy, const DyRows& d, const Gradients& grads,
                     bool expert_path, const BackwardJudges& judges, detail::Checker& chk);

/// True when any output of the expert path is requested.
bool wants_expert_path(const Gradients& g);

/// The state as the contracts read it (ops/experts/saved_view.cpp).
contracts::TrainSaved saved_view(const TrainState& s);
contracts::TrainSaved saved_view(const Saved::Impl& s);

/// The judge of the op's clause `intact` (saved_intact) into `scan`, where
/// the clause is on and the forward recorded c1's digests (it ran at audit).
template <const ClauseInfo& intact>
void judge_saved_intact(const TrainState& s, detail::Checker& chk,
                        std::optional<contracts::SavedIntactScan>& scan) {
  if (s.digests.valid) MOECERT_CONTRACT(chk, intact) {
      scan.emplace(chk, intact, saved_view(s).rows);
    }
}

std::vector<contracts::PackedFactor> packed_factors(const PackedLora& l);
std::array<contracts::PackedFactor, 8> packed_factors(std::size_t e, const PackedLoraExpert& p);
/// PackedLora::pack's hook that hands each expert to `finite` and its packs
/// to `padding` (either may be null; both null: no hook).
PackedLora::Hook judge_packs(contracts::LoraFiniteScan* finite,
                             contracts::LoraPaddingScan* padding);

/// Packs `lora` for E experts of H -> I -> H into `into` (reusing its
/// memory), judging the op's clauses `finite` (lora_finite), `range`
/// (lora_range) and `padding` (lora_padding) per expert while its factors are
/// packed, on the packing thread. False when a precondition failed under
/// observe: the op returns.
template <const ClauseInfo& finite, const ClauseInfo& range, const ClauseInfo& padding>
bool pack_lora(const Lora& lora, std::size_t E, std::size_t H, std::size_t I, bool backward,
               PackedLora& into, detail::Checker& chk) {
  bool judge_finite = false, judge_range = false, judge_padding = false;
  MOECERT_CONTRACT(chk, finite) { judge_finite = true; }
  MOECERT_CONTRACT(chk, range) { judge_range = true; }
  MOECERT_CONTRACT(chk, padding) { judge_padding = true; }
  contracts::LoraFiniteScan finite_scan(lora, E, judge_range);
  contracts::LoraPaddingScan padding_scan;
  const bool scan = judge_finite || judge_range;
  into = PackedLora::pack(
      lora, E, H, I, backward, std::move(into),
      judge_packs(scan ? &finite_scan : nullptr, judge_padding ? &padding_scan : nullptr));
  if (scan) finite_scan.report(chk, finite, range);
  if (chk.stop()) return false;
  if (judge_padding) padding_scan.report(chk, padding);
  return true;
}

}  // namespace moecert::experts
