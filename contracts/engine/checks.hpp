// Reusable clause bodies: element scans that report the first offender.
#pragma once

#include <fmt/format.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/parallel_reduce.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "contracts/engine/engine.hpp"
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
/// Inf and NaN are outside. Branch-free on the magnitude bits, so scans
/// vectorize.
constexpr bool bf16_in_range(bf16 x) {
  const std::uint16_t mag = x.bits & 0x7fffu;
  constexpr std::uint16_t lo = (127 - 60) << 7, hi = ((127 + 60) << 7) | 0x7f;
  return (mag == 0) | (static_cast<std::uint16_t>(mag - lo) <= hi - lo);
}

/// p[0, n) = value on the op's threads, in blocks of 64 Ki elements (the
/// probes' sums set to NaN before the op hands them over).
template <class T>
void fill_parallel(T* p, std::size_t n, const T& value) {
  constexpr std::size_t kGrain = std::size_t{1} << 16;
  oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, n, kGrain),
                            [&](const oneapi::tbb::blocked_range<std::size_t>& r) {
                              std::fill(p + r.begin(), p + r.end(), value);
                            });
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

/// Judges rows 0..n-1 with row(i, fail), which returns whether row i passes
/// and on failure calls fail(location, observed, expected): every row on
/// the op's threads with a fail that does nothing, then the first failing
/// row again with `report` (only its message is formatted). `work`
/// estimates the elements a row reads.
template <class Row, class Report>
void report_first_failing_row(std::size_t n, std::size_t work, Row row, Report report) {
  const std::size_t i = first_failing(
      n, work, [&](std::size_t i) { return row(i, [](std::string, std::string, std::string) {}); });
  if (i < n) row(i, report);
}

/// Whether ok(p[i]) holds for every i < n: evaluated without an early exit
/// inside blocks of 256 elements, the failures OR-ed in an integer as wide
/// as T, so that a predicate on bits vectorizes.
template <class T, class Pred>
bool all_of(const T* p, std::size_t n, Pred ok) {
  using Bits = std::conditional_t<sizeof(T) == 2, std::uint16_t, std::uint32_t>;
  constexpr std::size_t kBlock = 256;
  for (std::size_t i = 0; i < n; i += kBlock) {
    Bits bad = 0;
    const std::size_t end = std::min(n, i + kBlock);
    for (std::size_t k = i; k < end; ++k) bad |= static_cast<Bits>(!ok(p[k]));
    if (bad) return false;
  }
  return true;
}

/// The first row of m holding an element for which ok(value) is false
/// (m.rows if none).
template <class T, class Pred>
std::size_t first_failing_row(MatView<const T> m, Pred ok) {
  return first_failing(m.rows, m.cols, [&](std::size_t i) { return all_of(m.row(i), m.cols, ok); });
}

/// The first element of m in row-major order for which ok(value) is false,
/// as i * cols + j (rows * cols if none). A dense m is scanned as one array
/// in blocks on the op's threads, however narrow its rows.
template <class T, class Pred>
std::size_t first_failing_element(MatView<const T> m, Pred ok) {
  const std::size_t n = m.rows * m.cols;
  if (m.stride != m.cols || m.cols >= 4096) {
    const std::size_t i = first_failing_row(m, ok);
    if (i == m.rows) return n;
    std::size_t j = 0;
    while (ok(m(i, j))) ++j;
    return i * m.cols + j;
  }
  constexpr std::size_t kBlock = 4096;  // in elements
  const std::size_t blocks = (n + kBlock - 1) / kBlock;
  const std::size_t b = first_failing(blocks, kBlock, [&](std::size_t b) {
    return all_of(m.data + b * kBlock, std::min(kBlock, n - b * kBlock), ok);
  });
  if (b == blocks) return n;
  std::size_t i = b * kBlock;
  while (ok(m.data[i])) ++i;
  return i;
}

/// Fails `clause` at the first element of `m` (row-major) for which
/// ok(value) is false, naming it `name[i, j]`. Returns whether all passed.
template <class T, class Pred>
bool scan(Checker& c, const ClauseInfo& clause, std::string_view name, MatView<const T> m, Pred ok,
          std::string_view expected) {
  const std::size_t at = first_failing_element(m, ok);
  if (at == m.rows * m.cols) return true;
  const std::size_t i = at / m.cols, j = at % m.cols;
  c.fail(clause, fmt::format("{}[{}, {}]", name, i, j),
         fmt::format("{}={}", name, static_cast<double>(static_cast<float>(m(i, j)))),
         std::string(expected));
  return false;
}

/// A function compiled for AVX-512, AVX2 and baseline x86-64, one chosen at
/// load time (g++ without sanitizers; elsewhere the baseline only).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define MOECERT_CLONES [[gnu::target_clones("avx512f", "avx2", "default")]]
#else
#define MOECERT_CLONES
#endif

/// Whether rows [0, rows) x columns [0, cols) of the matrix at p (row stride
/// ld) are all finite (contracts/experts/scans.cpp; MOECERT_CLONES).
bool rows_finite(const float* p, std::size_t ld, std::size_t rows, std::size_t cols);

/// Whether v is finite, from its bits (vectorizes; no floating compare).
constexpr bool finite_bits(float v) {
  return (std::bit_cast<std::uint32_t>(v) & 0x7f800000u) != 0x7f800000u;
}
constexpr bool finite_bits(bf16 v) { return v.is_finite(); }

template <class T>
bool scan_finite(Checker& c, const ClauseInfo& clause, std::string_view name, MatView<const T> m) {
  return scan(
      c, clause, name, m, [](T v) { return finite_bits(v); }, "finite");
}

inline bool scan_bf16_range(Checker& c, const ClauseInfo& clause, std::string_view name,
                            MatView<const bf16> m) {
  return scan(
      c, clause, name, m, [](bf16 v) { return bf16_in_range(v); }, "0 or 2^-60 <= |x| <= 2^60");
}

}  // namespace moecert::detail
