// Grouped SwiGLU experts, forward: y_t = sum_j w[t,j] E_{idx[t,j]}(x_t) with
// E_e(x) = (silu(x W_g[e]^T) * (x W_u[e]^T)) W_d[e]^T.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

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
  static PackedExperts pack(std::size_t experts, MatView<const bf16> w_gate, MatView<const bf16> w_up,
                            MatView<const bf16> w_down, bool backward = false);

  std::size_t experts() const { return gate_up_.size(); }
  std::size_t hidden() const { return hidden_; }
  std::size_t inter() const { return inter_; }
  const gemm::PackedWeights& gate_up(std::size_t e) const { return gate_up_[e]; }
  const gemm::PackedWeights& down(std::size_t e) const { return down_[e]; }
  bool has_backward() const { return !down_t_.empty(); }
  const gemm::PackedWeights& down_t(std::size_t e) const { return down_t_[e]; }
  const gemm::PackedWeights& gate_up_t(std::size_t e) const { return gate_up_t_[e]; }
  gemm::PackedWeights& mutable_down_for_testing(std::size_t e) { return down_[e]; }
  /// Weights read back from the packed layout.
  bf16 gate(std::size_t e, std::size_t i, std::size_t h) const;
  bf16 up(std::size_t e, std::size_t i, std::size_t h) const;
  bf16 down(std::size_t e, std::size_t h, std::size_t i) const { return down_[e].at(h, i); }
  std::size_t bytes() const;

 private:
  std::vector<gemm::PackedWeights> gate_up_, down_, down_t_, gate_up_t_;
  std::size_t hidden_ = 0, inter_ = 0;
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
  /// block beats the AVX-512 kernel even below one routed row per expert:
  /// docs/PERFORMANCE.md).
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
/// Clauses (contracts/experts.cpp; bounds in proofs/bounds.md §10):
///   experts.forward.shape          pre   shape    x T x H, idx and weights T x K, y T x H; H matches
///   experts.forward.idx_in_range   pre   index    -1 <= idx[t,j] < E, and -1 only at the tail of a row
///   experts.forward.idx_unique     pre   index    no expert twice in a row
///   experts.forward.weight_finite  pre   finite   every weight finite; 0 at -1 slots
///   experts.forward.x_finite       pre   finite   every x element finite
///   experts.forward.x_range        pre   numeric  every x element 0 or 2^-60 <= |x| <= 2^60
///   experts.forward.no_alias       pre   alias    y shares no byte with x, idx, weights or packed weights
///   experts.forward.permutation    invariant index  the grouping holds every valid slot exactly once,
///                                                 histogram sums to the routed rows
///   experts.forward.y_finite       post  finite   every y element finite
///   experts.forward.probe          post  numeric  Freivalds probe of each expert's two GEMMs (audit)
///   experts.forward.within_bound   post  numeric  every y element within the chained bound of the
///                                                 reference (full)
/// and gemm.pack.checksum (audit) on every expert's packed weights.
ForwardStats forward(const PackedExperts& w, MatView<const bf16> x, MatView<const std::int32_t> idx,
                     MatView<const float> weights, MatView<float> y, const ForwardOptions& opt = {});

}  // namespace moecert::experts
