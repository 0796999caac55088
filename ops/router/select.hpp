// Selection under a strict total order, and the scalar functions the router
// kernels share (so forward, backward and contracts compute them alike).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "moecert/types.hpp"
#include "ops/gemm/exp_poly.hpp"

namespace moecert::router::detail {

/// Writes the k best of the ids 0..n-1 under `better` (a strict total
/// order: better(a, b) means a ranks before b) into out, best first.
template <class Better>
void top_k(std::size_t n, std::size_t k, Better better, std::int32_t* out,
           std::vector<std::int32_t>& ids) {
  ids.resize(n);
  for (std::size_t i = 0; i < n; ++i) ids[i] = static_cast<std::int32_t>(i);
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), better);
  std::copy(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), out);
}

/// Slots of a row before its first -1 (-1 slots sit only at the tail).
inline std::size_t valid_slots(const std::int32_t* idx, std::size_t k) {
  std::size_t v = 0;
  while (v < k && idx[v] >= 0) ++v;
  return v;
}

/// Score descending, then index ascending.
inline bool outranks(float sa, std::int32_t a, float sb, std::int32_t b) {
  return sa > sb || (sa == sb && a < b);
}

/// sigma(z) in fp32 as every router kernel computes it (proofs/bounds.md §4).
inline float sigmoid(float z) { return 1.0f / (1.0f + gemm::exp_poly::exp(-z)); }

/// The exact real sum a + b of two floats, as an unevaluated double pair
/// (hi = fl64(a + b), lo = the exact error): compared lexicographically it
/// orders sums exactly (proofs/router.md §2).
struct ExactSum {
  double hi, lo;
  friend bool operator>(const ExactSum& x, const ExactSum& y) {
    return x.hi > y.hi || (x.hi == y.hi && x.lo > y.lo);
  }
  friend bool operator==(const ExactSum& x, const ExactSum& y) {
    return x.hi == y.hi && x.lo == y.lo;
  }
};
inline ExactSum exact_sum(float a, float b) {
  const double x = a, y = b, s = x + y, bb = s - x;
  return {s, (x - (s - bb)) + (y - bb)};
}

/// A bf16 matrix as fp32, row-major and dense (exact).
inline std::vector<float> widen(MatView<const bf16> m) {
  std::vector<float> out(m.rows * m.cols);
  for (std::size_t i = 0; i < m.rows; ++i)
    for (std::size_t j = 0; j < m.cols; ++j) out[i * m.cols + j] = m(i, j).to_float();
  return out;
}

}  // namespace moecert::router::detail
