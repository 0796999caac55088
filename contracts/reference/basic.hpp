// Reference evaluators, templated on their scalar T (double, DoubleDouble,
// Hp): dot, GEMM, exp, sigmoid, silu, softmax, log-sum-exp. Inputs are bf16
// or float and enter T exactly; nothing here is fast, everything is plain.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "contracts/reference/scalar.hpp"
#include "moecert/types.hpp"

namespace moecert::ref {

inline double widen(float x) { return x; }
inline double widen(bf16 x) { return x.to_float(); }
inline double widen(double x) { return x; }

/// sum_i a[i] * b[i] at precision T (products exact in double for bf16 and
/// float inputs, so T = double rounds only the sums).
template <class T, class A, class B>
T dot(const A* a, const B* b, std::size_t n, std::size_t stride_b = 1) {
  T s = T(0);
  for (std::size_t i = 0; i < n; ++i) s += T(widen(a[i])) * T(widen(b[i * stride_b]));
  return s;
}

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

template <class T>
T sigmoid(T z) {
  return T(1) / (T(1) + exp(-z));
}

template <class T>
T silu(T z) {
  return z * sigmoid(z);
}

/// d silu / dz = sigma(z) (1 + z (1 - sigma(z))).
template <class T>
T silu_grad(T z) {
  const T s = sigmoid(z);
  return s * (T(1) + z * (T(1) - s));
}

/// Softmax over n values, shifted by the maximum (exact in any T).
template <class T, class In>
std::vector<T> softmax(const In* z, std::size_t n) {
  std::vector<T> p(n);
  if (n == 0) return p;
  double m = widen(z[0]);
  for (std::size_t i = 1; i < n; ++i) m = std::max(m, widen(z[i]));
  T sum = T(0);
  for (std::size_t i = 0; i < n; ++i) sum += p[i] = exp(T(widen(z[i])) - T(m));
  for (auto& v : p) v = v / sum;
  return p;
}

/// log sum_i exp(z_i), shifted by the maximum.
template <class T, class In>
T logsumexp(const In* z, std::size_t n) {
  double m = widen(z[0]);
  for (std::size_t i = 1; i < n; ++i) m = std::max(m, widen(z[i]));
  T sum = T(0);
  for (std::size_t i = 0; i < n; ++i) sum += exp(T(widen(z[i])) - T(m));
  return T(m) + log(sum);
}

}  // namespace moecert::ref
