// The router linear's probes (proofs/bounds.md §9.4): Lemma 9 on
// z = [x | 1] [W_r | b]^T (K = H + 1), on dx's rows, dx = [dz | 1] times
// [W_r^T | dx before] (K = R + 1, the last column the row's own), and on
// dW_r^T = x^T dz (K = T, rows h); db against its sums' bounds.
#include "contracts/layer/router_linear_probe.hpp"

#include <fmt/format.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "contracts/engine/tbb_sync.hpp"
#include "contracts/gemm/gemm.hpp"
#include "contracts/numeric/rounding.hpp"

namespace moecert::contracts {

namespace {

constexpr std::size_t kNarrow = 4;
constexpr std::uint64_t kDenseSeed = 0x726c'6465'6e73'65ULL, kNarrowSeed = 0x726c'6e61'7200ULL;

// Calls so far, per direction: call c probes narrow block c mod ceil(N / 4);
// and layer.backward's calls.
std::atomic<std::uint64_t> forward_calls{0}, backward_calls{0}, layer_backward_calls{0};

// body(i0, i1) over [0, n) in blocks of `grain`, in parallel.
template <class F>
void for_blocks(std::size_t n, std::size_t grain, F body) {
  oneapi::tbb::parallel_for(
      std::size_t{0}, (n + grain - 1) / grain,
      detail::TbbBody([&](std::size_t blk) { body(blk * grain, std::min(n, (blk + 1) * grain)); }));
}

// A probe's signs for columns [j0, j0 + width) and room for its K-entry
// weight side.
verify::Probe empty_probe(std::size_t k, std::size_t j0, std::size_t width, std::uint64_t seed) {
  return {j0, width, verify::probe_signs(width, seed), std::vector<float>(k),
          std::vector<float>(k)};
}

// Binary64 sums of a weight side stored in binary32 (§9.1), at entry k0.
void store(verify::Probe& p, std::size_t k0, const double* sum, const double* mag, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    p.br[k0 + i] = static_cast<float>(sum[i]), p.babs[k0 + i] = static_cast<float>(mag[i]);
}

// z's probe of columns [j0, j0 + width) of z: B = [W_r | b], K = H + 1.
verify::Probe logits_probe(MatView<const float> w, View<const float> b, std::size_t j0,
                           std::size_t width, std::uint64_t seed) {
  const std::size_t H = w.cols;
  verify::Probe p = empty_probe(H + 1, j0, width, seed);
  for_blocks(H, 256, [&](std::size_t k0, std::size_t k1) {
    std::vector<double> sum(k1 - k0), mag(k1 - k0);
    verify::detail::add_signed_rows(w.row(j0) + k0, w.stride, width, k1 - k0, p.r.data(),
                                    sum.data(), mag.data());
    store(p, k0, sum.data(), mag.data(), k1 - k0);
  });
  double sum = 0, mag = 0;
  for (std::size_t j = 0; j < width; ++j)
    sum += p.r[j] * static_cast<double>(b[j0 + j]), mag += std::fabs(b[j0 + j]);
  store(p, H, &sum, &mag, 1);
  return p;
}

// dx's probe of columns [j0, j0 + width) of dx: B(h, e) = W_r(e, h), K = R.
verify::Probe dx_probe(MatView<const float> w, std::size_t j0, std::size_t width,
                       std::uint64_t seed) {
  verify::Probe p = empty_probe(w.rows, j0, width, seed);
  for_blocks(w.rows, 4, [&](std::size_t e0, std::size_t e1) {
    double sum[4], mag[4];
    verify::detail::signed_row_sums(w.row(e0) + j0, w.stride, e1 - e0, width, p.r.data(), sum, mag);
    store(p, e0, sum, mag, e1 - e0);
  });
  return p;
}

// dW_r^T's probe of its columns [j0, j0 + width) (W_r's rows): B(e, t) =
// dz(t, e), K = T; each plane's part of a row summed on its own, then added.
verify::Probe dw_probe(const DzPlanes& dz, std::size_t j0, std::size_t width, std::uint64_t seed) {
  verify::Probe p = empty_probe(dz.rows(), j0, width, seed);
  for_blocks(dz.rows(), 256, [&](std::size_t t0, std::size_t t1) {
    const std::size_t n = t1 - t0;
    std::vector<double> sum(n, 0.0), mag(n, 0.0), s(n), m(n);
    std::size_t c0 = 0;
    for (const MatView<const float>& plane : {dz.lo, dz.hi}) {
      const std::size_t a = std::max(j0, c0), e = std::min(j0 + width, c0 + plane.cols);
      if (a < e) {
        verify::detail::signed_row_sums(plane.row(t0) + (a - c0), plane.stride, n, e - a,
                                        p.r.data() + (a - j0), s.data(), m.data());
        for (std::size_t i = 0; i < n; ++i) sum[i] += s[i], mag[i] += m[i];
      }
      c0 += plane.cols;
    }
    store(p, t0, sum.data(), mag.data(), n);
  });
  return p;
}

// The dense probe of N columns and call `call`'s narrow block, from
// make(j0, width, seed).
template <class Make>
std::array<verify::Probe, 2> probes_of(std::size_t n, std::uint64_t call, Make make) {
  const std::size_t j0 = call % ((n + kNarrow - 1) / kNarrow) * kNarrow;
  return {make(0, n, kDenseSeed), make(j0, std::min(kNarrow, n - j0), kNarrowSeed + call)};
}

// The first failure of verdicts v (two per row: dense, narrow) in row order.
verify::ProbeResult first_failure(const std::vector<verify::RowProbe>& v,
                                  const std::array<verify::Probe, 2>& p) {
  verify::ProbeResult r;
  for (std::size_t i = 0; i < v.size(); ++i) r.add(i / 2, p[i % 2], v[i]);
  return r;
}

}  // namespace

void probe_router_logits(detail::Checker& c, const ClauseInfo& clause, MatView<const bf16> x,
                         MatView<const float> w, View<const float> b, MatView<const float> z) {
  const std::size_t T = x.rows, H = x.cols, R = w.rows;
  if (T == 0 || R == 0) return;
  // B = [W_r | b]: the bias is the term of column H, A's entry there 1.
  const auto p =
      probes_of(R, forward_calls++, [&](std::size_t j0, std::size_t w0, std::uint64_t s) {
        return logits_probe(w, b, j0, w0, s);
      });
  std::vector<verify::RowProbe> v(2 * T);
  for_blocks(T, 16, [&](std::size_t t0, std::size_t t1) {
    std::vector<float> row(H);
    for (std::size_t t = t0; t < t1; ++t) {
      // x is bf16 without denormals (finite clause); the op's fp32 FMAs flush nothing.
      verify::load_bf16(x.row(t), H, row.data());
      for (std::size_t q = 0; q < 2; ++q) {
        verify::RowSide s = verify::row_side(p[q], 0, row.data(), H, false);
        s.rhs += p[q].br[H], s.mag += p[q].babs[H];
        double lhs, cabs;
        verify::detail::signed_sum_and_magnitude(z.row(t) + p[q].j0, p[q].r.data(), p[q].width, lhs,
                                                 cabs);
        v[2 * t + q] = verify::judge_row(p[q], H + 1, s, lhs, cabs);
      }
    }
  });
  const verify::ProbeResult r = first_failure(v, p);
  if (!r.pass)
    fail_probe(c, clause, fmt::format("z row {} columns [{}, {})", r.row, r.j0, r.j0 + r.width), r);
}

RouterLinearProbe::RouterLinearProbe(MatView<const float> w, MatView<const float> dx)
    : call_(backward_calls++) {
  if (dx.empty() || w.rows == 0) return;
  const std::size_t T = dx.rows, H = dx.cols;
  dx_probes_ = probes_of(H, call_, [&](std::size_t j0, std::size_t w0, std::uint64_t s) {
    return dx_probe(w, j0, w0, s);
  });
  // The last weight-side entry of each row, in binary64 (§9.4).
  for (std::size_t q = 0; q < 2; ++q) before_[q].assign(2 * T, 0.0);
  for_blocks(T, 64, [&](std::size_t t0, std::size_t t1) {
    for (std::size_t q = 0; q < 2; ++q) {
      const verify::Probe& p = dx_probes_[q];
      verify::detail::signed_row_sums(dx.row(t0) + p.j0, dx.stride, t1 - t0, p.width, p.r.data(),
                                      before_[q].data() + t0, before_[q].data() + T + t0);
    }
  });
}

void RouterLinearProbe::keep(const std::vector<verify::RowProbe>& v, const Probes& p,
                             const char* what) {
  if (!result_.pass) return;
  const verify::ProbeResult r = first_failure(v, p);
  if (!(r.max_ratio <= result_.max_ratio)) result_.max_ratio = r.max_ratio;
  if (r.pass) return;
  const double ratio = result_.max_ratio;
  result_ = r, result_.max_ratio = ratio, result_.probe = nullptr;  // p does not outlive the call
  failure_ = fmt::format(fmt::runtime(what), r.row, r.j0, r.j0 + r.width);
}

// Row t: A = [dz_t | 1], the last weight-side entry the row's dx before.
void RouterLinearProbe::judge_dx(const DzPlanes& dz, MatView<const float> dx) {
  const std::size_t T = dx.rows, R = dz.cols();
  std::vector<verify::RowProbe> v(2 * T);
  for_blocks(T, 64, [&](std::size_t t0, std::size_t t1) {
    std::vector<float> row(R);
    for (std::size_t t = t0; t < t1; ++t) {
      for (std::size_t e = 0; e < R; ++e) row[e] = dz(t, e);
      for (std::size_t q = 0; q < 2; ++q) {
        const verify::Probe& p = dx_probes_[q];
        verify::RowSide s = verify::row_side(p, 0, row.data(), R, false);
        s.rhs += before_[q][t], s.mag += before_[q][T + t];
        double lhs, cabs;
        verify::detail::signed_sum_and_magnitude(dx.row(t) + p.j0, p.r.data(), p.width, lhs, cabs);
        v[2 * t + q] = verify::judge_row(p, R + 1, s, lhs, cabs);
      }
    }
  });
  keep(v, dx_probes_, "dx row {} columns [{}, {})");
}

// dW_r^T = x^T dz: row h of A is x's column h (K = T), B(e, t) = dz(t, e).
// By blocks of 64 columns of x: their sides as §9.1's (verify::detail::
// column_sides), dW_r's sums down its rows in binary64.
void RouterLinearProbe::judge_dw(MatView<const bf16> x, const DzPlanes& dz,
                                 MatView<const float> dw) {
  constexpr std::size_t kCols = 64;
  const std::size_t T = x.rows, H = x.cols, R = dz.cols();
  const auto p = probes_of(R, call_, [&](std::size_t j0, std::size_t w0, std::uint64_t s) {
    return dw_probe(dz, j0, w0, s);
  });
  std::vector<verify::RowProbe> v(2 * H);
  for_blocks(H, kCols, [&](std::size_t h0, std::size_t h1) {
    const std::size_t n = h1 - h0;
    double sides[2][2 * kCols], lhs[kCols], cabs[kCols];
    const float* const y[2] = {p[0].br.data(), p[1].br.data()};
    const float* const z[2] = {p[0].babs.data(), p[1].babs.data()};
    double* const side[2] = {sides[0], sides[1]};
    verify::detail::column_sides(x.row(0) + h0, x.stride, T, n, y, z, side);
    for (std::size_t q = 0; q < 2; ++q) {
      std::fill_n(lhs, n, 0.0), std::fill_n(cabs, n, 0.0);
      verify::detail::add_signed_rows(dw.row(p[q].j0) + h0, dw.stride, p[q].width, n, p[q].r.data(),
                                      lhs, cabs);
      for (std::size_t i = 0; i < n; ++i)
        v[2 * (h0 + i) + q] =
            verify::judge_row(p[q], T, {side[q][i], side[q][n + i], 0}, lhs[i], cabs[i]);
    }
  });
  keep(v, p, "router_w grad column {} rows [{}, {})");
}

// db_e: an fp32 sum of T terms (bounds::dot), against its binary64 sum.
void RouterLinearProbe::judge_db(const DzPlanes& dz, View<const float> db) {
  const std::size_t T = dz.rows();
  for (std::size_t e = 0; e < db.size && result_.pass; ++e) {
    double sum = 0, mag = 0;
    for (std::size_t t = 0; t < T; ++t) sum += dz(t, e), mag += std::fabs(dz(t, e));
    const double n = static_cast<double>(T);
    const verify::RowProbe r{std::fabs(db[e] - sum),
                             bounds::dot(T, mag) + 2 * bounds::gamma(n, bounds::kU64) * mag};
    if (!(r.ratio() <= result_.max_ratio)) result_.max_ratio = r.ratio();
    if (!r.pass()) {
      result_.pass = false;
      result_.row = e, result_.j0 = e, result_.width = 1;
      result_.residual = r.residual, result_.threshold = r.threshold;
      failure_ = fmt::format("router_b grad[{}]", e);
    }
  }
}

void RouterLinearProbe::judge(MatView<const bf16> x, const DzPlanes& dz,
                              const layer::RouterLinearGrads& g) {
  if (dz.rows() == 0 || dz.cols() == 0) return;
  if (!g.dx.empty() && !before_[0].empty()) judge_dx(dz, MatView<const float>(g.dx));
  if (!g.router_w.empty()) judge_dw(x, dz, MatView<const float>(g.router_w));
  if (!g.router_b.empty()) judge_db(dz, {g.router_b.data, g.router_b.size});
}

bool RouterLinearProbe::due_in_layer() { return layer_backward_calls++ % kLayerEvery == 0; }

void RouterLinearProbe::report(detail::Checker& c, const ClauseInfo& clause) const {
  if (!result_.pass) fail_probe(c, clause, failure_, result_);
}

}  // namespace moecert::contracts
