// Clauses of layer.forward and layer.backward, and the bounded reference of a
// kernel run (proofs/layer.md).
#include "contracts/layer.hpp"

#include <array>
#include <cmath>

#include <oneapi/tbb/parallel_for.h>

#include "contracts/bounds/experts.hpp"
#include "contracts/bounds/router.hpp"
#include "contracts/checks.hpp"
#include "contracts/clauses.hpp"
#include "contracts/compare.hpp"
#include "ops/workspace/arena.hpp"

namespace moecert::contracts {

namespace k = clauses::layer;
using bounds::Tracked;

namespace {

std::size_t router_outs(const MoeConfig& cfg) { return static_cast<std::size_t>(workspace::router_outputs(cfg)); }

struct Dims {
  std::size_t E, H, I, K, r, R;
};
Dims dims(const MoeConfig& cfg) {
  return {static_cast<std::size_t>(cfg.experts), static_cast<std::size_t>(cfg.hidden), static_cast<std::size_t>(cfg.inter),
          static_cast<std::size_t>(cfg.topk),    static_cast<std::size_t>(cfg.lora_rank), router_outs(cfg)};
}

template <class T>
bool is(MatView<T> m, std::size_t rows, std::size_t cols) {
  return m.rows == rows && m.cols == cols && m.stride >= cols;
}

// The LoRA views with their expected shapes.
struct LoraShape {
  const char* name;
  std::size_t rows, cols;
};
std::array<LoraShape, 6> lora_shapes(const Dims& d) {
  return {{{"a_gate", d.E * d.r, d.H}, {"b_gate", d.E * d.I, d.r}, {"a_up", d.E * d.r, d.H},
           {"b_up", d.E * d.I, d.r}, {"a_down", d.E * d.r, d.I}, {"b_down", d.E * d.H, d.r}}};
}
std::array<MatView<const bf16>, 6> lora_views(const layer::Lora& l) {
  return {l.a_gate, l.b_gate, l.a_up, l.b_up, l.a_down, l.b_down};
}
// The weight gradients (LoRA's six, then the base weights' three) with
// their expected shapes.
constexpr std::size_t kWeightGrads = 9;
std::array<LoraShape, kWeightGrads> grad_shapes(const Dims& d) {
  const auto l = lora_shapes(d);
  return {{l[0], l[1], l[2], l[3], l[4], l[5], {"w_gate", d.E * d.I, d.H}, {"w_up", d.E * d.I, d.H}, {"w_down", d.E * d.H, d.I}}};
}
std::array<MatView<float>, kWeightGrads> weight_grads(const layer::Gradients& g) {
  return {g.a_gate, g.b_gate, g.a_up, g.b_up, g.a_down, g.b_down, g.w_gate, g.w_up, g.w_down};
}
bool wants_base(const layer::Gradients& g) { return !g.w_gate.empty() || !g.w_up.empty() || !g.w_down.empty(); }

bool same_config(const MoeConfig& a, const MoeConfig& b) {
  return a.experts == b.experts && a.hidden == b.hidden && a.inter == b.inter && a.topk == b.topk &&
         a.lora_rank == b.lora_rank && a.lora_alpha == b.lora_alpha && a.router == b.router &&
         a.renormalize == b.renormalize && a.groups == b.groups && a.topk_group == b.topk_group && a.scaling == b.scaling;
}

// Compares got[i] (stride-aware) with the bounded reference; fails `clause`
// at the worst element.
template <class Get>
bool within(detail::Checker& c, const ClauseInfo& clause, std::string_view name, std::size_t rows, std::size_t cols,
            Get got, const std::vector<Tracked>& ref) {
  std::vector<float> g(rows * cols);
  std::vector<double> v(rows * cols), b(rows * cols);
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < cols; ++j) {
      g[i * cols + j] = got(i, j);
      v[i * cols + j] = ref[i * cols + j].v;
      b[i * cols + j] = bounds::kReferenceSlack * ref[i * cols + j].e;
    }
  const auto cmp = compare::bounded(g, v, b);
  if (cmp.pass()) return true;
  c.fail(clause, fmt::format("{}[{}, {}]", name, cmp.worst / std::max<std::size_t>(cols, 1), cmp.worst % std::max<std::size_t>(cols, 1)),
         fmt::format("{}={:.9g} ref={:.17g} (utilisation {:.3g})", name, cmp.worst_got, cmp.worst_ref, cmp.max_utilization),
         fmt::format("|{} - ref| <= {:.6g} (proofs/layer.md)", name, cmp.worst_bound));
  return false;
}

// The router backward kernel's own rounding, given the g it was fed
// (proofs/router.md §4), per element of the row's dz.
std::vector<double> router_rounding(const ref::LayerData<Tracked>& d, const float* z, const std::int32_t* ir, std::size_t v,
                                    const float* g) {
  if (v == 0) return std::vector<double>(d.R, 0.0);
  switch (d.kind) {
    case RouterKind::sigmoid_topk: return bounds::sigmoid_topk_grad_row(z, d.R, ir, g, v, d.scaling);
    case RouterKind::softmax_topk: return bounds::softmax_topk_grad_row(z, d.R, ir, g, v, d.renormalize);
    case RouterKind::product_key: break;
  }
  const std::size_t n = d.R / 2;
  return bounds::product_key_grad_row(z, z + n, n, ir, g, v, router::KeyWeights::softmax);
}

}  // namespace

template <class S>
ref::LayerData<S> layer_data(const MoeConfig& cfg, const layer::Weights& w, MatView<const bf16> x, const float* dy,
                             const layer::Saved::Impl& s) {
  const Dims dm = dims(cfg);
  ref::LayerData<S> d;
  d.T = x.rows, d.H = dm.H, d.I = dm.I, d.E = dm.E, d.K = dm.K, d.r = dm.r, d.R = dm.R;
  d.kind = cfg.router, d.renormalize = cfg.renormalize, d.scaling = static_cast<double>(static_cast<float>(cfg.scaling));
  d.scale = dm.r ? static_cast<double>(static_cast<float>(cfg.lora_alpha / static_cast<double>(dm.r))) : 0.0;
  auto put = [](std::vector<S>& out, auto m) {
    out.resize(m.rows * m.cols);
    for (std::size_t i = 0; i < m.rows; ++i)
      for (std::size_t j = 0; j < m.cols; ++j) out[i * m.cols + j] = S(ref::widen(m(i, j)));
  };
  put(d.x, x);
  put(d.wr, w.router_w);
  d.b.resize(dm.R);
  for (std::size_t e = 0; e < dm.R; ++e) d.b[e] = S(double(w.router_b[e]));
  const auto& pe = *w.experts;
  d.wg.resize(dm.E * dm.I * dm.H), d.wu.resize(d.wg.size()), d.wd.resize(dm.E * dm.H * dm.I);
  for (std::size_t e = 0; e < dm.E; ++e) {
    for (std::size_t i = 0; i < dm.I; ++i)
      for (std::size_t h = 0; h < dm.H; ++h) {
        d.wg[(e * dm.I + i) * dm.H + h] = S(double(pe.gate(e, i, h).to_float()));
        d.wu[(e * dm.I + i) * dm.H + h] = S(double(pe.up(e, i, h).to_float()));
      }
    for (std::size_t h = 0; h < dm.H; ++h)
      for (std::size_t i = 0; i < dm.I; ++i) d.wd[(e * dm.H + h) * dm.I + i] = S(double(pe.down(e, h, i).to_float()));
  }
  if (dm.r) {
    put(d.ag, w.lora.a_gate), put(d.bg, w.lora.b_gate), put(d.au, w.lora.a_up);
    put(d.bu, w.lora.b_up), put(d.ad, w.lora.a_down), put(d.bd, w.lora.b_down);
  }
  d.idx.assign(s.idx, s.idx + d.T * d.K);
  d.z_given.resize(d.T * d.R), d.w_given.resize(d.T * d.K);
  for (std::size_t i = 0; i < d.T * d.R; ++i) d.z_given[i] = S(double(s.logits[i]));
  for (std::size_t i = 0; i < d.T * d.K; ++i) d.w_given[i] = S(double(s.weights[i]));
  if (dy) {
    d.dy.resize(d.T * d.H);
    for (std::size_t i = 0; i < d.T * d.H; ++i) d.dy[i] = S(double(dy[i]));
  }
  return d;
}

template ref::LayerData<double> layer_data<double>(const MoeConfig&, const layer::Weights&, MatView<const bf16>, const float*,
                                                   const layer::Saved::Impl&);
template ref::LayerData<Tracked> layer_data<Tracked>(const MoeConfig&, const layer::Weights&, MatView<const bf16>, const float*,
                                                     const layer::Saved::Impl&);

ref::LayerResult<Tracked> layer_bounds(const MoeConfig& cfg, const layer::Weights& w, MatView<const bf16> x, const float* dy,
                                       const layer::Saved::Impl& s, ref::Paths paths, const float* dw_kernel) {
  const auto d = layer_data<Tracked>(cfg, w, x, dy, s);
  return ref::layer_reference(d, dy != nullptr, paths, [&](std::size_t t, std::vector<Tracked>& dz) {
    if (!dw_kernel) return;
    const std::int32_t* ir = s.idx + t * d.K;
    const auto extra = router_rounding(d, s.logits + t * d.R, ir, ref::valid_prefix(ir, d.K), dw_kernel + t * d.K);
    for (std::size_t i = 0; i < d.R; ++i) dz[i].e += extra[i];
  });
}

void layer_forward_pre(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w, MatView<const bf16> x,
                       MatView<float> y) {
  const Dims d = dims(cfg);
  MOECERT_CONTRACT(c, k::kFwdShape) {
    std::string bad;
    if (!is(x, x.rows, d.H) || x.rows > static_cast<std::size_t>(cfg.max_tokens)) bad = fmt::format("x {}x{}", x.rows, x.cols);
    else if (!is(y, x.rows, d.H)) bad = fmt::format("y {}x{}", y.rows, y.cols);
    else if (!w.experts || w.experts->experts() != d.E || w.experts->hidden() != d.H || w.experts->inter() != d.I)
      bad = "packed experts of another shape";
    else if (!is(w.router_w, d.R, d.H)) bad = fmt::format("router_w {}x{}", w.router_w.rows, w.router_w.cols);
    else if (w.router_b.size != d.R) bad = fmt::format("router_b {}", w.router_b.size);
    else if (cfg.router == RouterKind::sigmoid_topk && w.router_bias.size != d.E) bad = fmt::format("router_bias {}", w.router_bias.size);
    else if (d.r)
      for (std::size_t i = 0; i < 6; ++i) {
        const auto sh = lora_shapes(d)[i];
        const auto v = lora_views(w.lora)[i];
        if (!is(v, sh.rows, sh.cols)) {
          bad = fmt::format("lora.{} {}x{}, expected {}x{}", sh.name, v.rows, v.cols, sh.rows, sh.cols);
          break;
        }
      }
    if (!bad.empty()) c.fail(k::kFwdShape, "", bad, fmt::format("the shapes of E={} H={} I={} K={} r={}, T <= {}", d.E, d.H, d.I, d.K, d.r, cfg.max_tokens));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kFwdXFinite) {
    detail::scan(c, k::kFwdXFinite, "x", x, [](bf16 v) { return v.is_finite() && detail::bf16_in_range(v); },
                 "finite, 0 or 2^-60 <= |x| <= 2^60") &&
        detail::scan_finite(c, k::kFwdXFinite, "router_w", w.router_w) &&
        detail::scan_finite(c, k::kFwdXFinite, "router_b", MatView<const float>(w.router_b.data, 1, w.router_b.size, w.router_b.size)) &&
        detail::scan_finite(c, k::kFwdXFinite, "router_bias", MatView<const float>(w.router_bias.data, 1, w.router_bias.size, w.router_bias.size));
  }
  MOECERT_CONTRACT(c, k::kFwdLoraFinite) {
    if (d.r)
      for (std::size_t i = 0; i < 6; ++i)
        if (!detail::scan(c, k::kFwdLoraFinite, fmt::format("lora.{}", lora_shapes(d)[i].name), lora_views(w.lora)[i],
                          [](bf16 v) { return v.is_finite() && detail::bf16_in_range(v); }, "finite, 0 or 2^-60 <= |a| <= 2^60"))
          break;
  }
  MOECERT_CONTRACT(c, k::kFwdScale) {
    if (d.r) {
      const float s = static_cast<float>(cfg.lora_alpha / static_cast<double>(d.r));
      if (!std::isfinite(s) || !(s > 0) || s < 0x1p-60f || s > 0x1p60f)
        c.fail(k::kFwdScale, "", fmt::format("s={} (alpha={}, r={})", s, cfg.lora_alpha, d.r), "finite, 2^-60 <= s <= 2^60");
    }
  }
  MOECERT_CONTRACT(c, k::kFwdNoAlias) {
    const ByteRange out = y.bytes();
    std::vector<std::pair<std::string, ByteRange>> in{{"x", x.bytes()}, {"router_w", w.router_w.bytes()},
                                                      {"router_b", w.router_b.bytes()}, {"router_bias", w.router_bias.bytes()}};
    for (std::size_t i = 0; i < 6 && d.r; ++i) in.emplace_back(fmt::format("lora.{}", lora_shapes(d)[i].name), lora_views(w.lora)[i].bytes());
    for (const auto& [name, r] : in)
      if (overlaps(out, r)) {
        c.fail(k::kFwdNoAlias, fmt::format("y and {}", name), "overlapping", "disjoint");
        break;
      }
  }
}

void layer_lora_padding(detail::Checker& c, const experts::PackedLora& l) {
  MOECERT_CONTRACT(c, k::kFwdLoraPadding) {
    for (std::size_t e = 0; e < l.experts.size(); ++e) {
      const auto& p = l.experts[e];
      const std::pair<const char*, const gemm::PackedWeights*> all[] = {
          {"a_gu", &p.a_gu}, {"b_gu", &p.b_gu}, {"a_d", &p.a_d}, {"b_d", &p.b_d}, {"b_d_t", &p.b_d_t}, {"a_d_t", &p.a_d_t}, {"b_gu_t", &p.b_gu_t}, {"a_gu_t", &p.a_gu_t}};
      for (const auto& [name, w] : all) {
        if (!w->data()) continue;
        for (std::size_t n = 0; n < w->np(); ++n)
          for (std::size_t kk = n < w->n() ? w->k() : 0; kk < w->kp(); ++kk)
            if (w->at(n, kk).bits & 0x7fff) {
              c.fail(k::kFwdLoraPadding, fmt::format("expert {} {} ({}, {})", e, name, n, kk),
                     fmt::format("{}", w->at(n, kk).to_float()), "0 (rank padding)");
              return;
            }
      }
    }
  }
}

void layer_forward_post(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w, MatView<const bf16> x,
                        MatView<const float> y, const layer::Saved::Impl& s) {
  MOECERT_CONTRACT(c, k::kFwdYFinite) { detail::scan_finite(c, k::kFwdYFinite, "y", y); }
  MOECERT_CONTRACT(c, k::kFwdWithin) {
    const Dims d = dims(cfg);
    // z: an fp32 sum of H + 1 terms (proofs/bounds.md §1).
    std::vector<Tracked> zr(x.rows * d.R);
    for (std::size_t t = 0; t < x.rows; ++t)
      for (std::size_t e = 0; e < d.R; ++e) {
        double v = w.router_b[e], mag = std::fabs(w.router_b[e]);
        for (std::size_t h = 0; h < d.H; ++h) {
          const double p = double(x(t, h).to_float()) * w.router_w(e, h);
          v += p, mag += std::fabs(p);
        }
        zr[t * d.R + e] = {v, bounds::dot(d.H + 1, mag)};
      }
    if (!within(c, k::kFwdWithin, "z", x.rows, d.R, [&](std::size_t t, std::size_t e) { return s.logits[t * d.R + e]; }, zr)) return;
    const auto ref = layer_bounds(cfg, w, x, nullptr, s, {}, nullptr);
    within(c, k::kFwdWithin, "y", x.rows, d.H, [&](std::size_t t, std::size_t m) { return y(t, m); }, ref.y);
  }
}

void layer_backward_pre(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w, MatView<const bf16> x,
                        MatView<const float> dy, const layer::Saved& saved, const layer::Gradients& g) {
  const Dims d = dims(cfg);
  const auto& s = saved.impl();
  MOECERT_CONTRACT(c, k::kBwdState) {
    if (!s.valid) c.fail(k::kBwdState, "", "no forward saved", "a training forward first");
    else if (!s.training) c.fail(k::kBwdState, "", "forward ran with training = false", "a training forward");
    else if (!same_config(s.cfg, cfg)) c.fail(k::kBwdState, "", "saved by a forward of another config", "the same config");
    else if (s.tokens != x.rows) c.fail(k::kBwdState, "", fmt::format("saved T={}, x has {}", s.tokens, x.rows), "the same T");
    else if (!w.experts || !w.experts->has_backward()) c.fail(k::kBwdState, "", "experts packed without backward", "pack(..., backward = true)");
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kBwdShape) {
    std::string bad;
    const std::size_t T = x.rows;
    if (!is(x, T, d.H)) bad = fmt::format("x {}x{}", x.rows, x.cols);
    else if (!is(dy, T, d.H)) bad = fmt::format("dy {}x{}", dy.rows, dy.cols);
    else if (!g.dx.empty() && !is(g.dx, T, d.H)) bad = fmt::format("dx {}x{}", g.dx.rows, g.dx.cols);
    else if (!g.router_w.empty() && !is(g.router_w, d.R, d.H)) bad = fmt::format("router_w grad {}x{}", g.router_w.rows, g.router_w.cols);
    else if (!g.router_b.empty() && g.router_b.size != d.R) bad = fmt::format("router_b grad {}", g.router_b.size);
    else if (!g.m_a.empty() && !is(g.m_a, T, d.E)) bad = fmt::format("m_a {}x{}", g.m_a.rows, g.m_a.cols);
    else if (!g.m_g.empty() && !is(g.m_g, T, d.E)) bad = fmt::format("m_g {}x{}", g.m_g.rows, g.m_g.cols);
    else
      for (std::size_t i = 0; i < kWeightGrads; ++i) {
        const auto v = weight_grads(g)[i];
        const auto sh = grad_shapes(d)[i];
        if (!v.empty() && !is(v, sh.rows, sh.cols)) {
          bad = fmt::format("{} grad {}x{}, expected {}x{}", sh.name, v.rows, v.cols, sh.rows, sh.cols);
          break;
        }
      }
    if (!bad.empty()) c.fail(k::kBwdShape, "", bad, "the config's shapes");
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kBwdDyFinite) { detail::scan_finite(c, k::kBwdDyFinite, "dy", dy); }
  MOECERT_CONTRACT(c, k::kBwdNoAlias) {
    std::vector<std::pair<std::string, ByteRange>> outs{{"dx", g.dx.bytes()}, {"router_w grad", g.router_w.bytes()},
                                                        {"router_b grad", g.router_b.bytes()}, {"m_a", g.m_a.bytes()},
                                                        {"m_g", g.m_g.bytes()}};
    for (std::size_t i = 0; i < kWeightGrads; ++i) outs.emplace_back(fmt::format("{} grad", grad_shapes(d)[i].name), weight_grads(g)[i].bytes());
    std::vector<std::pair<std::string, ByteRange>> ins{{"x", x.bytes()}, {"dy", dy.bytes()}, {"router_w", w.router_w.bytes()},
                                                       {"router_b", w.router_b.bytes()}, {"saved workspace", s.arena.bytes()}};
    for (std::size_t i = 0; i < 6 && d.r; ++i) ins.emplace_back(fmt::format("lora.{}", lora_shapes(d)[i].name), lora_views(w.lora)[i].bytes());
    for (std::size_t i = 0; i < outs.size(); ++i) {
      if (outs[i].second.empty()) continue;
      for (std::size_t j = i + 1; j < outs.size(); ++j)
        if (overlaps(outs[i].second, outs[j].second)) {
          c.fail(k::kBwdNoAlias, fmt::format("{} and {}", outs[i].first, outs[j].first), "overlapping", "disjoint");
          return;
        }
      for (const auto& [name, r] : ins)
        if (overlaps(outs[i].second, r)) {
          c.fail(k::kBwdNoAlias, fmt::format("{} and {}", outs[i].first, name), "overlapping", "disjoint");
          return;
        }
    }
  }
}

void layer_backward_saved(detail::Checker& c, const MoeConfig& cfg, MatView<const bf16> x, const layer::Saved& saved) {
  const Dims d = dims(cfg);
  const auto& s = saved.impl();
  MOECERT_CONTRACT(c, k::kBwdSavedFinite) {
    // The saved activations the backward reads, at the elements it reads
    // (a NaN here: read before write, or a co-live buffer overwrote it).
    const auto& st = s.st;
    const auto& gr = st.grouping;
    auto fail = [&](const char* buffer, std::size_t row, std::size_t col, float v) {
      c.fail(k::kBwdSavedFinite, fmt::format("{} row {} col {}", buffer, row, col), fmt::format("{}", v),
             "finite (saved by the forward)");
    };
    for (std::size_t i = 0; i < x.rows * d.R; ++i)
      if (!std::isfinite(s.logits[i])) return fail("router.logits", i / d.R, i % d.R, s.logits[i]);
    for (std::size_t i = 0; i < x.rows * d.K; ++i)
      if (!std::isfinite(s.weights[i])) return fail("router.weights", i / d.K, i % d.K, s.weights[i]);
    for (std::size_t row = 0; row < gr.rows(); ++row) {
      if (gr.row_slot[row] < 0) continue;
      for (std::size_t i = 0; i < d.I; ++i) {
        const std::size_t at = 2 * gemm::kPanel * (i / gemm::kPanel) + i % gemm::kPanel;
        for (const std::size_t col : {at, at + gemm::kPanel})
          if (!std::isfinite(st.c1[row * st.ldc1 + col])) return fail("experts.c1", row, col, st.c1[row * st.ldc1 + col]);
        if (!std::isfinite(st.h_at(row, i).to_float())) return fail("experts.h", row, i, st.h_at(row, i).to_float());
      }
      for (std::size_t kk = 0; kk < 2 * d.r; ++kk)
        if (!std::isfinite(st.xa[row * 2 * d.r + kk])) return fail("lora.xa", row, kk, st.xa[row * 2 * d.r + kk]);
      for (std::size_t kk = 0; kk < d.r; ++kk)
        if (!std::isfinite(st.ha[row * d.r + kk])) return fail("lora.ha", row, kk, st.ha[row * d.r + kk]);
    }
  }
}

void layer_backward_post(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w, MatView<const bf16> x,
                         MatView<const float> dy, const layer::Saved& saved, const layer::Gradients& g,
                         const layer::BackwardOptions& opt) {
  const Dims d = dims(cfg);
  const auto& s = saved.impl();
  const float* dw = s.arena.plan().find("router.dw") ? s.arena.get<float>("router.dw", x.rows * d.K) : nullptr;
  MOECERT_CONTRACT(c, k::kBwdGradFinite) {
    bool ok = detail::scan_finite(c, k::kBwdGradFinite, "dx", MatView<const float>(g.dx)) &&
              detail::scan_finite(c, k::kBwdGradFinite, "router_w grad", MatView<const float>(g.router_w)) &&
              detail::scan_finite(c, k::kBwdGradFinite, "router_b grad", MatView<const float>(g.router_b.data, 1, g.router_b.size, g.router_b.size));
    for (std::size_t i = 0; i < kWeightGrads && ok; ++i)
      ok = detail::scan_finite(c, k::kBwdGradFinite, fmt::format("{} grad", grad_shapes(d)[i].name), MatView<const float>(weight_grads(g)[i]));
  }
  MOECERT_CONTRACT(c, k::kBwdEmptyZero) {
    const auto& gr = s.st.grouping;
    for (std::size_t e = 0; e < d.E; ++e) {
      if (gr.count[e]) continue;
      for (std::size_t i = 0; i < kWeightGrads; ++i) {
        const auto v = weight_grads(g)[i];
        if (v.empty() || v.rows < d.E) continue;
        const std::size_t per = v.rows / d.E;
        for (std::size_t row = e * per; row < (e + 1) * per; ++row)
          for (std::size_t col = 0; col < v.cols; ++col)
            if (v(row, col) != 0.0f) {
              c.fail(k::kBwdEmptyZero, fmt::format("expert {} {} grad ({}, {})", e, grad_shapes(d)[i].name, row, col),
                     fmt::format("{}", v(row, col)), "exactly 0 (the expert has no token)");
              return;
            }
      }
    }
  }
  MOECERT_CONTRACT(c, k::kBwdRouterMasked) {
    for (std::size_t i = 0; dw && i < x.rows * d.K; ++i)
      if (s.idx[i] < 0 && dw[i] != 0.0f) {
        c.fail(k::kBwdRouterMasked, fmt::format("t={} j={} (idx -1)", i / d.K, i % d.K), fmt::format("dL/dw={}", dw[i]), "exactly 0");
        break;
      }
  }
  MOECERT_CONTRACT(c, k::kBwdWithin) {
    static const float no_tokens = 0;  // T = 0: dy may be null, the backward still runs
    const auto ref = layer_bounds(cfg, w, x, dy.data ? dy.data : &no_tokens, s,
                                  {opt.expert_path, opt.router_path, opt.expert_path && wants_base(g)}, dw);
    auto mat = [&](MatView<float> m) { return [m](std::size_t i, std::size_t j) { return m(i, j); }; };
    if (opt.router_path && !within(c, k::kBwdWithin, "dL/dw", x.rows, d.K, [&](std::size_t t, std::size_t j) { return dw[t * d.K + j]; }, ref.dw)) return;
    if (!g.dx.empty() && !within(c, k::kBwdWithin, "dx", x.rows, d.H, mat(g.dx), ref.dx)) return;
    if (!g.router_w.empty() && !within(c, k::kBwdWithin, "router_w grad", d.R, d.H, mat(g.router_w), ref.dwr)) return;
    if (!g.router_b.empty() &&
        !within(c, k::kBwdWithin, "router_b grad", 1, d.R, [&](std::size_t, std::size_t e) { return g.router_b[e]; }, ref.db))
      return;
    // Without the expert path the reference's weight gradients are all 0
    // (base ones not even formed): compare with zeros of the right size.
    const std::vector<Tracked>* refs[] = {&ref.dag, &ref.dbg, &ref.dau, &ref.dbu, &ref.dad, &ref.dbd, &ref.dwg, &ref.dwu, &ref.dwd};
    for (std::size_t i = 0; i < kWeightGrads; ++i) {
      const auto v = weight_grads(g)[i];
      if (v.empty() || v.rows == 0) continue;
      std::vector<Tracked> zeros;
      const std::vector<Tracked>* want = refs[i];
      if (want->size() != v.rows * v.cols) want = &(zeros = std::vector<Tracked>(v.rows * v.cols, Tracked{0, 0}));
      if (!within(c, k::kBwdWithin, fmt::format("{} grad", grad_shapes(d)[i].name), v.rows, v.cols, mat(v), *want)) return;
    }
  }
}

}  // namespace moecert::contracts
