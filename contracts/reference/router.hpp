// High-precision router references, templated on the scalar T: weights and
// gradients for a given selection (selection itself is exact and checked by
// the index clauses and the brute-force tests).
#pragma once

#include <cstdint>
#include <vector>

#include "contracts/numeric/functions.hpp"
#include "moecert/router.hpp"

namespace moecert::ref {

/// Valid slots of one idx row (the prefix before any -1).
inline std::size_t valid_prefix(const std::int32_t* idx, std::size_t k) {
  std::size_t v = 0;
  while (v < k && idx[v] >= 0) ++v;
  return v;
}

/// softmax_topk weights of one row (z [E], selection idx [K]).
template <class T>
std::vector<T> softmax_topk_weights(const float* z, std::size_t e, const std::int32_t* idx,
                                    std::size_t k, bool renormalize) {
  const std::size_t v = valid_prefix(idx, k);
  std::vector<T> w(k, T(0));
  if (renormalize) {
    std::vector<float> zs(v);
    for (std::size_t j = 0; j < v; ++j) zs[j] = z[idx[j]];
    const auto p = softmax<T>(zs.data(), v);
    for (std::size_t j = 0; j < v; ++j) w[j] = p[j];
  } else {
    const auto p = softmax<T>(z, e);
    for (std::size_t j = 0; j < v; ++j) w[j] = p[static_cast<std::size_t>(idx[j])];
  }
  return w;
}

/// softmax_topk gradient dz [E] of one row from g [K].
template <class T>
std::vector<T> softmax_topk_grad(const float* z, std::size_t e, const std::int32_t* idx,
                                 const float* g, std::size_t k, bool renormalize) {
  const std::size_t v = valid_prefix(idx, k);
  std::vector<T> dz(e, T(0));
  if (renormalize) {
    const auto w = softmax_topk_weights<T>(z, e, idx, k, true);
    T dot(0);
    for (std::size_t j = 0; j < v; ++j) dot += w[j] * T(g[j]);
    for (std::size_t j = 0; j < v; ++j)
      dz[static_cast<std::size_t>(idx[j])] = w[j] * (T(g[j]) - dot);
  } else {
    const auto p = softmax<T>(z, e);
    T dot(0);
    std::vector<T> gh(e, T(0));
    for (std::size_t j = 0; j < v; ++j) {
      dot += p[static_cast<std::size_t>(idx[j])] * T(g[j]);
      gh[static_cast<std::size_t>(idx[j])] = T(g[j]);
    }
    for (std::size_t i = 0; i < e; ++i) dz[i] = p[i] * (gh[i] - dot);
  }
  return dz;
}

/// sigmoid_topk weights of one row: c s_j / sum_S s.
template <class T>
std::vector<T> sigmoid_topk_weights(const float* z, const std::int32_t* idx, std::size_t k,
                                    double c) {
  const std::size_t v = valid_prefix(idx, k);
  std::vector<T> w(k, T(0));
  T sum(0);
  for (std::size_t j = 0; j < v; ++j) sum += sigmoid(T(z[idx[j]]));
  for (std::size_t j = 0; j < v; ++j) w[j] = T(c) * sigmoid(T(z[idx[j]])) / sum;
  return w;
}

template <class T>
std::vector<T> sigmoid_topk_grad(const float* z, std::size_t e, const std::int32_t* idx,
                                 const float* g, std::size_t k, double c) {
  const std::size_t v = valid_prefix(idx, k);
  std::vector<T> dz(e, T(0));
  T sum(0), dot(0);
  for (std::size_t j = 0; j < v; ++j) sum += sigmoid(T(z[idx[j]]));
  for (std::size_t j = 0; j < v; ++j) dot += T(g[j]) * sigmoid(T(z[idx[j]])) / sum;
  for (std::size_t j = 0; j < v; ++j) {
    const T s = sigmoid(T(z[idx[j]]));
    dz[static_cast<std::size_t>(idx[j])] = T(c) / sum * (T(g[j]) - dot) * s * (T(1) - s);
  }
  return dz;
}

/// product_key weights of one row (scores sx[ix] + sy[iy], exact in T).
template <class T>
std::vector<T> product_key_weights(const float* sx, const float* sy, std::size_t n,
                                   const std::int32_t* idx, std::size_t k,
                                   router::KeyWeights mode) {
  const std::size_t v = valid_prefix(idx, k);
  std::vector<T> s(v), w(k, T(0));
  const auto ni = static_cast<std::int32_t>(n);
  for (std::size_t j = 0; j < v; ++j) s[j] = T(sx[idx[j] / ni]) + T(sy[idx[j] % ni]);
  if (mode == router::KeyWeights::raw)
    for (std::size_t j = 0; j < v; ++j) w[j] = s[j];
  if (mode == router::KeyWeights::exp)
    for (std::size_t j = 0; j < v; ++j) w[j] = exp(s[j]);
  if (mode == router::KeyWeights::softmax &&
      v > 0) {  // a row of -1 slots has no weights to normalise
    T m = s[0], sum(0);
    for (std::size_t j = 1; j < v; ++j)
      if (s[j] > m) m = s[j];
    for (std::size_t j = 0; j < v; ++j) sum += w[j] = exp(s[j] - m);
    for (std::size_t j = 0; j < v; ++j) w[j] = w[j] / sum;
  }
  return w;
}

/// product_key gradients (dsx, dsy) of one row, -1 slots adding nothing.
template <class T>
void product_key_grad(const float* sx, const float* sy, std::size_t n, const std::int32_t* idx,
                      const float* g, std::size_t k, router::KeyWeights mode, std::vector<T>& dsx,
                      std::vector<T>& dsy) {
  const std::size_t v = valid_prefix(idx, k);
  dsx.assign(n, T(0));
  dsy.assign(n, T(0));
  const auto w = product_key_weights<T>(sx, sy, n, idx, k, mode);
  T dot(0);
  for (std::size_t j = 0; j < v; ++j) dot += w[j] * T(g[j]);
  const auto ni = static_cast<std::int32_t>(n);
  for (std::size_t j = 0; j < v; ++j) {
    const T ds = mode == router::KeyWeights::raw   ? T(g[j])
                 : mode == router::KeyWeights::exp ? T(g[j]) * w[j]
                                                   : w[j] * (T(g[j]) - dot);
    dsx[static_cast<std::size_t>(idx[j] / ni)] += ds;
    dsy[static_cast<std::size_t>(idx[j] % ni)] += ds;
  }
}

}  // namespace moecert::ref
