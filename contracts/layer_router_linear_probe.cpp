// The router linear's probes (proofs/bounds.md §9.4): Lemma 9 on
// z = [x | 1] [W_r | b]^T (K = H + 1), on dx's rows, dx = [dz | 1] times
// [W_r^T | dx before] (K = R + 1, the last column the row's own), and on
// dW_r^T = x^T dz (K = T, rows h); db against its sums' bounds.
#include "contracts/layer_router_linear_probe.hpp"

#include <fmt/format.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "contracts/bounds/basic.hpp"
#include "contracts/gemm.hpp"
#include "contracts/tbb_sync.hpp"

namespace moecert::contracts {

namespace {

constexpr std::size_t kNarrow = 4;
constexpr std::uint64_t kDenseSeed = 0x726c'6465'6e73'65ULL, kNarrowSeed = 0x726c'6e61'7200ULL;

// Calls so far, per direction: call c probes narrow block c mod ceil(N / 4).
std::atomic<std::uint64_t> forward_calls{0}, backward_calls{0};

// The dense probe of C's N columns and call `call`'s narrow block, for
// C = A B^T with B [N x K] read through b(j, k).
template <class BAt>
std::array<verify::Probe, 2> probes_of(std::size_t n, std::size_t k, BAt b, std::uint64_t call) {
  const std::size_t j0 = call % ((n + kNarrow - 1) / kNarrow) * kNarrow;
  return {verify::make_probe(k, b, 0, n, kDenseSeed),
          verify::make_probe(k, b, j0, std::min(kNarrow, n - j0), kNarrowSeed + call)};
}

// body(i0, i1) over [0, n) in blocks of `grain`, in parallel.
template <class F>
void for_blocks(std::size_t n, std::size_t grain, F body) {
  oneapi::tbb::parallel_for(
      std::size_t{0}, (n + grain - 1) / grain,
      detail::TbbBody([&](std::size_t blk) { body(blk * grain, std::min(n, (blk + 1) * grain)); }));
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
  const auto p = probes_of(
      R, H + 1, [&](std::size_t e, std::size_t k) { return k < H ? w(e, k) : b[e]; },
      forward_calls++);
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
    : w_(w), call_(backward_calls++) {
  if (dx.empty() || w.rows == 0) return;
  const std::size_t T = dx.rows, H = dx.cols;
  // dx's columns are W_r's: B(h, e) = W_r(e, h), read by rows of W_r.
  dx_probes_ = probes_of(
      H, w.rows, [&](std::size_t h, std::size_t e) { return w(e, h); }, call_);
  before_.assign(4 * T, 0.0);
  for_blocks(T, 64, [&](std::size_t t0, std::size_t t1) {
    for (std::size_t t = t0; t < t1; ++t)
      for (std::size_t q = 0; q < 2; ++q) {
        const verify::Probe& p = dx_probes_[q];
        verify::detail::signed_sum_and_magnitude(dx.row(t) + p.j0, p.r.data(), p.width,
                                                 before_[4 * t + 2 * q],
                                                 before_[4 * t + 2 * q + 1]);
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
  result_ = r, result_.max_ratio = ratio;
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
        s.rhs += before_[4 * t + 2 * q], s.mag += before_[4 * t + 2 * q + 1];
        double lhs, cabs;
        verify::detail::signed_sum_and_magnitude(dx.row(t) + p.j0, p.r.data(), p.width, lhs, cabs);
        v[2 * t + q] = verify::judge_row(p, R + 1, s, lhs, cabs);
      }
    }
  });
  keep(v, dx_probes_, "dx row {} columns [{}, {})");
}

// dW_r^T = x^T dz: row h of A is x's column h (K = T), B(e, t) = dz(t, e).
// A row's sides in binary64 over t in order, by blocks of 64 columns of x.
void RouterLinearProbe::judge_dw(MatView<const bf16> x, const DzPlanes& dz,
                                 MatView<const float> dw) {
  const std::size_t T = x.rows, H = x.cols, R = dz.cols();
  const auto p = probes_of(
      R, T, [&](std::size_t e, std::size_t t) { return dz(t, e); }, call_);
  std::vector<verify::RowProbe> v(2 * H);
  for_blocks(H, 64, [&](std::size_t h0, std::size_t h1) {
    const std::size_t n = h1 - h0;
    std::vector<double> side(4 * n, 0.0);  // rhs, mag per probe, column-major by probe
    for (std::size_t t = 0; t < T; ++t) {
      const bf16* xr = x.row(t) + h0;
      for (std::size_t q = 0; q < 2; ++q) {
        const double br = p[q].br[t], babs = p[q].babs[t];
        double* rhs = side.data() + 2 * q * n;
        double* mag = rhs + n;
        for (std::size_t i = 0; i < n; ++i) {
          const double a = xr[i].to_float();
          rhs[i] += a * br, mag[i] += std::fabs(a) * babs;
        }
      }
    }
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t q = 0; q < 2; ++q) {
        double lhs = 0, cabs = 0;
        for (std::size_t j = 0; j < p[q].width; ++j) {
          const double g = dw(p[q].j0 + j, h0 + i);
          lhs += p[q].r[j] * g, cabs += std::fabs(g);
        }
        const verify::RowSide s{side[2 * q * n + i], side[(2 * q + 1) * n + i], 0};
        v[2 * (h0 + i) + q] = verify::judge_row(p[q], T, s, lhs, cabs);
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
  if (!g.dx.empty() && !before_.empty()) judge_dx(dz, MatView<const float>(g.dx));
  if (!g.router_w.empty()) judge_dw(x, dz, MatView<const float>(g.router_w));
  if (!g.router_b.empty()) judge_db(dz, {g.router_b.data, g.router_b.size});
}

void RouterLinearProbe::report(detail::Checker& c, const ClauseInfo& clause) const {
  if (!result_.pass) fail_probe(c, clause, failure_, result_);
}

}  // namespace moecert::contracts
