// One routed pair (t, e) of the layer reference (contracts/reference/layer.hpp):
// the expert's forward and backward in the kernel's rounding structure, and
// the sums over an expert's rows that make the weight gradients. Written
// once over the scalar S, as layer.hpp.
#pragma once

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "contracts/numeric/tracked.hpp"
#include "contracts/reference/router.hpp"

namespace moecert::ref {

template <class S>
struct LayerData;
template <class S>
struct LayerResult;

namespace layer_detail {

/// n padded to the kernels' K step (32).
inline std::size_t kpad(std::size_t n) { return (n + 31) / 32 * 32; }

/// Expert e's base weights and LoRA factors by (row, column).
template <class S>
struct ExpertView {
  const LayerData<S>& d;
  std::size_t e;
  S wg(std::size_t i, std::size_t h) const { return d.wg[(e * d.I + i) * d.H + h]; }
  S wu(std::size_t i, std::size_t h) const { return d.wu[(e * d.I + i) * d.H + h]; }
  S wd(std::size_t m, std::size_t i) const { return d.wd[(e * d.H + m) * d.I + i]; }
  S ag(std::size_t k, std::size_t h) const { return d.ag[(e * d.r + k) * d.H + h]; }
  S au(std::size_t k, std::size_t h) const { return d.au[(e * d.r + k) * d.H + h]; }
  S bg(std::size_t i, std::size_t k) const { return d.bg[(e * d.I + i) * d.r + k]; }
  S bu(std::size_t i, std::size_t k) const { return d.bu[(e * d.I + i) * d.r + k]; }
  S ad(std::size_t k, std::size_t i) const { return d.ad[(e * d.r + k) * d.I + i]; }
  S bd(std::size_t m, std::size_t k) const { return d.bd[(e * d.H + m) * d.r + k]; }
};

/// The forward of one routed pair: xa = x [A_g; A_u]^T, lb = bf16(s xa),
/// g and u (base + LoRA in one sum), h = bf16(silu(g) u), ha = h A_d^T,
/// lbd = bf16(s ha), o = h W_d^T + lbd B_d^T.
template <class S>
struct PairForward {
  std::vector<S> xa, lb, g, u, sg, silu, h, ha, lbd, o;
};

template <class S>
PairForward<S> pair_forward(const ExpertView<S>& w, const S* x, const S& s) {
  const std::size_t H = w.d.H, I = w.d.I, r = w.d.r;
  PairForward<S> f{std::vector<S>(2 * r), std::vector<S>(2 * r), std::vector<S>(I),
                   std::vector<S>(I),     std::vector<S>(I),     std::vector<S>(I),
                   std::vector<S>(I),     std::vector<S>(r),     std::vector<S>(r),
                   std::vector<S>(H)};
  for (std::size_t k = 0; k < 2 * r; ++k) {
    f.xa[k] = kdot<S>(
        H, [&](std::size_t q) { return x[q]; },
        [&](std::size_t q) { return k < r ? w.ag(k, q) : w.au(k - r, q); }, kpad(H));
    f.lb[k] = rbf16(r32(s * f.xa[k]));
  }
  const std::size_t n1 = kpad(H) + (r ? kpad(2 * r) : 0);
  for (std::size_t i = 0; i < I; ++i) {
    auto a = [&](std::size_t q) { return q < H ? x[q] : f.lb[q - H]; };
    f.g[i] = kdot<S>(
        H + 2 * r, a,
        [&](std::size_t q) { return q < H ? w.wg(i, q) : (q - H < r ? w.bg(i, q - H) : S(0)); },
        n1);
    f.u[i] = kdot<S>(
        H + 2 * r, a,
        [&](std::size_t q) {
          return q < H ? w.wu(i, q) : (q - H >= r ? w.bu(i, q - H - r) : S(0));
        },
        n1);
    f.sg[i] = sig(f.g[i]);
    f.silu[i] = r32(f.g[i] * f.sg[i]);
    f.h[i] = rbf16(r32(f.silu[i] * f.u[i]));
  }
  for (std::size_t k = 0; k < r; ++k) {
    f.ha[k] = kdot<S>(
        I, [&](std::size_t q) { return f.h[q]; }, [&](std::size_t q) { return w.ad(k, q); },
        kpad(I));
    f.lbd[k] = rbf16(r32(s * f.ha[k]));
  }
  for (std::size_t m = 0; m < H; ++m)
    f.o[m] = kdot<S>(
        I + r, [&](std::size_t q) { return q < I ? f.h[q] : f.lbd[q - I]; },
        [&](std::size_t q) { return q < I ? w.wd(m, q) : w.bd(m, q - I); },
        kpad(I) + (r ? kpad(r) : 0));
  return f;
}

/// The backward of one routed pair. Both paths: dyb16 = bf16(dy), dhb =
/// dyb16 W_d, dyb = dyb16 B_d, qd = bf16(s dyb). The expert path (after
/// pair_expert_backward): dh, dg, du, dgb = [dg B_g, du B_u], qgu =
/// bf16(s dgb), dxr = the pair's share of dx.
template <class S>
struct PairBackward {
  std::vector<S> dyb16, dhb, dyb, qd, dg, du, dgb, qgu, dxr;
};

template <class S>
PairBackward<S> pair_backward_head(const ExpertView<S>& w, const S* dy, const S& s) {
  const std::size_t H = w.d.H, I = w.d.I, r = w.d.r;
  PairBackward<S> b;
  b.dyb16.resize(H), b.dhb.resize(I), b.dyb.resize(r), b.qd.resize(r);
  for (std::size_t m = 0; m < H; ++m) b.dyb16[m] = rbf16(dy[m]);
  for (std::size_t i = 0; i < I; ++i)
    b.dhb[i] = kdot<S>(
        H, [&](std::size_t q) { return b.dyb16[q]; }, [&](std::size_t q) { return w.wd(q, i); },
        kpad(H));
  for (std::size_t k = 0; k < r; ++k) {
    b.dyb[k] = kdot<S>(
        H, [&](std::size_t q) { return b.dyb16[q]; }, [&](std::size_t q) { return w.bd(q, k); },
        kpad(H));
    b.qd[k] = rbf16(r32(s * b.dyb[k]));
  }
  return b;
}

/// The router path's dL/dw = <dy, o>, as <dy W_d, h> + <dy B_d, lbd> in
/// binary64, rounded once to fp32.
template <class S>
S pair_dweight(const PairForward<S>& f, const PairBackward<S>& b) {
  S dw = 0;
  double mag = 0;
  for (std::size_t i = 0; i < f.h.size(); ++i)
    dw += b.dhb[i] * f.h[i], mag += to_double_abs(b.dhb[i]) * to_double_abs(f.h[i]);
  for (std::size_t k = 0; k < f.lbd.size(); ++k)
    dw += b.dyb[k] * f.lbd[k], mag += to_double_abs(b.dyb[k]) * to_double_abs(f.lbd[k]);
  return r64to32(dw, mag, f.h.size() + f.lbd.size());
}

/// The expert path of one pair with routing weight wt: dh = dyb16 W_d +
/// qd A_d, the SwiGLU backward to dg and du (bf16), dgb, qgu, and dxr =
/// [dg, du, qgu] [W_g; W_u; A_g; A_u].
template <class S>
void pair_expert_backward(const ExpertView<S>& w, const S& wt, const S& s, const PairForward<S>& f,
                          PairBackward<S>& b) {
  const std::size_t H = w.d.H, I = w.d.I, r = w.d.r;
  b.dg.resize(I), b.du.resize(I), b.dgb.resize(2 * r), b.qgu.resize(2 * r), b.dxr.resize(H);
  for (std::size_t i = 0; i < I; ++i) {
    const S dh = kdot<S>(
        H + r, [&](std::size_t q) { return q < H ? b.dyb16[q] : b.qd[q - H]; },
        [&](std::size_t q) { return q < H ? w.wd(q, i) : w.ad(q - H, i); },
        kpad(H) + (r ? kpad(r) : 0));
    const S dhv = r32(wt * dh);
    const S dsilu = r32(f.sg[i] * r32(S(1) + r32(f.g[i] * r32(S(1) - f.sg[i]))));
    b.dg[i] = rbf16(r32(r32(dhv * f.u[i]) * dsilu));
    b.du[i] = rbf16(r32(dhv * f.silu[i]));
  }
  for (std::size_t k = 0; k < 2 * r; ++k) {
    b.dgb[k] = kdot<S>(
        I, [&](std::size_t q) { return k < r ? b.dg[q] : b.du[q]; },
        [&](std::size_t q) { return k < r ? w.bg(q, k) : w.bu(q, k - r); }, kpad(2 * I));
    b.qgu[k] = rbf16(r32(s * b.dgb[k]));
  }
  for (std::size_t m = 0; m < H; ++m)
    b.dxr[m] = kdot<S>(
        2 * I + 2 * r,
        [&](std::size_t q) { return q < I       ? b.dg[q]
                                    : q < 2 * I ? b.du[q - I]
                                                : b.qgu[q - 2 * I]; },
        [&](std::size_t q) {
          return q < I           ? w.wg(q, m)
                 : q < 2 * I     ? w.wu(q - I, m)
                 : q - 2 * I < r ? w.ag(q - 2 * I, m)
                                 : w.au(q - 2 * I - r, m);
        },
        kpad(2 * I) + (r ? kpad(2 * r) : 0));
}

/// The weight gradients: sums over each expert's rows, one term per routed
/// pair in token order. The kernel's sums are fp32 in its own order; with
/// S = Tracked their rounding is added in finish() from the terms'
/// magnitudes and the row counts (proofs/layer.md §3; the base weights'
/// GEMMs with the padded row count and flushed inputs apart, Lemma 1').
template <class S>
class GradSums {
 public:
  GradSums(const LayerData<S>& d, bool base, LayerResult<S>& out) : d_(d), base_(base), out_(out) {
    const std::size_t E = d.E, H = d.H, I = d.I, r = d.r;
    rows_of_.assign(E, 0);
    for (auto* g : {&out.dag, &out.dau}) g->assign(E * r * H, S(0));
    for (auto* g : {&out.dbg, &out.dbu}) g->assign(E * I * r, S(0));
    out.dad.assign(E * r * I, S(0));
    out.dbd.assign(E * H * r, S(0));
    if (base) {
      for (auto* g : {&out.dwg, &out.dwu}) g->assign(E * I * H, S(0));
      out.dwd.assign(E * H * I, S(0));
    }
    if constexpr (kTracked) {
      mag_ag.assign(E * r * H, 0), mag_au.assign(E * r * H, 0);
      mag_bg.assign(E * I * r, 0), mag_bu.assign(E * I * r, 0);
      mag_ad.assign(E * r * I, 0), mag_bd.assign(E * H * r, 0);
      if (base) {
        for (auto* v : {&mag_wg, &mag_wu, &fl_wg, &fl_wu}) v->assign(E * I * H, 0);
        for (auto* v : {&mag_wd, &fl_wd}) v->assign(E * H * I, 0);
      }
    }
  }

  /// Pair (t, e) with weight wt: the LoRA terms and, with base, the base
  /// weights' terms.
  void add(std::size_t t, std::size_t e, const S& wt, const S* x, const PairForward<S>& f,
           const PairBackward<S>& b) {
    ++rows_of_[e];
    add_lora(t, e, wt, x, f, b);
    if (base_) add_base(t, e, wt, x, f, b);
  }

  /// The bounds of the sums (Tracked), then the LoRA gradients times s.
  void finish() {
    if constexpr (kTracked) {
      const std::pair<std::vector<S>*, std::vector<double>*> lora[] = {
          {&out_.dag, &mag_ag}, {&out_.dbg, &mag_bg}, {&out_.dau, &mag_au},
          {&out_.dbu, &mag_bu}, {&out_.dad, &mag_ad}, {&out_.dbd, &mag_bd}};
      for (const auto& [g, mag] : lora)
        for (std::size_t i = 0; i < g->size(); ++i)
          (*g)[i].e += bounds::dot(rows_of_[expert_of(*g, i)], (*mag)[i]);
      const std::tuple<std::vector<S>*, std::vector<double>*, std::vector<double>*> base[] = {
          {&out_.dwg, &mag_wg, &fl_wg}, {&out_.dwu, &mag_wu, &fl_wu}, {&out_.dwd, &mag_wd, &fl_wd}};
      for (const auto& [g, mag, fl] : base)
        for (std::size_t i = 0; i < g->size(); ++i)
          (*g)[i].e += bounds::dot(kpad(rows_of_[expert_of(*g, i)]), (*mag)[i], (*fl)[i]);
    }
    const S s(d_.scale);
    for (auto* g : {&out_.dag, &out_.dbg, &out_.dau, &out_.dbu, &out_.dad, &out_.dbd})
      for (auto& v : *g) v = r32(s * v);
  }

 private:
  static constexpr bool kTracked = std::is_same_v<S, bounds::Tracked>;

  std::size_t expert_of(const std::vector<S>& g, std::size_t i) const {
    return i / (g.size() / std::max<std::size_t>(d_.E, 1));
  }
  static void acc(std::vector<S>& g, std::vector<double>& mag, std::size_t i, const S& term) {
    g[i] += term;
    if constexpr (kTracked) mag[i] += term.mag();
  }
  // A GEMM term a * b, with a product of an input the tile unit may flush
  // (a possible denormal) also counted apart (Lemma 1').
  static void acc_flushed(std::vector<S>& g, std::vector<double>& mag, std::vector<double>& fl,
                          std::size_t i, const S& a, const S& b) {
    const S term = a * b;
    g[i] += term;
    if constexpr (kTracked) {
      mag[i] += term.mag();
      if (may_flush(a) || may_flush(b)) fl[i] += term.mag();
    }
  }

  void add_lora(std::size_t t, std::size_t e, const S& wt, const S* x, const PairForward<S>& f,
                const PairBackward<S>& b) {
    const std::size_t H = d_.H, I = d_.I, r = d_.r;
    const S* dy = &d_.dy[t * H];
    for (std::size_t k = 0; k < r; ++k) {
      for (std::size_t m = 0; m < H; ++m)
        acc(out_.dbd, mag_bd, (e * H + m) * r + k, r32(wt * dy[m]) * f.ha[k]);
      for (std::size_t i = 0; i < I; ++i)
        acc(out_.dad, mag_ad, (e * r + k) * I + i, r32(wt * b.dyb[k]) * f.h[i]);
      for (std::size_t i = 0; i < I; ++i) {
        acc(out_.dbg, mag_bg, (e * I + i) * r + k, b.dg[i] * f.xa[k]);
        acc(out_.dbu, mag_bu, (e * I + i) * r + k, b.du[i] * f.xa[r + k]);
      }
      for (std::size_t q = 0; q < H; ++q) {
        acc(out_.dag, mag_ag, (e * r + k) * H + q, b.dgb[k] * x[q]);
        acc(out_.dau, mag_au, (e * r + k) * H + q, b.dgb[r + k] * x[q]);
      }
    }
  }

  void add_base(std::size_t t, std::size_t e, const S& wt, const S* x, const PairForward<S>& f,
                const PairBackward<S>& b) {
    const std::size_t H = d_.H, I = d_.I;
    std::vector<S> wdy(H);
    for (std::size_t m = 0; m < H; ++m) wdy[m] = rbf16(r32(wt * d_.dy[t * H + m]));
    for (std::size_t i = 0; i < I; ++i) {
      for (std::size_t q = 0; q < H; ++q) {
        acc_flushed(out_.dwg, mag_wg, fl_wg, (e * I + i) * H + q, b.dg[i], x[q]);
        acc_flushed(out_.dwu, mag_wu, fl_wu, (e * I + i) * H + q, b.du[i], x[q]);
      }
      for (std::size_t m = 0; m < H; ++m)
        acc_flushed(out_.dwd, mag_wd, fl_wd, (e * H + m) * I + i, wdy[m], f.h[i]);
    }
  }

  const LayerData<S>& d_;
  bool base_;
  LayerResult<S>& out_;
  std::vector<std::size_t> rows_of_;
  std::vector<double> mag_ag, mag_bg, mag_au, mag_bu, mag_ad, mag_bd, mag_wg, mag_wu, mag_wd, fl_wg,
      fl_wu, fl_wd;
};

}  // namespace layer_detail
}  // namespace moecert::ref
