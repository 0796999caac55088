// Conformance cases of the experts op with the caller's routing
// (experts.forward_train + experts.backward, every output at level full):
// per ISA and routing class, determinism across thread counts, and
// amx_bf16 bit-exact with amx_emu.
#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>

#include <cmath>
#include <cstring>
#include <random>

#include "contracts/experts/train.hpp"
#include "contracts/judge/ops.hpp"
#include "moecert/experts.hpp"
#include "moecert/isa.hpp"
#include "ops/experts/train.hpp"
#include "tools/conform/case.hpp"

namespace moecert::tools {
namespace {

// The caller's routing: distinct experts per row (normal); a random number
// of -1 tail slots per row (tail); every token on one expert, the other
// slots -1 (one_expert); only the first half of the experts used (idle).
enum class Routing { normal, tail, one_expert, idle };
constexpr const char* kRoutingNames[] = {"normal", "minus1_tail", "one_expert", "idle_experts"};

struct Dims {
  std::size_t E, H, I, K, r, T;
};
constexpr Dims kSmall{8, 40, 24, 3, 4, 13}, kOneToken{8, 40, 24, 3, 4, 1},
    kRealistic{16, 512, 384, 4, 8, 64};

struct Problem {
  Dims d;
  std::vector<bf16> x, wg, wu, wd, lora[6];
  std::vector<std::int32_t> idx;
  std::vector<float> w, dy;
  experts::PackedExperts packed;
  experts::Lora lora_view() const {
    return experts::Lora::stacked(d.E, d.H, d.I, d.r, 2.0 * double(d.r), lora[0].data(),
                                  lora[1].data(), lora[2].data(), lora[3].data(), lora[4].data(),
                                  lora[5].data());
  }
};

void route(Problem& p, Routing routing, std::mt19937_64& rng) {
  const Dims& d = p.d;
  std::normal_distribution<float> nd(0, 1);
  const std::size_t used = routing == Routing::idle ? std::max<std::size_t>(d.E / 2, d.K) : d.E;
  std::vector<std::int32_t> order(used);
  p.idx.assign(d.T * d.K, -1), p.w.assign(d.T * d.K, 0.0f);
  for (std::size_t t = 0; t < d.T; ++t) {
    for (std::size_t e = 0; e < used; ++e) order[e] = static_cast<std::int32_t>(e);
    std::shuffle(order.begin(), order.end(), rng);
    std::size_t valid = d.K;
    if (routing == Routing::tail) valid = rng() % (d.K + 1);
    if (routing == Routing::one_expert) order[0] = 1, valid = 1;
    for (std::size_t j = 0; j < valid; ++j)
      p.idx[t * d.K + j] = order[j], p.w[t * d.K + j] = 0.5f * nd(rng);
  }
}

// wide: every input and weight element (and dy) scaled by 2^U(-8, 8):
// exponents spread along the whole GEMM chain. The chain multiplies them
// (x W, then silu(g) u, then h W_d, and the backward's products of those),
// so wider spreads overflow fp32 legitimately (y_finite).
Problem make(Dims d, Routing routing, std::uint64_t seed, bool wide = false) {
  Problem p;
  p.d = d;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0, 1);
  std::uniform_int_distribution<int> ex(-8, 8);
  auto spread = [&](float v) { return wide ? std::ldexp(v, ex(rng)) : v; };
  auto fill = [&](std::vector<bf16>& v, std::size_t n, float s) {
    v.resize(n);
    for (auto& q : v) q = bf16(spread(nd(rng) * s));
  };
  const float sh = 1 / std::sqrt(float(d.H)), si = 1 / std::sqrt(float(d.I));
  fill(p.x, d.T * d.H, 1), fill(p.wg, d.E * d.I * d.H, sh), fill(p.wu, d.E * d.I * d.H, sh),
      fill(p.wd, d.E * d.H * d.I, si);
  const std::size_t sizes[6] = {d.E * d.r * d.H, d.E * d.I * d.r, d.E * d.r * d.H,
                                d.E * d.I * d.r, d.E * d.r * d.I, d.E * d.H * d.r};
  for (int i = 0; i < 6; ++i) fill(p.lora[i], sizes[i], i % 2 ? 0.3f : (i == 4 ? si : sh));
  route(p, routing, rng);
  p.dy.resize(d.T * d.H);
  for (auto& q : p.dy) q = spread(nd(rng));
  p.packed = experts::PackedExperts::pack(d.E, {p.wg.data(), d.E * d.I, d.H},
                                          {p.wu.data(), d.E * d.I, d.H},
                                          {p.wd.data(), d.E * d.H, d.I}, true);
  return p;
}

// The problem and moecert's outputs as another implementation's tensors,
// judged by `moecert check`'s judge under the declared precision `mixed`
// (every clause of experts.forward_train and experts.backward it applies,
// with `audit` the rounding audit): fails the case on any failed clause.
void judged_as_foreign(CaseResult& r, const Problem& p, const std::vector<float>& y,
                       const std::vector<float>& dx, const std::vector<float>& dw,
                       const std::vector<float> (&weight_grads)[9], bool audit) {
  namespace jg = contracts::judge;
  const Dims& d = p.d;
  auto values = [](const std::vector<bf16>& v, std::size_t rows) {
    jg::Tensor t{.rows = rows, .cols = v.size() / rows};
    for (const bf16 b : v) t.f.push_back(b.to_float());
    return t;
  };
  jg::Tensors in{{"x", values(p.x, d.T)},
                 {"w_gate", values(p.wg, d.E * d.I)},
                 {"w_up", values(p.wu, d.E * d.I)},
                 {"w_down", values(p.wd, d.E * d.H)},
                 {"weights", {.f = p.w, .rows = d.T, .cols = d.K}},
                 {"idx", {.i = p.idx, .rows = d.T, .cols = d.K}},
                 {"dy", {.f = p.dy, .rows = d.T, .cols = d.H}}};
  const auto shapes = contracts::lora_shapes(d.E, d.H, d.I, d.r);
  for (int i = 0; i < 6; ++i) in[shapes[i].name] = values(p.lora[i], shapes[i].rows);
  const jg::Params params{{"precision", "mixed"},
                          {"alpha", fmt::format("{}", 2.0 * double(d.r))},
                          {"audit", audit ? "true" : "false"}};
  jg::Tensors grads{{"dx", {.f = dx, .rows = d.T, .cols = d.H}},
                    {"dweights", {.f = dw, .rows = d.T, .cols = d.K}}};
  const auto names = contracts::grad_shapes(d.E, d.H, d.I, d.r);
  for (int i = 0; i < 9; ++i)
    grads[fmt::format("{}_grad", names[i].name)] = {
        .f = weight_grads[i], .rows = names[i].rows, .cols = names[i].cols};
  const jg::Verdict verdicts[] = {jg::judge_op("experts.forward_train", in,
                                               {{"y", {.f = y, .rows = d.T, .cols = d.H}}}, params),
                                  jg::judge_op("experts.backward", in, grads, params)};
  for (const auto& v : verdicts)
    for (const auto& c : v.clauses)
      if (!c.passed)
        expect(r, false, "judged as another implementation: " + c.violations.front().one_line());
}

// Forward, then a backward asking for every output (fresh buffers hold
// NaN, as a caller's might); the outputs in one vector. With `r`, each
// output against its bounded reference (proofs/experts.md), one row each.
std::vector<float> forward_backward(const Problem& p, Isa isa, CaseResult* r = nullptr,
                                    bool audit = true) {
  const Dims& d = p.d;
  std::vector<float> y(d.T * d.H, NAN), dx(d.T * d.H, NAN), dw(d.T * d.K, NAN), ma(d.T * d.E, NAN),
      mg(d.T * d.E, NAN);
  std::vector<float> g[9];
  const std::size_t rows[9] = {d.E * d.r, d.E * d.I, d.E * d.r, d.E * d.I, d.E * d.r,
                               d.E * d.H, d.E * d.I, d.E * d.I, d.E * d.H};
  const std::size_t cols[9] = {d.H, d.r, d.H, d.r, d.I, d.r, d.H, d.H, d.I};
  experts::Gradients gr;
  gr.dx = {dx.data(), d.T, d.H}, gr.dweights = {dw.data(), d.T, d.K};
  MatView<float>* v[9] = {&gr.a_gate, &gr.b_gate, &gr.a_up, &gr.b_up,  &gr.a_down,
                          &gr.b_down, &gr.w_gate, &gr.w_up, &gr.w_down};
  for (int i = 0; i < 9; ++i)
    g[i].assign(rows[i] * cols[i], NAN), *v[i] = {g[i].data(), rows[i], cols[i]};
  gr.m_a = {ma.data(), d.T, d.E}, gr.m_g = {mg.data(), d.T, d.E};
  experts::Saved saved;
  experts::forward_train(p.packed, p.lora_view(), {p.x.data(), d.T, d.H}, {p.idx.data(), d.T, d.K},
                         {p.w.data(), d.T, d.K}, {y.data(), d.T, d.H}, saved, {.isa = isa});
  experts::backward(p.packed, p.lora_view(), {p.x.data(), d.T, d.H}, {p.dy.data(), d.T, d.H}, saved,
                    gr);
  if (r) {
    const auto data = contracts::experts_data<bounds::Tracked>(
        p.packed, p.lora_view(), {p.x.data(), d.T, d.H},
        MatView<const float>{p.dy.data(), d.T, d.H}, experts::saved_view(saved.impl()));
    const auto ref = ref::layer_reference(data, true, {.base = true});
    const std::pair<const char*, const std::vector<bounds::Tracked>*> refs[] = {
        {"a_gate grad", &ref.dag}, {"b_gate grad", &ref.dbg}, {"a_up grad", &ref.dau},
        {"b_up grad", &ref.dbu},   {"a_down grad", &ref.dad}, {"b_down grad", &ref.dbd},
        {"w_gate grad", &ref.dwg}, {"w_up grad", &ref.dwu},   {"w_down grad", &ref.dwd}};
    compare_output(*r, "y", y, ref.y, audit);
    compare_output(*r, "dx", dx, ref.dx, audit);
    compare_output(*r, "dweights", dw, ref.dw, audit);
    compare_output(*r, "m_a", ma, ref.m_a);
    compare_output(*r, "m_g", mg, ref.m_g);
    for (int i = 0; i < 9; ++i) compare_output(*r, refs[i].first, g[i], *refs[i].second);
    judged_as_foreign(*r, p, y, dx, dw, g, audit);
  }
  std::vector<float> out;
  for (const auto* o : {&y, &dx, &dw, &ma, &mg}) out.insert(out.end(), o->begin(), o->end());
  for (const auto& o : g) out.insert(out.end(), o.begin(), o.end());
  return out;
}

CaseResult train_case(Routing routing, Isa isa, Dims dims, const RunContext& ctx,
                      bool wide = false) {
  if (!isa_usable(isa))
    return CaseResult::only(Verdict::skip, fmt::format("{} not usable on this CPU", isa_name(isa)));
  CaseResult r;
  const Problem p = make(dims, routing, ctx.seed + 11, wide);
  // Wide exponents: one operand dominates a row, whose errors are then not
  // independent (the audit's model): the bounds only.
  const auto many = forward_backward(p, isa, &r, !wide);
  std::vector<float> one;
  {  // compared bit for bit with the run judged above: contracts at check suffice
    oneapi::tbb::global_control gc(oneapi::tbb::global_control::max_allowed_parallelism, 1);
    const ContractScope check{Level::check, Semantic::enforce};
    one = forward_backward(p, isa);
  }
  r.deterministic = std::memcmp(many.data(), one.data(), many.size() * sizeof(float)) == 0;
  r.digest = digest_of(many);
  expect(r, r.deterministic, "results differ between 1 and N threads");
  if (r.verdict != Verdict::pass) return r;
  r.detail =
      "y, dx, dweights, LoRA and base-weight gradients, M_A, M_G within proofs/experts.md (level "
      "full; per output below); judged from tensors as a mixed-precision implementation";
  if (isa == Isa::amx_bf16) {
    const ContractScope check{Level::check, Semantic::enforce};
    const auto emu = forward_backward(p, Isa::amx_emu);
    const bool exact = std::memcmp(emu.data(), many.data(), many.size() * sizeof(float)) == 0;
    r.detail += exact ? "; bit-exact with amx_emu" : "";
    expect(r, exact, "amx_bf16 and amx_emu differ bitwise");
  }
  return r;
}

}  // namespace

void add_experts_train_cases(std::vector<CaseDef>& out, const std::vector<Isa>& isas) {
  for (Routing routing : {Routing::normal, Routing::tail, Routing::one_expert, Routing::idle})
    for (Isa isa : isas)
      out.push_back({"experts.forward_backward_train", "caller_routing", std::string(isa_name(isa)),
                     "small:E8_H40_I24_K3_r4_T13", kRoutingNames[static_cast<int>(routing)],
                     Suite::smoke, Level::full, [routing, isa](const RunContext& ctx) {
                       return train_case(routing, isa, kSmall, ctx);
                     }});
  for (Isa isa : isas) {
    out.push_back({"experts.forward_backward_train", "caller_routing", std::string(isa_name(isa)),
                   "small:E8_H40_I24_K3_r4_T13", "wide_exponent", Suite::smoke, Level::full,
                   [isa](const RunContext& ctx) {
                     return train_case(Routing::normal, isa, kSmall, ctx, true);
                   }});
    out.push_back({"experts.forward_backward_train", "caller_routing", std::string(isa_name(isa)),
                   "one_token:E8_H40_I24_K3_r4_T1", "normal", Suite::smoke, Level::full,
                   [isa](const RunContext& ctx) {
                     return train_case(Routing::normal, isa, kOneToken, ctx);
                   }});
  }
  for (Isa isa : isas)
    out.push_back(
        {"experts.forward_backward_train", "caller_routing", std::string(isa_name(isa)),
         "realistic:E16_H512_I384_K4_r8_T64", "minus1_tail", Suite::def, Level::full,
         [isa](const RunContext& ctx) { return train_case(Routing::tail, isa, kRealistic, ctx); }});
}

}  // namespace moecert::tools
