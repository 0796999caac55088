// Clauses of experts.forward_train and experts.backward, and the clause
// bodies the layer shares with them (proofs/experts.md).
#include "contracts/experts/train.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "contracts/bounds/experts.hpp"
#include "contracts/engine/checks.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/engine/compare.hpp"
#include "contracts/experts/backward_probe.hpp"
#include "contracts/experts/experts.hpp"

namespace moecert::contracts {

namespace k = clauses::experts_train;
using bounds::Tracked;

namespace {

ByteRange packed_bytes(const gemm::PackedWeights& p) { return p.storage(); }

using NamedRanges = std::vector<std::pair<std::string, ByteRange>>;

// The inputs an output of the op must not share a byte with. The packed
// weights (four per expert) are listed only where they overlap one of
// `outs`: the others cannot change detail::no_overlap's verdict or the pair
// it names, and naming them all cost more than the clause.
NamedRanges input_ranges(const experts::PackedExperts& w, const experts::Lora& lora,
                         MatView<const bf16> x, const NamedRanges& outs) {
  NamedRanges in{{"x", x.bytes()}};
  const auto names = lora_shapes(0, 0, 0, 0);
  for (std::size_t i = 0; i < 6 && lora.rank; ++i)
    in.emplace_back(fmt::format("lora.{}", names[i].name), lora_views(lora)[i].bytes());
  auto add = [&](const char* name, std::size_t e, const gemm::PackedWeights& p) {
    const ByteRange r = packed_bytes(p);
    if (std::any_of(outs.begin(), outs.end(), [&](const auto& o) { return overlaps(o.second, r); }))
      in.emplace_back(fmt::format("{} e={}", name, e), r);
  };
  for (std::size_t e = 0; e < w.experts(); ++e) {
    add("packed gate_up", e, w.gate_up(e));
    add("packed down", e, w.down(e));
    if (w.has_backward()) {
      add("packed gate_up_t", e, w.gate_up_t(e));
      add("packed down_t", e, w.down_t(e));
    }
  }
  return in;
}

// Whether any output of the expert path is requested.
bool wants_expert_path(const experts::Gradients& g) {
  for (const auto& v : {g.dx, g.a_gate, g.b_gate, g.a_up, g.b_up, g.a_down, g.b_down, g.w_gate,
                        g.w_up, g.w_down, g.m_a, g.m_g})
    if (!v.empty()) return true;
  return false;
}

}  // namespace

// ---- shared clause bodies ----------------------------------------------------

void routing_in_range(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx,
                      std::size_t experts) {
  for (std::size_t t = 0; t < idx.rows; ++t) {
    bool tail = false;
    for (std::size_t j = 0; j < idx.cols; ++j) {
      const std::int32_t e = idx(t, j);
      if (e < -1 || e >= static_cast<std::int64_t>(experts) || (tail && e != -1)) {
        c.fail(clause, fmt::format("t={} j={}", t, j), fmt::format("idx={}", e),
               tail ? "-1 (after a -1 slot)" : fmt::format("-1 <= idx < {}", experts));
        return;
      }
      tail = tail || e == -1;
    }
  }
}

void routing_unique(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx) {
  for (std::size_t t = 0; t < idx.rows; ++t)
    for (std::size_t j = 0; j < idx.cols; ++j)
      for (std::size_t l = 0; l < j; ++l)
        if (idx(t, j) >= 0 && idx(t, j) == idx(t, l)) {
          c.fail(clause, fmt::format("t={} j={}", t, j),
                 fmt::format("idx={} also at j={}", idx(t, j), l), "distinct experts in a row");
          return;
        }
}

void routing_weights(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx,
                     MatView<const float> weights) {
  for (std::size_t t = 0; t < weights.rows; ++t)
    for (std::size_t j = 0; j < weights.cols; ++j)
      if (!std::isfinite(weights(t, j)) || (idx(t, j) == -1 && weights(t, j) != 0)) {
        c.fail(clause, fmt::format("t={} j={}", t, j),
               fmt::format("w={} idx={}", weights(t, j), idx(t, j)),
               idx(t, j) == -1 ? "0 at a -1 slot" : "finite");
        return;
      }
}

std::array<Named, 6> lora_shapes(std::size_t E, std::size_t H, std::size_t I, std::size_t r) {
  return {{{"a_gate", E * r, H},
           {"b_gate", E * I, r},
           {"a_up", E * r, H},
           {"b_up", E * I, r},
           {"a_down", E * r, I},
           {"b_down", E * H, r}}};
}

std::array<MatView<const bf16>, 6> lora_views(const experts::Lora& l) {
  return {l.a_gate, l.b_gate, l.a_up, l.b_up, l.a_down, l.b_down};
}

std::string lora_shape_error(const experts::Lora& l, std::size_t E, std::size_t H, std::size_t I) {
  if (l.rank == 0) return "";
  for (std::size_t i = 0; i < 6; ++i) {
    const auto sh = lora_shapes(E, H, I, l.rank)[i];
    const auto v = lora_views(l)[i];
    if (!detail::has_shape(v, sh.rows, sh.cols))
      return fmt::format("lora.{} {}x{}, expected {}x{}", sh.name, v.rows, v.cols, sh.rows,
                         sh.cols);
  }
  return "";
}

void lora_scale(detail::Checker& c, const ClauseInfo& clause, std::size_t rank, double alpha) {
  if (rank) {
    const float s = static_cast<float>(alpha / static_cast<double>(rank));
    if (!std::isfinite(s) || !(s > 0) || s < 0x1p-60f || s > 0x1p60f)
      c.fail(clause, "", fmt::format("s={} (alpha={}, r={})", s, alpha, rank),
             "finite, 2^-60 <= s <= 2^60");
  }
}

std::vector<double> exact(const std::vector<Tracked>& ref) {
  std::vector<double> v(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) v[i] = ref[i].v;
  return v;
}

bool rounding_unbiased(detail::Checker& c, const ClauseInfo& clause, std::string_view name,
                       std::span<const float> got, std::span<const double> ref) {
  const auto a = compare::rounding_audit(got, ref);
  if (!a.biased()) return true;
  c.fail(clause, std::string(name),
         fmt::format("{} of {} errors toward zero ({:.3f})", a.toward_zero, a.audited,
                     double(a.toward_zero) / double(a.audited)),
         fmt::format("|fraction - 1/2| <= {:.3f} (round to nearest, leaning at most {}; "
                     "proofs/bounds.md §11)",
                     a.threshold(), compare::RoundingAudit::kLean));
  return false;
}

std::array<Named, kWeightGrads> grad_shapes(std::size_t E, std::size_t H, std::size_t I,
                                            std::size_t r) {
  const auto l = lora_shapes(E, H, I, r);
  return {{l[0],
           l[1],
           l[2],
           l[3],
           l[4],
           l[5],
           {"w_gate", E * I, H},
           {"w_up", E * I, H},
           {"w_down", E * H, I}}};
}

std::array<MatView<float>, kWeightGrads> weight_grads(const experts::Gradients& g) {
  return {g.a_gate, g.b_gate, g.a_up, g.b_up, g.a_down, g.b_down, g.w_gate, g.w_up, g.w_down};
}

void empty_expert_zero(detail::Checker& c, const ClauseInfo& clause, const TrainSaved& s,
                       const experts::Gradients& g) {
  const auto& gr = s.rows.grouping;
  const std::size_t E = gr.experts;
  const auto names = grad_shapes(0, 0, 0, 0);
  for (std::size_t e = 0; e < E; ++e) {
    if (gr.count[e]) continue;
    for (std::size_t i = 0; i < kWeightGrads; ++i) {
      const auto v = weight_grads(g)[i];
      if (v.empty() || v.rows < E) continue;
      const std::size_t per = v.rows / E;
      const MatView<const float> rows(v.row(e * per), per, v.cols, v.stride);
      const std::size_t at = detail::first_failing_element(rows, [](float x) { return x == 0.0f; });
      if (at == per * v.cols) continue;
      const std::size_t row = e * per + at / v.cols, col = at % v.cols;
      c.fail(clause, fmt::format("expert {} {} grad ({}, {})", e, names[i].name, row, col),
             fmt::format("{}", v(row, col)), "exactly 0 (the expert has no token)");
      return;
    }
  }
  // M_A, M_G: 0 wherever t is not routed to e.
  for (const auto& [name, m] : {std::pair{"m_a", g.m_a}, std::pair{"m_g", g.m_g}}) {
    if (m.empty()) continue;
    for (std::size_t t = 0; t < m.rows; ++t)
      for (std::size_t e = 0; e < m.cols; ++e) {
        bool routed = false;
        for (std::size_t j = 0; j < s.topk; ++j)
          routed = routed || s.idx[t * s.topk + j] == static_cast<std::int32_t>(e);
        if (!routed && m(t, e) != 0.0f) {
          c.fail(clause, fmt::format("{}[{}, {}]", name, t, e), fmt::format("{}", m(t, e)),
                 "exactly 0 (t not routed to e)");
          return;
        }
      }
  }
}

void dweights_masked(detail::Checker& c, const ClauseInfo& clause, const TrainSaved& s,
                     MatView<const float> dw) {
  for (std::size_t t = 0; t < dw.rows; ++t)
    for (std::size_t j = 0; j < dw.cols; ++j)
      if (s.idx[t * s.topk + j] < 0 && dw(t, j) != 0.0f) {
        c.fail(clause, fmt::format("t={} j={} (idx -1)", t, j), fmt::format("dL/dw={}", dw(t, j)),
               "exactly 0");
        return;
      }
}

std::vector<float> values(MatView<const float> m) {
  std::vector<float> v(m.rows * m.cols);
  for (std::size_t i = 0; i < m.rows; ++i)
    for (std::size_t j = 0; j < m.cols; ++j) v[i * m.cols + j] = m(i, j);
  return v;
}

bool within(detail::Checker& c, const ClauseInfo& clause, std::string_view name, std::size_t cols,
            const std::vector<float>& got, const std::vector<Tracked>& ref,
            std::string_view proof) {
  std::vector<double> v(got.size()), b(got.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    v[i] = ref[i].v, b[i] = bounds::kReferenceSlack * ref[i].e;
  const auto cmp = compare::bounded(got, v, b);
  if (cmp.pass()) return true;
  const std::size_t n = std::max<std::size_t>(cols, 1);
  c.fail(clause, fmt::format("{}[{}, {}]", name, cmp.worst / n, cmp.worst % n),
         fmt::format("{}={:.9g} ref={:.17g} (utilisation {:.3g})", name, cmp.worst_got,
                     cmp.worst_ref, cmp.max_utilization),
         fmt::format("|{} - ref| <= {:.6g} ({})", name, cmp.worst_bound, proof));
  return false;
}

template <class S>
ref::LayerData<S> experts_data(const experts::PackedExperts& w, const experts::Lora& lora,
                               MatView<const bf16> x, std::optional<MatView<const float>> dy,
                               const TrainSaved& s) {
  ref::LayerData<S> d;
  d.T = x.rows, d.H = w.hidden(), d.I = w.inter(), d.E = w.experts(), d.K = s.topk, d.r = lora.rank,
  d.R = 0;
  d.router = false;
  d.scale =
      d.r ? static_cast<double>(static_cast<float>(lora.alpha / static_cast<double>(d.r))) : 0.0;
  auto put = [](std::vector<S>& out, auto m) {
    out.resize(m.rows * m.cols);
    for (std::size_t i = 0; i < m.rows; ++i)
      for (std::size_t j = 0; j < m.cols; ++j) out[i * m.cols + j] = S(ref::widen(m(i, j)));
  };
  put(d.x, x);
  d.wg.resize(d.E * d.I * d.H), d.wu.resize(d.wg.size()), d.wd.resize(d.E * d.H * d.I);
  for (std::size_t e = 0; e < d.E; ++e) {
    for (std::size_t i = 0; i < d.I; ++i)
      for (std::size_t h = 0; h < d.H; ++h) {
        d.wg[(e * d.I + i) * d.H + h] = S(double(w.gate(e, i, h).to_float()));
        d.wu[(e * d.I + i) * d.H + h] = S(double(w.up(e, i, h).to_float()));
      }
    for (std::size_t h = 0; h < d.H; ++h)
      for (std::size_t i = 0; i < d.I; ++i)
        d.wd[(e * d.H + h) * d.I + i] = S(double(w.down(e, h, i).to_float()));
  }
  if (d.r) {
    put(d.ag, lora.a_gate), put(d.bg, lora.b_gate), put(d.au, lora.a_up);
    put(d.bu, lora.b_up), put(d.ad, lora.a_down), put(d.bd, lora.b_down);
  }
  d.idx.assign(s.idx, s.idx + d.T * d.K);
  d.w_given.resize(d.T * d.K);
  for (std::size_t i = 0; i < d.T * d.K; ++i) d.w_given[i] = S(double(s.weights[i]));
  if (dy) put(d.dy, *dy);
  return d;
}

template ref::LayerData<double> experts_data<double>(const experts::PackedExperts&,
                                                     const experts::Lora&, MatView<const bf16>,
                                                     std::optional<MatView<const float>>,
                                                     const TrainSaved&);
template ref::LayerData<Tracked> experts_data<Tracked>(const experts::PackedExperts&,
                                                       const experts::Lora&, MatView<const bf16>,
                                                       std::optional<MatView<const float>>,
                                                       const TrainSaved&);

// ---- experts.forward_train -----------------------------------------------------

void experts_train_forward_pre(detail::Checker& c, const experts::PackedExperts& w,
                               const experts::Lora& lora, MatView<const bf16> x,
                               MatView<const std::int32_t> idx, MatView<const float> weights,
                               MatView<float> y) {
  const std::size_t T = x.rows, K = idx.cols, E = w.experts(), H = w.hidden(), I = w.inter();
  MOECERT_CONTRACT(c, k::kFwdShape) {
    std::string bad;
    if (!detail::has_shape(x, T, H) || T > static_cast<std::size_t>(kMaxTokens))
      bad = fmt::format("x {}x{}", x.rows, x.cols);
    else if (!detail::has_shape(idx, T, K) || K < 1 || K > std::min<std::size_t>(E, kMaxTopk))
      bad = fmt::format("idx {}x{}", idx.rows, idx.cols);
    else if (!detail::has_shape(weights, T, K))
      bad = fmt::format("weights {}x{}", weights.rows, weights.cols);
    else if (!detail::has_shape(y, T, H))
      bad = fmt::format("y {}x{}", y.rows, y.cols);
    else if (lora.rank > static_cast<std::size_t>(kMaxRank))
      bad = fmt::format("r={}", lora.rank);
    else
      bad = lora_shape_error(lora, E, H, I);
    if (!bad.empty())
      c.fail(k::kFwdShape, "", bad,
             fmt::format("x, y Tx{} (T <= 2^20), idx and weights TxK (1 <= K <= min(E={}, 64)), r "
                         "<= 256, LoRA of E={} H={} I={} r",
                         H, E, E, H, I));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kFwdIdxInRange) { routing_in_range(c, k::kFwdIdxInRange, idx, E); }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kFwdIdxUnique) { routing_unique(c, k::kFwdIdxUnique, idx); }
  MOECERT_CONTRACT(c, k::kFwdWeightFinite) {
    routing_weights(c, k::kFwdWeightFinite, idx, weights);
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kFwdXFinite) { detail::scan_finite(c, k::kFwdXFinite, "x", x); }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kFwdXRange) { detail::scan_bf16_range(c, k::kFwdXRange, "x", x); }
  // lora_finite, lora_range: judged as the factors are packed (LoraFiniteScan).
  MOECERT_CONTRACT(c, k::kFwdScale) { lora_scale(c, k::kFwdScale, lora.rank, lora.alpha); }
  MOECERT_CONTRACT(c, k::kFwdNoAlias) {
    const NamedRanges outs{{"y", y.bytes()}};
    auto in = input_ranges(w, lora, x, outs);
    in.emplace_back("idx", idx.bytes());
    in.emplace_back("weights", weights.bytes());
    detail::no_overlap(c, k::kFwdNoAlias, outs, in);
  }
}

void experts_train_forward_post(detail::Checker& c, const experts::PackedExperts& w,
                                const experts::Lora& lora, MatView<const bf16> x,
                                MatView<const float> y, const TrainSaved& s) {
  MOECERT_CONTRACT(c, k::kFwdYFinite) { detail::scan_finite(c, k::kFwdYFinite, "y", y); }
  // x, W and the LoRA factors in range, no overflow; the probes of both
  // GEMMs with their LoRA products and of xa and ha, never failing within
  // bounds::dot; proofs/bounds.md §9.2.
  MOECERT_CONTRACT(c, k::kFwdProbe) {
    probe_expert_gemms(c, k::kFwdProbe, w, &lora, x, s.topk, s.rows);
  }
  // Inputs exact, no overflow; every y within layer_reference over Tracked with
  // the caller's weights (the layer's expert part); proofs/experts.md §1.
  MOECERT_CONTRACT(c, k::kFwdWithin) {
    const auto ref =
        ref::layer_reference(experts_data<Tracked>(w, lora, x, std::nullopt, s), false);
    within(c, k::kFwdWithin, "y", y.cols, values(y), ref.y, "proofs/experts.md §1");
  }
}

// ---- experts.backward ----------------------------------------------------------

void experts_backward_pre(detail::Checker& c, const experts::PackedExperts& w,
                          const experts::Lora& lora, MatView<const bf16> x, MatView<const float> dy,
                          const TrainSaved& s, const experts::Gradients& g) {
  const std::size_t T = x.rows, E = w.experts(), H = w.hidden(), I = w.inter();
  MOECERT_CONTRACT(c, k::kBwdState) {
    if (!s.valid)
      c.fail(k::kBwdState, "", "no forward saved", "a training forward first");
    else if (!s.training)
      c.fail(k::kBwdState, "", "forward ran with training = false", "a training forward");
    else if (s.experts != E || s.hidden != H || s.inter != I || s.rank != lora.rank ||
             (lora.rank && s.alpha != lora.alpha))
      c.fail(k::kBwdState, "",
             fmt::format("saved by a forward of E={} H={} I={} r={} alpha={}", s.experts, s.hidden,
                         s.inter, s.rank, s.alpha),
             fmt::format("E={} H={} I={} r={} alpha={}", E, H, I, lora.rank, lora.alpha));
    else if (s.tokens != T)
      c.fail(k::kBwdState, "", fmt::format("saved T={}, x has {}", s.tokens, T), "the same T");
    else if (!w.has_backward())
      c.fail(k::kBwdState, "", "experts packed without backward", "pack(..., backward = true)");
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kBwdShape) {
    const std::size_t K = s.topk;
    std::string bad;
    if (!detail::has_shape(x, T, H))
      bad = fmt::format("x {}x{}", x.rows, x.cols);
    else if (!detail::has_shape(dy, T, H))
      bad = fmt::format("dy {}x{}", dy.rows, dy.cols);
    else if (!g.dx.empty() && !detail::has_shape(g.dx, T, H))
      bad = fmt::format("dx {}x{}", g.dx.rows, g.dx.cols);
    else if (!g.dweights.empty() && !detail::has_shape(g.dweights, T, K))
      bad = fmt::format("dweights {}x{}", g.dweights.rows, g.dweights.cols);
    else if (!g.m_a.empty() && !detail::has_shape(g.m_a, T, E))
      bad = fmt::format("m_a {}x{}", g.m_a.rows, g.m_a.cols);
    else if (!g.m_g.empty() && !detail::has_shape(g.m_g, T, E))
      bad = fmt::format("m_g {}x{}", g.m_g.rows, g.m_g.cols);
    else
      for (std::size_t i = 0; i < kWeightGrads; ++i) {
        const auto v = weight_grads(g)[i];
        const auto sh = grad_shapes(E, H, I, lora.rank)[i];
        if (!v.empty() && !detail::has_shape(v, sh.rows, sh.cols)) {
          bad = fmt::format("{} grad {}x{}, expected {}x{}", sh.name, v.rows, v.cols, sh.rows,
                            sh.cols);
          break;
        }
      }
    if (!bad.empty())
      c.fail(k::kBwdShape, "", bad,
             fmt::format("the shapes of E={} H={} I={} K={} r={}, T={}", E, H, I, K, lora.rank, T));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kBwdDyFinite) { detail::scan_finite(c, k::kBwdDyFinite, "dy", dy); }
  MOECERT_CONTRACT(c, k::kBwdNoAlias) {
    NamedRanges outs{{"dx", g.dx.bytes()},
                     {"dweights", g.dweights.bytes()},
                     {"m_a", g.m_a.bytes()},
                     {"m_g", g.m_g.bytes()}};
    const auto names = grad_shapes(E, H, I, lora.rank);
    for (std::size_t i = 0; i < kWeightGrads; ++i)
      outs.emplace_back(fmt::format("{} grad", names[i].name), weight_grads(g)[i].bytes());
    auto in = input_ranges(w, lora, x, outs);
    in.emplace_back("dy", dy.bytes());
    in.emplace_back("saved workspace", s.workspace);
    detail::no_overlap(c, k::kBwdNoAlias, outs, in);
  }
}

void experts_backward_post(detail::Checker& c, const experts::PackedExperts& w,
                           const experts::Lora& lora, MatView<const bf16> x,
                           MatView<const float> dy, const TrainSaved& s,
                           const experts::Gradients& g, GradFiniteScan* grads_judge,
                           const BackwardProbe* probe) {
  const std::size_t E = w.experts(), H = w.hidden(), I = w.inter();
  const auto names = grad_shapes(E, H, I, lora.rank);
  if (grads_judge) {
    grads_judge->report(c, k::kBwdGradFinite);
  } else {
    MOECERT_CONTRACT(c, k::kBwdGradFinite) {
      GradFiniteScan(experts_grad_outputs(g, E, H, I, lora.rank)).report(c, k::kBwdGradFinite);
    }
  }
  MOECERT_CONTRACT(c, k::kBwdEmptyZero) { empty_expert_zero(c, k::kBwdEmptyZero, s, g); }
  MOECERT_CONTRACT(c, k::kBwdDwMasked) { dweights_masked(c, k::kBwdDwMasked, s, g.dweights); }
  // dy, x, W and the LoRA factors in range, no overflow; the probes the op
  // ran (audit) never fail within bounds::dot; proofs/bounds.md §9.3.
  MOECERT_CONTRACT(c, k::kBwdProbe) {
    if (probe) probe->report(c, k::kBwdProbe);
  }
  // Inputs and dy exact, no overflow; every gradient within layer_reference over
  // Tracked (dweights, dx, LoRA, base); proofs/experts.md §2.
  MOECERT_CONTRACT(c, k::kBwdWithin) {
    [&] {  // a failure ends this clause, not the others (observe goes on)
      const bool expert = wants_expert_path(g);
      const bool base = !g.w_gate.empty() || !g.w_up.empty() || !g.w_down.empty();
      const auto r = ref::layer_reference(experts_data<Tracked>(w, lora, x, dy, s), true,
                                          {expert, !g.dweights.empty(), expert && base});
      const char* proof = "proofs/experts.md §2";
      if (!g.dweights.empty() &&
          !within(c, k::kBwdWithin, "dweights", s.topk, values(g.dweights), r.dw, proof))
        return;
      if (!g.dx.empty() && !within(c, k::kBwdWithin, "dx", H, values(g.dx), r.dx, proof)) return;
      if (!g.m_a.empty() && !within(c, k::kBwdWithin, "m_a", E, values(g.m_a), r.m_a, proof))
        return;
      if (!g.m_g.empty() && !within(c, k::kBwdWithin, "m_g", E, values(g.m_g), r.m_g, proof))
        return;
      const std::vector<Tracked>* refs[] = {&r.dag, &r.dbg, &r.dau, &r.dbu, &r.dad,
                                            &r.dbd, &r.dwg, &r.dwu, &r.dwd};
      for (std::size_t i = 0; i < kWeightGrads; ++i) {
        const auto v = weight_grads(g)[i];
        if (v.empty() || v.rows == 0) continue;
        if (!within(c, k::kBwdWithin, fmt::format("{} grad", names[i].name), v.cols, values(v),
                    *refs[i], proof))
          return;
      }
    }();
  }
}

}  // namespace moecert::contracts
