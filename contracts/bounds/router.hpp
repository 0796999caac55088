// Element-wise bounds of the router gradients (proofs/router.md §4), in
// terms of exact (reference) values; each inherits the model of
// proofs/bounds.md §0.
#pragma once

#include <cmath>
#include <cstddef>

#include "contracts/bounds/basic.hpp"

namespace moecert::bounds {

/// §4.1: d = fl(w_hat (g - D_hat)) with D = sum_S w g over k terms, where each
/// w_hat_j = w_j (1 + e_j) + a_j, |e_j| <= eps, |a_j| <= 2 eta; sum_w_absg =
/// sum_S w |g|, sum_absg = sum_S |g|. The form of every softmax-style
/// gradient (renormalised over S, dense over E, product-key softmax).
constexpr double weighted_diff(double w, double g, double d_exact, double sum_w_absg, double sum_absg, std::size_t k,
                               double eps) {
  const double eta2 = 2 * kMinNormal32;
  const double e_d = eps * sum_w_absg + eta2 * sum_absg + gamma(static_cast<double>(k)) * ((1 + eps) * sum_w_absg + eta2 * sum_absg);
  const double diff = std::fabs(g - d_exact);
  const double e_f = e_d + kU32 * (diff + e_d);
  const double w_hat = w * (1 + eps) + eta2;
  return (eps * w + eta2) * diff + w_hat * e_f + kU32 * w_hat * (diff + e_f) + kMinNormal32;
}

/// §4.2: sigmoid_topk gradient of a selected expert: dz = fl(fl(fl(c / S_hat)
/// fl(g - D_hat)) fl(s_hat (1 - s_hat))) with S = sum_S s over k terms, r_j =
/// s_j / S, D = sum_S g r.
inline double sigmoid_grad(double s, double g, double c, double sum_s, double d_exact, double sum_absg_r,
                           double sum_absg, std::size_t k) {
  const double es = gamma(kExpUlps + 2);  // relative error of s_hat (§4 of bounds.md)
  const double e_sum = (1 + es) * (1 + gamma(static_cast<double>(k > 0 ? k - 1 : 0))) - 1;
  const double e_r = (1 + es) * (1 + kU32) / (1 - e_sum) - 1;
  const double e_d = e_r * sum_absg_r + gamma(static_cast<double>(k)) * (1 + e_r) * sum_absg_r + 2 * kMinNormal32 * sum_absg;
  const double diff = std::fabs(g - d_exact);
  const double e_f = e_d + kU32 * (diff + e_d);
  const double a = c / sum_s, e_a = a * ((1 + kU32) / (1 - e_sum) - 1);
  const double ds = a * diff, e_ds = e_a * diff + (a + e_a) * e_f + kU32 * (a + e_a) * (diff + e_f);
  // q = s (1 - s): 1 - s_hat is off by es s plus its own rounding u (1 - s).
  const double one_minus = 1 - s, e_om = es * s + kU32 * one_minus + kMinNormal32;
  const double q = s * one_minus, e_q = es * s * one_minus + (s * (1 + es)) * e_om + kU32 * (s * (1 + es)) * (one_minus + e_om);
  return ds * e_q + q * e_ds + e_ds * e_q + kU32 * (ds + e_ds) * (q + e_q) + kMinNormal32;
}

/// §4.3: an fp32 sum of `count` terms t_j each within e_j, in slot order.
constexpr double accumulated(double sum_abs_terms, double sum_errors, std::size_t count) {
  return sum_errors + gamma(static_cast<double>(count)) * (sum_abs_terms + sum_errors);
}

}  // namespace moecert::bounds
