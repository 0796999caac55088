// The GEMM reference: C = A B^T at precision T, and |A| |B|^T, the
// magnitude its bound (contracts/bounds/gemm.hpp) scales with.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "contracts/numeric/functions.hpp"

namespace moecert::ref {

/// C = A * B^T: A [M x K], B [N x K] (a weight matrix W[out, in]); C [M x N]
/// row-major, at precision T.
template <class T, class In>
std::vector<T> gemm_nt(MatView<const In> a, MatView<const In> b) {
  std::vector<T> c(a.rows * b.rows);
  for (std::size_t i = 0; i < a.rows; ++i)
    for (std::size_t j = 0; j < b.rows; ++j) c[i * b.rows + j] = dot<T>(a.row(i), b.row(j), a.cols);
  return c;
}

/// |A| * |B|^T in double: the quantity the GEMM bounds scale with. Exact
/// up to a relative 2^-53 * K (negligible beside fp32's gamma_K; see
/// proofs/bounds.md §2).
template <class In>
std::vector<double> gemm_nt_abs(MatView<const In> a, MatView<const In> b) {
  std::vector<double> c(a.rows * b.rows);
  for (std::size_t i = 0; i < a.rows; ++i)
    for (std::size_t j = 0; j < b.rows; ++j) {
      double s = 0;
      for (std::size_t k = 0; k < a.cols; ++k) s += std::fabs(widen(a(i, k)) * widen(b(j, k)));
      c[i * b.rows + j] = s;
    }
  return c;
}

}  // namespace moecert::ref
