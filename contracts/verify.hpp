// Result verification for the `audit` level: a Freivalds/ABFT probe of
// C = A B^T with a threshold derived from the same bounds as the full
// comparison, and recomputation of output rows by the reference.
// B is read through an accessor b(j, k) -> bf16, so packed weights can be
// verified in place (PackedWeights::at).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "contracts/bounds/basic.hpp"
#include "contracts/bounds/gemm.hpp"
#include "contracts/compare.hpp"
#include "contracts/reference/basic.hpp"
#include "moecert/types.hpp"

namespace moecert::verify {

struct ProbeOptions {
  /// Columns per probe vector. Each probe r is +-1 on one block of `width`
  /// columns and 0 elsewhere; the threshold is the sum of the block's
  /// element bounds, so a narrower probe sees smaller errors at
  /// proportionally higher cost (proofs/bounds.md §9).
  std::size_t width = 4;
  std::uint64_t seed = 0x5eed;
  bool c_is_bf16 = false;  // C was rounded to bf16 (adds §2 to the bound)
};

struct ProbeResult {
  bool pass = true;
  std::size_t row = 0, block = 0;      // first failing (row, column block)
  double residual = 0, threshold = 0;  // |C r - A (B^T r)| and its allowance there
  double max_ratio = 0;                // max residual / threshold over all probes
};

/// Checks C [M x N] against A [M x K] B^T (B [N x K] via b(j, k)), one probe
/// per column block, all rows at once. Cost (N / width)(M K + N K) binary64
/// operations. Never fails for a C within bounds::dot of the exact product
/// (§9: the threshold includes the probe's own rounding).
template <class AAt, class BAt>
ProbeResult probe_gemm_nt(std::size_t m, std::size_t k, AAt a, std::size_t n, BAt b,
                          MatView<const float> c, const ProbeOptions& opt = {}) {
  ProbeResult res;
  const std::size_t width = std::max<std::size_t>(opt.width, 1);
  std::mt19937_64 rng(opt.seed);
  std::vector<double> br(k), babs(k), r(width);
  // The probe's own binary64 rounding (§9): K + width + 1 terms of
  // A (B^T r) and width terms of C r.
  const double g_probe = bounds::gamma(static_cast<double>(k + 2 * width + 2), bounds::kU64);
  for (std::size_t j0 = 0, block = 0; j0 < n; j0 += width, ++block) {
    const std::size_t w = std::min(width, n - j0);
    for (std::size_t j = 0; j < w; ++j) r[j] = (rng() & 1) ? 1.0 : -1.0;
    std::fill(br.begin(), br.end(), 0.0);
    std::fill(babs.begin(), babs.end(), 0.0);
    for (std::size_t j = 0; j < w; ++j)
      for (std::size_t kk = 0; kk < k; ++kk) {
        const double v = b(j0 + j, kk).to_float();
        br[kk] += v * r[j];
        babs[kk] += std::fabs(v);
      }
    for (std::size_t i = 0; i < m; ++i) {
      double lhs = 0, cabs = 0, rhs = 0, mag = 0, flushed = 0;
      for (std::size_t j = 0; j < w; ++j) {
        lhs += static_cast<double>(c(i, j0 + j)) * r[j];
        cabs += std::fabs(static_cast<double>(c(i, j0 + j)));
      }
      for (std::size_t kk = 0; kk < k; ++kk) {
        const double av = a(i, kk).to_float();
        rhs += av * br[kk];
        mag += std::fabs(av) * babs[kk];                                 // (|A| (|B|^T |r|))_i
        if (bounds::flushable(av)) flushed += std::fabs(av) * babs[kk];  // Lemma 1'
      }
      // The block's element bounds (§1, and §2 when C is bf16), summed,
      // plus the probe's own rounding.
      double threshold = bounds::gamma(static_cast<double>(k)) * mag +
                         3 * static_cast<double>(w * k) * bounds::kMinNormal32 + flushed;
      if (opt.c_is_bf16)
        threshold +=
            bounds::kUbf16 * (mag + threshold) + static_cast<double>(w) * bounds::kBf16HalfDenormal;
      threshold += 2 * g_probe * (mag + cabs);
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

inline ProbeResult probe_gemm_nt(MatView<const bf16> a, MatView<const bf16> b,
                                 MatView<const float> c, const ProbeOptions& opt = {}) {
  return probe_gemm_nt(
      a.rows, a.cols, a, b.rows, [&](std::size_t j, std::size_t kk) { return b(j, kk); }, c, opt);
}

/// Recomputes rows `rows` of C = A B^T (A [m x k] via a(i, k)) with the
/// double-double reference and compares every element within bounds::dot
/// (and §2 when C is bf16).
template <class AAt, class BAt>
compare::Bounded check_rows_gemm_nt(std::size_t k, AAt a, std::size_t n, BAt b,
                                    MatView<const float> c, const std::vector<std::size_t>& rows,
                                    bool c_is_bf16 = false) {
  std::vector<float> got;
  std::vector<double> want, bound;
  std::vector<bf16> col(k), row(k);
  for (std::size_t i : rows) {  // output in row-major order of the sampled rows
    for (std::size_t kk = 0; kk < k; ++kk) row[kk] = a(i, kk);
    for (std::size_t j = 0; j < n; ++j) {
      for (std::size_t kk = 0; kk < k; ++kk) col[kk] = b(j, kk);
      double sum_abs = 0, flushed = 0;
      for (std::size_t kk = 0; kk < k; ++kk) {
        const double p = std::fabs(double(row[kk].to_float()) * double(col[kk].to_float()));
        sum_abs += p;
        if (bounds::flushable(row[kk].to_float()) || bounds::flushable(col[kk].to_float()))
          flushed += p;
      }
      const double exact = ref::to_double(ref::dot<ref::DoubleDouble>(row.data(), col.data(), k));
      got.push_back(c(i, j));
      want.push_back(exact);
      bound.push_back(bounds::gemm_element(k, sum_abs, flushed, std::fabs(exact), c_is_bf16));
    }
  }
  return compare::bounded(got, want, bound);
}

inline compare::Bounded check_rows_gemm_nt(MatView<const bf16> a, MatView<const bf16> b,
                                           MatView<const float> c,
                                           const std::vector<std::size_t>& rows,
                                           bool c_is_bf16 = false) {
  return check_rows_gemm_nt(
      a.cols, a, b.rows, [&](std::size_t j, std::size_t kk) { return b(j, kk); }, c, rows,
      c_is_bf16);
}

}  // namespace moecert::verify
