// The routers' total order as the judge computes it, written here from the
// definition (docs/DESIGN.md, proofs/router.md §2) and not shared with the
// kernels, so that a kernel whose order is wrong meets a clause that is not.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moecert::contracts::order {

/// Whether expert a with score sa ranks before expert b with score sb:
/// score descending, then expert index ascending.
inline bool ranks_before(float sa, std::int32_t a, float sb, std::int32_t b) {
  if (sa != sb) return sa > sb;
  return a < b;
}

/// The number of slots of a row before its first -1.
inline std::size_t filled_slots(const std::int32_t* row, std::size_t k) {
  std::size_t j = 0;
  for (; j < k; ++j)
    if (row[j] < 0) break;
  return j;
}

/// The exact real value of a + b for floats a, b: the double nearest to it
/// and the double remainder (Knuth's TwoSum; every float is a double, so the
/// pair is exact). Pairs compare as the exact sums do.
struct PairSum {
  double hi, lo;
};

inline PairSum pair_sum(float a, float b) {
  const double x = a, y = b, s = x + y;
  const double y_part = s - x, x_part = s - y_part;
  return {s, (x - x_part) + (y - y_part)};
}

/// Whether the exact sum p exceeds q (-1: less, 0: equal, 1: greater).
inline int compare(const PairSum& p, const PairSum& q) {
  if (p.hi != q.hi) return p.hi > q.hi ? 1 : -1;
  if (p.lo != q.lo) return p.lo > q.lo ? 1 : -1;
  return 0;
}

}  // namespace moecert::contracts::order
