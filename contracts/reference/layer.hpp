// The MoE layer reference, forward and backward, written once over a scalar
// S: the 50-digit type (finite differences, tests), double, or
// bounds::Tracked (the kernel's error bound, proofs/layer.md). The kernel's
// rounding points are marked (r32, rbf16, kdot, r64to32); they are no-ops
// for the exact scalars. Routing (idx) is given; the logits and weights are
// computed from the inputs, or given (the kernel's: the bounds are
// conditioned on the routing the kernel chose, proofs/layer.md §1).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "contracts/bounds/tracked.hpp"
#include "contracts/reference/router.hpp"
#include "moecert/config.hpp"

namespace moecert::ref {

template <class S>
struct LayerData {
  std::size_t T = 0, H = 0, I = 0, E = 0, K = 0, r = 0, R = 0;  // R: router outputs
  bool router = true;  // false: the experts op alone (w_given, no router: R = 0, no z, no dz)
  RouterKind kind = RouterKind::softmax_topk;
  bool renormalize = true;
  double scaling = 1;                     // sigmoid_topk c
  double scale = 0;                       // LoRA s = float(alpha / r)
  std::vector<S> x, wr, b;                // T x H, R x H, R
  std::vector<S> wg, wu, wd;              // E I x H, E I x H, E H x I
  std::vector<S> ag, bg, au, bu, ad, bd;  // E r x H, E I x r, E r x H, E I x r, E r x I, E H x r
  std::vector<std::int32_t> idx;          // T x K
  std::vector<S> z_given, w_given;        // the kernel's logits and weights, or empty
  std::vector<S> dy;                      // T x H
};

struct Paths {
  bool expert = true, router = true;
  bool base = false;  // the expert path also yields the base weights' gradients
};

template <class S>
struct LayerResult {
  std::vector<S> z, w, y;                       // forward
  std::vector<S> dw, dz, dx, dwr, db;           // router path (dx: both paths summed)
  std::vector<S> dag, dbg, dau, dbu, dad, dbd;  // LoRA
  std::vector<S> dwg, dwu, dwd;                 // base weights (Paths::base)
  std::vector<S> m_a, m_g;                      // T x E
};

namespace layer_detail {

template <class S>
S sqrt_of(const S& a) {
  if constexpr (std::is_same_v<S, bounds::Tracked>) {
    // |sqrt(a_hat) - sqrt(a)| <= min(sqrt(e), e / sqrt(a)); plus the kernel's
    // binary64 sums of squares (relative gamma_n at 2^-53, n <= 2^17) and sqrt.
    const double v = std::sqrt(std::max(a.v, 0.0));
    const double e = std::min(std::sqrt(a.e), v > 0 ? a.e / v : INFINITY);
    return {v, e + 0x1p-35 * (v + e)};
  } else {
    using boost::multiprecision::sqrt;
    using std::sqrt;
    return sqrt(a);
  }
}

template <class S>
S exp_of(const S& a) {
  if constexpr (std::is_same_v<S, bounds::Tracked>)
    return {std::exp(a.v), 0};
  else
    return exp(a);
}

}  // namespace layer_detail

/// Router weights of one row from its logits zr (R values), for the
/// selected idx (valid prefix v).
template <class S>
std::vector<S> router_weights(const LayerData<S>& d, const S* zr, const std::int32_t* ir,
                              std::size_t v) {
  using layer_detail::exp_of;
  std::vector<S> w(d.K, S(0));
  if (v == 0) return w;
  if (d.kind == RouterKind::softmax_topk) {
    S m = zr[ir[0]];
    for (std::size_t i = 0; i < d.E; ++i)
      if (to_double(zr[i]) > to_double(m)) m = zr[i];
    S sum = 0;
    if (d.renormalize)
      for (std::size_t j = 0; j < v; ++j) sum += exp_of(S(zr[ir[j]] - m));
    else
      for (std::size_t i = 0; i < d.E; ++i) sum += exp_of(S(zr[i] - m));
    for (std::size_t j = 0; j < v; ++j) w[j] = exp_of(S(zr[ir[j]] - m)) / sum;
  } else if (d.kind == RouterKind::sigmoid_topk) {
    S sum = 0;
    for (std::size_t j = 0; j < v; ++j) sum += sig(zr[ir[j]]);
    for (std::size_t j = 0; j < v; ++j) w[j] = S(d.scaling) * sig(zr[ir[j]]) / sum;
  } else {
    const std::size_t n = d.R / 2;
    std::vector<S> s(v);
    S m = 0;
    for (std::size_t j = 0; j < v; ++j) {
      s[j] = zr[static_cast<std::size_t>(ir[j]) / n] + zr[n + static_cast<std::size_t>(ir[j]) % n];
      if (j == 0 || to_double(s[j]) > to_double(m)) m = s[j];
    }
    S sum = 0;
    for (std::size_t j = 0; j < v; ++j) sum += exp_of(S(s[j] - m));
    for (std::size_t j = 0; j < v; ++j) w[j] = exp_of(S(s[j] - m)) / sum;
  }
  return w;
}

/// dz of one row (R values) from g = dL/dw (K values), exact math.
template <class S>
std::vector<S> router_grad(const LayerData<S>& d, const S* zr, const std::int32_t* ir,
                           std::size_t v, const S* g) {
  std::vector<S> dz(d.R, S(0));
  if (v == 0) return dz;
  if (d.kind == RouterKind::sigmoid_topk) {
    S sum = 0, dot = 0;
    for (std::size_t j = 0; j < v; ++j) sum += sig(zr[ir[j]]);
    for (std::size_t j = 0; j < v; ++j) dot += g[j] * sig(zr[ir[j]]) / sum;
    for (std::size_t j = 0; j < v; ++j) {
      const S s = sig(zr[ir[j]]);
      dz[static_cast<std::size_t>(ir[j])] = s * (S(1) - s) * (S(d.scaling) / sum) * (g[j] - dot);
    }
    return dz;
  }
  const std::vector<S> w = router_weights(d, zr, ir, v);
  S dot = 0;
  for (std::size_t j = 0; j < v; ++j) dot += w[j] * g[j];
  if (d.kind == RouterKind::softmax_topk && !d.renormalize) {
    // p over every expert; dz_i = p_i (g^_i - sum_S p g).
    std::vector<S> p(d.E);
    S m = zr[0], sum = 0;
    for (std::size_t i = 0; i < d.E; ++i)
      if (to_double(zr[i]) > to_double(m)) m = zr[i];
    for (std::size_t i = 0; i < d.E; ++i) sum += layer_detail::exp_of(S(zr[i] - m));
    for (std::size_t i = 0; i < d.E; ++i) dz[i] = -(layer_detail::exp_of(S(zr[i] - m)) / sum) * dot;
    for (std::size_t j = 0; j < v; ++j) dz[static_cast<std::size_t>(ir[j])] += w[j] * g[j];
    return dz;
  }
  for (std::size_t j = 0; j < v; ++j) {
    const S ds = w[j] * (g[j] - dot);
    if (d.kind == RouterKind::softmax_topk) {
      dz[static_cast<std::size_t>(ir[j])] = ds;
    } else {
      const std::size_t n = d.R / 2;
      dz[static_cast<std::size_t>(ir[j]) / n] += ds;
      dz[n + static_cast<std::size_t>(ir[j]) % n] += ds;
    }
  }
  return dz;
}

/// The router path after dL/dw: dz per row (dz_hook adds the router
/// kernel's own rounding), the router linear's gradients dW_r, db, and its
/// share of dx (dxr).
template <class S, class DzHook>
void router_backward_reference(const LayerData<S>& d, LayerResult<S>& out, std::vector<S>& dxr,
                               DzHook dz_hook) {
  const std::size_t T = d.T, H = d.H, K = d.K, R = d.R;
  for (std::size_t t = 0; t < T; ++t) {
    const std::size_t v = valid_prefix(&d.idx[t * K], K);
    auto dz = router_grad(d, &out.z[t * R], &d.idx[t * K], v, &out.dw[t * K]);
    dz_hook(t, dz);
    for (std::size_t e = 0; e < R; ++e) out.dz[t * R + e] = dz[e];
  }
  for (std::size_t e = 0; e < R; ++e) {
    for (std::size_t h = 0; h < H; ++h)
      out.dwr[e * H + h] = kdot<S>(
          T, [&](std::size_t t) { return out.dz[t * R + e]; },
          [&](std::size_t t) { return d.x[t * H + h]; }, T);
    out.db[e] = kdot<S>(
        T, [&](std::size_t t) { return out.dz[t * R + e]; }, [&](std::size_t) { return S(1); }, T);
  }
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t h = 0; h < H; ++h)
      dxr[t * H + h] = kdot<S>(
          R, [&](std::size_t e) { return out.dz[t * R + e]; },
          [&](std::size_t e) { return d.wr[e * H + h]; }, R);
}

/// The layer forward (and, with dy, the backward) for every routed pair, in
/// the kernel's rounding structure; with d.router false, the experts op.
template <class S, class DzHook>
LayerResult<S> layer_reference(const LayerData<S>& d, bool backward, Paths paths, DzHook dz_hook);

template <class S>
LayerResult<S> layer_reference(const LayerData<S>& d, bool backward, Paths paths = {}) {
  return layer_reference(d, backward, paths, [](std::size_t, std::vector<S>&) {});
}

/// dz_hook(t, dz_row) runs on each row's dz before the router linear's
/// gradients use it (the bound adds the router kernel's own rounding there).
template <class S, class DzHook>
LayerResult<S> layer_reference(const LayerData<S>& d, bool backward, Paths paths, DzHook dz_hook) {
  const std::size_t T = d.T, H = d.H, I = d.I, K = d.K, r = d.r, R = d.R;
  const S s(d.scale);
  auto kp = [](std::size_t n) { return (n + 31) / 32 * 32; };
  LayerResult<S> out;
  // Router linear and weights.
  if (!d.router) {
    // The experts op: the caller's weights, no logits.
  } else if (!d.z_given.empty()) {
    out.z = d.z_given;
  } else {
    out.z.assign(T * R, S(0));
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t e = 0; e < R; ++e)
        out.z[t * R + e] = kdot<S>(
            H + 1, [&](std::size_t h) { return h < H ? d.x[t * H + h] : S(1); },
            [&](std::size_t h) { return h < H ? d.wr[e * H + h] : d.b[e]; }, H + 1);
  }
  out.w.assign(T * K, S(0));
  if (!d.w_given.empty()) {
    out.w = d.w_given;
  } else {
    for (std::size_t t = 0; t < T; ++t) {
      const std::size_t v = valid_prefix(&d.idx[t * K], K);
      const auto w = router_weights(d, &out.z[t * R], &d.idx[t * K], v);
      for (std::size_t j = 0; j < K; ++j) out.w[t * K + j] = w[j];
    }
  }
  out.y.assign(T * H, S(0));
  if (backward) {
    out.dw.assign(T * K, S(0));
    out.dz.assign(T * R, S(0));
    out.dx.assign(T * H, S(0));
    out.dwr.assign(R * H, S(0));
    out.db.assign(R, S(0));
    for (auto* g : {&out.dag, &out.dau}) g->assign(d.E * r * H, S(0));
    for (auto* g : {&out.dbg, &out.dbu}) g->assign(d.E * I * r, S(0));
    out.dad.assign(d.E * r * I, S(0));
    out.dbd.assign(d.E * H * r, S(0));
    if (paths.base) {
      for (auto* g : {&out.dwg, &out.dwu}) g->assign(d.E * I * H, S(0));
      out.dwd.assign(d.E * H * I, S(0));
    }
    out.m_a.assign(T * d.E, S(0));
    out.m_g.assign(T * d.E, S(0));
  }
  std::vector<S> dxe(T * H, S(0));  // expert path dx, slot sums
  // LoRA gradients are fp32 sums over each expert's rows: with S = Tracked
  // their rounding is added at the end from the magnitudes and row counts.
  constexpr bool tracked = std::is_same_v<S, bounds::Tracked>;
  std::vector<double> mag_ag, mag_bg, mag_au, mag_bu, mag_ad, mag_bd, mag_wg, mag_wu, mag_wd, fl_wg,
      fl_wu, fl_wd;
  std::vector<std::size_t> rows_of(d.E, 0);
  if (backward && tracked) {
    mag_ag.assign(d.E * r * H, 0), mag_au.assign(d.E * r * H, 0), mag_bg.assign(d.E * I * r, 0),
        mag_bu.assign(d.E * I * r, 0);
    mag_ad.assign(d.E * r * I, 0), mag_bd.assign(d.E * H * r, 0);
    if (paths.base) {
      for (auto* v : {&mag_wg, &mag_wu, &fl_wg, &fl_wu}) v->assign(d.E * I * H, 0);
      for (auto* v : {&mag_wd, &fl_wd}) v->assign(d.E * H * I, 0);
    }
  }
  auto acc = [&](std::vector<S>& g, std::vector<double>& mag, std::size_t i, const S& term) {
    g[i] += term;
    if constexpr (tracked) mag[i] += term.mag();
  };
  // A GEMM term a * b: as acc, and a product with an input the tile unit
  // may flush (a possible denormal) counted apart (Lemma 1').
  auto acc_flushed = [&](std::vector<S>& g, std::vector<double>& mag, std::vector<double>& fl,
                         std::size_t i, const S& a, const S& b) {
    const S term = a * b;
    g[i] += term;
    if constexpr (tracked) {
      mag[i] += term.mag();
      if (may_flush(a) || may_flush(b)) fl[i] += term.mag();
    }
  };
  for (std::size_t t = 0; t < T; ++t) {
    const std::size_t v = valid_prefix(&d.idx[t * K], K);
    std::vector<std::vector<S>> o_slots;
    std::vector<std::vector<S>> dxr_slots;
    for (std::size_t j = 0; j < v; ++j) {
      const std::size_t e = static_cast<std::size_t>(d.idx[t * K + j]);
      const S* x = &d.x[t * H];
      auto WG = [&](std::size_t i, std::size_t h) { return d.wg[(e * I + i) * H + h]; };
      auto WU = [&](std::size_t i, std::size_t h) { return d.wu[(e * I + i) * H + h]; };
      auto WD = [&](std::size_t m, std::size_t i) { return d.wd[(e * H + m) * I + i]; };
      auto AG = [&](std::size_t k, std::size_t h) { return d.ag[(e * r + k) * H + h]; };
      auto AU = [&](std::size_t k, std::size_t h) { return d.au[(e * r + k) * H + h]; };
      auto BG = [&](std::size_t i, std::size_t k) { return d.bg[(e * I + i) * r + k]; };
      auto BU = [&](std::size_t i, std::size_t k) { return d.bu[(e * I + i) * r + k]; };
      auto AD = [&](std::size_t k, std::size_t i) { return d.ad[(e * r + k) * I + i]; };
      auto BD = [&](std::size_t m, std::size_t k) { return d.bd[(e * H + m) * r + k]; };
      // Forward: xa, lb, g, u, h, ha, lbd, o.
      std::vector<S> xa(2 * r), lb(2 * r), g(I), u(I), sg(I), silu(I), h(I), ha(r), lbd(r), o(H);
      for (std::size_t k = 0; k < 2 * r; ++k) {
        xa[k] = kdot<S>(
            H, [&](std::size_t q) { return x[q]; },
            [&](std::size_t q) { return k < r ? AG(k, q) : AU(k - r, q); }, kp(H));
        lb[k] = rbf16(r32(s * xa[k]));
      }
      for (std::size_t i = 0; i < I; ++i) {
        const std::size_t n = kp(H) + (r ? kp(2 * r) : 0);
        g[i] = kdot<S>(
            H + 2 * r, [&](std::size_t q) { return q < H ? x[q] : lb[q - H]; },
            [&](std::size_t q) { return q < H ? WG(i, q) : (q - H < r ? BG(i, q - H) : S(0)); }, n);
        u[i] = kdot<S>(
            H + 2 * r, [&](std::size_t q) { return q < H ? x[q] : lb[q - H]; },
            [&](std::size_t q) {
              return q < H ? WU(i, q) : (q - H >= r ? BU(i, q - H - r) : S(0));
            },
            n);
        sg[i] = sig(g[i]);
        silu[i] = r32(g[i] * sg[i]);
        h[i] = rbf16(r32(silu[i] * u[i]));
      }
      for (std::size_t k = 0; k < r; ++k) {
        ha[k] = kdot<S>(
            I, [&](std::size_t q) { return h[q]; }, [&](std::size_t q) { return AD(k, q); }, kp(I));
        lbd[k] = rbf16(r32(s * ha[k]));
      }
      for (std::size_t m = 0; m < H; ++m)
        o[m] = kdot<S>(
            I + r, [&](std::size_t q) { return q < I ? h[q] : lbd[q - I]; },
            [&](std::size_t q) { return q < I ? WD(m, q) : BD(m, q - I); },
            kp(I) + (r ? kp(r) : 0));
      o_slots.push_back(o);
      if (!backward) continue;
      // Backward of this routed pair.
      const S wt = out.w[t * K + j];
      std::vector<S> dyb16(H), dhb(I), dh(I), dyb(r), qd(r), dg(I), du(I), dgb(2 * r), qgu(2 * r),
          dxr(H);
      for (std::size_t m = 0; m < H; ++m) dyb16[m] = rbf16(d.dy[t * H + m]);
      for (std::size_t i = 0; i < I; ++i)
        dhb[i] = kdot<S>(
            H, [&](std::size_t q) { return dyb16[q]; }, [&](std::size_t q) { return WD(q, i); },
            kp(H));
      for (std::size_t k = 0; k < r; ++k) {
        dyb[k] = kdot<S>(
            H, [&](std::size_t q) { return dyb16[q]; }, [&](std::size_t q) { return BD(q, k); },
            kp(H));
        qd[k] = rbf16(r32(s * dyb[k]));
      }
      if (paths.router) {
        // dL/dw = <dy, o>, computed as <dy W_d, h> + <dy B_d, lbd> in binary64, rounded once.
        S dw = 0;
        double mag = 0;
        for (std::size_t i = 0; i < I; ++i)
          dw += dhb[i] * h[i], mag += to_double_abs(dhb[i]) * to_double_abs(h[i]);
        for (std::size_t k = 0; k < r; ++k)
          dw += dyb[k] * lbd[k], mag += to_double_abs(dyb[k]) * to_double_abs(lbd[k]);
        out.dw[t * K + j] = r64to32(dw, mag, I + r);
      }
      if (!paths.expert) continue;
      for (std::size_t i = 0; i < I; ++i) {
        dh[i] = kdot<S>(
            H + r, [&](std::size_t q) { return q < H ? dyb16[q] : qd[q - H]; },
            [&](std::size_t q) { return q < H ? WD(q, i) : AD(q - H, i); },
            kp(H) + (r ? kp(r) : 0));
        const S dhv = r32(wt * dh[i]);
        const S dsilu = r32(sg[i] * r32(S(1) + r32(g[i] * r32(S(1) - sg[i]))));
        dg[i] = rbf16(r32(r32(dhv * u[i]) * dsilu));
        du[i] = rbf16(r32(dhv * silu[i]));
      }
      for (std::size_t k = 0; k < 2 * r; ++k) {
        dgb[k] = kdot<S>(
            I, [&](std::size_t q) { return k < r ? dg[q] : du[q]; },
            [&](std::size_t q) { return k < r ? BG(q, k) : BU(q, k - r); }, kp(2 * I));
        qgu[k] = rbf16(r32(s * dgb[k]));
      }
      for (std::size_t m = 0; m < H; ++m)
        dxr[m] = kdot<S>(
            2 * I + 2 * r,
            [&](std::size_t q) { return q < I       ? dg[q]
                                        : q < 2 * I ? du[q - I]
                                                    : qgu[q - 2 * I]; },
            [&](std::size_t q) {
              return q < I           ? WG(q, m)
                     : q < 2 * I     ? WU(q - I, m)
                     : q - 2 * I < r ? AG(q - 2 * I, m)
                                     : AU(q - 2 * I - r, m);
            },
            kp(2 * I) + (r ? kp(2 * r) : 0));
      dxr_slots.push_back(dxr);
      // LoRA gradients: sums over this expert's rows, accumulated in token
      // order (here: one term per routed pair; the kernel's fp32 sums are
      // bounded in proofs/layer.md §3 with the expert's row count).
      ++rows_of[e];
      for (std::size_t k = 0; k < r; ++k) {
        for (std::size_t m = 0; m < H; ++m)
          acc(out.dbd, mag_bd, (e * H + m) * r + k, r32(wt * d.dy[t * H + m]) * ha[k]);
        for (std::size_t i = 0; i < I; ++i)
          acc(out.dad, mag_ad, (e * r + k) * I + i, r32(wt * dyb[k]) * h[i]);
        for (std::size_t i = 0; i < I; ++i) {
          acc(out.dbg, mag_bg, (e * I + i) * r + k, dg[i] * xa[k]);
          acc(out.dbu, mag_bu, (e * I + i) * r + k, du[i] * xa[r + k]);
        }
        for (std::size_t q = 0; q < H; ++q) {
          acc(out.dag, mag_ag, (e * r + k) * H + q, dgb[k] * x[q]);
          acc(out.dau, mag_au, (e * r + k) * H + q, dgb[r + k] * x[q]);
        }
      }
      // Base weights (optional): GEMMs over this expert's rows (one term
      // per routed pair; the kernel's fp32 sums, in its order, bounded with
      // the padded row count and flushed inputs as kdot does).
      if (paths.base) {
        std::vector<S> wdy(H);
        for (std::size_t m = 0; m < H; ++m) wdy[m] = rbf16(r32(wt * d.dy[t * H + m]));
        for (std::size_t i = 0; i < I; ++i) {
          for (std::size_t q = 0; q < H; ++q) {
            acc_flushed(out.dwg, mag_wg, fl_wg, (e * I + i) * H + q, dg[i], x[q]);
            acc_flushed(out.dwu, mag_wu, fl_wu, (e * I + i) * H + q, du[i], x[q]);
          }
          for (std::size_t m = 0; m < H; ++m)
            acc_flushed(out.dwd, mag_wd, fl_wd, (e * H + m) * I + i, wdy[m], h[i]);
        }
      }
      // Per-token statistics (DESIGN.md): rank-1 norms of each trainable
      // matrix's per-token gradient.
      auto norm2 = [](const std::vector<S>& a, std::size_t b0, std::size_t n) {
        S q = 0;
        for (std::size_t i = b0; i < b0 + n; ++i) q += a[i] * a[i];
        return q;
      };
      S x2 = 0, dy2 = 0;
      for (std::size_t q = 0; q < H; ++q)
        x2 += x[q] * x[q], dy2 += d.dy[t * H + q] * d.dy[t * H + q];
      const S h2 = norm2(h, 0, I), w2 = wt * wt;
      out.m_a[t * d.E + e] = r32(layer_detail::sqrt_of(S(x2 + h2)));
      S g2 = 0;
      if (r) {
        g2 = s * s *
             (norm2(dgb, 0, r) * x2 + norm2(dg, 0, I) * norm2(xa, 0, r) + norm2(dgb, r, r) * x2 +
              norm2(du, 0, I) * norm2(xa, r, r) + w2 * norm2(dyb, 0, r) * h2 +
              w2 * dy2 * norm2(ha, 0, r));
      } else {
        g2 = norm2(dg, 0, I) * x2 + norm2(du, 0, I) * x2 + w2 * dy2 * h2;
      }
      out.m_g[t * d.E + e] = r32(layer_detail::sqrt_of(g2));
    }
    // Combine: y_t = sum_j w_j o_j in fp32 over the K slots.
    for (std::size_t m = 0; m < H; ++m)
      out.y[t * H + m] = kdot<S>(
          v, [&](std::size_t j) { return out.w[t * K + j]; },
          [&](std::size_t j) { return o_slots[j][m]; }, K);
    if (backward && paths.expert)
      for (std::size_t m = 0; m < H; ++m)
        dxe[t * H + m] = kdot<S>(
            v, [&](std::size_t) { return S(1); }, [&](std::size_t j) { return dxr_slots[j][m]; },
            K);
  }
  if (!backward) return out;
  // The LoRA gradients: fp32 sums over the expert's rows (§1 with n = its
  // row count), then times the scale s. The base weights': GEMMs with K =
  // the row count padded to 32 (§1 with that n, flushed inputs apart).
  if constexpr (tracked) {
    const std::pair<std::vector<S>*, std::vector<double>*> all[] = {
        {&out.dag, &mag_ag}, {&out.dbg, &mag_bg}, {&out.dau, &mag_au},
        {&out.dbu, &mag_bu}, {&out.dad, &mag_ad}, {&out.dbd, &mag_bd}};
    for (const auto& [g, mag] : all) {
      const std::size_t per_expert = g->size() / std::max<std::size_t>(d.E, 1);
      for (std::size_t i = 0; i < g->size(); ++i)
        (*g)[i].e += bounds::dot(rows_of[i / per_expert], (*mag)[i]);
    }
    const std::tuple<std::vector<S>*, std::vector<double>*, std::vector<double>*> base[] = {
        {&out.dwg, &mag_wg, &fl_wg}, {&out.dwu, &mag_wu, &fl_wu}, {&out.dwd, &mag_wd, &fl_wd}};
    for (const auto& [g, mag, fl] : base) {
      const std::size_t per_expert = g->size() / std::max<std::size_t>(d.E, 1);
      for (std::size_t i = 0; i < g->size(); ++i)
        (*g)[i].e += bounds::dot(kp(rows_of[i / per_expert]), (*mag)[i], (*fl)[i]);
    }
  }
  for (auto* g : {&out.dag, &out.dbg, &out.dau, &out.dbu, &out.dad, &out.dbd})
    for (auto& v : *g) v = r32(s * v);
  // Router path: dz, then the router linear's gradients and its share of dx.
  std::vector<S> dxr(T * H, S(0));
  if (paths.router && d.router) router_backward_reference(d, out, dxr, dz_hook);
  for (std::size_t i = 0; i < T * H; ++i) out.dx[i] = r32(dxe[i] + dxr[i]);
  return out;
}

}  // namespace moecert::ref
