// Clauses of layer.forward and layer.backward, and the bounded reference of a
// kernel run (proofs/layer.md).
#include "contracts/layer/layer.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "contracts/bounds/experts.hpp"
#include "contracts/bounds/router.hpp"
#include "contracts/engine/checks.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/engine/compare.hpp"
#include "contracts/experts/backward_probe.hpp"
#include "contracts/experts/experts.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/layer/router_linear.hpp"
#include "contracts/router/kind.hpp"

namespace moecert::contracts {

namespace k = clauses::layer;
using bounds::Tracked;

namespace {

struct Dims {
  std::size_t E, H, I, K, r, R;
};
Dims dims(const MoeConfig& cfg) {
  return {static_cast<std::size_t>(cfg.experts),   static_cast<std::size_t>(cfg.hidden),
          static_cast<std::size_t>(cfg.inter),     static_cast<std::size_t>(cfg.topk),
          static_cast<std::size_t>(cfg.lora_rank), router_width(cfg)};
}

// The layer's gradients that its experts op forms (all but the router's).
experts::Gradients expert_gradients(const layer::Gradients& g) {
  return {.dx = g.dx,
          .dweights = {},
          .a_gate = g.a_gate,
          .b_gate = g.b_gate,
          .a_up = g.a_up,
          .b_up = g.b_up,
          .a_down = g.a_down,
          .b_down = g.b_down,
          .w_gate = g.w_gate,
          .w_up = g.w_up,
          .w_down = g.w_down,
          .m_a = g.m_a,
          .m_g = g.m_g};
}

bool wants_base(const layer::Gradients& g) {
  return !g.w_gate.empty() || !g.w_up.empty() || !g.w_down.empty();
}

bool same_config(const MoeConfig& a, const MoeConfig& b) {
  return a.experts == b.experts && a.hidden == b.hidden && a.inter == b.inter && a.topk == b.topk &&
         a.lora_rank == b.lora_rank && a.lora_alpha == b.lora_alpha && a.router == b.router &&
         a.renormalize == b.renormalize && a.groups == b.groups && a.topk_group == b.topk_group &&
         a.scaling == b.scaling;
}

// The LoRA factors (when r > 0) as named inputs of a no_alias clause.
void add_lora_inputs(std::vector<std::pair<std::string, ByteRange>>& in, const Dims& d,
                     const layer::Weights& w) {
  for (std::size_t i = 0; i < 6 && d.r; ++i)
    in.emplace_back(fmt::format("lora.{}", lora_shapes(d.E, d.H, d.I, d.r)[i].name),
                    lora_views(w.lora)[i].bytes());
}

// Compares got(i, j) with the bounded reference (proofs/layer.md).
template <class Get>
bool within(detail::Checker& c, const ClauseInfo& clause, std::string_view name, std::size_t rows,
            std::size_t cols, Get got, const std::vector<Tracked>& ref) {
  std::vector<float> g(rows * cols);
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < cols; ++j) g[i * cols + j] = got(i, j);
  return contracts::within(c, clause, name, cols, g, ref, "proofs/layer.md");
}

}  // namespace

void layer_forward_pre(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                       MatView<const bf16> x, MatView<float> y) {
  const Dims d = dims(cfg);
  MOECERT_CONTRACT(c, k::kFwdShape) {
    std::string bad;
    if (static_cast<std::size_t>(cfg.router) >= kRouterKinds)  // core.config.router_kind observed
      bad = fmt::format("router kind {}", static_cast<unsigned>(cfg.router));
    else if (!detail::has_shape(x, x.rows, d.H) ||
             x.rows > static_cast<std::size_t>(cfg.max_tokens))
      bad = fmt::format("x {}x{}", x.rows, x.cols);
    else if (!detail::has_shape(y, x.rows, d.H))
      bad = fmt::format("y {}x{}", y.rows, y.cols);
    else if (!w.experts || w.experts->experts() != d.E || w.experts->hidden() != d.H ||
             w.experts->inter() != d.I)
      bad = "packed experts of another shape";
    else if (!detail::has_shape(w.router_w, d.R, d.H))
      bad = fmt::format("router_w {}x{}", w.router_w.rows, w.router_w.cols);
    else if (w.router_b.size != d.R)
      bad = fmt::format("router_b {}", w.router_b.size);
    else if (router_kind(cfg.router).expert_bias && w.router_bias.size != d.E)
      bad = fmt::format("router_bias {}", w.router_bias.size);
    else if (d.r && (w.lora.rank != d.r || w.lora.alpha != cfg.lora_alpha))
      bad = fmt::format("lora r={} alpha={}, config r={} alpha={}", w.lora.rank, w.lora.alpha, d.r,
                        cfg.lora_alpha);
    else if (d.r)
      bad = lora_shape_error(w.lora, d.E, d.H, d.I);
    if (!bad.empty())
      c.fail(k::kFwdShape, "", bad,
             fmt::format("the shapes of E={} H={} I={} K={} r={}, T <= {}", d.E, d.H, d.I, d.K, d.r,
                         cfg.max_tokens));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kFwdXFinite) {
    detail::scan_finite(c, k::kFwdXFinite, "x", x) &&
        detail::scan_finite(c, k::kFwdXFinite, "router_w", w.router_w) &&
        detail::scan_finite(
            c, k::kFwdXFinite, "router_b",
            MatView<const float>(w.router_b.data, 1, w.router_b.size, w.router_b.size)) &&
        detail::scan_finite(
            c, k::kFwdXFinite, "router_bias",
            MatView<const float>(w.router_bias.data, 1, w.router_bias.size, w.router_bias.size));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kFwdXRange) { detail::scan_bf16_range(c, k::kFwdXRange, "x", x); }
  // lora_finite, lora_range: judged as the factors are packed (LoraFiniteScan).
  MOECERT_CONTRACT(c, k::kFwdScale) { lora_scale(c, k::kFwdScale, d.r, cfg.lora_alpha); }
  MOECERT_CONTRACT(c, k::kFwdNoAlias) {
    std::vector<std::pair<std::string, ByteRange>> in{{"x", x.bytes()},
                                                      {"router_w", w.router_w.bytes()},
                                                      {"router_b", w.router_b.bytes()},
                                                      {"router_bias", w.router_bias.bytes()}};
    add_lora_inputs(in, d, w);
    detail::no_overlap(c, k::kFwdNoAlias, {{"y", y.bytes()}}, in);
  }
}

void layer_forward_post(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                        MatView<const bf16> x, MatView<const float> y, const LayerSaved& s) {
  MOECERT_CONTRACT(c, k::kFwdYFinite) { detail::scan_finite(c, k::kFwdYFinite, "y", y); }
  // As experts.forward_train.probe (proofs/bounds.md §9.2).
  MOECERT_CONTRACT(c, k::kFwdProbe) {
    probe_expert_gemms(c, k::kFwdProbe, *w.experts, cfg.lora_rank ? &w.lora : nullptr, x,
                       s.train.topk, s.train.rows);
    const std::size_t R = dims(cfg).R;
    probe_router_logits(c, k::kFwdProbe, x, w.router_w, w.router_b, {s.logits, x.rows, R, R});
  }
  // Conditioned on the kernel's routing; inputs exact, no overflow; every z and y
  // within layer_bounds (Tracked through the kernel's rounding points); proofs/layer.md §1-2.
  MOECERT_CONTRACT(c, k::kFwdWithin) {
    const Dims d = dims(cfg);
    // z: an fp32 sum of H + 1 terms (proofs/bounds.md §1).
    const std::vector<Tracked> zr = router_logits_reference(x, w.router_w, w.router_b);
    if (!within(
            c, k::kFwdWithin, "z", x.rows, d.R,
            [&](std::size_t t, std::size_t e) { return s.logits[t * d.R + e]; }, zr))
      return;
    const auto ref = layer_bounds(cfg, w, x, std::nullopt, s, {}, nullptr);
    within(
        c, k::kFwdWithin, "y", x.rows, d.H, [&](std::size_t t, std::size_t m) { return y(t, m); },
        ref.y);
  }
}

namespace {

// layer.backward.state: what is wrong with the saved forward and what was
// expected, or nothing.
std::optional<std::pair<std::string, std::string>> saved_state_error(const MoeConfig& cfg,
                                                                     MatView<const bf16> x,
                                                                     const layer::Weights& w,
                                                                     const LayerSaved& s) {
  if (!s.train.valid) return {{"no forward saved", "a training forward first"}};
  if (!s.train.training) return {{"forward ran with training = false", "a training forward"}};
  if (!same_config(s.cfg, cfg))
    return {{"saved by a forward of another config", "the same config"}};
  if (s.train.tokens != x.rows)
    return {{fmt::format("saved T={}, x has {}", s.train.tokens, x.rows), "the same T"}};
  if (!w.experts || !w.experts->has_backward())
    return {{"experts packed without backward", "pack(..., backward = true)"}};
  return std::nullopt;
}

// layer.backward.shape: the first argument whose shape is not the config's,
// or "".
std::string backward_shape_error(const Dims& d, MatView<const bf16> x, MatView<const float> dy,
                                 const layer::Gradients& g) {
  const std::size_t T = x.rows;
  if (!detail::has_shape(x, T, d.H)) return fmt::format("x {}x{}", x.rows, x.cols);
  if (!detail::has_shape(dy, T, d.H)) return fmt::format("dy {}x{}", dy.rows, dy.cols);
  if (!g.dx.empty() && !detail::has_shape(g.dx, T, d.H))
    return fmt::format("dx {}x{}", g.dx.rows, g.dx.cols);
  if (!g.router_w.empty() && !detail::has_shape(g.router_w, d.R, d.H))
    return fmt::format("router_w grad {}x{}", g.router_w.rows, g.router_w.cols);
  if (!g.router_b.empty() && g.router_b.size != d.R)
    return fmt::format("router_b grad {}", g.router_b.size);
  if (!g.m_a.empty() && !detail::has_shape(g.m_a, T, d.E))
    return fmt::format("m_a {}x{}", g.m_a.rows, g.m_a.cols);
  if (!g.m_g.empty() && !detail::has_shape(g.m_g, T, d.E))
    return fmt::format("m_g {}x{}", g.m_g.rows, g.m_g.cols);
  for (std::size_t i = 0; i < kWeightGrads; ++i) {
    const auto v = weight_grads(expert_gradients(g))[i];
    const auto sh = grad_shapes(d.E, d.H, d.I, d.r)[i];
    if (!v.empty() && !detail::has_shape(v, sh.rows, sh.cols))
      return fmt::format("{} grad {}x{}, expected {}x{}", sh.name, v.rows, v.cols, sh.rows,
                         sh.cols);
  }
  return "";
}

// layer.backward.no_alias: the outputs pairwise, and each against every
// input (the saved workspace included).
void backward_no_alias(detail::Checker& c, const Dims& d, const layer::Weights& w,
                       MatView<const bf16> x, MatView<const float> dy, const LayerSaved& s,
                       const layer::Gradients& g) {
  std::vector<std::pair<std::string, ByteRange>> outs{{"dx", g.dx.bytes()},
                                                      {"router_w grad", g.router_w.bytes()},
                                                      {"router_b grad", g.router_b.bytes()},
                                                      {"m_a", g.m_a.bytes()},
                                                      {"m_g", g.m_g.bytes()}};
  for (std::size_t i = 0; i < kWeightGrads; ++i)
    outs.emplace_back(fmt::format("{} grad", grad_shapes(d.E, d.H, d.I, d.r)[i].name),
                      weight_grads(expert_gradients(g))[i].bytes());
  std::vector<std::pair<std::string, ByteRange>> ins{{"x", x.bytes()},
                                                     {"dy", dy.bytes()},
                                                     {"router_w", w.router_w.bytes()},
                                                     {"router_b", w.router_b.bytes()},
                                                     {"saved workspace", s.train.workspace}};
  add_lora_inputs(ins, d, w);
  detail::no_overlap(c, k::kBwdNoAlias, outs, ins);
}

}  // namespace

void layer_backward_pre(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                        MatView<const bf16> x, MatView<const float> dy, const LayerSaved& saved,
                        const layer::Gradients& g) {
  const Dims d = dims(cfg);
  const auto& s = saved;
  MOECERT_CONTRACT(c, k::kBwdState) {
    if (const auto bad = saved_state_error(cfg, x, w, s))
      c.fail(k::kBwdState, "", bad->first, bad->second);
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kBwdShape) {
    if (const std::string bad = backward_shape_error(d, x, dy, g); !bad.empty())
      c.fail(k::kBwdShape, "", bad, "the config's shapes");
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kBwdDyFinite) { detail::scan_finite(c, k::kBwdDyFinite, "dy", dy); }
  MOECERT_CONTRACT(c, k::kBwdNoAlias) { backward_no_alias(c, d, w, x, dy, s, g); }
}

std::vector<GradFiniteScan::Output> layer_grad_outputs(const MoeConfig& cfg,
                                                       const layer::Gradients& g) {
  const Dims d = dims(cfg);
  std::vector<GradFiniteScan::Output> out = {
      {"dx", g.dx},
      {"router_w grad", g.router_w},
      {"router_b grad", MatView<const float>(g.router_b.data, 1, g.router_b.size, g.router_b.size)},
      {"m_a", g.m_a},
      {"m_g", g.m_g}};
  const auto names = grad_shapes(d.E, d.H, d.I, d.r);
  const auto wg = weight_grads(expert_gradients(g));
  for (std::size_t i = 0; i < kWeightGrads; ++i)
    out.push_back({fmt::format("{} grad", names[i].name), wg[i]});
  return out;
}

void layer_backward_post(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                         MatView<const bf16> x, MatView<const float> dy, const LayerSaved& saved,
                         const layer::Gradients& g, const layer::BackwardOptions& opt,
                         GradFiniteScan* grads_judge, const BackwardProbe* probe,
                         const RouterLinearProbe* linear_probe) {
  const Dims d = dims(cfg);
  const auto& s = saved;
  const float* dw = s.router_dw;
  const auto names = grad_shapes(d.E, d.H, d.I, d.r);
  const auto wg = weight_grads(expert_gradients(g));
  if (grads_judge) {
    grads_judge->report(c, k::kBwdGradFinite);
  } else {
    MOECERT_CONTRACT(c, k::kBwdGradFinite) {
      GradFiniteScan(layer_grad_outputs(cfg, g)).report(c, k::kBwdGradFinite);
    }
  }
  MOECERT_CONTRACT(c, k::kBwdEmptyZero) {
    empty_expert_zero(c, k::kBwdEmptyZero, s.train, expert_gradients(g));
  }
  MOECERT_CONTRACT(c, k::kBwdRouterMasked) {
    if (dw)
      dweights_masked(c, k::kBwdRouterMasked, s.train, MatView<const float>(dw, x.rows, d.K, d.K));
  }
  // As experts.backward.probe (proofs/bounds.md §9.3).
  MOECERT_CONTRACT(c, k::kBwdProbe) {
    if (probe) probe->report(c, k::kBwdProbe);
    if (linear_probe) linear_probe->report(c, k::kBwdProbe);
  }
  // Conditioned on the kernel's routing and dL/dw; every gradient within
  // layer_bounds (expert path, router path, base weights); proofs/layer.md §3-4.
  MOECERT_CONTRACT(c, k::kBwdWithin) {
    const auto ref = layer_bounds(
        cfg, w, x, dy, s, {opt.expert_path, opt.router_path, opt.expert_path && wants_base(g)}, dw);
    auto mat = [&](MatView<float> m) {
      return [m](std::size_t i, std::size_t j) { return m(i, j); };
    };
    if (opt.router_path &&
        !within(
            c, k::kBwdWithin, "dL/dw", x.rows, d.K,
            [&](std::size_t t, std::size_t j) { return dw[t * d.K + j]; }, ref.dw))
      return;
    if (!g.dx.empty() && !within(c, k::kBwdWithin, "dx", x.rows, d.H, mat(g.dx), ref.dx)) return;
    // M_A, M_G: formed by the expert path (else written 0, which empty_expert_zero judges).
    for (const auto& [name, m, r] :
         {std::tuple{"m_a", g.m_a, &ref.m_a}, std::tuple{"m_g", g.m_g, &ref.m_g}})
      if (!m.empty() && r->size() == m.rows * m.cols &&
          !within(c, k::kBwdWithin, name, m.rows, m.cols, mat(m), *r))
        return;
    if (!g.router_w.empty() &&
        !within(c, k::kBwdWithin, "router_w grad", d.R, d.H, mat(g.router_w), ref.dwr))
      return;
    if (!g.router_b.empty() &&
        !within(
            c, k::kBwdWithin, "router_b grad", 1, d.R,
            [&](std::size_t, std::size_t e) { return g.router_b[e]; }, ref.db))
      return;
    // Without the expert path the reference's weight gradients are all 0
    // (base ones not even formed): compare with zeros of the right size.
    const std::vector<Tracked>* refs[] = {&ref.dag, &ref.dbg, &ref.dau, &ref.dbu, &ref.dad,
                                          &ref.dbd, &ref.dwg, &ref.dwu, &ref.dwd};
    for (std::size_t i = 0; i < kWeightGrads; ++i) {
      const auto v = wg[i];
      if (v.empty() || v.rows == 0) continue;
      std::vector<Tracked> zeros;
      const std::vector<Tracked>* want = refs[i];
      if (want->size() != v.rows * v.cols)
        want = &(zeros = std::vector<Tracked>(v.rows * v.cols, Tracked{0, 0}));
      if (!within(c, k::kBwdWithin, fmt::format("{} grad", names[i].name), v.rows, v.cols, mat(v),
                  *want))
        return;
    }
  }
}

}  // namespace moecert::contracts
