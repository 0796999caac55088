// Reference evaluators, templated on their scalar T (double, DoubleDouble,
// Hp): dot, exp, sigmoid, silu, softmax, log-sum-exp. Inputs are bf16
// or float and enter T exactly; nothing here is fast, everything is plain.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "contracts/numeric/scalar.hpp"
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
