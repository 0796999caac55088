// layer.router_linear.probe, and the router linear's part of
// layer.forward.probe and layer.backward.probe: Freivalds probes of
// z = x W_r^T + b, of dx += dz W_r and of dW_r = dz^T x, and db against its
// sums' bounds (proofs/bounds.md §9.4). Each product gets a dense probe over
// all its columns and one block of 4 columns in rotation (call c probes
// block c mod ceil(N / 4)); the weight sides are formed per call from the
// caller's W_r (its R H values, as the LoRA factors' in §9.2).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "contracts/engine/engine.hpp"
#include "contracts/probes/verify.hpp"
#include "moecert/layer.hpp"

namespace moecert::contracts {

/// dz as the router's backward leaves it: [T x R] rows in `lo`, or for
/// product_key two planes, columns [0, R/2) in `lo` and the rest in `hi`.
struct DzPlanes {
  MatView<const float> lo, hi;
  std::size_t rows() const { return lo.rows; }
  std::size_t cols() const { return lo.cols + hi.cols; }
  float operator()(std::size_t t, std::size_t e) const {
    return e < lo.cols ? lo(t, e) : hi(t, e - lo.cols);
  }
};

/// Fails `clause` where a probe of z = x W_r^T + b fails (the first row).
/// Cost: 4 R (H + 1) for the weight sides, 4 H + 8 per row; rows in parallel.
void probe_router_logits(detail::Checker& c, const ClauseInfo& clause, MatView<const bf16> x,
                         MatView<const float> w, View<const float> b, MatView<const float> z);

/// The router linear backward's probes: formed before the op adds into dx
/// (each row's sums of dx as it was), judged after it, reported last.
class RouterLinearProbe {
 public:
  /// W_r as the op reads it; dx before the op adds into it (empty: none).
  RouterLinearProbe(MatView<const float> w, MatView<const float> dx);
  /// dx, dW_r and db as the op left them in g (empty ones skipped), dz as
  /// the op read it. On the caller's thread; rows and columns in parallel.
  void judge(MatView<const bf16> x, const DzPlanes& dz, const layer::RouterLinearGrads& g);
  /// Fails `clause` at the first failure: dx's rows, dW_r's columns, db.
  void report(detail::Checker& c, const ClauseInfo& clause) const;
  /// Whether this call of layer.backward probes its router linear: one call
  /// in kLayerEvery, process-wide (proofs/bounds.md §9.4).
  static constexpr std::uint64_t kLayerEvery = 4;
  static bool due_in_layer();

 private:
  using Probes = std::array<verify::Probe, 2>;  // dense, narrow
  void judge_dx(const DzPlanes& dz, MatView<const float> dx);
  void judge_dw(MatView<const bf16> x, const DzPlanes& dz, MatView<const float> dw);
  void judge_db(const DzPlanes& dz, View<const float> db);
  // Keeps the first failure (verdicts in row order) with its location.
  void keep(const std::vector<verify::RowProbe>& v, const Probes& p, const char* what);

  std::uint64_t call_;
  Probes dx_probes_;
  // Per probe (dense, narrow): each dx row's sum as it was, then its magnitude.
  std::array<std::vector<double>, 2> before_;
  verify::ProbeResult result_;
  std::string failure_;
};

}  // namespace moecert::contracts
