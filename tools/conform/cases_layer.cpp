// Conformance cases of the MoE layer (forward + backward with LoRA, two
// training steps on one saved state: the LoRA factors change between them)
// and of the workspace plan of failure mode 4.
#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>

#include <cmath>
#include <cstring>
#include <random>
#include <type_traits>

#include "contracts/layer/bounds.hpp"
#include "contracts/layer/router_linear.hpp"
#include "contracts/reference/experts_model.hpp"
#include "contracts/router/kind.hpp"
#include "moecert/isa.hpp"
#include "moecert/layer.hpp"
#include "moecert/workspace.hpp"
#include "ops/layer/state.hpp"
#include "ops/workspace/arena.hpp"
#include "support/layer_judged.hpp"
#include "tools/conform/case.hpp"

namespace moecert::tools {
namespace {

using Layer = fixture::LayerProblem;

struct Dims {
  std::size_t E, H, I, K, r, T;
};
constexpr Dims kSmall{8, 40, 24, 3, 4, 13}, kOneToken{8, 40, 24, 3, 4, 1},
    kRealistic{16, 512, 384, 4, 8, 64};

// The data classes beside normal: x, the experts' weights, LoRA and dy
// scaled by 2^U(-8, 8) (exponents spread along the GEMM chain; wider ones
// overflow it legitimately); every token routed to expert 0.
enum class Data { normal, wide, hot_expert };
constexpr const char* kDataNames[] = {"normal", "wide_exponent", "all_on_one_expert"};

Layer make(RouterKind kind, std::uint64_t seed, Dims d, Data data = Data::normal) {
  std::size_t E = d.E;  // the fewest experts from d.E up that the kind routes
  while (contracts::router_kind(kind).width(E) == 0) ++E;
  Layer l =
      fixture::random_layer(fixture::layer_config(kind, E, d.H, d.I, d.K, d.r, d.T), d.T, seed);
  l.b[l.R / 2 - 1] = -50;  // an output no token selects: idle experts (their LoRA gradients: 0)
  if (data == Data::wide) {
    std::mt19937_64 rng(seed + 1);
    std::uniform_int_distribution<int> ex(-8, 8);
    auto spread = [&](auto& v) {
      for (auto& q : v) {
        if constexpr (std::is_same_v<std::decay_t<decltype(q)>, bf16>)
          q = bf16(std::ldexp(q.to_float(), ex(rng)));
        else
          q = std::ldexp(q, ex(rng));
      }
    };
    spread(l.x), spread(l.wg), spread(l.wu), spread(l.wd), spread(l.dy);
    for (auto& f : l.lora) spread(f);
    l.pack();
  }
  if (data == Data::hot_expert) {  // expert 0 outranks every other for every token
    if (kind == RouterKind::sigmoid_topk) l.bias[0] = 10;
    l.b[0] = 50;
    if (kind == RouterKind::product_key) l.b[l.R / 2] = 50;
  }
  return l;
}

// The step's tensors judged by `moecert check`'s judge as another
// implementation's under the declared precision `mixed` (stage by stage,
// every clause of layer.forward and layer.backward it applies): fails the
// case on any failed clause.
void judged_as_foreign(CaseResult& r, const Layer& l, const layer::Saved& saved, const float* z,
                       const std::vector<float>& y, const std::vector<float>& dx,
                       const std::vector<float>& dw, const std::vector<float>& gwr,
                       const std::vector<float>& gb, const std::vector<float> (&weight_grads)[9]) {
  const auto iv = saved.idx();
  const auto wv = saved.weights();
  const std::vector<std::int32_t> idx(iv.data, iv.data + l.T * l.K);
  const std::vector<float> weights(wv.data, wv.data + l.T * l.K);
  const auto s = fixture::judged_step(l, z, idx, weights, y, dx, dw, gwr, gb, weight_grads);
  const auto params = fixture::layer_params(l);
  namespace jg = contracts::judge;
  const jg::Verdict verdicts[] = {
      jg::judge_op("layer.forward", fixture::layer_inputs(l), s.forward_out, params),
      jg::judge_op("layer.backward", s.backward_in, s.backward_out, params)};
  for (const auto& v : verdicts)
    for (const auto& c : v.clauses)
      if (!c.passed)
        expect(r, false, "judged as another implementation: " + c.violations.front().one_line());
}

// One step's outputs: fresh buffers hold NaN, as a caller's might, so
// every element must be written; the base weights' gradients where asked.
struct StepOutputs {
  std::vector<float> y, dx, gwr, gb, ma, mg;
  std::vector<float> g[9];  // LoRA's six, then the base weights' three (empty if not asked)
  layer::Gradients views;
  StepOutputs(const Layer& l, bool base)
      : y(l.T * l.H, NAN),
        dx(l.T * l.H, NAN),
        gwr(l.R * l.H, NAN),
        gb(l.R, NAN),
        ma(l.T * l.E, NAN),
        mg(l.T * l.E, NAN) {
    views.m_a = {ma.data(), l.T, l.E}, views.m_g = {mg.data(), l.T, l.E};
    views.dx = {dx.data(), l.T, l.H};
    views.router_w = {gwr.data(), l.R, l.H};
    views.router_b = {gb.data(), l.R};
    MatView<float>* v[9] = {&views.a_gate, &views.b_gate, &views.a_up, &views.b_up,  &views.a_down,
                            &views.b_down, &views.w_gate, &views.w_up, &views.w_down};
    for (int i = 0; i < 6; ++i) {
      g[i].assign(l.lora_size(i), NAN);
      *v[i] = {g[i].data(), l.E * l.lora_rows(i), l.lora_cols(i)};
    }
    const std::size_t base_rows[3] = {l.E * l.I, l.E * l.I, l.E * l.H};
    for (int i = 0; i < 3 && base; ++i) {
      g[6 + i].assign(l.E * l.I * l.H, NAN);
      *v[6 + i] = {g[6 + i].data(), base_rows[i], l.E * l.I * l.H / base_rows[i]};
    }
  }
  void append_to(std::vector<float>& out) const {
    for (const auto* v : {&y, &dx, &gwr, &gb, &ma, &mg})
      out.insert(out.end(), v->begin(), v->end());
    for (const auto& v : g) out.insert(out.end(), v.begin(), v.end());
  }
};

// Every output of the step against its bounded reference
// (contracts::layer_bounds on the kernel's routing), one row each; the
// rounding audit on y, dx and dL/dw with `audit`; then judged from tensors.
void judge_step(CaseResult& r, const Layer& l, const layer::Weights& w, layer::Saved& saved,
                StepOutputs& o, bool base, bool audit) {
  const auto view = layer::saved_view(saved);
  const auto ref = contracts::layer_bounds(l.cfg, w, {l.x.data(), l.T, l.H},
                                           MatView<const float>{l.dy.data(), l.T, l.H}, view,
                                           {.base = base}, view.router_dw);
  const std::pair<const char*, std::pair<std::vector<float>*, const std::vector<bounds::Tracked>*>>
      named[] = {{"y", {&o.y, &ref.y}},
                 {"dx", {&o.dx, &ref.dx}},
                 {"router_w grad", {&o.gwr, &ref.dwr}},
                 {"router_b grad", {&o.gb, &ref.db}},
                 {"m_a", {&o.ma, &ref.m_a}},
                 {"m_g", {&o.mg, &ref.m_g}},
                 {"a_gate grad", {&o.g[0], &ref.dag}},
                 {"b_gate grad", {&o.g[1], &ref.dbg}},
                 {"a_up grad", {&o.g[2], &ref.dau}},
                 {"b_up grad", {&o.g[3], &ref.dbu}},
                 {"a_down grad", {&o.g[4], &ref.dad}},
                 {"b_down grad", {&o.g[5], &ref.dbd}},
                 {"w_gate grad", {&o.g[6], &ref.dwg}},
                 {"w_up grad", {&o.g[7], &ref.dwu}},
                 {"w_down grad", {&o.g[8], &ref.dwd}}};
  for (const auto& [name, pair] : named)
    if (!pair.first->empty())
      compare_output(r, name, *pair.first, *pair.second,
                     audit && (pair.first == &o.y || pair.first == &o.dx));
  // dL/dw: the router path's input, left in the saved state.
  const std::vector<float> dw(view.router_dw, view.router_dw + l.T * l.K);
  compare_output(r, "dL/dw", dw, ref.dw, audit);
  judged_as_foreign(r, l, saved, view.logits, o.y, o.dx, dw, o.gwr, o.gb, o.g);
}

// Two training steps: forward + backward, an update of every LoRA factor,
// forward + backward again on the same saved state; contracts at the
// caller's level (the case's: full).
// With `r`, every output of the last step judged (judge_step).
std::vector<float> steps(Layer& l, Isa isa, bool base, CaseResult* r = nullptr, bool audit = true) {
  std::vector<float> out;
  layer::Saved saved;
  for (int step = 0; step < 2; ++step) {
    if (step)
      for (auto& f : l.lora)
        for (std::size_t i = 0; i < f.size(); i += 3) f[i] = bf16(f[i].to_float() * 0.75f + 0.01f);
    StepOutputs o(l, base);
    const auto w = l.weights();
    layer::forward(l.cfg, w, {l.x.data(), l.T, l.H}, {o.y.data(), l.T, l.H}, saved, {.isa = isa});
    layer::backward(l.cfg, w, {l.x.data(), l.T, l.H}, {l.dy.data(), l.T, l.H}, saved, o.views);
    if (r && step == 1) judge_step(*r, l, w, saved, o, base, audit);
    o.append_to(out);
  }
  return out;
}

// base: also the base weights' gradients (the small cases: their bounded
// reference costs E I H per routed pair).
CaseResult layer_case(RouterKind kind, Isa isa, Dims dims, bool base, const RunContext& ctx,
                      Data data = Data::normal) {
  CaseResult r;
  if (!isa_usable(isa)) {
    r.verdict = Verdict::skip;
    r.detail = fmt::format("{} not usable on this CPU", isa_name(isa));
    return r;
  }
  Layer a = make(kind, ctx.seed + 3, dims, data);
  // Wide exponents: one operand dominates a row, whose errors are then not
  // independent (the rounding audit's model): the bounds only.
  const auto many = steps(a, isa, base, &r, data != Data::wide);
  Layer b = make(kind, ctx.seed + 3, dims, data);
  std::vector<float> one;
  {  // compared bit for bit with the run judged above: contracts at check suffice
    oneapi::tbb::global_control gc(oneapi::tbb::global_control::max_allowed_parallelism, 1);
    const ContractScope check{Level::check, Semantic::enforce};
    one = steps(b, isa, base);
  }
  r.deterministic = many == one;
  r.digest = digest_of(many);
  expect(r, r.deterministic, "results differ between 1 and N threads");
  if (r.verdict == Verdict::pass) {
    r.detail = fmt::format(
        "2 training steps; y, dx, dL/dw, router, LoRA{} gradients, M_A, M_G within proofs/layer.md "
        "(level full; per output below); judged from tensors as a mixed-precision implementation",
        base ? ", base-weight" : "");
    if (isa ==
        Isa::amx_bf16) {  // every output of both steps, LoRA products fused in the kernel included
      Layer c = make(kind, ctx.seed + 3, dims, data);
      const ContractScope check{Level::check, Semantic::enforce};
      const auto emu = steps(c, Isa::amx_emu, base);
      const bool exact = emu.size() == many.size() &&
                         std::memcmp(emu.data(), many.data(), many.size() * sizeof(float)) == 0;
      r.detail += exact ? "; bit-exact with amx_emu" : "";
      expect(r, exact, "amx_bf16 and amx_emu differ bitwise");
    }
  }
  return r;
}

// The router linear alone, forward and backward (dx accumulated into a
// nonzero dx), contracts at full: every output within its sum's bound.
// The router linear's inputs: the layer's x, W_r, b, and dz and the dx the
// backward accumulates into, both made from dy.
struct RouterLinearInputs {
  std::vector<float> dz, dx_before;
  explicit RouterLinearInputs(const Layer& l) : dz(l.T * l.R), dx_before(l.T * l.H) {
    for (std::size_t i = 0; i < dx_before.size(); ++i) dx_before[i] = l.dy[i] * 0.5f;
    for (std::size_t i = 0; i < dz.size(); ++i) dz[i] = l.dy[i % l.dy.size()] * 0.25f;
  }
};

// z, dx, dW_r, db of the router linear forward and backward, one after another.
std::vector<float> router_linear_run(const Layer& l, Isa isa) {
  RouterLinearInputs in(l);
  std::vector<float> z(l.T * l.R, NAN), dx = in.dx_before, dwr(l.R * l.H, NAN), db(l.R, NAN);
  const MatView<const float> w{l.wr.data(), l.R, l.H};
  const MatView<const bf16> x{l.x.data(), l.T, l.H};
  layer::router_linear_forward(x, w, {l.b.data(), l.R}, {z.data(), l.T, l.R}, isa);
  layer::router_linear_backward(x, w, {in.dz.data(), l.T, l.R},
                                {.dx = {dx.data(), l.T, l.H},
                                 .router_w = {dwr.data(), l.R, l.H},
                                 .router_b = {db.data(), l.R}},
                                isa);
  for (auto* v : {&dx, &dwr, &db}) z.insert(z.end(), v->begin(), v->end());
  return z;
}

// Each output of router_linear_run against its bounded reference: errors
// and bound utilisation in the report.
void compare_router_linear(CaseResult& r, const Layer& l, const std::vector<float>& run) {
  const RouterLinearInputs in(l);
  const MatView<const float> w{l.wr.data(), l.R, l.H};
  const MatView<const bf16> x{l.x.data(), l.T, l.H};
  const auto grads =
      contracts::router_linear_grads_reference(x, w, {in.dz.data(), l.T, l.R}, in.dx_before);
  const std::pair<const char*, std::vector<bounds::Tracked>> refs[] = {
      {"z", contracts::router_logits_reference(x, w, {l.b.data(), l.R})},
      {"dx", grads.dx},
      {"router_w grad", grads.router_w},
      {"router_b grad", grads.router_b}};
  std::size_t at = 0;
  for (const auto& [name, ref] : refs) {
    compare_output(r, name, std::vector<float>(run.begin() + at, run.begin() + at + ref.size()),
                   ref, false);
    at += ref.size();
  }
}

CaseResult router_linear_case(RouterKind kind, Isa isa, const RunContext& ctx) {
  CaseResult r;
  if (!isa_usable(isa)) {
    r.verdict = Verdict::skip;
    r.detail = fmt::format("{} not usable on this CPU", isa_name(isa));
    return r;
  }
  const Layer l = make(kind, ctx.seed + 5, kSmall);
  const auto many = router_linear_run(l, isa);
  std::vector<float> one;
  {
    oneapi::tbb::global_control gc(oneapi::tbb::global_control::max_allowed_parallelism, 1);
    one = router_linear_run(l, isa);
  }
  r.deterministic = many == one;
  r.digest = digest_of(many);
  expect(r, r.deterministic, "results differ between 1 and N threads");
  compare_router_linear(r, l, many);
  if (r.verdict == Verdict::pass) {
    r.detail = "z, dx, dW_r, db within proofs/layer.md §4 (level full; per output below)";
    if (isa == Isa::amx_bf16) {
      const bool exact = router_linear_run(l, Isa::amx_emu) == many;
      r.detail += exact ? "; bit-exact with amx_emu" : "";
      expect(r, exact, "amx_bf16 and amx_emu differ bitwise");
    }
  }
  return r;
}

// failure mode 3's layer at its real size (E64 H2048 I1408 K6 r8), T = 48:
// uniform data at the fan-in scales; the experts packed for the backward.
Layer failure_mode_3_layer(std::uint64_t seed) {
  constexpr std::size_t E = 64, H = 2048, I = 1408, K = 6, r = 8, T = 48;
  Layer l = Layer::shaped(fixture::layer_config(RouterKind::softmax_topk, E, H, I, K, r, T), T);
  const float sh = 1.7f / std::sqrt(float(H)), si = 1.7f / std::sqrt(float(I));
  fixture::fill_uniform(l.x, seed + 1, 1.7f);
  fixture::fill_uniform(l.wg, seed + 2, sh), fixture::fill_uniform(l.wu, seed + 3, sh);
  fixture::fill_uniform(l.wd, seed + 4, si);
  const float lora_scale[6] = {sh, 0.3f, sh, 0.3f, si, 0.3f};
  for (int i = 0; i < 6; ++i) fixture::fill_uniform(l.lora[i], seed + 5 + i, lora_scale[i]);
  fixture::fill_uniform(l.wr, seed + 11, sh), fixture::fill_uniform(l.b, seed + 12, 0.1f);
  fixture::fill_uniform(l.dy, seed + 13, 1.7f);
  l.pack(true);
  return l;
}

// The rows `tokens` of the layer's expert part as the judge's model reads
// them: x, dy, the kernel's routing, and fp32 copies of only the experts
// those tokens reach (renumbered), their LoRA factors with them.
struct SampledRows {
  contracts::ExpertsTensors t;
  std::vector<float> x, dy, weights, w[3], lora[6];
  std::vector<std::int32_t> idx;
};
SampledRows sampled_rows(const Layer& l, const contracts::LayerSaved& s,
                         const std::vector<std::size_t>& tokens) {
  SampledRows o;
  std::vector<std::int32_t> local(l.E, -1), experts;
  for (const std::size_t t : tokens)
    for (std::size_t j = 0; j < l.K; ++j) {
      const std::int32_t e = s.train.idx[t * l.K + j];
      if (e >= 0 && local[e] < 0)
        local[e] = static_cast<std::int32_t>(experts.size()), experts.push_back(e);
      o.idx.push_back(e >= 0 ? local[e] : -1);
      o.weights.push_back(s.train.weights[t * l.K + j]);
    }
  for (const std::size_t t : tokens)
    for (std::size_t h = 0; h < l.H; ++h)
      o.x.push_back(l.x[t * l.H + h].to_float()), o.dy.push_back(l.dy[t * l.H + h]);
  // Expert e's block of rows_per_expert rows of a stacked matrix, in fp32.
  auto take = [&](std::vector<float>& out, const std::vector<bf16>& m, std::size_t rows_per_expert,
                  std::size_t cols) {
    for (const std::int32_t e : experts) {
      const std::size_t at = static_cast<std::size_t>(e) * rows_per_expert * cols;
      for (std::size_t i = 0; i < rows_per_expert * cols; ++i) out.push_back(m[at + i].to_float());
    }
  };
  take(o.w[0], l.wg, l.I, l.H), take(o.w[1], l.wu, l.I, l.H), take(o.w[2], l.wd, l.H, l.I);
  for (int i = 0; i < 6; ++i) take(o.lora[i], l.lora[i], l.lora_rows(i), l.lora_cols(i));
  const std::size_t n = experts.size(), T = tokens.size();
  o.t = {.E = n,
         .H = l.H,
         .I = l.I,
         .r = l.r,
         .alpha = l.cfg.lora_alpha,
         .x = {o.x.data(), T, l.H},
         .idx = {o.idx.data(), T, l.K},
         .weights = {o.weights.data(), T, l.K},
         .w_gate = {o.w[0].data(), n * l.I, l.H},
         .w_up = {o.w[1].data(), n * l.I, l.H},
         .w_down = {o.w[2].data(), n * l.H, l.I}};
  MatView<const float>* lv[6] = {&o.t.a_gate, &o.t.b_gate, &o.t.a_up,
                                 &o.t.b_up,   &o.t.a_down, &o.t.b_down};
  for (int i = 0; i < 6; ++i) *lv[i] = {o.lora[i].data(), n * l.lora_rows(i), l.lora_cols(i)};
  return o;
}

// One training step of failure mode 3's layer at level check, then y and
// dL/dw of sampled tokens against the judge's mixed-precision model on the
// kernel's routing (proofs/experts.md §4-5; the full reference of every
// output would take minutes at this size).
CaseResult failure_mode_3_case(const RunContext& ctx) {
  CaseResult r;
  const Layer l = failure_mode_3_layer(ctx.seed + 17);
  std::vector<float> y(l.T * l.H, NAN), dx(l.T * l.H, NAN);
  layer::Saved saved;
  const auto w = l.weights();
  layer::forward(l.cfg, w, l.X(), {y.data(), l.T, l.H}, saved);
  layer::Gradients gr;
  gr.dx = {dx.data(), l.T, l.H};
  layer::backward(l.cfg, w, l.X(), l.DY(), saved, gr);
  const auto view = layer::saved_view(saved);
  const std::vector<std::size_t> tokens = {0, l.T / 2, l.T - 1};
  const SampledRows s = sampled_rows(l, view, tokens);
  std::vector<float> y_rows, dw_rows;
  for (const std::size_t t : tokens) {
    y_rows.insert(y_rows.end(), y.begin() + t * l.H, y.begin() + (t + 1) * l.H);
    dw_rows.insert(dw_rows.end(), view.router_dw + t * l.K, view.router_dw + (t + 1) * l.K);
  }
  compare_output(r, "y (3 sampled rows)", y_rows,
                 contracts::experts_model_forward(s.t, bounds::kMixed));
  compare_output(
      r, "dL/dw (3 sampled rows)", dw_rows,
      contracts::experts_model_backward(s.t, {s.dy.data(), tokens.size(), l.H}, bounds::kMixed)
          .dweights);
  r.digest = digest_of(y);
  if (r.verdict == Verdict::pass)
    r.detail = fmt::format(
        "one training step at level check on {}; y and dL/dw of tokens 0, {}, {} within the "
        "mixed-precision model (proofs/experts.md §4-5)",
        isa_name(default_isa()), l.T / 2, l.T - 1);
  return r;
}

CaseResult plan_case(const RunContext&) {
  CaseResult r;
  const MoeConfig cfg{.experts = 256,
                      .hidden = 7168,
                      .inter = 2048,
                      .topk = 8,
                      .lora_rank = 16,
                      .lora_alpha = 32,
                      .max_tokens = 25600};
  const auto p = workspace::plan(cfg, 25600);
  r.detail = fmt::format("total {:.2f} GiB (target <= 16 GiB), lower bound {:.2f} GiB",
                         p.total_bytes / 0x1p30, p.peak_live_bytes / 0x1p30);
  expect(r, p.total_bytes <= (std::uint64_t{16} << 30),
         "failure mode 4 config over 16 GiB: " + r.detail);
  return r;
}

}  // namespace

void add_layer_cases(std::vector<CaseDef>& out, const std::vector<Isa>& isas) {
  std::vector<RouterKind> kinds;  // every registered kind
  for (const contracts::RouterKindInfo* k : contracts::router_kinds()) kinds.push_back(k->kind);
  out.push_back({"workspace.plan", "failure_mode_4", "any", "E256_H7168_I2048_K8_r16_T25600", "-",
                 Suite::smoke, Level::check, plan_case});
  for (const RouterKind kind : kinds)
    for (Isa isa : isas)
      out.push_back({"layer.forward_backward", std::string(router_kind_name(kind)),
                     std::string(isa_name(isa)), "small:E8_H40_I24_K3_r4_T13", "normal",
                     Suite::smoke, Level::full, [kind, isa](const RunContext& ctx) {
                       return layer_case(kind, isa, kSmall, true, ctx);
                     }});
  // One token; every token on one expert; (softmax_topk: the sigmoid's
  // logits must stay >= -87) exponents spread over 2^-8 .. 2^8.
  for (const RouterKind kind : kinds)
    for (Isa isa : isas) {
      out.push_back({"layer.forward_backward", std::string(router_kind_name(kind)),
                     std::string(isa_name(isa)), "one_token:E8_H40_I24_K3_r4_T1", "normal",
                     Suite::smoke, Level::full, [kind, isa](const RunContext& ctx) {
                       return layer_case(kind, isa, kOneToken, true, ctx);
                     }});
      out.push_back({"layer.forward_backward", std::string(router_kind_name(kind)),
                     std::string(isa_name(isa)), "small:E8_H40_I24_K3_r4_T13",
                     kDataNames[int(Data::hot_expert)], Suite::smoke, Level::full,
                     [kind, isa](const RunContext& ctx) {
                       return layer_case(kind, isa, kSmall, true, ctx, Data::hot_expert);
                     }});
    }
  for (Isa isa : isas)
    out.push_back({"layer.forward_backward", "softmax_topk", std::string(isa_name(isa)),
                   "small:E8_H40_I24_K3_r4_T13", kDataNames[int(Data::wide)], Suite::smoke,
                   Level::full, [isa](const RunContext& ctx) {
                     return layer_case(RouterKind::softmax_topk, isa, kSmall, true, ctx,
                                       Data::wide);
                   }});
  for (RouterKind kind : {RouterKind::softmax_topk, RouterKind::product_key})
    for (Isa isa : isas)
      out.push_back(
          {"layer.router_linear", std::string(router_kind_name(kind)), std::string(isa_name(isa)),
           "small:E8_H40_K3_T13", "normal", Suite::smoke, Level::full,
           [kind, isa](const RunContext& ctx) { return router_linear_case(kind, isa, ctx); }});
  out.push_back({"layer.forward_backward", "softmax_topk", "default",
                 "failure_mode_3:E64_H2048_I1408_K6_r8_T48", "uniform", Suite::def, Level::check,
                 failure_mode_3_case});
  for (Isa isa : isas)
    out.push_back({"layer.forward_backward", "softmax_topk", std::string(isa_name(isa)),
                   "realistic:E16_H512_I384_K4_r8_T64", "normal", Suite::def, Level::full,
                   [isa](const RunContext& ctx) {
                     return layer_case(RouterKind::softmax_topk, isa, kRealistic, false, ctx);
                   }});
}

}  // namespace moecert::tools
