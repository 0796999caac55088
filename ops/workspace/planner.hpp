// The workspace planner, written once over an integer type N: instantiated
// with checked 64-bit integers by the library (ops/workspace/plan.cpp) and
// with z3 integer expressions by the proof (proofs/workspace/prove.cpp), so
// the proof runs this arithmetic, not a copy of it.
//
// N needs: construction from std::uint64_t, +, *, / (by a constant), and
// max_of(N, N), min_of(N, N) found by argument-dependent lookup. No
// subtraction and no comparison: every quantity is non-negative and every
// branch below is on structure (steps, flags), never on a size.
//
// Placement rule: buffers are placed in list order; a buffer's offset is the
// largest end (offset + size rounded to kAlign, plus a kGuard guard zone) of
// the earlier buffers whose live step intervals intersect its own. Co-live
// buffers are therefore disjoint by construction; the proof checks that the
// code below does what this sentence says, for every config in the limits.
// With training, experts.h and the LoRA buffers live to the backward's last
// step and come after every other saved buffer, so each backward buffer
// lies beyond all of them: a backward leaves the saved activations intact,
// even those past their last step, and may run again (tests/workspace_test.cpp).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "moecert/formats.hpp"

namespace moecert::workspace {

/// Steps of one layer's forward and backward, in execution order.
enum Step : int {
  f_route,    // router linear + router
  f_gather,   // x rows grouped by expert
  f_gate_up,  // gate+up GEMM (+ LoRA), SwiGLU
  f_down,     // down GEMM (+ LoRA)
  f_combine,  // y = sum_j w o
  b_gather,   // dy rows grouped by expert
  b_dh,       // dh' = dy W_d (+ LoRA); router path: dw = <dy, o>
  b_router,   // router backward, router linear backward
  b_swiglu,   // dg, du; LoRA down gradients
  b_dx,       // dx rows = [dg du] [W_g; W_u] (+ LoRA)
  b_scatter,  // dx = sum_j dx rows + router path; LoRA gate/up gradients
  kSteps
};
inline constexpr std::uint64_t kAlign = 64;  // bytes; every offset and size is a multiple
inline constexpr std::uint64_t kGuard = 64;  // guard zone after every buffer
inline constexpr std::uint64_t kMaxMr = 32;  // largest kernel MR (rows each expert's group pads to)
inline constexpr std::uint64_t kKStep = 32;  // GEMM depth padding (ops/gemm/ukernel.hpp)
inline constexpr std::uint64_t kARowPad = 32;  // extra bf16 per packed-A row (loops.hpp a_stride)

/// Test-only planner defects for the proof's negative test.
enum class Flaw { none, stack_on_previous_only };

template <class N>
struct Dims {
  N experts, hidden, inter, topk, rank, tokens, router_out;
};

template <class N>
struct Planned {
  std::string_view name;
  N bytes;          // requested
  N offset;         // from the plan's start
  N end;            // offset + round_up(bytes, kAlign) + kGuard
  int first, last;  // live steps, inclusive
};

template <class N>
N round_up(const N& x, std::uint64_t m) {
  return (x + N(m - 1)) / N(m) * N(m);
}

constexpr bool co_live(int f1, int l1, int f2, int l2) { return f1 <= l2 && f2 <= l1; }

/// Every buffer of a layer call for `d` in placement order, placed; `total`
/// = the largest end. `training`: forward and backward (saved activations
/// live across); otherwise the forward only.
template <class N, Flaw flaw = Flaw::none>
std::vector<Planned<N>> plan_buffers(const Dims<N>& d, bool training, N& total) {
  const N T = d.tokens, K = d.topk, E = d.experts, H = d.hidden, I = d.inter, r = d.rank;
  const N TK = T * K;
  // Padded grouped rows: each expert with a token pads to MR; empty ones take none.
  const N R = TK + min_of(E, TK) * N(kMaxMr - 1);
  // Packed A of depth k (bf16): rows of round_up(k, 32) + 32 elements (the
  // larger of the two ALayouts, ops/gemm/loops.hpp).
  auto packed_a = [&](const N& k) { return R * (round_up(k, kKStep) + N(kARowPad)) * N(2); };
  const int last = training ? b_scatter : f_combine;
  std::vector<Planned<N>> out;
  auto add = [&](std::string_view name, N bytes, int first, int last_step) {
    if (!training && first > f_combine) return;
    if (!training && last_step > f_combine) last_step = f_combine;
    N offset(0);
    if constexpr (flaw == Flaw::stack_on_previous_only) {
      for (auto it = out.rbegin(); it != out.rend(); ++it)
        if (co_live(it->first, it->last, first, last_step)) {
          offset = it->end;
          break;
        }
    } else {
      for (const auto& b : out)
        if (co_live(b.first, b.last, first, last_step)) offset = max_of(offset, b.end);
    }
    out.push_back(
        {name, bytes, offset, offset + round_up(bytes, kAlign) + N(kGuard), first, last_step});
  };
  // Saved across forward and backward; without training, kept to the end of
  // the forward (its postconditions read them).
  add("router.logits", T * d.router_out * N(4), f_route, training ? b_router : f_route);
  add("router.idx", TK * N(4), f_route, last);
  add("router.weights", TK * N(4), f_route, last);
  add("experts.c1", R * round_up(I, kKStep) * N(2) * N(4), f_gate_up,
      training ? b_swiglu : f_combine);
  add("experts.h", packed_a(I), f_gate_up, training ? b_scatter : f_combine);
  // LoRA buffers are sized by r (empty when r = 0).
  add("lora.xa", R * r * N(2) * N(4), f_gather, training ? b_scatter : f_combine);
  add("lora.ha", R * r * N(4), f_down, training ? b_scatter : f_combine);
  // Forward scratch.
  add("experts.o", R * H * N(4), f_down, f_combine);
  add("experts.a", packed_a(H), f_gather, f_gate_up);
  add("lora.lb_gu", packed_a(r * N(2)), f_gather, f_gate_up);
  add("lora.lb_d", packed_a(r), f_down, f_down);
  // Backward scratch, largest first.
  add("bwd.dx_rows", R * H * N(4), b_dx, b_scatter);
  add("bwd.dy", packed_a(H), b_gather, b_dh);
  add("bwd.dh", R * round_up(I, kKStep) * N(4), b_dh, b_swiglu);
  add("lora.dyb", R * r * N(4), b_dh, b_scatter);  // read by the statistics
  add("lora.qd", packed_a(r), b_dh, b_dh);
  add("router.dw", TK * N(4), b_dh, b_scatter);  // read by the postconditions
  add("router.dz", T * d.router_out * N(4), b_router, b_scatter);
  add("bwd.dgu", packed_a(I * N(2)), b_swiglu, b_scatter);  // LoRA gate/up gradients, statistics
  add("lora.dgb", R * r * N(2) * N(4), b_swiglu, b_scatter);
  add("lora.qgu", packed_a(r * N(2)), b_dx, b_dx);
  total = N(0);
  for (const auto& b : out) total = max_of(total, b.end);
  return out;
}

/// Bytes of the packed weights the layer keeps: forward orientation
/// (gate+up fused, down), with `training` also the backward one (W_d^T for
/// dh, [W_g; W_u]^T for dx), and the LoRA factors (bf16) packed both ways.
/// Base weights in `format` (moecert/formats.hpp): bf16 values, or codes of
/// its width over the padded shape, plus its scale table (the source rows'
/// blocks x the padded other dimension's blocks, fp32) and a table row index
/// (4 bytes) per padded column, or per padded depth of a transposed pack
/// (ops/gemm/pack_quantized.cpp).
template <class N>
N packed_weight_bytes(const Dims<N>& d, bool training,
                      const FormatInfo& format = format_info(WeightFormat::bf16)) {
  const N E = d.experts, H = d.hidden, I = d.inter, r = d.rank;
  auto packed = [](const N& n, const N& k) {
    return round_up(n, kKStep) * round_up(k, kKStep) * N(2);
  };
  auto blocks = [](const N& n, std::uint64_t b) { return b ? (n + N(b - 1)) / N(b) : N(1); };
  // W [n x k] whose scales have `rows` table rows and whose index has an
  // entry per padded column (transposed: per padded depth).
  auto base = [&](const N& n, const N& k, const N& rows, bool transposed) {
    if (format.code_bits == 16) return packed(n, k);
    const N np = round_up(n, kKStep), kp = round_up(k, kKStep);
    const N cols = blocks(transposed ? np : kp, format.block_cols);
    return np * kp * N(format.code_bits) / N(8) + rows * cols * N(4) +
           (transposed ? kp : np) * N(4);
  };
  const N gu_rows = blocks(I, format.block_rows) * N(2), d_rows = blocks(H, format.block_rows);
  N per_expert = base(I * N(2), H, gu_rows, false) + base(H, I, d_rows, false);
  N lora = packed(r * N(2), H) + packed(I * N(2), r * N(2)) + packed(r, I) + packed(H, r);
  if (training) {  // W_d^T, [W_g; W_u]^T
    per_expert = per_expert + base(I, H, d_rows, true) + base(H, I * N(2), gu_rows, true);
    lora = lora + packed(r, H) + packed(I, r) + packed(r * N(2), I * N(2)) + packed(H, r * N(2));
  }
  return E * (per_expert + lora);
}

}  // namespace moecert::workspace
