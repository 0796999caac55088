// A-priori element-wise error bounds for fp32 kernels (derivations and
// assumptions: proofs/bounds.md; the § numbers below refer to it).
//
// Every function returns an absolute bound on |computed - exact| in terms
// of exact (reference) magnitudes. Assumptions shared by all: IEEE binary32
// arithmetic with round-to-nearest-even, possibly flushing denormal inputs
// and results to zero; no overflow; bf16 x bf16 products exact in fp32
// (true unless a product underflows: a precondition of the ops using §1).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace moecert::bounds {

inline constexpr double kU32 = 0x1p-24;                // unit roundoff of binary32
inline constexpr double kUbf16 = 0x1p-8;               // unit roundoff of bf16
inline constexpr double kU64 = 0x1p-53;                // of binary64
inline constexpr double kMinNormal32 = 0x1p-126;       // flush threshold
inline constexpr double kBf16HalfDenormal = 0x1p-134;  // half the least bf16 denormal
inline constexpr double kMaxBf16 = 0x1.fep127;         // the largest finite bf16
/// Relative error, in binary32 ulps (units of kU32), allowed for the
/// kernels' exp and log: ops/gemm/exp_poly.hpp measures at most 1 ulp over
/// the normal range (tests/gemm_test.cpp), glibc's expf/logf < 1 ulp. §4.
inline constexpr double kExpUlps = 2;

/// gamma_n = n u / (1 - n u) (Higham, Lemma 3.1); +Inf when n u >= 1.
constexpr double gamma(double n, double u = kU32) {
  return n * u < 1 ? n * u / (1 - n * u) : std::numeric_limits<double>::infinity();
}

/// §1: an fp32 sum of n products (exact bf16 products, or rounded fp32
/// products), in any order and any summation tree, FMA or not, with
/// denormal flushing of results and of products that underflow:
/// |s_hat - s| <= gamma_n sum|a_i b_i| + 3 n 2^-126, plus (§1, Lemma 1')
/// sum |a_i b_i| over inputs a_i that are themselves denormal (flushed):
/// `flushed_inputs`, 0 wherever the inputs are range-checked.
constexpr double dot(std::size_t n, double sum_abs_products, double flushed_inputs = 0) {
  return gamma(static_cast<double>(n)) * sum_abs_products +
         3 * static_cast<double>(n) * kMinNormal32 + flushed_inputs;
}

/// §13: a quantized weight w = code * scale as the kernels compute with it,
/// bf16(fp32(w)): |w_hat - w| <= (u_bf16 + u_32 + u_bf16 u_32) |w| wherever
/// w_hat is normal (gemm.pack.w_range).
constexpr double dequantized(double abs_w) { return (kUbf16 + kU32 + kUbf16 * kU32) * abs_w; }

/// True for an input a kernel may flush to zero (a nonzero denormal).
constexpr bool flushable(double a) { return a != 0 && (a < 0 ? -a : a) < kMinNormal32; }

/// §2: rounding a computed value x_hat (|x_hat - x| <= e) to bf16:
/// |bf16(x_hat) - x| <= e + u_bf16 (|x| + e) + 2^-134.
constexpr double bf16_store(double exact_abs, double e) {
  return e + kUbf16 * (exact_abs + e) + kBf16HalfDenormal;
}

/// §3: a second product fed with a perturbed input. For c = sum_k a_k b_k
/// with |a_hat_k - a_k| <= ea_k, |b_hat_k - b_k| <= eb_k, the propagated
/// part is sum_k (ea_k |b_k| + |a_k| eb_k + ea_k eb_k); the caller sums
/// those terms (e.g. with gemm_nt_abs on the bound matrices) and adds
/// dot() of the perturbed magnitudes |a|+ea, |b|+eb for the new rounding.
constexpr double propagate(double ea, double abs_b, double abs_a, double eb) {
  return ea * abs_b + abs_a * eb + ea * eb;
}

/// §4: sigma(z) = 1 / (1 + exp(-z)) in fp32 with exp within kExpUlps,
/// input error e_z: |sigma_hat - sigma| <= gamma_{c+2} (sigma + e_z/4) + e_z/4 + 2^-126.
constexpr double sigmoid(double sigma_exact, double e_z = 0) {
  return gamma(kExpUlps + 2) * (sigma_exact + e_z / 4) + e_z / 4 + kMinNormal32;
}

/// max_z |silu'(z)| < 1.0999 (attained near z = 2.3994).
inline constexpr double kSiluLipschitz = 1.0999;

/// §5: silu(g) = g sigma(g) in fp32: relative gamma_{c+3}, plus the input
/// error through the Lipschitz constant. Where exp(-g) overflows (g < -88.7)
/// the kernel returns 0; then |silu(g)| < 2^-100 for every fp32 g, and that
/// whole value is allowed as error.
inline constexpr double kSiluOverflowFloor = 0x1p-100;
constexpr double silu(double silu_exact_abs, double e_g = 0) {
  const double es = kSiluLipschitz * e_g;
  const double floor = silu_exact_abs < kSiluOverflowFloor ? silu_exact_abs : 0;
  return es + gamma(kExpUlps + 3) * (silu_exact_abs + es) + floor + kMinNormal32;
}

/// §5: h = silu(g) * u in fp32, given exact |silu(g)| and |u| and input
/// errors e_g, e_u.
constexpr double silu_mul(double silu_exact_abs, double u_abs, double e_g = 0, double e_u = 0) {
  const double es = silu(silu_exact_abs, e_g);
  const double e_prod = es * u_abs + silu_exact_abs * e_u + es * e_u;
  return e_prod + kU32 * (silu_exact_abs * u_abs + e_prod) + kMinNormal32;
}

/// Beyond this shift below the maximum, exp underflows to 0 (§6).
inline constexpr double kUnderflowShift = 104.0;

/// §6: relative error of every fp32 softmax output over n scores (shift by
/// the exact maximum, exp within kExpUlps, any summation order), where
/// max_shift = max_i |z_i - m|; input errors e_z in every score.
/// The bound on p_i is softmax_rel(...) * p_i + 2^-125.
inline double softmax_rel(std::size_t n, double max_shift, double e_z = 0) {
  // Terms with z_i - m < -104 underflow to 0 in both the kernel and the exact
  // softmax (|e^d| < 2^-150): the absolute term covers them, so the shift
  // that matters is capped (found by router_fuzzer with |z| near 1e38).
  max_shift = std::min(max_shift, kUnderflowShift);
  const double rho =
      std::expm1(max_shift * kU32) + (1 + std::expm1(max_shift * kU32)) * kExpUlps * kU32;
  const double theta = (1 + rho) * (1 + gamma(static_cast<double>(n > 0 ? n - 1 : 0))) - 1;
  const double rounding = (1 + rho) * (1 + kU32) / (1 - theta) - 1;
  return (1 + rounding) * std::exp(2 * e_z) - 1;
}
inline double softmax(double p_exact, std::size_t n, double max_shift, double e_z = 0) {
  return softmax_rel(n, max_shift, e_z) * p_exact + 2 * kMinNormal32;
}

/// §7: weights renormalised over the K selected, w_i = v_i / sum_S v_j, from
/// values v_hat_j = v_j (1 + eps_j) + a_j with |eps_j| <= eps, |a_j| <= v_abs
/// (the absolute part covers values that underflowed), and `extra_mults`
/// fp32 multiplications by a constant (e.g. the scaling factor c).
constexpr double renormalized_rel(std::size_t k, double eps, int extra_mults = 0) {
  double num = (1 + eps) * (1 + kU32);
  for (int i = 0; i < extra_mults; ++i) num *= 1 + kU32;
  const double den = (1 - eps) * (1 - gamma(static_cast<double>(k > 0 ? k - 1 : 0)));
  return num / den - 1;
}
/// The absolute bound on w_i: relative part, plus the underflow part
/// 2 (k + 1) v_abs / sum_S v_j (valid while k v_abs <= sum_S v_j / 4).
constexpr double renormalized(double w_exact, std::size_t k, double eps, double v_abs,
                              double sum_exact, int extra_mults = 0) {
  return renormalized_rel(k, eps, extra_mults) * w_exact +
         2 * static_cast<double>(k + 1) * v_abs / sum_exact;
}

/// §8: log-sum-exp over n scores in fp32 (shift, exp, sum, logf within
/// kExpUlps, add the maximum back): absolute error, given exact |lse|, the
/// exact log-sum L = lse - m and the maximum shift.
inline double logsumexp(double lse_abs, double l_abs, std::size_t n, double max_shift) {
  max_shift = std::min(max_shift, kUnderflowShift);
  const double rho =
      std::expm1(max_shift * kU32) + (1 + std::expm1(max_shift * kU32)) * kExpUlps * kU32;
  const double theta = (1 + rho) * (1 + gamma(static_cast<double>(n > 0 ? n - 1 : 0))) - 1;
  const double e_log_arg = -std::log1p(-theta);  // |log S_hat - log S|
  const double e_l = e_log_arg + kExpUlps * kU32 * (l_abs + e_log_arg) + kMinNormal32;
  return e_l + kU32 * (lse_abs + e_l);
}

/// §4: exp(z) in fp32 within kExpUlps, input error e_z.
inline double exp(double exp_exact, double e_z = 0) {
  return exp_exact * (std::expm1(e_z) + std::exp(e_z) * kExpUlps * kU32) + kMinNormal32;
}

}  // namespace moecert::bounds
