// The audit probe: no false alarm on correct products, and wrong products
// (one term dropped, one element moved by one bf16 ulp) caught at K = 1024.
#include "contracts/probes/verify.hpp"

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "contracts/gemm/gemm.hpp"
#include "contracts/numeric/functions.hpp"
#include "test_util.hpp"

using namespace moecert;

namespace {

struct Problem {
  std::size_t m, n, k;
  std::vector<bf16> a, b;
  std::vector<float> c;
  MatView<const bf16> A() const { return {a.data(), m, k}; }
  MatView<const bf16> B() const { return {b.data(), n, k}; }
  MatView<const float> C() const { return {c.data(), m, n}; }
};

// Magnitudes in [lo, 1), random signs unless `positive`; C by a plain fp32
// kernel (sequential FMA), i.e. a correct product.
Problem make(std::mt19937_64& rng, std::size_t m, std::size_t n, std::size_t k, float lo,
             bool positive) {
  std::uniform_real_distribution<float> u(lo, 1.0f);
  auto draw = [&] { return bf16(u(rng) * ((positive || (rng() & 1)) ? 1.0f : -1.0f)); };
  Problem p{m, n, k, std::vector<bf16>(m * k), std::vector<bf16>(n * k), std::vector<float>(m * n)};
  for (auto& v : p.a) v = draw();
  for (auto& v : p.b) v = draw();
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      float s = 0;
      for (std::size_t kk = 0; kk < k; ++kk)
        s = std::fma(p.a[i * k + kk].to_float(), p.b[j * k + kk].to_float(), s);
      p.c[i * n + j] = s;
    }
  return p;
}

}  // namespace

TEST_CASE("verify: no false alarm on 10^4 correct products", "[verify][numeric]") {
  std::mt19937_64 rng(21);
  double worst = 0;
  for (int t = 0; t < 10000; ++t) {
    const std::size_t m = 1 + rng() % 6, n = 1 + rng() % 20, k = 1 + rng() % 1024;
    Problem p = make(rng, m, n, k, t % 2 ? 0.0f : 0.5f, t % 3 == 0);
    const auto r =
        verify::probe_gemm_nt(p.A(), p.B(), p.C(), {.width = 1 + rng() % 8, .seed = rng()});
    REQUIRE(r.pass);
    worst = std::max(worst, r.max_ratio);
  }
  std::printf("verify.probe: 10^4 correct products, max residual/threshold %.3g\n", worst);
}

TEST_CASE("verify: no blind probe where its binary32 sums would overflow", "[verify][numeric]") {
  // |a|, |b| = 2^59 (in range): C = 2^124 at most, but |A| (|B|^T 1) over
  // 1024 columns is 2^128, past binary32.
  std::mt19937_64 rng(25);
  const std::size_t m = 2, n = 1024, k = 64;
  Problem p{m, n, k, std::vector<bf16>(m * k), std::vector<bf16>(n * k), std::vector<float>(m * n)};
  for (auto* v : {&p.a, &p.b})
    for (auto& x : *v) x = bf16((rng() & 1) ? 0x1p59f : -0x1p59f);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::size_t kk = 0; kk < k; ++kk)
        s += double(p.a[i * k + kk].to_float()) * p.b[j * k + kk].to_float();
      p.c[i * n + j] = static_cast<float>(s);
    }
  CHECK(verify::probe_gemm_nt(p.A(), p.B(), p.C(), {.width = n}).pass);
  // Formed again in binary64, the allowance stays finite (about 2^117), so
  // an error of 2^120 is still seen.
  p.c[5] += 0x1p120f;
  const auto r = verify::probe_gemm_nt(p.A(), p.B(), p.C(), {.width = n});
  CHECK_FALSE(r.pass);
  CHECK(r.row == 0);
}

TEST_CASE("verify: an overflowed C is left to the finite clause; an inf that cannot be one fails",
          "[verify][numeric]") {
  // Row 0: |a| |b| = 2^126 over k = 4 terms of one sign, C = 2^128: the
  // exact product leaves binary32's range, C's inf is an overflow (not
  // the probe's to judge). Row 1: small values, an inf in C is a bug.
  const std::size_t m = 2, n = 4, k = 4;
  Problem p{m, n, k, std::vector<bf16>(m * k), std::vector<bf16>(n * k), std::vector<float>(m * n)};
  for (std::size_t kk = 0; kk < k; ++kk) {
    p.a[kk] = bf16(0x1p63f), p.a[k + kk] = bf16(0.5f);
    for (std::size_t j = 0; j < n; ++j) p.b[j * k + kk] = bf16(0x1p63f);
  }
  for (std::size_t j = 0; j < n; ++j) p.c[j] = INFINITY, p.c[n + j] = 4 * 0.5f * 0x1p63f;
  const auto overflowed = verify::probe_gemm_nt(p.A(), p.B(), p.C(), {.width = n});
  CHECK(overflowed.pass);
  p.c[n + 2] = INFINITY;
  const auto wrong = verify::probe_gemm_nt(p.A(), p.B(), p.C(), {.width = n});
  CHECK_FALSE(wrong.pass);
  CHECK(wrong.row == 1);
  p.c[n + 2] = NAN;
  CHECK_FALSE(verify::probe_gemm_nt(p.A(), p.B(), p.C(), {.width = n}).pass);
}

TEST_CASE("verify: an inf in A (an overflow upstream) is not this product's to judge",
          "[verify][numeric]") {
  // A's row 0 holds an inf where B's column is 0 (a block-diagonal factor):
  // the row's magnitude |a| |B|^T |r| is NaN there, and C may be finite.
  // Row 1 is finite and judged as ever: a wrong C there still fails.
  const std::size_t m = 2, n = 2, k = 4;
  Problem p{m, n, k, std::vector<bf16>(m * k), std::vector<bf16>(n * k), std::vector<float>(m * n)};
  for (std::size_t kk = 0; kk < k; ++kk) {
    p.a[kk] = bf16(kk == 3 ? INFINITY : 1.0f), p.a[k + kk] = bf16(0.5f);
    p.b[kk] = bf16(kk < 2 ? 1.0f : 0.0f), p.b[k + kk] = bf16(0.0f);
  }
  p.c = {2.0f, 0.0f, 1.0f, 0.0f};
  CHECK(verify::probe_gemm_nt(p.A(), p.B(), p.C(), {.width = n}).pass);
  p.c[2] = 1.5f;
  const auto wrong = verify::probe_gemm_nt(p.A(), p.B(), p.C(), {.width = n});
  CHECK_FALSE(wrong.pass);
  CHECK(wrong.row == 1);
}

TEST_CASE("verify: a dropped term is caught at K = 1024", "[verify][numeric]") {
  std::mt19937_64 rng(22);
  int caught = 0;
  const int trials = 300;
  for (int t = 0; t < trials; ++t) {
    Problem p = make(rng, 8, 32, 1024, 0.5f, false);
    const std::size_t i = rng() % 8, j = rng() % 32, kk = rng() % 1024;
    p.c[i * 32 + j] -= p.a[i * 1024 + kk].to_float() * p.b[j * 1024 + kk].to_float();
    caught += !verify::probe_gemm_nt(p.A(), p.B(), p.C(), {.seed = rng()}).pass;
  }
  std::printf("verify.probe: dropped term caught in %d of %d trials (width 4)\n", caught, trials);
  CHECK(caught >= trials * 99 / 100);
}

TEST_CASE("verify: one element moved by one bf16 ulp is caught at K = 1024", "[verify][numeric]") {
  std::mt19937_64 rng(23);
  int caught = 0, caught_signed = 0;
  const int trials = 300;
  for (int t = 0; t < trials; ++t) {
    for (bool positive : {true, false}) {
      Problem p = make(rng, 8, 32, 1024, 0.5f, positive);
      const std::size_t i = rng() % 8, j = rng() % 32;
      float& x = p.c[i * 32 + j];
      const bf16 xb(x);
      x = bf16::from_bits(static_cast<std::uint16_t>(xb.bits + ((rng() & 1) ? 1 : -1))).to_float();
      const bool hit = !verify::probe_gemm_nt(p.A(), p.B(), p.C(), {.seed = rng()}).pass;
      (positive ? caught : caught_signed) += hit;
    }
  }
  std::printf(
      "verify.probe: one-ulp move caught in %d of %d (nonnegative products), %d of %d (signed, "
      "informational)\n",
      caught, trials, caught_signed, trials);
  CHECK(caught >= trials * 99 / 100);
}

TEST_CASE("verify: sampled rows recomputed by the reference", "[verify][numeric]") {
  std::mt19937_64 rng(24);
  Problem p = make(rng, 16, 24, 300, 0.0f, false);
  auto ok = verify::check_rows_gemm_nt(p.A(), p.B(), p.C(), {0, 7, 15});
  CHECK(ok.pass());
  CHECK(ok.count == 3 * 24);
  p.c[7 * 24 + 5] += 0.5f;
  auto bad = verify::check_rows_gemm_nt(p.A(), p.B(), p.C(), {0, 7, 15});
  CHECK_FALSE(bad.pass());
  CHECK(bad.worst == 24 + 5);
}

TEST_CASE("verify: block sums are the pairwise binary32 tree, bit for bit", "[verify][numeric]") {
  // The tree of verify.hpp written out: columns j and j + 16 paired, then
  // lane l + w added into lane l for w = 8, 4, 2, 1; binary64 in column
  // order where a result leaves binary32's range.
  auto tree = [](const float* c, const float* r) {
    float s[16], m[16];
    for (int l = 0; l < 16; ++l)
      s[l] = c[l] * r[l] + c[l + 16] * r[l + 16], m[l] = std::fabs(c[l]) + std::fabs(c[l + 16]);
    for (int w = 8; w > 0; w /= 2)
      for (int l = 0; l < w; ++l) s[l] += s[l + w], m[l] += m[l + w];
    if (std::isfinite(s[0]) && std::isfinite(m[0])) return std::pair<double, double>{s[0], m[0]};
    double sd = 0, md = 0;
    for (int j = 0; j < 32; ++j) sd += double(c[j]) * r[j], md += std::fabs(double(c[j]));
    return std::pair<double, double>{sd, md};
  };
  std::mt19937_64 rng(31);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  constexpr std::size_t kRows = 40, kLd = 48;
  std::vector<float> c(kRows * kLd), r(32);
  for (auto& v : r) v = (rng() & 1) ? 1.0f : -1.0f;
  for (std::size_t i = 0; i < kRows; ++i)
    for (std::size_t j = 0; j < kLd; ++j) {
      const float scale =
          i % 7 == 3 ? 0x1p126f : (i % 5 == 1 ? 0x1p-140f : std::ldexp(1.0f, int(i % 30) - 15));
      c[i * kLd + j] = u(rng) * scale;
    }
  c[9 * kLd + 4] = INFINITY;
  c[11 * kLd + 30] = NAN;
  std::vector<double> out(2 * kRows);
  verify::detail::block_sums(c.data(), kLd, kRows, r.data(), out.data());
  for (std::size_t i = 0; i < kRows; ++i) {
    const auto [s, m] = tree(&c[i * kLd], r.data());
    INFO("row " << i);
    CHECK(std::memcmp(&out[2 * i], &s, sizeof s) == 0);
    CHECK(std::memcmp(&out[2 * i + 1], &m, sizeof m) == 0);
  }
}

TEST_CASE("verify: row digests are the weighted sums, split-invariant, and see any one change",
          "[verify][memory]") {
  // D = sum_j bits(c_j) (2 (j mod 32) + 1) mod 2^32, written out.
  auto digest = [](const float* c, std::size_t cols) {
    std::uint32_t d = 0;
    for (std::size_t j = 0; j < cols; ++j)
      d += std::bit_cast<std::uint32_t>(c[j]) * static_cast<std::uint32_t>(2 * (j % 32) + 1);
    return d;
  };
  std::mt19937_64 rng(37);
  constexpr std::size_t kRows = 5, kLd = 100, kCols = 96;
  std::vector<float> c(kRows * kLd);
  for (auto& v : c) v = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));  // NaNs too
  std::array<std::uint32_t, kRows> whole, left, right;
  verify::detail::row_digests(c.data(), kLd, kRows, kCols, whole.data());
  verify::detail::row_digests(c.data(), kLd, kRows, 32, left.data());
  verify::detail::row_digests(c.data() + 32, kLd, kRows, kCols - 32, right.data());
  for (std::size_t i = 0; i < kRows; ++i) {
    INFO("row " << i);
    CHECK(whole[i] == digest(&c[i * kLd], kCols));
    CHECK(whole[i] == static_cast<std::uint32_t>(left[i] + right[i]));
  }
  // One element of a row changed changes its digest: each element with
  // each of its bits flipped (bit 0: one ulp).
  for (std::size_t j = 0; j < kCols; ++j) {
    const float old = c[j];
    for (int bit = 0; bit < 32; ++bit) {
      c[j] = std::bit_cast<float>(std::bit_cast<std::uint32_t>(old) ^ (1u << bit));
      std::uint32_t d = 0;
      verify::detail::row_digests(c.data(), kLd, 1, kCols, &d);
      CHECK(d != whole[0]);
    }
    c[j] = old;
  }
}

TEST_CASE("verify: weight sides by rows are the row-by-row binary64 loops, bit for bit",
          "[verify][numeric]") {
  // x [rows x n] at stride ld: magnitudes over 2^-135..2^127 (bf16
  // denormals and sums that round in binary64) and zeros; n and rows past
  // and short of the 8-lane blocks.
  std::mt19937_64 rng(37);
  for (int t = 0; t < 200; ++t) {
    const std::size_t rows = 1 + rng() % 21, n = 1 + rng() % 40, ld = n + rng() % 5;
    std::vector<bf16> x(rows * ld);
    for (auto& v : x)
      v = rng() % 9 == 0
              ? bf16(0.0f)
              : bf16(std::ldexp((rng() & 1 ? 1.0f : -1.0f) * (1.0f + float(rng() % 128) / 128),
                                int(rng() % 263) - 135));
    std::vector<float> signs(std::max(rows, n));
    for (auto& s : signs) s = (rng() & 1) ? 1.0f : -1.0f;
    INFO("rows " << rows << " n " << n << " ld " << ld);
    // add_signed_rows: sum[k] += signs[j] x[j][k], rows j in order.
    std::vector<double> sum(n), mag(n);
    for (std::size_t k = 0; k < n; ++k) sum[k] = double(k) - 3.5, mag[k] = double(k);
    std::vector<double> want_sum = sum, want_mag = mag;
    for (std::size_t j = 0; j < rows; ++j)
      for (std::size_t k = 0; k < n; ++k) {
        const double v = x[j * ld + k].to_float();
        want_sum[k] += double(signs[j]) * v, want_mag[k] += std::fabs(v);
      }
    verify::detail::add_signed_rows(x.data(), ld, rows, n, signs.data(), sum.data(), mag.data());
    CHECK(std::memcmp(sum.data(), want_sum.data(), n * sizeof(double)) == 0);
    CHECK(std::memcmp(mag.data(), want_mag.data(), n * sizeof(double)) == 0);
    // signed_row_sums: sum[i] = signs[q] x[i][q] over q in order, from zero.
    std::vector<double> rs(rows, NAN), rm(rows, NAN), want_rs(rows), want_rm(rows);
    for (std::size_t i = 0; i < rows; ++i) {
      double s = 0, m = 0;
      for (std::size_t q = 0; q < n; ++q) {
        const double v = x[i * ld + q].to_float();
        s += double(signs[q]) * v, m += std::fabs(v);
      }
      want_rs[i] = s, want_rm[i] = m;
    }
    verify::detail::signed_row_sums(x.data(), ld, rows, n, signs.data(), rs.data(), rm.data());
    CHECK(std::memcmp(rs.data(), want_rs.data(), rows * sizeof(double)) == 0);
    CHECK(std::memcmp(rm.data(), want_rm.data(), rows * sizeof(double)) == 0);
  }
}

TEST_CASE("verify: the router linear's sides from binary32 rows and from x's columns",
          "[verify][numeric]") {
  std::mt19937_64 rng(41);
  std::normal_distribution<float> nd;
  for (int t = 0; t < 100; ++t) {
    const std::size_t rows = 1 + rng() % 30, n = 1 + rng() % 50, ld = n + rng() % 5;
    std::vector<float> w(rows * ld), signs(std::max(rows, n));
    for (auto& v : w) v = std::ldexp(nd(rng), int(rng() % 40) - 20);
    for (auto& s : signs) s = (rng() & 1) ? 1.0f : -1.0f;
    INFO("rows " << rows << " n " << n << " ld " << ld);
    // add_signed_rows (binary32 rows): the row-by-row binary64 loop, bit for bit.
    std::vector<double> sum(n, 0.5), mag(n, 0.5), want_sum(n, 0.5), want_mag(n, 0.5);
    for (std::size_t j = 0; j < rows; ++j)
      for (std::size_t k = 0; k < n; ++k)
        want_sum[k] += double(signs[j]) * w[j * ld + k], want_mag[k] += std::fabs(w[j * ld + k]);
    verify::detail::add_signed_rows(w.data(), ld, rows, n, signs.data(), sum.data(), mag.data());
    CHECK(std::memcmp(sum.data(), want_sum.data(), n * sizeof(double)) == 0);
    CHECK(std::memcmp(mag.data(), want_mag.data(), n * sizeof(double)) == 0);
    // signed_row_sums (binary32 rows): binary64 sums of exact terms, within
    // gamma^(64)_n of the exact ones (double-double reference).
    std::vector<double> rs(rows), rm(rows);
    verify::detail::signed_row_sums(w.data(), ld, rows, n, signs.data(), rs.data(), rm.data());
    for (std::size_t i = 0; i < rows; ++i) {
      ref::DoubleDouble s{}, m{};
      for (std::size_t q = 0; q < n; ++q)
        s += ref::DoubleDouble(double(signs[q]) * w[i * ld + q]),
            m += ref::DoubleDouble(std::fabs(double(w[i * ld + q])));
      const double tol = bounds::gamma(double(n), bounds::kU64) * ref::to_double(m);
      CHECK(std::fabs(rs[i] - ref::to_double(s)) <= tol);
      CHECK(std::fabs(rm[i] - ref::to_double(m)) <= tol);
    }
  }
  // column_sides: each column's two sums within gamma_8 (binary32 steps of
  // up to 8 rows) plus gamma^(64) of the exact ones; a column whose binary32
  // sums overflow is formed in binary64 (finite, and within the same bound).
  for (int t = 0; t < 100; ++t) {
    const std::size_t rows = 1 + rng() % 40, n = 1 + rng() % 50, ld = n + rng() % 5;
    std::vector<bf16> x(rows * ld);
    for (auto& v : x) v = bf16(nd(rng));
    std::vector<float> y[2], z[2];
    for (int p = 0; p < 2; ++p) {
      y[p].resize(rows), z[p].resize(rows);
      for (std::size_t i = 0; i < rows; ++i)
        y[p][i] = nd(rng), z[p][i] = std::fabs(y[p][i]) + std::fabs(nd(rng));
    }
    if (t % 4 == 0) y[1][0] = 3e38f, z[1][0] = 3e38f, x[0] = bf16(4.0f);  // column 0 overflows
    std::vector<double> s0(2 * n), s1(2 * n);
    const float* const yy[2] = {y[0].data(), y[1].data()};
    const float* const zz[2] = {z[0].data(), z[1].data()};
    double* const side[2] = {s0.data(), s1.data()};
    verify::detail::column_sides(x.data(), ld, rows, n, yy, zz, side);
    INFO("rows " << rows << " n " << n);
    for (int p = 0; p < 2; ++p)
      for (std::size_t i = 0; i < n; ++i) {
        double d = 0, m = 0, mm = 0;
        for (std::size_t r = 0; r < rows; ++r) {
          const double v = x[r * ld + i].to_float();
          d += v * y[p][r], m += std::fabs(v) * z[p][r], mm += std::fabs(v * y[p][r]);
        }
        const double g = bounds::gamma(8) + bounds::gamma(double(rows) + 2, bounds::kU64);
        CHECK(std::isfinite(side[p][i]));
        CHECK(std::fabs(side[p][i] - d) <= g * mm);
        CHECK(std::fabs(side[p][n + i] - m) <= g * m);
      }
  }
}
TEST_CASE("verify: load_bf16 reads runs at their stride and flags a denormal", "[verify]") {
  // Three runs of 4 values 10 apart (the tile layout's shape), the last run short.
  std::vector<bf16> p(30, bf16(7.0f));
  std::vector<float> want;
  for (std::size_t j = 0; j < 3; ++j)
    for (std::size_t k = 0; k < 4 && want.size() < 10; ++k) {
      p[j * 10 + k] = bf16(float(j * 4 + k) - 5.5f);
      want.push_back(p[j * 10 + k].to_float());
    }
  std::vector<float> row(10, NAN);
  CHECK_FALSE(verify::load_bf16(p.data(), 10, 4, 10, row.data()));
  CHECK(row == want);
  p[21].bits = 0x0001;  // the smallest denormal: the last value read
  CHECK(verify::load_bf16(p.data(), 10, 4, 10, row.data()));
  CHECK(row[9] == p[21].to_float());
  p[21] = bf16(1.0f);
  p[22].bits = 0x0001;  // past the 10 values read: not seen
  CHECK_FALSE(verify::load_bf16(p.data(), 10, 4, 10, row.data()));
}

TEST_CASE("verify: RowSums holds each row's probe sums as formed, NaN until then",
          "[verify][numeric]") {
  // Rows of 40 small integers (exact sums); a dense probe over all columns
  // and a narrow one over columns [20, 24).
  constexpr std::size_t kN = 40;
  contracts::PackProbes p;
  p.dense = std::make_shared<const verify::Probe>(
      verify::Probe{0, kN, verify::probe_signs(kN, 5), {}, {}});
  p.narrow.push_back({20, 4, verify::probe_signs(4, 6), {}, {}});
  std::vector<float> c(3 * kN);
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = float(int(i * 7 % 23) - 11);
  std::vector<std::pair<double, double>> storage;
  contracts::RowSums sums(storage);
  sums.size(3);
  sums.form(0, p, &c[0]);
  sums.form(2, p, &c[2 * kN]);
  for (const std::size_t i : {0, 2}) {
    double s = 0, m = 0, sn = 0, mn = 0;
    for (std::size_t j = 0; j < kN; ++j)
      s += c[i * kN + j] * p.dense->r[j], m += std::fabs(c[i * kN + j]);
    for (std::size_t j = 0; j < 4; ++j)
      sn += c[i * kN + 20 + j] * p.narrow[0].r[j], mn += std::fabs(c[i * kN + 20 + j]);
    INFO("row " << i);
    CHECK(sums.of(i, 0) == std::pair<double, double>{s, m});
    CHECK(sums.of(i, 1) == std::pair<double, double>{sn, mn});
  }
  CHECK(std::isnan(sums.of(1, 0).first));  // never handed over
  CHECK(std::isnan(sums.of(1, 1).second));
  sums.size(3);  // a new call forgets the last one's rows
  CHECK(std::isnan(sums.of(0, 0).first));
}
