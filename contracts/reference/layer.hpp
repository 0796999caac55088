// The MoE layer reference, forward and backward, written once over a scalar
// S: the 50-digit type (finite differences, tests), double, or
// bounds::Tracked (the kernel's error bound, proofs/layer.md). The kernel's
// rounding points are marked (r32, rbf16, kdot, r64to32); they are no-ops
// for the exact scalars. Routing (idx) is given; the logits and weights are
// computed from the inputs, or given (the kernel's: the bounds are
// conditioned on the routing the kernel chose, proofs/layer.md §1).
#pragma once

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "contracts/engine/tbb_sync.hpp"
#include "contracts/numeric/tracked.hpp"
#include "contracts/reference/layer_pair.hpp"
#include "contracts/reference/layer_router.hpp"
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

}  // namespace layer_detail

/// Router weights of one row from its logits zr (R values), for the
/// selected idx (valid prefix v): the kind's (contracts/reference/layer_router.hpp).
template <class S>
std::vector<S> router_weights(const LayerData<S>& d, const S* zr, const std::int32_t* ir,
                              std::size_t v) {
  return with_router_reference(d.kind, [&](auto kind) { return kind.weights(d, zr, ir, v); });
}

/// dz of one row (R values) from g = dL/dw (K values), exact math.
template <class S>
std::vector<S> router_grad(const LayerData<S>& d, const S* zr, const std::int32_t* ir,
                           std::size_t v, const S* g) {
  return with_router_reference(d.kind, [&](auto kind) { return kind.grad(d, zr, ir, v, g); });
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

namespace layer_detail {

/// Per-token statistics of pair (t, e) (docs/DESIGN.md): m_a = ||[x, h]||, and
/// m_g the rank-1 norm of the pair's gradient of each trainable matrix.
template <class S>
std::pair<S, S> pair_stats(const LayerData<S>& d, const S* x, const S* dy, const S& wt,
                           const PairForward<S>& f, const PairBackward<S>& b) {
  const std::size_t H = d.H, I = d.I, r = d.r;
  const S s(d.scale);
  auto norm2 = [](const std::vector<S>& a, std::size_t b0, std::size_t n) {
    S q = 0;
    for (std::size_t i = b0; i < b0 + n; ++i) q += a[i] * a[i];
    return q;
  };
  S x2 = 0, dy2 = 0;
  for (std::size_t q = 0; q < H; ++q) x2 += x[q] * x[q], dy2 += dy[q] * dy[q];
  const S h2 = norm2(f.h, 0, I), w2 = wt * wt;
  S g2 = 0;
  if (r)
    g2 = s * s *
         (norm2(b.dgb, 0, r) * x2 + norm2(b.dg, 0, I) * norm2(f.xa, 0, r) +
          norm2(b.dgb, r, r) * x2 + norm2(b.du, 0, I) * norm2(f.xa, r, r) +
          w2 * norm2(b.dyb, 0, r) * h2 + w2 * dy2 * norm2(f.ha, 0, r));
  else
    g2 = norm2(b.dg, 0, I) * x2 + norm2(b.du, 0, I) * x2 + w2 * dy2 * h2;
  return {r32(sqrt_of(S(x2 + h2))), r32(sqrt_of(g2))};
}

/// The router linear's logits z = x W_r^T + b, or the given ones; then the
/// routing weights of the selected experts, or the given ones.
template <class S>
void logits_and_weights(const LayerData<S>& d, LayerResult<S>& out) {
  const std::size_t T = d.T, H = d.H, K = d.K, R = d.R;
  if (d.router && !d.z_given.empty()) {
    out.z = d.z_given;
  } else if (d.router) {
    out.z.assign(T * R, S(0));
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t e = 0; e < R; ++e)
        out.z[t * R + e] = kdot<S>(
            H + 1, [&](std::size_t h) { return h < H ? d.x[t * H + h] : S(1); },
            [&](std::size_t h) { return h < H ? d.wr[e * H + h] : d.b[e]; }, H + 1);
  }  // else the experts op: the caller's weights, no logits
  out.w.assign(T * K, S(0));
  if (!d.w_given.empty()) {
    out.w = d.w_given;
    return;
  }
  for (std::size_t t = 0; t < T; ++t) {
    const std::size_t v = valid_prefix(&d.idx[t * K], K);
    const auto w = router_weights(d, &out.z[t * R], &d.idx[t * K], v);
    for (std::size_t j = 0; j < K; ++j) out.w[t * K + j] = w[j];
  }
}

/// y_t = sum_j w_j o_j in fp32 over the K slots; the expert path's dx_t =
/// sum_j dxr_j, also over the slots in order.
template <class S>
void combine(const LayerData<S>& d, std::size_t t, const std::vector<PairForward<S>>& f,
             const std::vector<PairBackward<S>>& b, LayerResult<S>& out, std::vector<S>& dxe) {
  const std::size_t H = d.H, K = d.K, v = f.size();
  for (std::size_t m = 0; m < H; ++m)
    out.y[t * H + m] = kdot<S>(
        v, [&](std::size_t j) { return out.w[t * K + j]; },
        [&](std::size_t j) { return f[j].o[m]; }, K);
  if (!b.empty())
    for (std::size_t m = 0; m < H; ++m)
      dxe[t * H + m] = kdot<S>(
          v, [&](std::size_t) { return S(1); }, [&](std::size_t j) { return b[j].dxr[m]; }, K);
}

/// Tokens per block of the reference: a block's pairs are held at once.
inline constexpr std::size_t kTokenBlock = 64;

/// body(i) for every i in [i0, i1): in parallel on the caller's oneTBB
/// arena for the machine scalars (double, Tracked), in order for the
/// multiprecision one. Each body writes only its own index's outputs.
template <class S, class F>
void for_each_index(std::size_t i0, std::size_t i1, F body) {
  if constexpr (std::is_same_v<S, double> || std::is_same_v<S, bounds::Tracked>) {
    oneapi::tbb::parallel_for(i0, i1, moecert::detail::TbbBody(body));
  } else {
    for (std::size_t i = i0; i < i1; ++i) body(i);
  }
}

/// Token t's routed pairs: the forward of each, and with a backward the
/// head of each (dL/dw into out.dw), the expert path (into b) and the
/// pair's M_A, M_G.
template <class S>
struct TokenPairs {
  std::vector<PairForward<S>> f;
  std::vector<PairBackward<S>> b;  // the expert path's, one per f, or empty
};

template <class S>
TokenPairs<S> token_pairs(const LayerData<S>& d, std::size_t t, bool backward, Paths paths,
                          LayerResult<S>& out) {
  const std::size_t H = d.H, K = d.K, v = valid_prefix(&d.idx[t * K], K);
  const S s(d.scale);
  const S* x = &d.x[t * H];
  TokenPairs<S> p;
  for (std::size_t j = 0; j < v; ++j) {
    const std::size_t e = static_cast<std::size_t>(d.idx[t * K + j]);
    const ExpertView<S> w{d, e};
    p.f.push_back(pair_forward(w, x, s));
    if (!backward) continue;
    const S* dy = &d.dy[t * H];
    const S wt = out.w[t * K + j];
    PairBackward<S> pb = pair_backward_head(w, dy, s);
    if (paths.router) out.dw[t * K + j] = pair_dweight(p.f.back(), pb);
    if (!paths.expert) continue;
    pair_expert_backward(w, wt, s, p.f.back(), pb);
    std::tie(out.m_a[t * d.E + e], out.m_g[t * d.E + e]) = pair_stats(d, x, dy, wt, p.f.back(), pb);
    p.b.push_back(std::move(pb));
  }
  return p;
}

/// Expert e's terms of the weight gradients from a block of tokens starting
/// at t0, in token order (the sums of different experts are disjoint).
template <class S>
void add_expert_terms(const LayerData<S>& d, std::size_t t0,
                      const std::vector<TokenPairs<S>>& block, std::size_t e,
                      const LayerResult<S>& out, GradSums<S>& sums) {
  const std::size_t K = d.K;
  for (std::size_t i = 0; i < block.size(); ++i) {
    const std::size_t t = t0 + i;
    for (std::size_t j = 0; j < block[i].b.size(); ++j)
      if (static_cast<std::size_t>(d.idx[t * K + j]) == e)
        sums.add(t, e, out.w[t * K + j], &d.x[t * d.H], block[i].f[j], block[i].b[j]);
  }
}

}  // namespace layer_detail

/// dz_hook(t, dz_row) runs on each row's dz before the router linear's
/// gradients use it (the bound adds the router kernel's own rounding there).
template <class S, class DzHook>
LayerResult<S> layer_reference(const LayerData<S>& d, bool backward, Paths paths, DzHook dz_hook) {
  using namespace layer_detail;
  const std::size_t T = d.T, H = d.H, K = d.K, R = d.R;
  LayerResult<S> out;
  logits_and_weights(d, out);
  out.y.assign(T * H, S(0));
  std::optional<GradSums<S>> sums;
  if (backward) {
    out.dw.assign(T * K, S(0));
    out.m_a.assign(T * d.E, S(0));
    out.m_g.assign(T * d.E, S(0));
    out.dz.assign(T * R, S(0));
    out.dx.assign(T * H, S(0));
    out.dwr.assign(R * H, S(0));
    out.db.assign(R, S(0));
    sums.emplace(d, paths.base, out);
  }
  std::vector<S> dxe(T * H, S(0));  // expert path dx, slot sums
  for (std::size_t t0 = 0; t0 < T; t0 += kTokenBlock) {
    const std::size_t t1 = std::min(T, t0 + kTokenBlock);
    std::vector<TokenPairs<S>> block(t1 - t0);
    for_each_index<S>(t0, t1, [&](std::size_t t) {
      block[t - t0] = token_pairs(d, t, backward, paths, out);
      combine(d, t, block[t - t0].f, block[t - t0].b, out, dxe);
    });
    if (sums)
      for_each_index<S>(0, d.E,
                        [&](std::size_t e) { add_expert_terms(d, t0, block, e, out, *sums); });
  }
  if (!backward) return out;
  sums->finish();
  // Router path: dz, then the router linear's gradients and its share of dx.
  std::vector<S> dxr(T * H, S(0));
  if (paths.router && d.router) router_backward_reference(d, out, dxr, dz_hook);
  for (std::size_t i = 0; i < T * H; ++i) out.dx[i] = r32(dxe[i] + dxr[i]);
  return out;
}

}  // namespace moecert::ref
