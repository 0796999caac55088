// Grouped SwiGLU experts with the caller's routing: y_t = sum_j w[t,j]
// E_{idx[t,j]}(x_t) with E_e(x) = (silu(x W_g[e]^T) * (x W_u[e]^T)) W_d[e]^T,
// an inference forward, and a training forward and backward with LoRA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "moecert/config.hpp"
#include "moecert/gemm.hpp"
#include "moecert/types.hpp"

namespace moecert::experts {

/// One layer's expert weights, packed once: gate and up fused (interleaved
/// panels), down separately, per expert.
class PackedExperts {
 public:
  PackedExperts() = default;

  /// w_gate, w_up: [E*I x H] (expert e: rows e*I .. e*I + I - 1, i.e. W_g[e]
  /// [I x H]); w_down: [E*H x I] (W_d[e] [H x I]). Runs gemm.pack's clauses
  /// on every matrix. With `backward`, also the orientations the layer
  /// backward multiplies by: W_d[e]^T ([I x H] as packed W, for dh = do W_d)
  /// and [W_g[e]^T | W_u[e]^T] ([H x 2I], for dx = [dg du] [W_g; W_u]).
  static PackedExperts pack(std::size_t experts, MatView<const bf16> w_gate,
                            MatView<const bf16> w_up, MatView<const bf16> w_down,
                            bool backward = false);
  /// Quantized base weights (moecert/formats.hpp), one view per expert as
  /// checkpoints store them, each with its own scales: w_gate[e], w_up[e]
  /// [I x H], w_down[e] [H x I]. The kernels compute with the dequantized
  /// weights bf16(fp32(code * scale)) (proofs/bounds.md §13), which the
  /// readers below return; `backward` as above (the transposed packs hold
  /// the same codes).
  ///
  /// Clauses (contracts/experts/experts.cpp):
  ///   experts.pack.shape  pre  shape  as many views of gate, up and down (>= 1), all of one
  ///                                   quantized format; gate and up I x H, down H x I, the same
  ///                                   I, H >= 1 for every expert
  /// and gemm.pack's (codes, scales, dequantized weights) on every matrix.
  static PackedExperts pack(const std::vector<QuantView>& w_gate,
                            const std::vector<QuantView>& w_up,
                            const std::vector<QuantView>& w_down, bool backward = false);

  std::size_t experts() const { return gate_up_.size(); }
  std::size_t hidden() const { return hidden_; }
  std::size_t inter() const { return inter_; }
  WeightFormat format() const { return format_; }
  const gemm::PackedWeights& gate_up(std::size_t e) const { return gate_up_[e]; }
  const gemm::PackedWeights& down(std::size_t e) const { return down_[e]; }
  bool has_backward() const { return !down_t_.empty(); }
  const gemm::PackedWeights& down_t(std::size_t e) const { return down_t_[e]; }
  const gemm::PackedWeights& gate_up_t(std::size_t e) const { return gate_up_t_[e]; }
  /// The weights pack() was given, read back from the packed layout into
  /// w_gate, w_up [E*I x H] and w_down [E*H x I] (bitwise those weights; a
  /// quantized pack's dequantized weights).
  void unpack(MatView<bf16> w_gate, MatView<bf16> w_up, MatView<bf16> w_down) const;
  /// A quantized pack's codes and scales, bitwise those pack() was given,
  /// written per expert into outputs of the views' layouts (gate, up
  /// [I x H], down [H x I]).
  void unpack(const std::vector<QuantOut>& w_gate, const std::vector<QuantOut>& w_up,
              const std::vector<QuantOut>& w_down) const;
  /// Weights read back from the packed layout.
  bf16 gate(std::size_t e, std::size_t i, std::size_t h) const;
  bf16 up(std::size_t e, std::size_t i, std::size_t h) const;
  bf16 down(std::size_t e, std::size_t h, std::size_t i) const { return down_[e].at(h, i); }
  std::size_t bytes() const;

 private:
  std::vector<gemm::PackedWeights> gate_up_, down_, down_t_, gate_up_t_;
  std::size_t hidden_ = 0, inter_ = 0;
  WeightFormat format_ = WeightFormat::bf16;
};

/// Scratch and saved activations of the expert forward, kept across calls:
/// buffers grow as needed and are reused, never cleared (every element a
/// call reads, it has written). One workspace per concurrent caller.
class Workspace {
 public:
  Workspace();
  ~Workspace();
  Workspace(Workspace&&) noexcept;
  Workspace& operator=(Workspace&&) noexcept;
  std::size_t bytes() const;  // held now
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

struct ForwardOptions {
  /// Kernel; default: default_isa() at every batch size (AMX's 16-row edge
  /// block beats the AVX-512 kernel even below one routed row per expert).
  std::optional<Isa> isa;
  /// Reused scratch; null: a temporary one for this call.
  Workspace* workspace = nullptr;
};

/// What a forward call did (for reports and tests).
struct ForwardStats {
  Isa isa = Isa::scalar;
  std::size_t routed_rows = 0;  // valid (t, j) slots
  std::size_t padded_rows = 0;  // rows after padding each expert's group to the kernel's MR
};

/// Forward of the routed experts. x [T x H] bf16, idx [T x K] int32 (-1 =
/// empty slot, only at the tail of a row), weights [T x K] fp32, y [T x H]
/// fp32 (written, never read). Tokens are grouped by expert with a counting
/// sort (stable: token order within an expert); gate and up are one GEMM;
/// h = silu(g) * u is rounded to bf16 for the down GEMM; the combine adds
/// w[t,j] o_{t,j} in slot order j = 0..K-1 in fp32. Bitwise identical for
/// any thread count.
///
/// Clauses (contracts/experts/experts.cpp; bounds in proofs/bounds.md §10):
///   experts.forward.shape          pre   shape    x T x H, idx and weights T x K, y T x H; H matches
///   experts.forward.idx_in_range   pre   index    -1 <= idx[t,j] < E, and -1 only at the tail of a row
///   experts.forward.idx_unique     pre   index    no expert twice in a row
///   experts.forward.weight_finite  pre   finite   every weight finite; 0 at -1 slots
///   experts.forward.x_finite       pre   finite   every x element finite
///   experts.forward.x_range        pre   numeric  every x element 0 or 2^-60 <= |x| <= 2^60, the range
///                                                 the bounds hold in (audit)
///   experts.forward.no_alias       pre   alias    y shares no byte with x, idx, weights or packed weights
///   experts.forward.permutation    invariant index  the grouping holds every valid slot exactly once,
///                                                 histogram sums to the routed rows
///   experts.forward.y_finite       post  finite   every y element finite
///   experts.forward.probe          post  numeric  Freivalds probes of each expert's two GEMMs (audit):
///                                                 every row against each pack's dense probe and
///                                                 one 4-column block in rotation
///                                                 (proofs/bounds.md §9.1)
///   experts.forward.within_bound   post  numeric  every y element within the chained bound of the
///                                                 reference (full)
///   experts.forward.rounding_unbiased post numeric y's errors as often toward zero as away from it
///                                                 within Hoeffding's threshold (a false alarm with
///                                                 probability <= 2^-30 on random data,
///                                                 proofs/bounds.md §11); applied by the judge
///                                                 (`moecert check`) and conformance, not per call
///   experts.forward.spread_explained post numeric every y element within the declared
///                                                 precision's probabilistic bound (accumulations
///                                                 at lambda sqrt(n) u; a false alarm with
///                                                 probability <= 2^-31 on random data,
///                                                 proofs/bounds.md §12); the judge and conformance
///   experts.forward.scale_explained post numeric <y - ref, ref> within the declared precision's
///                                                 probabilistic bound: an error along y (a scale
///                                                 off by a few %) fails it where the element
///                                                 bounds hold it (proofs/bounds.md §12); the judge
/// and gemm.pack.checksum (audit) on every expert's packed weights.
ForwardStats forward(const PackedExperts& w, MatView<const bf16> x, MatView<const std::int32_t> idx,
                     MatView<const float> weights, MatView<float> y,
                     const ForwardOptions& opt = {});

/// LoRA factors of every expert, stacked by expert (expert e: rows
/// e*rows .. e*rows + rows - 1): a_gate, a_up [E*r x H]; b_gate, b_up
/// [E*I x r]; a_down [E*r x I]; b_down [E*H x r]; scale s = float(alpha / r).
/// rank = 0: no LoRA (the views are not read).
struct Lora {
  MatView<const bf16> a_gate, b_gate, a_up, b_up, a_down, b_down;
  std::size_t rank = 0;  // r
  double alpha = 0.0;    // alpha

  /// Views of six dense row-major arrays in that order and those shapes.
  static Lora stacked(std::size_t experts, std::size_t hidden, std::size_t inter, std::size_t rank,
                      double alpha, const bf16* a_gate, const bf16* b_gate, const bf16* a_up,
                      const bf16* b_up, const bf16* a_down, const bf16* b_down) {
    const std::size_t E = experts, H = hidden, I = inter, r = rank;
    return {{a_gate, E * r, H},
            {b_gate, E * I, r},
            {a_up, E * r, H},
            {b_up, E * I, r},
            {a_down, E * r, I},
            {b_down, E * H, r},
            rank,
            alpha};
  }
  /// The same for `cfg`'s E, H, I, r and alpha.
  static Lora stacked(const MoeConfig& cfg, const bf16* a_gate, const bf16* b_gate,
                      const bf16* a_up, const bf16* b_up, const bf16* a_down, const bf16* b_down) {
    auto u = [](std::int64_t v) { return static_cast<std::size_t>(v); };
    return stacked(u(cfg.experts), u(cfg.hidden), u(cfg.inter), u(cfg.lora_rank), cfg.lora_alpha,
                   a_gate, b_gate, a_up, b_up, a_down, b_down);
  }
};

/// What a training forward keeps for its backward: a planned arena with the
/// saved activations (the workspace plan of `moecert plan` with no router
/// outputs), copies of idx and weights, the packed LoRA factors, and the
/// identity of the call (shapes, T).
class Saved {
 public:
  Saved();
  ~Saved();
  Saved(Saved&&) noexcept;
  Saved& operator=(Saved&&) noexcept;
  bool valid() const;
  std::size_t bytes() const;  // arena held
  struct Impl;
  Impl& impl() { return *impl_; }
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

struct TrainOptions {
  std::optional<Isa> isa;        // as ForwardOptions
  bool training = true;          // keep what the backward needs (false: y only)
  std::uint64_t memory_cap = 0;  // workspace.plan.memory_cap (0: none)
};

/// Training forward with LoRA: y = sum_j w[t,j] E_{idx[t,j]}(x_t) where each
/// expert's gate, up and down carry their LoRA term s (. A^T) B^T (docs/DESIGN.md;
/// the kernel's rounding points: include/moecert/layer.hpp). x [T x H] bf16,
/// idx [T x K] int32 (-1 = empty slot, only at the tail of a row), weights
/// [T x K] fp32 (the router's, any real values; 0 at -1 slots), y [T x H]
/// fp32 (written, never read). w packed with backward = true for a
/// backward. Keeps in `saved` what the backward needs; the caller keeps x
/// for the backward. The same code as the layer's expert part: the layer is
/// router linear + router + this op.
///
/// Clauses (contracts/experts/train.cpp; bounds: proofs/experts.md):
///   experts.forward_train.shape          pre   shape    x T x H (T <= 2^20), idx and weights T x K
///                                                       (1 <= K <= min(E, 64)), y T x H; r <= 256 and
///                                                       LoRA views of their shapes
///   experts.forward_train.idx_in_range   pre   index    -1 <= idx[t,j] < E, and -1 only at the tail of a row
///   experts.forward_train.idx_unique     pre   index    no expert twice in a row
///   experts.forward_train.weight_finite  pre   finite   every weight finite; 0 at -1 slots
///   experts.forward_train.x_finite       pre   finite   every x element finite
///   experts.forward_train.x_range        pre   numeric  every x element 0 or 2^-60 <= |x| <= 2^60, the range
///                                                       the bounds hold in (audit)
///   experts.forward_train.lora_finite    pre   finite   every LoRA element finite (judged per expert while
///                                                       its factors are packed)
///   experts.forward_train.lora_range     pre   numeric  every LoRA element 0 or 2^-60 <= |a| <= 2^60 (audit;
///                                                       judged as lora_finite is)
///   experts.forward_train.scale_finite   pre   numeric  alpha finite and s = float(alpha / r) in [2^-60, 2^60]
///   experts.forward_train.no_alias       pre   alias    y shares no byte with x, idx, weights, LoRA or
///                                                       packed weights
///   experts.forward_train.lora_padding   invariant numeric  the packed LoRA factors' depth padding (k >= r
///                                                           of every panel with a column n < N) is zero,
///                                                           each expert's packs as they are written
///                                                           (columns past N are never stored)
///   experts.forward_train.y_finite       post  finite   every y element finite
///   experts.forward_train.probe          post  numeric  Freivalds probes of each expert's GEMMs with
///                                                       their LoRA products (audit): gate/up and down
///                                                       as experts.forward.probe, each probe's weight
///                                                       side with B^T r of the caller's factors, and
///                                                       xa = x [A_g; A_u]^T and ha = h A_d^T
///                                                       (proofs/bounds.md §9.2)
///   experts.forward_train.within_bound   post  numeric  every y element within its bound of the
///                                                       reference (full)
///   experts.forward_train.rounding_unbiased post numeric y's errors unbiased (judge and
///                                                       conformance; proofs/bounds.md §11)
///   experts.forward_train.spread_explained post numeric y within the probabilistic bound
///                                                       (judge and conformance; proofs/bounds.md §12)
///   experts.forward_train.scale_explained post numeric <y - ref, ref> within the probabilistic
///                                                       bound (the judge; proofs/bounds.md §12)
/// and experts.forward.permutation (the grouping it shares with experts::forward) and the
/// workspace.* clauses of its arena.
void forward_train(const PackedExperts& w, const Lora& lora, MatView<const bf16> x,
                   MatView<const std::int32_t> idx, MatView<const float> weights, MatView<float> y,
                   Saved& saved, const TrainOptions& opt = {});

/// Gradients of the experts op; each is optional (an empty view is not
/// computed) and, when given, written entirely. Shapes: dx [T x H],
/// dweights [T x K], the LoRA factors' and base weights' as those weights
/// (base: [E*I x H], [E*I x H], [E*H x I]), m_a, m_g [T x E].
struct Gradients {
  MatView<float> dx;        // expert path
  MatView<float> dweights;  // dL/dw[t,j] = <dy_t, o_{t,idx[t,j]}>, 0 at -1 slots
  MatView<float> a_gate, b_gate, a_up, b_up, a_down, b_down;  // LoRA (expert path)
  MatView<float> w_gate, w_up, w_down;                        // base weights (expert path)
  MatView<float> m_a, m_g;                                    // per-token statistics (expert path)
};

/// Backward from dy [T x H] fp32 with the forward's `saved`, the same w,
/// lora and x. Two parts, each run only when one of its outputs is asked
/// for: the expert path (do = w dy_t through each routed expert: dx, the
/// LoRA and base-weight gradients, M_A and M_G; docs/DESIGN.md) and dweights
/// (dL/dw = <dy_t, o_{t,j}> in binary64 rounded once, the router's input
/// gradient). It leaves `saved` as it found it: a backward may run again.
///
/// Clauses (contracts/experts/train.cpp; bounds: proofs/experts.md):
///   experts.backward.state             pre   shape    saved holds a training forward of these
///                                                     shapes (E, H, I, K, r, alpha) and T (not: backward
///                                                     before forward, another config, another T), w packed
///                                                     with backward
///   experts.backward.shape             pre   shape    x and dy T x H; every requested gradient of its shape
///   experts.backward.dy_finite         pre   finite   every dy element finite
///   experts.backward.no_alias          pre   alias    gradients share no byte with each other, x, dy,
///                                                     LoRA factors, packed weights or the saved state
///   experts.backward.saved_finite      pre   finite   the saved activations and weights read by the
///                                                     backward are finite, the idx copy in range
///                                                     (failure mode 3); judged as the backward reads
///                                                     them, before it writes an output
///                                                     (proofs/experts.md §7)
///   experts.backward.saved_intact      pre   memory   the saved gate/up rows hold the bits the forward
///                                                     wrote (audit, where the forward ran at audit: its
///                                                     row digests formed again as the SwiGLU backward
///                                                     reads each row; one changed element of a row is
///                                                     always caught; proofs/experts.md §7)
///   experts.backward.grad_finite       post  finite   every gradient element finite
///   experts.backward.empty_expert_zero post  numeric  an expert with no routed token has LoRA and
///                                                     base-weight gradients exactly 0; M_A, M_G are 0
///                                                     wherever t is not routed to e
///   experts.backward.dweights_masked   post  numeric  dweights exactly 0 at -1 slots (failure modes 1, 5)
///   experts.backward.probe             post  numeric  Freivalds probes of the two row GEMMs (audit),
///                                                     judged inside the op: dh = dy W_d
///                                                     (+ bf16(s dyb) A_d) and dyb = dy B_d; the dx
///                                                     rows = [dg du] [W_g; W_u] (+ bf16(s dgb)
///                                                     [A_g; A_u]) and dgb; LoRA factors as passed
///                                                     here (proofs/bounds.md §9.3)
///   experts.backward.within_bound      post  numeric  every requested output within its derived bound of
///                                                     the reference backward (full)
///   experts.backward.rounding_unbiased post  numeric  dx's, dweights' and the weight gradients'
///                                                     errors unbiased (a weight gradient's on one
///                                                     element per row and column of an expert;
///                                                     judge and conformance; proofs/bounds.md §11)
///   experts.backward.spread_explained  post  numeric  every output given within the probabilistic
///                                                     bound (judge and conformance; proofs/bounds.md
///                                                     §12)
///   experts.backward.scale_explained   post  numeric  <dx - ref, ref> and <dweights - ref, ref>
///                                                     within the probabilistic bound: an error a
///                                                     token's elements share (a scale off by a few
///                                                     %) fails it where the element bounds hold it
///                                                     (judge and conformance; proofs/bounds.md §12)
void backward(const PackedExperts& w, const Lora& lora, MatView<const bf16> x,
              MatView<const float> dy, Saved& saved, const Gradients& grads);

}  // namespace moecert::experts
