// Bound-based, ULP and tie-aware top-k comparison.
#include "contracts/engine/compare.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <set>

namespace moecert::compare {

void UtilizationHistogram::add(double u) {
  int bin;
  if (!(u <= 1))
    bin = kBins - 1;
  else if (u >= 0.1)
    bin = kBins - 2;
  else if (u < 1e-6)
    bin = 0;
  else
    bin = std::clamp(static_cast<int>(std::floor(std::log10(u))) + 7, 1, kBins - 3);
  ++count[bin];
}

RoundingAudit rounding_audit(std::span<const float> got, std::span<const double> ref) {
  RoundingAudit a;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = double(got[i]) - ref[i];
    if (err == 0 || ref[i] == 0 || !std::isfinite(err)) continue;
    ++a.audited;
    a.toward_zero += (err < 0) == (ref[i] > 0);
  }
  a.eps = a.audited ? std::sqrt(std::log(2 / RoundingAudit::kAlpha) / (2 * double(a.audited))) : 1;
  return a;
}

Bounded bounded(std::span<const float> got, std::span<const double> ref,
                std::span<const double> bound) {
  Bounded b;
  b.count = got.size();
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = got[i];
    const double err = std::fabs(g - ref[i]);
    const double allowed = bound[i] + 0x1p-52 * std::fabs(ref[i]);
    double util;
    if (!std::isfinite(g) || !std::isfinite(err)) {
      util = std::numeric_limits<double>::infinity();
    } else {
      util = allowed > 0 ? err / allowed : (err > 0 ? std::numeric_limits<double>::infinity() : 0);
      b.max_abs_err = std::max(b.max_abs_err, err);
      if (ref[i] != 0) b.max_rel_err = std::max(b.max_rel_err, err / std::fabs(ref[i]));
    }
    if (!(util <= 1)) ++b.exceeded;
    b.histogram.add(util);
    if (i == 0 || util > b.max_utilization) {
      b.max_utilization = util;
      b.worst = i;
      b.worst_got = g;
      b.worst_ref = ref[i];
      b.worst_bound = bound[i];
    }
  }
  return b;
}

namespace {
// Maps a float's bits onto a monotone integer line (+0 and -0 both at 0).
std::int64_t ordered(std::uint32_t u) {
  const std::int64_t mag = u & 0x7fffffffu;
  return (u >> 31) ? -mag : mag;
}
}  // namespace

std::uint64_t ulp_distance(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<std::uint64_t>::max();
  const std::int64_t d =
      ordered(std::bit_cast<std::uint32_t>(a)) - ordered(std::bit_cast<std::uint32_t>(b));
  return static_cast<std::uint64_t>(d < 0 ? -d : d);
}

std::uint64_t ulp_distance(bf16 a, bf16 b) {
  if (a.is_nan() || b.is_nan()) return std::numeric_limits<std::uint64_t>::max();
  return ulp_distance(a.to_float(), b.to_float()) >> 16;
}

Topk topk_tie_aware(MatView<const float> scores, MatView<const std::int32_t> cand,
                    MatView<const std::int32_t> ref) {
  const std::size_t e = scores.cols, k = ref.cols;
  auto fail = [](std::size_t t, std::size_t j, std::string why) {
    return Topk{false, t, j, std::move(why)};
  };
  if (cand.rows != ref.rows || cand.cols != k || scores.rows != ref.rows)
    return fail(0, 0,
                fmt::format("shapes differ: candidate {}x{}, reference {}x{}, scores {} rows",
                            cand.rows, cand.cols, ref.rows, k, scores.rows));
  for (std::size_t t = 0; t < ref.rows; ++t) {
    std::set<std::int32_t> seen;
    bool tail = false;
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t c = cand(t, j), r = ref(t, j);
      if ((c == -1) != (r == -1))
        return fail(t, j,
                    fmt::format("candidate idx={} but reference idx={}: -1 slots differ", c, r));
      if (c == -1) {
        tail = true;
        continue;
      }
      if (tail) return fail(t, j, fmt::format("idx={} after a -1 slot", c));
      if (c < 0 || static_cast<std::size_t>(c) >= e)
        return fail(t, j, fmt::format("idx={} outside [0, {})", c, e));
      if (!seen.insert(c).second) return fail(t, j, fmt::format("expert {} selected twice", c));
      const float sc = scores(t, static_cast<std::size_t>(c));
      const float sr = scores(t, static_cast<std::size_t>(r));
      if (!(sc == sr))
        return fail(t, j,
                    fmt::format("candidate expert {} has score {}, reference expert {} has {}", c,
                                sc, r, sr));
    }
  }
  return {};
}

}  // namespace moecert::compare
