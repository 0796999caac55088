// Each router kind's maths inside the layer reference, written once over a
// scalar S (the 50-digit type, double, bounds::Tracked) on one row of
// logits zr (R values) and its valid prefix v of selected ids ir. The
// reference's kind table is `with_router_reference`.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "contracts/numeric/tracked.hpp"
#include "moecert/config.hpp"

namespace moecert::ref {

namespace layer_detail {

template <class S>
S exp_of(const S& a) {
  if constexpr (std::is_same_v<S, bounds::Tracked>)
    return {std::exp(a.v), 0};
  else
    return exp(a);
}

}  // namespace layer_detail

/// softmax_topk: w = softmax over the selected (renormalised) or over all
/// E logits; dz_i = w_i (g_i - sum_S w g) on the selection, and with
/// p over every expert when not renormalised.
struct SoftmaxTopkReference {
  template <class S, class D>
  static std::vector<S> weights(const D& d, const S* zr, const std::int32_t* ir, std::size_t v) {
    using layer_detail::exp_of;
    std::vector<S> w(d.K, S(0));
    if (v == 0) return w;
    S m = zr[ir[0]];
    for (std::size_t i = 0; i < d.E; ++i)
      if (to_double(zr[i]) > to_double(m)) m = zr[i];
    S sum = 0;
    if (d.renormalize)
      for (std::size_t j = 0; j < v; ++j) sum += exp_of(S(zr[ir[j]] - m));
    else
      for (std::size_t i = 0; i < d.E; ++i) sum += exp_of(S(zr[i] - m));
    for (std::size_t j = 0; j < v; ++j) w[j] = exp_of(S(zr[ir[j]] - m)) / sum;
    return w;
  }

  template <class S, class D>
  static std::vector<S> grad(const D& d, const S* zr, const std::int32_t* ir, std::size_t v,
                             const S* g) {
    using layer_detail::exp_of;
    std::vector<S> dz(d.R, S(0));
    if (v == 0) return dz;
    const std::vector<S> w = weights(d, zr, ir, v);
    S dot = 0;
    for (std::size_t j = 0; j < v; ++j) dot += w[j] * g[j];
    if (!d.renormalize) {
      // p over every expert; dz_i = p_i (g^_i - sum_S p g).
      S m = zr[0], sum = 0;
      for (std::size_t i = 0; i < d.E; ++i)
        if (to_double(zr[i]) > to_double(m)) m = zr[i];
      for (std::size_t i = 0; i < d.E; ++i) sum += exp_of(S(zr[i] - m));
      for (std::size_t i = 0; i < d.E; ++i) dz[i] = -(exp_of(S(zr[i] - m)) / sum) * dot;
      for (std::size_t j = 0; j < v; ++j) dz[static_cast<std::size_t>(ir[j])] += w[j] * g[j];
      return dz;
    }
    for (std::size_t j = 0; j < v; ++j) dz[static_cast<std::size_t>(ir[j])] = w[j] * (g[j] - dot);
    return dz;
  }
};

/// sigmoid_topk: w_j = c s_j / sum_S s with s = sigma(z);
/// dz_j = s_j (1 - s_j) (c / sum_S s) (g_j - sum_S g s / sum_S s).
struct SigmoidTopkReference {
  template <class S, class D>
  static std::vector<S> weights(const D& d, const S* zr, const std::int32_t* ir, std::size_t v) {
    std::vector<S> w(d.K, S(0));
    if (v == 0) return w;
    S sum = 0;
    for (std::size_t j = 0; j < v; ++j) sum += sig(zr[ir[j]]);
    for (std::size_t j = 0; j < v; ++j) w[j] = S(d.scaling) * sig(zr[ir[j]]) / sum;
    return w;
  }

  template <class S, class D>
  static std::vector<S> grad(const D& d, const S* zr, const std::int32_t* ir, std::size_t v,
                             const S* g) {
    std::vector<S> dz(d.R, S(0));
    if (v == 0) return dz;
    S sum = 0, dot = 0;
    for (std::size_t j = 0; j < v; ++j) sum += sig(zr[ir[j]]);
    for (std::size_t j = 0; j < v; ++j) dot += g[j] * sig(zr[ir[j]]) / sum;
    for (std::size_t j = 0; j < v; ++j) {
      const S s = sig(zr[ir[j]]);
      dz[static_cast<std::size_t>(ir[j])] = s * (S(1) - s) * (S(d.scaling) / sum) * (g[j] - dot);
    }
    return dz;
  }
};

/// product_key: zr = [sx | sy] (n each), expert i = ix n + iy scores
/// sx[ix] + sy[iy]; w = softmax over the selected scores; each slot's
/// ds_j = w_j (g_j - sum_S w g) reaches both halves.
struct ProductKeyReference {
  template <class S, class D>
  static std::vector<S> weights(const D& d, const S* zr, const std::int32_t* ir, std::size_t v) {
    using layer_detail::exp_of;
    std::vector<S> w(d.K, S(0));
    if (v == 0) return w;
    const std::size_t n = d.R / 2;
    std::vector<S> s(v);
    S m = 0;
    for (std::size_t j = 0; j < v; ++j) {
      s[j] = zr[static_cast<std::size_t>(ir[j]) / n] + zr[n + static_cast<std::size_t>(ir[j]) % n];
      if (j == 0 || to_double(s[j]) > to_double(m)) m = s[j];
    }
    S sum = 0;
    for (std::size_t j = 0; j < v; ++j) sum += exp_of(S(s[j] - m));
    for (std::size_t j = 0; j < v; ++j) w[j] = exp_of(S(s[j] - m)) / sum;
    return w;
  }

  template <class S, class D>
  static std::vector<S> grad(const D& d, const S* zr, const std::int32_t* ir, std::size_t v,
                             const S* g) {
    std::vector<S> dz(d.R, S(0));
    if (v == 0) return dz;
    const std::vector<S> w = weights(d, zr, ir, v);
    S dot = 0;
    for (std::size_t j = 0; j < v; ++j) dot += w[j] * g[j];
    const std::size_t n = d.R / 2;
    for (std::size_t j = 0; j < v; ++j) {
      const S ds = w[j] * (g[j] - dot);
      dz[static_cast<std::size_t>(ir[j]) / n] += ds;
      dz[n + static_cast<std::size_t>(ir[j]) % n] += ds;
    }
    return dz;
  }
};

/// The reference's kind table: calls f with the reference of `kind`.
template <class F>
decltype(auto) with_router_reference(RouterKind kind, F&& f) {
  switch (kind) {
    case RouterKind::softmax_topk:
      return std::forward<F>(f)(SoftmaxTopkReference{});
    case RouterKind::sigmoid_topk:
      return std::forward<F>(f)(SigmoidTopkReference{});
    case RouterKind::product_key:
      break;
  }
  return std::forward<F>(f)(ProductKeyReference{});
}

}  // namespace moecert::ref
