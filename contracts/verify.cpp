// Freivalds/ABFT probes and sampled-row recomputation (audit level).
#include "contracts/verify.hpp"

#include <cmath>
#include <random>

#include "contracts/bounds/basic.hpp"
#include "contracts/reference/basic.hpp"

namespace moecert::verify {

ProbeResult probe_gemm_nt(MatView<const bf16> a, MatView<const bf16> b, MatView<const float> c,
                          const ProbeOptions& opt) {
  ProbeResult res;
  const std::size_t m = a.rows, n = b.rows, k = a.cols;
  const std::size_t width = std::max<std::size_t>(opt.width, 1);
  std::mt19937_64 rng(opt.seed);
  std::vector<double> br(k), babs(k), r(width);
  // Rounding of the probe itself in double (§9): the K + width + 1 terms of
  // A (B^T r) and the width terms of C r.
  const double g_probe = bounds::gamma(static_cast<double>(k + 2 * width + 2), bounds::kU64);
  for (std::size_t j0 = 0, block = 0; j0 < n; j0 += width, ++block) {
    const std::size_t w = std::min(width, n - j0);
    for (std::size_t j = 0; j < w; ++j) r[j] = (rng() & 1) ? 1.0 : -1.0;
    // B^T r and |B|^T |r| over the block: y_k = sum_j b[j0+j][k] r_j.
    std::fill(br.begin(), br.end(), 0.0);
    std::fill(babs.begin(), babs.end(), 0.0);
    for (std::size_t j = 0; j < w; ++j)
      for (std::size_t kk = 0; kk < k; ++kk) {
        const double v = b(j0 + j, kk).to_float();
        br[kk] += v * r[j];
        babs[kk] += std::fabs(v);
      }
    for (std::size_t i = 0; i < m; ++i) {
      double lhs = 0, cabs = 0, rhs = 0, mag = 0;
      for (std::size_t j = 0; j < w; ++j) {
        lhs += static_cast<double>(c(i, j0 + j)) * r[j];
        cabs += std::fabs(static_cast<double>(c(i, j0 + j)));
      }
      for (std::size_t kk = 0; kk < k; ++kk) {
        const double av = a(i, kk).to_float();
        rhs += av * br[kk];
        mag += std::fabs(av) * babs[kk];  // (|A| (|B|^T |r|))_i
      }
      // Sum over the block of the per-element bounds (§1, and §2 when C is
      // bf16), plus the probe's own rounding.
      double threshold = bounds::gamma(static_cast<double>(k)) * mag +
                         2 * static_cast<double>(w * k) * bounds::kMinNormal32;
      if (opt.c_is_bf16) threshold += bounds::kUbf16 * (mag + threshold) + w * bounds::kBf16HalfDenormal;
      threshold += g_probe * (mag + cabs) * 2;
      const double residual = std::fabs(lhs - rhs);
      const double ratio = threshold > 0 ? residual / threshold : (residual > 0 ? INFINITY : 0);
      if (!(residual <= threshold) && res.pass) {
        res.pass = false;
        res.row = i;
        res.block = block;
        res.residual = residual;
        res.threshold = threshold;
      }
      if (!(ratio <= res.max_ratio)) res.max_ratio = ratio;
    }
  }
  return res;
}

compare::Bounded check_rows_gemm_nt(MatView<const bf16> a, MatView<const bf16> b,
                                    MatView<const float> c, const std::vector<std::size_t>& rows,
                                    bool c_is_bf16) {
  std::vector<float> got;
  std::vector<double> want, bound;
  for (std::size_t i : rows) {
    for (std::size_t j = 0; j < b.rows; ++j) {
      double sum_abs = 0;
      for (std::size_t kk = 0; kk < a.cols; ++kk)
        sum_abs += std::fabs(double(a(i, kk).to_float()) * double(b(j, kk).to_float()));
      const double exact = ref::to_double(ref::dot<ref::DoubleDouble>(a.row(i), b.row(j), a.cols));
      double e = bounds::dot(a.cols, sum_abs);
      if (c_is_bf16) e = bounds::bf16_store(std::fabs(exact), e);
      got.push_back(c(i, j));
      want.push_back(exact);
      bound.push_back(e);
    }
  }
  return compare::bounded(got, want, bound);
}

}  // namespace moecert::verify
