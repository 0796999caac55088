// Clauses of layer.router_linear: shapes, finite inputs, aliasing, finite
// outputs, (audit) the probes of contracts/layer/router_linear_probe.cpp and
// (full) every output within its sum's bound (proofs/layer.md §4,
// proofs/bounds.md §1, §9.4).
#include "contracts/layer/router_linear.hpp"

#include <cmath>
#include <string>
#include <utility>

#include "contracts/engine/checks.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/numeric/rounding.hpp"

namespace moecert::contracts {

namespace k = clauses::layer;
using bounds::Tracked;

namespace {

MatView<const float> row_of(View<const float> v) { return {v.data, 1, v.size, v.size}; }

bool inputs_finite(detail::Checker& c, MatView<const bf16> x, MatView<const float> w) {
  return detail::scan_finite(c, k::kRlFinite, "x", x) &&
         detail::scan_finite(c, k::kRlFinite, "router_w", w);
}

}  // namespace

void router_linear_forward_pre(detail::Checker& c, MatView<const bf16> x, MatView<const float> w,
                               View<const float> b, MatView<float> z) {
  const std::size_t T = x.rows, H = x.cols, R = w.rows;
  MOECERT_CONTRACT(c, k::kRlShape) {
    if (!detail::has_shape(w, R, H) || b.size != R || !detail::has_shape(z, T, R))
      c.fail(k::kRlShape, "",
             fmt::format("x {}x{}, router_w {}x{}, router_b {}, z {}x{}", T, H, w.rows, w.cols,
                         b.size, z.rows, z.cols),
             fmt::format("router_w R x {}, router_b R, z {} x R", H, T));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kRlFinite) {
    inputs_finite(c, x, w) && detail::scan_finite(c, k::kRlFinite, "router_b", row_of(b));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kRlXRange) { detail::scan_bf16_range(c, k::kRlXRange, "x", x); }
  MOECERT_CONTRACT(c, k::kRlNoAlias) {
    detail::no_overlap(c, k::kRlNoAlias, {{"z", z.bytes()}},
                       {{"x", x.bytes()}, {"router_w", w.bytes()}, {"router_b", b.bytes()}});
  }
}

std::vector<Tracked> router_logits_reference(MatView<const bf16> x, MatView<const float> w,
                                             View<const float> b) {
  const std::size_t T = x.rows, H = x.cols, R = w.rows;
  std::vector<Tracked> z(T * R);
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t e = 0; e < R; ++e) {
      double v = b[e], mag = std::fabs(b[e]);
      for (std::size_t h = 0; h < H; ++h) {
        const double p = double(x(t, h).to_float()) * w(e, h);
        v += p, mag += std::fabs(p);
      }
      z[t * R + e] = {v, bounds::dot(H + 1, mag)};
    }
  return z;
}

void router_linear_forward_post(detail::Checker& c, MatView<const bf16> x, MatView<const float> w,
                                View<const float> b, MatView<const float> z) {
  MOECERT_CONTRACT(c, k::kRlOutFinite) { detail::scan_finite(c, k::kRlOutFinite, "z", z); }
  MOECERT_CONTRACT(c, k::kRlProbe) { probe_router_logits(c, k::kRlProbe, x, w, b, z); }
  // Inputs exact (bf16 x, fp32 W_r, b), no overflow; z: fp32 sums of H + 1 terms,
  // bounds::dot via Tracked; proofs/bounds.md §1.
  MOECERT_CONTRACT(c, k::kRlWithin) {
    within(c, k::kRlWithin, "z", z.cols, values(z), router_logits_reference(x, w, b),
           "proofs/bounds.md §1");
  }
}

void router_linear_backward_pre(detail::Checker& c, MatView<const bf16> x, MatView<const float> w,
                                MatView<const float> dz, const layer::RouterLinearGrads& g) {
  const std::size_t T = x.rows, H = x.cols, R = w.rows;
  MOECERT_CONTRACT(c, k::kRlShape) {
    const bool ok = detail::has_shape(w, R, H) && detail::has_shape(dz, T, R) &&
                    (g.dx.empty() || detail::has_shape(g.dx, T, H)) &&
                    (g.router_w.empty() || detail::has_shape(g.router_w, R, H)) &&
                    (g.router_b.empty() || g.router_b.size == R);
    if (!ok)
      c.fail(k::kRlShape, "",
             fmt::format("x {}x{}, router_w {}x{}, dz {}x{}, dx {}x{}, router_w grad {}x{}, "
                         "router_b grad {}",
                         T, H, w.rows, w.cols, dz.rows, dz.cols, g.dx.rows, g.dx.cols,
                         g.router_w.rows, g.router_w.cols, g.router_b.size),
             fmt::format("router_w R x {}, dz {} x R; gradients {} x {}, R x {}, R (or empty)", H,
                         T, T, H, H));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kRlFinite) {
    inputs_finite(c, x, w) && detail::scan_finite(c, k::kRlFinite, "dz", dz) &&
        (g.dx.empty() || detail::scan_finite(c, k::kRlFinite, "dx", MatView<const float>(g.dx)));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kRlXRange) { detail::scan_bf16_range(c, k::kRlXRange, "x", x); }
  MOECERT_CONTRACT(c, k::kRlNoAlias) {
    std::vector<std::pair<std::string, ByteRange>> out;
    if (!g.dx.empty()) out.emplace_back("dx", g.dx.bytes());
    if (!g.router_w.empty()) out.emplace_back("router_w grad", g.router_w.bytes());
    if (!g.router_b.empty()) out.emplace_back("router_b grad", g.router_b.bytes());
    detail::no_overlap(c, k::kRlNoAlias, out,
                       {{"x", x.bytes()}, {"router_w", w.bytes()}, {"dz", dz.bytes()}});
  }
}

std::vector<float> router_linear_dx_before(detail::Checker& c, MatView<const float> dx) {
  std::vector<float> before;
  MOECERT_CONTRACT(c, k::kRlWithin) {
    if (!dx.empty()) before = values(dx);
  }
  return before;
}

// dz taken as exact; dW_r, db: fp32 sums over T, dx: the caller's value plus R
// products; bounds::dot via Tracked for any summation order; proofs/layer.md §4.
RouterLinearGradsReference router_linear_grads_reference(MatView<const bf16> x,
                                                         MatView<const float> w,
                                                         MatView<const float> dz,
                                                         const std::vector<float>& dx_before) {
  const std::size_t T = x.rows, H = x.cols, R = w.rows;
  RouterLinearGradsReference ref;
  // dx: the caller's value plus a sum of R products, R + 1 terms in all.
  if (!dx_before.empty()) {
    ref.dx.resize(T * H);
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t h = 0; h < H; ++h) {
        double v = dx_before[t * H + h], mag = std::fabs(v);
        for (std::size_t e = 0; e < R; ++e) {
          const double p = double(dz(t, e)) * w(e, h);
          v += p, mag += std::fabs(p);
        }
        ref.dx[t * H + h] = {v, bounds::dot(R + 1, mag)};
      }
  }
  // dW_r and db: sums of T products.
  ref.router_w.resize(R * H), ref.router_b.resize(R);
  for (std::size_t e = 0; e < R; ++e) {
    double bv = 0, bmag = 0;
    for (std::size_t t = 0; t < T; ++t) bv += dz(t, e), bmag += std::fabs(dz(t, e));
    ref.router_b[e] = {bv, bounds::dot(T, bmag)};
    for (std::size_t h = 0; h < H; ++h) {
      double v = 0, mag = 0;
      for (std::size_t t = 0; t < T; ++t) {
        const double p = double(dz(t, e)) * x(t, h).to_float();
        v += p, mag += std::fabs(p);
      }
      ref.router_w[e * H + h] = {v, bounds::dot(T, mag)};
    }
  }
  return ref;
}

void router_linear_backward_post(detail::Checker& c, MatView<const bf16> x, MatView<const float> w,
                                 MatView<const float> dz, const layer::RouterLinearGrads& g,
                                 const std::vector<float>& dx_before,
                                 const RouterLinearProbe* probe) {
  const std::size_t H = x.cols, R = w.rows;
  MOECERT_CONTRACT(c, k::kRlOutFinite) {
    (g.dx.empty() || detail::scan_finite(c, k::kRlOutFinite, "dx", MatView<const float>(g.dx))) &&
        (g.router_w.empty() || detail::scan_finite(c, k::kRlOutFinite, "router_w grad",
                                                   MatView<const float>(g.router_w))) &&
        (g.router_b.empty() ||
         detail::scan_finite(c, k::kRlOutFinite, "router_b grad", row_of(g.router_b)));
  }
  MOECERT_CONTRACT(c, k::kRlProbe) {
    if (probe) probe->report(c, k::kRlProbe);
  }
  // Each gradient within its bound of router_linear_grads_reference.
  MOECERT_CONTRACT(c, k::kRlWithin) {
    constexpr const char* kProof = "proofs/layer.md §4";
    const RouterLinearGradsReference ref = router_linear_grads_reference(x, w, dz, dx_before);
    if (!g.dx.empty() &&
        !within(c, k::kRlWithin, "dx", H, values(MatView<const float>(g.dx)), ref.dx, kProof))
      return;
    if (!g.router_w.empty() &&
        !within(c, k::kRlWithin, "router_w grad", H, values(MatView<const float>(g.router_w)),
                ref.router_w, kProof))
      return;
    if (!g.router_b.empty())
      within(c, k::kRlWithin, "router_b grad", R, values(row_of(g.router_b)), ref.router_b, kProof);
  }
}

}  // namespace moecert::contracts
