// Result verification for the `audit` level: a Freivalds/ABFT probe of
// C = A B^T with a threshold derived from the same bounds as the full
// comparison (proofs/bounds.md §9), and recomputation of output rows by the
// reference. B is read through an accessor b(j, k) -> bf16, so packed
// weights can be verified in place (PackedWeights::at).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "contracts/bounds/gemm.hpp"
#include "contracts/engine/compare.hpp"
#include "contracts/numeric/functions.hpp"
#include "contracts/numeric/rounding.hpp"
#include "moecert/types.hpp"

namespace moecert::verify {

/// The weight side of a probe of C = A W^T (W [N x K]) over the columns
/// [j0, j0 + width) (§9): signs r, W^T r and |W|^T |r|, formed in binary64
/// and stored in binary32 (§9.1). A pack keeps a dense one (every column)
/// from its first audited call on; narrow ones are formed per call.
struct Probe {
  std::size_t j0 = 0, width = 0;
  std::vector<float> r, br, babs;  // width signs; K entries each
};

/// A weight as binary64 (exact): bf16 or binary32.
inline double weight_value(bf16 v) { return v.to_float(); }
inline double weight_value(float v) { return v; }

/// `width` signs +-1 drawn from `seed`.
inline std::vector<float> probe_signs(std::size_t width, std::uint64_t seed) {
  std::vector<float> r(width);
  std::mt19937_64 rng(seed);
  for (float& s : r) s = (rng() & 1) ? 1.0f : -1.0f;
  return r;
}

/// The probe of W's columns [j0, j0 + width), signs drawn from `seed`;
/// W read through b(j, k) -> bf16 or float. Cost 2 width K.
template <class BAt>
Probe make_probe(std::size_t k, BAt b, std::size_t j0, std::size_t width, std::uint64_t seed) {
  Probe p{j0, width, probe_signs(width, seed), std::vector<float>(k), std::vector<float>(k)};
  std::vector<double> br(k), babs(k);
  // By 16 columns, k outermost within them: a packed panel's k pair holds
  // its 16 columns side by side, so each is read in storage order.
  constexpr std::size_t kCols = 16;
  for (std::size_t c0 = 0; c0 < width; c0 += kCols)
    for (std::size_t kk = 0; kk < k; ++kk) {
      double sum = 0, mag = 0;
      for (std::size_t j = c0; j < std::min(width, c0 + kCols); ++j) {
        const double v = weight_value(b(j0 + j, kk));
        sum += v * p.r[j];
        mag += std::fabs(v);
      }
      br[kk] += sum;
      babs[kk] += mag;
    }
  for (std::size_t kk = 0; kk < k; ++kk)
    p.br[kk] = static_cast<float>(br[kk]), p.babs[kk] = static_cast<float>(babs[kk]);
  return p;
}

/// One row's probe: |(C r)_i - (A (W^T r))_i| and Lemma 9's allowance.
struct RowProbe {
  double residual = 0, threshold = 0;
  bool pass() const { return residual <= threshold; }  // false for NaN
  double ratio() const {
    return threshold > 0 ? residual / threshold : (residual > 0 ? INFINITY : 0);
  }
};

namespace detail {
// §9.1: binary32 products summed in 16 lanes over up to 8 steps (each
// lane's partial sum of at most 8 products is within gamma_8 of its exact
// sum), the partial sums added in binary64; the tail in binary64.
// Vectorizes. Where a lane leaves binary32's range the sums are formed
// again in binary64.
inline constexpr std::size_t kProbeLanes = 16, kProbeSteps = 8;

// Sum a_k x_k and sum |a_k| y_k over k < n (contracts/probes/verify.cpp).
void dot_and_magnitude(const float* a, const float* x, const float* y, std::size_t n, double& dot,
                       double& mag);

// Sum c_j r_j and sum |c_j| over j < n (r_j = +-1: exact products).
void signed_sum_and_magnitude(const float* c, const float* r, std::size_t n, double& sum,
                              double& mag);

// Per row i < rows of a block of kBlockColumns columns (row i at c + i ldc):
// out[2i] = sum c_j r_j and out[2i + 1] = sum |c_j|, each pairwise in
// binary32 (columns j and j + 16, then a tree of depth 4: within gamma_5
// of the exact sum, proofs/bounds.md §9.1), in binary64 where binary32's
// range is left; with `add`, each added (binary64) to out's value instead.
inline constexpr std::size_t kBlockColumns = 32;
void block_sums(const float* c, std::size_t ldc, std::size_t rows, const float* r, double* out,
                bool add = false);
// The digest of saved rows (experts.backward.saved_intact): per row i <
// rows of c (row i at c + i ldc), out[i out_stride] = sum_{j < cols}
// bits(c_j) (2 (j mod 32) + 1) mod 2^32, cols a multiple of kBlockColumns.
// Exact and linear mod 2^32: every clone, order and split of a row into
// column ranges gives the same total (the parts added); a change of one
// element by d != 0 changes it by d times an odd factor, never 0 mod 2^32.
// With `add`, each digest is added to out's value (the digest of the
// columns so far and these).
void row_digests(const float* c, std::size_t ldc, std::size_t rows, std::size_t cols,
                 std::uint32_t* out, std::size_t out_stride = 1, bool add = false);

// A probe's weight side from bf16 weights, in binary64 (exact terms, any
// order: §9.1), for x [rows x n] at row stride ld: for k < n,
// sum[k] += sum_j signs[j] x[j][k] and mag[k] += sum_j |x[j][k]|, the rows
// j in order.
void add_signed_rows(const bf16* x, std::size_t ld, std::size_t rows, std::size_t n,
                     const float* signs, double* sum, double* mag);
// The same by rows: for i < rows, sum[i] = sum_q signs[q] x[i][q] and
// mag[i] = sum_q |x[i][q]| over q < n in order, from zero.
void signed_row_sums(const bf16* x, std::size_t ld, std::size_t rows, std::size_t n,
                     const float* signs, double* sum, double* mag);
// A narrow probe's weight side from a panel of VNNI pairs (column j of
// depth kk at x[(kk / 2) ld + 2 j + kk % 2], j < width): for kk < k,
// br[kk] = sum_j r_j x_j and babs[kk] = sum_j |x_j|, in binary64 over the
// columns in order from zero (make_probe's order), stored in binary32.
void pair_sides(const bf16* x, std::size_t ld, std::size_t k, std::size_t width, const float* r,
                float* br, float* babs);
// sum = sum_k r_k x[k] and mag = sum_k |x[k]| over k < n (r_k = +-1), in
// 8 binary64 lanes added in order.
void signed_sums(const bf16* x, const float* r, std::size_t n, double& sum, double& mag);
// add_signed_rows and signed_row_sums from binary32 rows (exact in binary64;
// the router linear's W_r and dW_r).
void add_signed_rows(const float* x, std::size_t ld, std::size_t rows, std::size_t n,
                     const float* signs, double* sum, double* mag);
void signed_row_sums(const float* x, std::size_t ld, std::size_t rows, std::size_t n,
                     const float* signs, double* sum, double* mag);
// Two probes' row sides where A = X^T (X [rows x n] bf16 at row stride ld,
// so A's row i is X's column i), in one pass: for p < 2 and i < n,
// side[p][i] = sum_t X[t][i] y[p][t] and side[p][n + i] = sum_t |X[t][i]|
// z[p][t], as lane_sums forms a row's (§9.1): binary32 products summed over
// up to 8 rows t in binary32, those sums added in binary64, t in order; a
// column whose sums leave binary32's range formed again in binary64.
void column_sides(const bf16* x, std::size_t ld, std::size_t rows, std::size_t n,
                  const float* const y[2], const float* const z[2], double* const side[2]);
}  // namespace detail

/// A row's side of a probe (§9.1): sum a_k (W^T r)_k, sum |a_k| (|W|^T |r|)_k
/// and Lemma 1''s sum of |a_k| (|W|^T |r|)_k over the flushable a_k (a
/// nonzero denormal). Sides over disjoint ranges of k add (in binary64).
struct RowSide {
  double rhs = 0, mag = 0, flushed = 0;
  RowSide& operator+=(const RowSide& o) {
    rhs += o.rhs, mag += o.mag, flushed += o.flushed;
    return *this;
  }
};

/// The side over the probe's weight entries [k0, k0 + n) from the row's n
/// values there (binary32; `flushable`: whether one is). Cost 2 n.
inline RowSide row_side(const Probe& p, std::size_t k0, const float* a, std::size_t n,
                        bool flushable) {
  RowSide s;
  detail::dot_and_magnitude(a, p.br.data() + k0, p.babs.data() + k0, n, s.rhs, s.mag);
  if (flushable)
    for (std::size_t kk = 0; kk < n; ++kk)
      if (bounds::flushable(a[kk])) s.flushed += std::fabs(double(a[kk])) * p.babs[k0 + kk];
  return s;
}

/// Lemma 9 on one row (§9.1) from its side over all K entries and C's:
/// lhs = (C r)_i and cabs = the sum of |C_ij| over the probe's columns,
/// each within gamma^(64)_width of its exact value (binary64 sums of exact
/// terms, in any order). Never fails for a row within bounds::dot of the
/// exact product (the allowance includes the probe's own rounding). Where
/// C's side or the probe's is not finite: if the row's computed magnitude
/// may reach the largest bf16 (C's elements may overflow binary32, or bf16
/// where C is rounded to it) or is itself not finite (A's row holds an inf
/// or NaN: an overflow upstream of this product), an overflow, not judged
/// here (residual 0, threshold infinite; the finite clause of the output it
/// reaches names it); otherwise a failure.
inline RowProbe judge_row(const Probe& p, std::size_t k, const RowSide& a, double lhs, double cabs,
                          bool c_is_bf16 = false) {
  // The probe's own rounding, relative to the exact magnitudes: gamma_8 in
  // a lane, u in storing W^T r and |W|^T |r|, the binary64 sums of the
  // lanes, the tail and the parts (gamma_10 covers the first two); the
  // computed magnitudes are raised by 2 gamma_10 to bound the exact ones.
  const double w = static_cast<double>(p.width);
  const double g_probe =
      bounds::gamma(10) + bounds::gamma(static_cast<double>(k) + 2 * w + 2, bounds::kU64);
  const double raise = 1 + 2 * g_probe;
  const double mag = a.mag * raise, flushed = a.flushed * raise;  // Lemma 1'
  if (!std::isfinite(lhs) || !std::isfinite(cabs) || !std::isfinite(a.rhs)) {
    if (!(mag * (1 + bounds::gamma(static_cast<double>(k))) * (1 + bounds::kUbf16) <
          bounds::kMaxBf16))
      return {0, INFINITY};    // an overflow (NaN: an inf of A met a 0 of B)
    lhs = INFINITY, cabs = 0;  // no overflow can explain it: fails
  }
  cabs *= raise;
  // The block's element bounds (§1, and §2 when C is bf16), summed, plus
  // twice the probe's rounding.
  double threshold = bounds::gamma(static_cast<double>(k)) * mag +
                     3 * w * static_cast<double>(k) * bounds::kMinNormal32 + flushed;
  if (c_is_bf16) threshold += bounds::kUbf16 * (mag + threshold) + w * bounds::kBf16HalfDenormal;
  threshold += 2 * g_probe * (mag + cabs);
  return {std::fabs(lhs - a.rhs), threshold};
}

/// Lemma 9 on one row (§9.1): a = the row of A (K bf16 values as binary32;
/// `flushable`: whether one of them is a nonzero denormal), C's side
/// summed as judge_row takes it. Cost 2 K + 2 width.
inline RowProbe probe_row_sums(const Probe& p, const float* a, std::size_t k, bool flushable,
                               double lhs, double cabs, bool c_is_bf16 = false) {
  return judge_row(p, k, row_side(p, 0, a, k, flushable), lhs, cabs, c_is_bf16);
}

/// The same with C's row: c = the row of C.
inline RowProbe probe_row(const Probe& p, const float* a, std::size_t k, bool flushable,
                          const float* c, bool c_is_bf16 = false) {
  double lhs, cabs;
  detail::signed_sum_and_magnitude(c + p.j0, p.r.data(), p.width, lhs, cabs);
  return probe_row_sums(p, a, k, flushable, lhs, cabs, c_is_bf16);
}

/// n bf16 values into `row` as binary32 (exact), read in runs of `run`
/// values, run j at p + j stride; returns whether one is flushable (a
/// nonzero bf16 denormal: exponent bits 0, fraction not), from the bits so
/// that the loop vectorizes.
bool load_bf16(const bf16* p, std::size_t n, std::size_t run, std::size_t stride, float* row);
/// p[0, n) into `row`: one run.
inline bool load_bf16(const bf16* p, std::size_t n, float* row) {
  return load_bf16(p, n, n, 0, row);
}

/// A[i, 0..k) into `row` as binary32; returns whether one is flushable.
template <class AAt>
bool load_row(AAt a, std::size_t i, std::size_t k, float* row) {
  bool flushable = false;
  for (std::size_t kk = 0; kk < k; ++kk) {
    row[kk] = a(i, kk).to_float();
    flushable |= bounds::flushable(row[kk]);
  }
  return flushable;
}

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
  std::size_t row = 0, j0 = 0, width = 0;  // first failing row and its probe's columns
  double residual = 0, threshold = 0;      // |C r - A (B^T r)| and its allowance there
  double max_ratio = 0;                    // max residual / threshold over all probes
  const Probe* probe = nullptr;            // the first failing probe
  /// Keeps the first failure (row i, probe p) and the largest ratio.
  void add(std::size_t i, const Probe& p, const RowProbe& v) {
    if (!v.pass() && pass) {
      pass = false;
      row = i, j0 = p.j0, width = p.width, probe = &p;
      residual = v.residual, threshold = v.threshold;
    }
    if (!(v.ratio() <= max_ratio)) max_ratio = v.ratio();
  }
};

/// Checks C [M x N] against A [M x K] B^T (B [N x K] via b(j, k)), one probe
/// per column block of opt.width, all rows. Cost (N / width)(2 M K) + 2 N K
/// binary64 operations: the exhaustive form of the probe, for tests and small
/// products (the ops' audit level probes in rotation, proofs/bounds.md §9.1).
template <class AAt, class BAt>
ProbeResult probe_gemm_nt(std::size_t m, std::size_t k, AAt a, std::size_t n, BAt b,
                          MatView<const float> c, const ProbeOptions& opt = {}) {
  const std::size_t width = std::max<std::size_t>(opt.width, 1);
  std::vector<Probe> probes;
  for (std::size_t j0 = 0; j0 < n; j0 += width)
    probes.push_back(make_probe(k, b, j0, std::min(width, n - j0), opt.seed + j0));
  ProbeResult res;
  std::vector<float> row(k);
  for (std::size_t i = 0; i < m; ++i) {
    const bool flushable = load_row(a, i, k, row.data());
    for (const Probe& p : probes)
      res.add(i, p, probe_row(p, row.data(), k, flushable, c.row(i), opt.c_is_bf16));
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
