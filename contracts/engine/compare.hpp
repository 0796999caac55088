// Comparison of kernel results with the reference: bound-based (utilisation
// |err| / bound), ULP distance, and the tie-aware top-k comparison.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "moecert/types.hpp"

namespace moecert::compare {

/// The outcome of comparing n results with reference values and bounds.
/// Counts of elements by bound utilisation u = |err| / bound: bin 0 holds
/// u < 1e-6 (exact results included), bin i (1..6) 10^(i-7) <= u < 10^(i-6),
/// bin 7 holds 0.1 <= u <= 1, bin 8 u > 1 (failures).
struct UtilizationHistogram {
  static constexpr int kBins = 9;
  std::uint64_t count[kBins] = {};
  void add(double u);
  void merge(const UtilizationHistogram& o) {
    for (int i = 0; i < kBins; ++i) count[i] += o.count[i];
  }
};

struct Bounded {
  std::size_t count = 0;
  std::size_t exceeded = 0;  // elements with |err| > bound (or non-finite)
  double max_abs_err = 0;
  double max_rel_err = 0;      // |err| / |ref| over elements with ref != 0
  double max_utilization = 0;  // max |err| / bound; +Inf for a non-finite result
  std::size_t worst = 0;       // index of the element of max utilisation
  double worst_got = 0, worst_ref = 0, worst_bound = 0;
  UtilizationHistogram histogram;
  bool pass() const { return exceeded == 0; }
};

/// Element i passes when |got[i] - ref[i]| <= bound[i] + 2^-52 |ref[i]|
/// (the second term covers the reference's own rounding to double).
/// A non-finite got[i] never passes.
Bounded bounded(std::span<const float> got, std::span<const double> ref,
                std::span<const double> bound);

/// The rounding audit (proofs/bounds.md §11): the signs of the errors of n
/// results, adjusted by the sign of the reference (negative: toward zero).
/// Round-to-nearest errors are as often toward zero as away from it;
/// truncation's are always toward zero. With N elements whose error and
/// reference are nonzero, k of them toward zero, the audit flags a bias when
/// |k/N - 1/2| > kLean + eps, eps = sqrt(ln(2/alpha) / (2N)) (Hoeffding: a
/// false alarm with probability <= alpha under the model of independent
/// rounding errors leaning at most kLean to one side). Below kMinAudited
/// elements it never flags.
struct RoundingAudit {
  static constexpr std::size_t kMinAudited = 64;
  static constexpr double kAlpha = 0x1p-30;  // false-alarm probability
  /// The lean granted to an implementation's own functions: PyTorch 2.11's
  /// bf16 silu errs toward zero 51.5% of the time, and a bf16 SwiGLU's y 58%;
  /// a truncated final rounding sends ~100% of the errors toward zero.
  static constexpr double kLean = 0.1;
  std::size_t audited = 0, toward_zero = 0;
  double eps = 0;  // Hoeffding's part of the threshold on |k/N - 1/2|
  double threshold() const { return kLean + eps; }
  bool biased() const {
    return audited >= kMinAudited &&
           std::abs(double(toward_zero) / double(audited) - 0.5) > threshold();
  }
};
RoundingAudit rounding_audit(std::span<const float> got, std::span<const double> ref);

/// Distance in units in the last place: the number of floats strictly
/// between a and b, plus one (0 when equal; +0 and -0 are equal). NaN: max.
std::uint64_t ulp_distance(float a, float b);
std::uint64_t ulp_distance(bf16 a, bf16 b);

/// Tie-aware top-k comparison of a candidate selection with the reference
/// one (docs/DESIGN.md "Reference and bounds"). Per token row of `scores` [T x E]
/// (the scores selection ranks by), idx rows [T x K] with -1 tail slots:
///  - -1 slots appear only at the tail and equally often in both;
///  - candidate indices lie in [0, E) and are distinct within a row;
///  - slot by slot the selected scores are equal (so indices may differ only
///    among experts of equal score at the k-th boundary).
struct Topk {
  bool ok = true;
  std::size_t t = 0, j = 0;  // first offending slot
  std::string reason;        // empty when ok
};
Topk topk_tie_aware(MatView<const float> scores, MatView<const std::int32_t> candidate,
                    MatView<const std::int32_t> reference);

}  // namespace moecert::compare
