// Reusable clause bodies: element scans that report the first offender.
#pragma once

#include <fmt/format.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_reduce.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "contracts/engine.hpp"
#include "moecert/types.hpp"

namespace moecert::detail {

/// Whether m is rows x cols with a row stride that holds a row.
template <class T>
bool has_shape(MatView<T> m, std::size_t rows, std::size_t cols) {
  return m.rows == rows && m.cols == cols && m.stride >= cols;
}

/// Fails `clause` at the first output (in order) that shares a byte with a
/// later output or with any input, naming the pair; empty outputs are skipped.
inline void no_overlap(Checker& c, const ClauseInfo& clause,
                       const std::vector<std::pair<std::string, ByteRange>>& outs,
                       const std::vector<std::pair<std::string, ByteRange>>& ins) {
  for (std::size_t i = 0; i < outs.size(); ++i) {
    if (outs[i].second.empty()) continue;
    for (std::size_t j = i + 1; j < outs.size(); ++j)
      if (overlaps(outs[i].second, outs[j].second)) {
        c.fail(clause, fmt::format("{} and {}", outs[i].first, outs[j].first), "overlapping",
               "disjoint");
        return;
      }
    for (const auto& [name, r] : ins)
      if (overlaps(outs[i].second, r)) {
        c.fail(clause, fmt::format("{} and {}", outs[i].first, name), "overlapping", "disjoint");
        return;
      }
  }
}

/// bf16 value usable by the GEMM bounds: 0, or 2^-60 <= |x| <= 2^60 (so no
/// product of two such values underflows or overflows; proofs/bounds.md §0).
constexpr bool bf16_in_range(bf16 x) {
  const unsigned e = (x.bits >> 7) & 0xffu;
  return (x.bits & 0x7fffu) == 0 || (e >= 127 - 60 && e <= 127 + 60);
}

/// The least i < n for which ok(i) is false (n if none): indices in blocks
/// on the op's threads when there are many (`work` estimates the elements
/// ok reads per index), the least failing one kept, so the answer is the
/// sequential scan's.
template <class Ok>
std::size_t first_failing(std::size_t n, std::size_t work, Ok ok) {
  auto scan_range = [&](std::size_t i0, std::size_t i1) {
    for (std::size_t i = i0; i < i1; ++i)
      if (!ok(i)) return i;
    return n;
  };
  constexpr std::size_t kParallelElements = std::size_t{1} << 16;
  if (n < 2 || n * work < kParallelElements) return scan_range(0, n);
  const std::size_t grain =
      std::max<std::size_t>(1, kParallelElements / std::max<std::size_t>(1, work));
  return oneapi::tbb::parallel_reduce(
      oneapi::tbb::blocked_range<std::size_t>(0, n, grain), n,
      [&](const oneapi::tbb::blocked_range<std::size_t>& r, std::size_t found) {
        return r.begin() >= found ? found : std::min(found, scan_range(r.begin(), r.end()));
      },
      [](std::size_t a, std::size_t b) { return std::min(a, b); });
}

/// The first row of m holding an element for which ok(value) is false
/// (m.rows if none).
template <class T, class Pred>
std::size_t first_failing_row(MatView<const T> m, Pred ok) {
  return first_failing(m.rows, m.cols, [&](std::size_t i) {
    for (std::size_t j = 0; j < m.cols; ++j)
      if (!ok(m(i, j))) return false;
    return true;
  });
}

/// Fails `clause` at the first element of `m` (row-major) for which
/// ok(value) is false, naming it `name[i, j]`. Returns whether all passed.
template <class T, class Pred>
bool scan(Checker& c, const ClauseInfo& clause, std::string_view name, MatView<const T> m, Pred ok,
          std::string_view expected) {
  const std::size_t i = first_failing_row(m, ok);
  if (i == m.rows) return true;
  std::size_t j = 0;
  while (ok(m(i, j))) ++j;
  c.fail(clause, fmt::format("{}[{}, {}]", name, i, j),
         fmt::format("{}={}", name, static_cast<double>(static_cast<float>(m(i, j)))),
         std::string(expected));
  return false;
}

template <class T>
bool scan_finite(Checker& c, const ClauseInfo& clause, std::string_view name, MatView<const T> m) {
  return scan(
      c, clause, name, m, [](T v) { return std::isfinite(static_cast<float>(v)); }, "finite");
}

inline bool scan_bf16_range(Checker& c, const ClauseInfo& clause, std::string_view name,
                            MatView<const bf16> m) {
  return scan(c, clause, name, m, bf16_in_range, "0 or 2^-60 <= |x| <= 2^60");
}

}  // namespace moecert::detail
