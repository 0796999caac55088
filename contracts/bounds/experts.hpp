// The chained bound of the expert forward (proofs/bounds.md §10), and the
// high-precision reference it is measured against.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "contracts/numeric/functions.hpp"
#include "contracts/numeric/rounding.hpp"

namespace moecert::bounds {

/// Reference value and bound of every element of one routed expert's
/// output o = (silu(g) * u) W_d^T for one token, given accessors to the
/// token's x and the expert's weights. Reference in binary64; its own
/// error is below 2^-20 of the fp32 bound (§10) and covered by the final
/// factor (1 + 2^-20).
struct ExpertRow {
  std::vector<double> o, o_bound;
};

template <class X, class Wg, class Wu, class Wd>
ExpertRow expert_row(std::size_t hidden, std::size_t inter, X x, Wg wg, Wu wu, Wd wd) {
  std::vector<double> h(inter), eh(inter);
  for (std::size_t i = 0; i < inter; ++i) {
    double g = 0, u = 0, sg = 0, su = 0;
    for (std::size_t k = 0; k < hidden; ++k) {
      const double xv = x(k), gv = wg(i, k), uv = wu(i, k);
      g += xv * gv;
      u += xv * uv;
      sg += std::fabs(xv * gv);
      su += std::fabs(xv * uv);
    }
    const double s = ref::silu(g);
    h[i] = s * u;
    // §5 then §2: the fp32 silu(g) * u from GEMM outputs within §1, in bf16.
    eh[i] = bf16_store(std::fabs(h[i]),
                       silu_mul(std::fabs(s), std::fabs(u), dot(hidden, sg), dot(hidden, su)));
  }
  ExpertRow r;
  r.o.resize(hidden);
  r.o_bound.resize(hidden);
  for (std::size_t m = 0; m < hidden; ++m) {
    double o = 0, propagated = 0, mag = 0, flushed = 0;
    for (std::size_t i = 0; i < inter; ++i) {
      const double d = wd(m, i);
      o += h[i] * d;
      propagated += eh[i] * std::fabs(d);               // §3 with eb = 0
      mag += (std::fabs(h[i]) + eh[i]) * std::fabs(d);  // |h_hat| |W_d|
      // h_hat may be a denormal bf16 (flushed by AMX and AVX-512): Lemma 1'.
      if (std::fabs(h[i]) - eh[i] < kMinNormal32)
        flushed += (std::fabs(h[i]) + eh[i]) * std::fabs(d);
    }
    r.o[m] = o;
    r.o_bound[m] = propagated + dot(inter, mag, flushed);
  }
  return r;
}

/// §10: y = sum_j w_j o_j accumulated in fp32 from zero in slot order:
/// |y_hat - y| <= sum_j |w_j| e_j + gamma_K sum_j |w_j| (|o_j| + e_j) + 2 K eta.
constexpr double combine(double sum_w_e, double sum_w_mag, std::size_t k) {
  return sum_w_e + gamma(static_cast<double>(k)) * sum_w_mag +
         2 * static_cast<double>(k) * kMinNormal32;
}

/// The factor covering the binary64 reference's own rounding (§10).
inline constexpr double kReferenceSlack = 1 + 0x1p-20;

}  // namespace moecert::bounds
