// Element-wise bounds of the router gradients (proofs/router.md §4), in
// terms of exact (reference) values; each inherits the model of
// proofs/bounds.md §0.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

#include "contracts/numeric/rounding.hpp"
#include "contracts/reference/router.hpp"

namespace moecert::bounds {

/// One router row's binary64 reference weights and each one's bound (§3):
/// |w_j - ref[j]| <= bound[j] (+ the reference's own rounding).
struct WeightsRow {
  std::vector<double> ref, bound;
};

/// §3 for the weights of one softmax_topk row (logits z [e], selection idx
/// [k]): |w_j - exact| <= eps w_j + 2 eta, eps from §6 over the logits the
/// softmax runs over (the selected ones, or all e when dense); 0 at -1
/// slots (weight exactly 0).
inline WeightsRow softmax_topk_weights_row(const float* z, std::size_t e, const std::int32_t* idx,
                                           std::size_t k, bool renormalize) {
  const std::size_t v = ref::valid_prefix(idx, k), n = renormalize ? v : e;
  auto w = ref::softmax_topk_weights<double>(z, e, idx, k, renormalize);
  double lo = INFINITY, hi = -INFINITY;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = renormalize ? z[idx[i]] : z[i];
    lo = std::min(lo, x), hi = std::max(hi, x);
  }
  const double eps = softmax_rel(n, hi - lo);
  std::vector<double> out(k, 0.0);
  for (std::size_t j = 0; j < v; ++j) out[j] = eps * w[j] + 2 * kMinNormal32;
  return {std::move(w), std::move(out)};
}

/// §1a: the fp32 selection score fl(sigma_hat(z) + b) of sigmoid_topk
/// against the exact sigma(z) + b (sigma within bounds.md §4, one rounded
/// addition; a sum below the normal range is exact).
constexpr double sigmoid_selection(double sigma_exact, double bias) {
  const double es = sigmoid(sigma_exact);
  const double s = sigma_exact + bias;
  return es + kU32 * ((s < 0 ? -s : s) + es);
}

/// §1b: the shift below which an fp32 softmax probability of a row of e
/// experts may leave the normal range: ln(2^-126) + ln(e) below the
/// row's maximum.
inline double softmax_normal_shift(std::size_t e) {
  return 126 * std::log(2.0) - std::log(static_cast<double>(e));
}

/// §1b: how far apart two logits z_a > z_b of a softmax row (maximum
/// z_max) may be while an fp32 implementation that selects on its own
/// probabilities may still give b a probability no lower than a's: the
/// shift's rounding (for a shift anywhere between 0 and z_max), exp within
/// kExpUlps and the division; infinite where both lie `normal_shift`
/// (softmax_normal_shift) or more below z_max.
inline double softmax_selection_reach(double za, double zb, double zmax, double normal_shift) {
  if (za - zmax < -normal_shift && zb - zmax < -normal_shift) return INFINITY;
  const double sa = std::max(std::fabs(za), std::fabs(za - zmax)),
               sb = std::max(std::fabs(zb), std::fabs(zb - zmax));
  const double x = kExpUlps * kU32;
  return (kU32 * (sa + sb) + 2 * x / (1 - x) + 2 * kU32 / (1 - kU32)) * (1 + 0x1p-20);
}

/// §1a: a group's fp32 score, the sum of its two best selection scores
/// (one if the group has one expert), each within `d_max` of exact, from
/// the exact group score g: the best-two sum moves by at most 2 d_max, then
/// one rounded addition.
constexpr double sigmoid_group_score(double g, double d_max, std::size_t size) {
  const double moved = (size >= 2 ? 2 : 1) * d_max;
  return moved + (size >= 2 ? kU32 * ((g < 0 ? -g : g) + moved) : 0);
}

/// §3 for the weights of one sigmoid_topk row (scaling c): w = c s / S with
/// s from §4 of bounds.md (relative gamma_{kExpUlps+2}; the scores_finite
/// clause keeps z >= -87, so s stays normal), §7 with one extra
/// multiplication, plus eta for a weight below the normal range; 0 at -1
/// slots.
inline WeightsRow sigmoid_topk_weights_row(const float* z, const std::int32_t* idx, std::size_t k,
                                           double c) {
  const std::size_t v = ref::valid_prefix(idx, k);
  auto w = ref::sigmoid_topk_weights<double>(z, idx, k, c);
  const double rel = renormalized_rel(v, gamma(kExpUlps + 2), 1);
  std::vector<double> out(k, 0.0);
  for (std::size_t j = 0; j < v; ++j) out[j] = rel * w[j] + kMinNormal32;
  return {std::move(w), std::move(out)};
}

/// §3 for the weights of one product_key row (halves sx [n], sy [n],
/// selection idx [k], `mode`), from the fp32 score fl(sx + sy) (relative
/// error u, exact where it is below the normal range): raw, u |s|; exp, §4a
/// with input error u |s|; softmax, §6 over the selected scores with their
/// rounding as input error, eps w + 2 eta. 0 at -1 slots.
inline WeightsRow product_key_weights_row(const float* sx, const float* sy, std::size_t n,
                                          const std::int32_t* idx, std::size_t k,
                                          router::KeyWeights mode) {
  const std::size_t v = ref::valid_prefix(idx, k);
  auto w = ref::product_key_weights<double>(sx, sy, n, idx, k, mode);
  std::vector<double> s(v);
  double top = -INFINITY, shift = 0;
  for (std::size_t j = 0; j < v; ++j) {
    const auto e = static_cast<std::size_t>(idx[j]);
    s[j] = double(sx[e / n]) + double(sy[e % n]);
    top = std::max(top, s[j]);
  }
  for (std::size_t j = 0; j < v; ++j) shift = std::max(shift, top - s[j]);
  const double eps = softmax_rel(v, shift, 2 * kU32 * std::fabs(top) + 2 * kU32 * shift);
  std::vector<double> out(k, 0.0);
  for (std::size_t j = 0; j < v; ++j) {
    const double b = mode == router::KeyWeights::raw   ? kU32 * std::fabs(s[j])
                     : mode == router::KeyWeights::exp ? bounds::exp(w[j], kU32 * std::fabs(s[j]))
                                                       : eps * w[j] + 2 * kMinNormal32;
    out[j] = std::isnan(b) ? INFINITY : b;
  }
  return {std::move(w), std::move(out)};
}

/// §4.1: d = fl(w_hat (g - D_hat)) with D = sum_S w g over k terms, where each
/// w_hat_j = w_j (1 + e_j) + a_j, |e_j| <= eps, |a_j| <= 2 eta; sum_w_absg =
/// sum_S w |g|, sum_absg = sum_S |g|. The form of every softmax-style
/// gradient (renormalised over S, dense over E, product-key softmax).
constexpr double weighted_diff(double w, double g, double d_exact, double sum_w_absg,
                               double sum_absg, std::size_t k, double eps) {
  const double eta2 = 2 * kMinNormal32;
  const double e_d = eps * sum_w_absg + eta2 * sum_absg +
                     gamma(static_cast<double>(k)) * ((1 + eps) * sum_w_absg + eta2 * sum_absg);
  const double diff = std::fabs(g - d_exact);
  const double e_f = e_d + kU32 * (diff + e_d);
  const double w_hat = w * (1 + eps) + eta2;
  return (eps * w + eta2) * diff + w_hat * e_f + kU32 * w_hat * (diff + e_f) + kMinNormal32;
}

/// §4.1 for every expert i of one softmax_topk row (logits z [e], selection
/// idx [k], g [k]), from the binary64 weights: weighted_diff with eps of §6
/// over the weights' logits (the selected ones, or all e when dense); an
/// expert off the selection of a renormalised row gets exactly 0 (bound 0);
/// logits too far apart for §6 (eps = inf) give +inf.
inline std::vector<double> softmax_topk_grad_row(const float* z, std::size_t e,
                                                 const std::int32_t* idx, const float* g,
                                                 std::size_t k, bool renormalize) {
  const std::size_t v = ref::valid_prefix(idx, k);
  const auto wsel = ref::softmax_topk_weights<double>(z, e, idx, k, renormalize);
  const auto p = ref::softmax<double>(z, e);
  double d = 0, swg = 0, sg = 0, lo = INFINITY, hi = -INFINITY;
  for (std::size_t j = 0; j < v; ++j)
    d += wsel[j] * g[j], swg += wsel[j] * std::fabs(g[j]), sg += std::fabs(g[j]);
  for (std::size_t i = 0; i < (renormalize ? v : e); ++i) {
    const double x = renormalize ? z[idx[i]] : z[i];
    lo = std::min(lo, x), hi = std::max(hi, x);
  }
  const double eps = softmax_rel(renormalize ? v : e, hi - lo);
  std::vector<double> out(e);
  for (std::size_t i = 0; i < e; ++i) {
    double gi = 0, wi = renormalize ? 0 : p[i];
    bool selected = false;
    for (std::size_t j = 0; j < v; ++j)
      if (idx[j] == static_cast<std::int32_t>(i)) gi = g[j], wi = wsel[j], selected = true;
    const double b = renormalize && !selected ? 0 : weighted_diff(wi, gi, d, swg, sg, v, eps);
    out[i] = std::isnan(b) ? INFINITY : b;  // eps = inf (§6: unconstrained weights) times 0
  }
  return out;
}

/// §4.4: softmax_topk's renormalised gradient as an implementation that
/// differentiates the dense softmax computes it (autograd through p =
/// softmax(z) over all E, the top K taken and w = p_S / sum_S p): |dz_i -
/// exact| per expert of a row; unselected experts get the rounding noise
/// p_i c, c = the computed sum_S p dp (exactly 0 in the maths).
inline std::vector<double> softmax_dense_grad_row(const float* z, std::size_t e,
                                                  const std::int32_t* idx, const float* g,
                                                  std::size_t k) {
  const std::size_t v = ref::valid_prefix(idx, k);
  const auto w = ref::softmax_topk_weights<double>(z, e, idx, k, true);
  const auto p = ref::softmax<double>(z, e);
  double lo = INFINITY, hi = -INFINITY, d = 0, swg = 0, gmax = 0;
  for (std::size_t i = 0; i < e; ++i)
    lo = std::min(lo, double(z[i])), hi = std::max(hi, double(z[i]));
  for (std::size_t j = 0; j < v; ++j)
    d += w[j] * g[j], swg += w[j] * std::fabs(g[j]), gmax = std::max(gmax, std::fabs(double(g[j])));
  const double eps = softmax_rel(e, hi - lo), eps_w = renormalized_rel(v, eps);
  const double big_w = (1 + eps_w) * swg;  // bounds sum_S w_hat |g|
  const double gk = gamma(static_cast<double>(v)), gk4 = gamma(static_cast<double>(v + 4));
  const double beta =
      gk + gk4 * (2 + gk) + 2 * gamma(static_cast<double>(e)) * (1 + gk) * (1 + gk4);
  const double eta = 8 * static_cast<double>(e + v + 8) * 2 * kMinNormal32 * (1 + gmax + big_w);
  std::vector<double> out(e);
  for (std::size_t i = 0; i < e; ++i) {
    const double noise = ((1 + eps) * p[i] + 2 * kMinNormal32) * beta * big_w * (1 + kU32) + eta;
    out[i] = noise;
    for (std::size_t j = 0; j < v; ++j)
      if (idx[j] == static_cast<std::int32_t>(i)) {
        const double wh = (1 + eps_w) * w[j], diff = std::fabs(g[j] - d);
        out[i] += wh * ((eps_w + gamma(2)) * diff + (eps_w + gk4) * (std::fabs(g[j]) + 2 * big_w)) *
                  (1 + gamma(2));
      }
    if (std::isnan(out[i])) out[i] = INFINITY;
  }
  return out;
}

/// §4.2: sigmoid_topk gradient of a selected expert: dz = fl(c fl(fl(f_hat
/// r_hat) fl(1 - s_hat))) with f_hat = fl(g - D_hat), r_hat = fl(s_hat /
/// S_hat), S = sum_S s over k terms, r_j = s_j / S, D = sum_S g r; s is the
/// exact sigma of this expert's logit.
inline double sigmoid_grad(double s, double g, double c, double sum_s, double d_exact,
                           double sum_absg_r, double sum_absg, std::size_t k) {
  const double eta = kMinNormal32;
  const double es = gamma(kExpUlps + 2);  // relative error of s_hat (§4 of bounds.md)
  const double e_sum = (1 + es) * (1 + gamma(static_cast<double>(k > 0 ? k - 1 : 0))) - 1;
  const double e_r = (1 + es) * (1 + kU32) / (1 - e_sum) - 1;
  const double e_d = e_r * sum_absg_r + gamma(static_cast<double>(k)) * (1 + e_r) * sum_absg_r +
                     2 * eta * sum_absg;
  const double diff = std::fabs(g - d_exact);
  const double e_f = e_d + kU32 * (diff + e_d);  // |f_hat - (g - D)|
  // p = f r: r_hat = r (1 + e) + a, |e| <= e_r, |a| <= 2 eta; rounding u |p_hat| + eta.
  const double r = s / sum_s, r_bar = r * (1 + e_r) + 2 * eta;
  const double e_p = e_f * r_bar + diff * (e_r * r + 2 * eta) + kU32 * (diff + e_f) * r_bar + eta;
  // o = 1 - s: s_hat off by es s, one rounding (never below the normal range).
  const double o = 1 - s, e_o = es * s + kU32 * (o + es * s);
  // q = p o, then dz = c q.
  const double p = diff * r, e_q = e_p * (o + e_o) + p * e_o + kU32 * (p + e_p) * (o + e_o) + eta;
  return c * e_q + kU32 * c * (p * o + e_q) + eta;
}

/// §4.2 for every expert i of one sigmoid_topk row (logits z [e], selection
/// idx [k], g [k], scaling c), from the exact sigmoids; 0 off the selection,
/// where the backward writes an exact 0.
inline std::vector<double> sigmoid_topk_grad_row(const float* z, std::size_t e,
                                                 const std::int32_t* idx, const float* g,
                                                 std::size_t k, double c) {
  const std::size_t v = ref::valid_prefix(idx, k);
  std::vector<double> s(v);
  double sum_s = 0, d = 0, sum_absg_r = 0, sum_absg = 0;
  for (std::size_t j = 0; j < v; ++j) sum_s += s[j] = ref::sigmoid(double(z[idx[j]]));
  for (std::size_t j = 0; j < v; ++j) {
    const double r = s[j] / sum_s;
    d += g[j] * r, sum_absg_r += std::fabs(g[j]) * r, sum_absg += std::fabs(g[j]);
  }
  std::vector<double> out(e, 0.0);
  for (std::size_t j = 0; j < v; ++j)
    out[static_cast<std::size_t>(idx[j])] =
        sigmoid_grad(s[j], g[j], c, sum_s, d, sum_absg_r, sum_absg, v);
  return out;
}

/// §4.3: an fp32 sum of `count` terms t_j each within e_j, in slot order.
constexpr double accumulated(double sum_abs_terms, double sum_errors, std::size_t count) {
  return sum_errors + gamma(static_cast<double>(count)) * (sum_abs_terms + sum_errors);
}

/// §4.3 for one product_key row (halves sx [n], sy [n], selection idx [k],
/// g [k], weights `mode`): bounds on the backward's dsx, then dsy (2n
/// values), from the binary64 weights. Each valid slot's ds_j is within e_j
/// (raw: exact; exp: the §4a weight of the rounded score, then one product,
/// which may land below the normal range; softmax: weighted_diff with eps
/// of §6 over the rounded scores fl(sx + sy)); a key sums its slots' ds_j
/// (`accumulated`), plus 2^-52 of their magnitudes for the binary64
/// reference's own evaluation. A key no valid slot selects gets 0 (the
/// backward leaves it exactly 0); a weight the scores leave unconstrained
/// (|s| beyond about 1e5, §6) gives +inf.
inline std::vector<double> product_key_grad_row(const float* sx, const float* sy, std::size_t n,
                                                const std::int32_t* idx, const float* g,
                                                std::size_t k, router::KeyWeights mode) {
  const std::size_t v = ref::valid_prefix(idx, k);
  const auto w = ref::product_key_weights<double>(sx, sy, n, idx, k, mode);
  auto score = [&](std::size_t j) {
    const auto e = static_cast<std::size_t>(idx[j]);
    return double(sx[e / n]) + double(sy[e % n]);
  };
  double top = -INFINITY, shift = 0, d = 0, swg = 0, sg = 0;
  for (std::size_t j = 0; j < v; ++j) top = std::max(top, score(j));
  for (std::size_t j = 0; j < v; ++j)
    shift = std::max(shift, top - score(j)), d += w[j] * g[j], swg += w[j] * std::fabs(g[j]),
    sg += std::fabs(g[j]);
  const double eps = softmax_rel(v, shift, 2 * kU32 * std::fabs(top) + 2 * kU32 * shift);
  std::vector<double> terms(2 * n, 0.0), errs(2 * n, 0.0), out(2 * n, 0.0);
  std::vector<std::size_t> count(2 * n, 0);
  for (std::size_t j = 0; j < v; ++j) {
    const double gj = g[j];
    double ds = gj, e = 0;
    if (mode == router::KeyWeights::exp) {
      const double e_w = bounds::exp(w[j], kU32 * std::fabs(score(j)));
      ds = gj * w[j];
      e = std::fabs(gj) * e_w + kU32 * std::fabs(gj) * (w[j] + e_w) +
          kMinNormal32;  // a product below the normal range
    } else if (mode == router::KeyWeights::softmax) {
      ds = w[j] * (gj - d);
      e = weighted_diff(w[j], gj, d, swg, sg, v, eps);
    }
    const auto at = static_cast<std::size_t>(idx[j]);
    for (const std::size_t key : {at / n, n + at % n})
      terms[key] += std::fabs(ds), errs[key] += e, ++count[key];
  }
  for (std::size_t i = 0; i < 2 * n; ++i) {
    if (!count[i]) continue;
    const double b = accumulated(terms[i], errs[i], count[i]) + 0x1p-52 * terms[i];
    out[i] = std::isnan(b) ? INFINITY : b;  // inf - inf in an unconstrained weight's terms
  }
  return out;
}

}  // namespace moecert::bounds
