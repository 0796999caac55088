// experts.forward_train and experts.backward: within the derived bounds on
// every ISA and routing class, bitwise the layer's expert part, each part
// callable alone, deterministic, and every clause fired.
#include <oneapi/tbb/global_control.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "contracts/bounds/experts.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/engine/compare.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/gemm/pack_audit.hpp"
#include "contracts/judge/experts.hpp"
#include "contracts/judge/ops.hpp"
#include "contracts/reference/experts_model.hpp"
#include "moecert/isa.hpp"
#include "moecert/layer.hpp"
#include "ops/experts/train.hpp"
#include "ops/layer/state.hpp"
#include "ops/workspace/arena.hpp"
#include "support/quantized.hpp"
#include "test_util.hpp"

using namespace moecert;

namespace {

// Routing classes of the caller's idx: distinct experts per row; a random
// number of -1 tail slots per row; every token's first slot on one expert
// (the rest -1); only the first half of the experts used (the rest idle).
enum class Routing { normal, tail, one_expert, idle };

struct Problem {
  std::size_t T, E, H, I, K, r;
  double alpha;
  std::vector<bf16> x, wg, wu, wd, lora[6];
  std::vector<std::int32_t> idx;
  std::vector<float> w, dy;
  experts::PackedExperts packed;
  experts::Lora lora_view() const {
    return experts::Lora::stacked(E, H, I, r, alpha, lora[0].data(), lora[1].data(), lora[2].data(),
                                  lora[3].data(), lora[4].data(), lora[5].data());
  }
  MatView<const bf16> X() const { return {x.data(), T, H}; }
  MatView<const std::int32_t> Idx() const { return {idx.data(), T, K}; }
  MatView<const float> W() const { return {w.data(), T, K}; }
  MatView<const float> DY() const { return {dy.data(), T, H}; }
};

Problem make(std::size_t E, std::size_t H, std::size_t I, std::size_t K, std::size_t r,
             std::size_t T, Routing routing, std::uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0, 1);
  Problem p;
  p.T = T, p.E = E, p.H = H, p.I = I, p.K = K, p.r = r, p.alpha = 2.0 * double(r);
  auto fill = [&](std::vector<bf16>& v, std::size_t n, float scale) {
    v.resize(n);
    for (auto& q : v) q = bf16(nd(rng) * scale);
  };
  const float sh = 1 / std::sqrt(float(H)), si = 1 / std::sqrt(float(I));
  fill(p.x, T * H, 1), fill(p.wg, E * I * H, sh), fill(p.wu, E * I * H, sh),
      fill(p.wd, E * H * I, si);
  const std::size_t sizes[6] = {E * r * H, E * I * r, E * r * H, E * I * r, E * r * I, E * H * r};
  for (int i = 0; i < 6; ++i) fill(p.lora[i], sizes[i], i % 2 ? 0.3f : (i == 4 ? si : sh));
  const std::size_t used = routing == Routing::idle ? std::max<std::size_t>(E / 2, K) : E;
  std::vector<std::int32_t> order(used);
  p.idx.assign(T * K, -1), p.w.assign(T * K, 0.0f);
  for (std::size_t t = 0; t < T; ++t) {
    for (std::size_t e = 0; e < used; ++e) order[e] = static_cast<std::int32_t>(e);
    std::shuffle(order.begin(), order.end(), rng);
    std::size_t valid = K;
    if (routing == Routing::tail) valid = rng() % (K + 1);
    if (routing == Routing::one_expert) order[0] = 2, valid = 1;
    for (std::size_t j = 0; j < valid; ++j)
      p.idx[t * K + j] = order[j], p.w[t * K + j] = 0.5f * nd(rng);
  }
  p.dy.resize(T * H);
  for (auto& q : p.dy) q = nd(rng);
  p.packed = experts::PackedExperts::pack(E, {p.wg.data(), E * I, H}, {p.wu.data(), E * I, H},
                                          {p.wd.data(), E * H, I}, true);
  return p;
}

// Every output, NaN-filled first (each must be written).
struct Out {
  std::vector<float> y, dx, dw, g[6], base[3], ma, mg;
  experts::Gradients views(const Problem& p) {
    dx.assign(p.T * p.H, NAN), dw.assign(p.T * p.K, NAN), ma.assign(p.T * p.E, NAN),
        mg.assign(p.T * p.E, NAN);
    const std::size_t rows[6] = {p.E * p.r, p.E * p.I, p.E * p.r, p.E * p.I, p.E * p.r, p.E * p.H};
    const std::size_t cols[6] = {p.H, p.r, p.H, p.r, p.I, p.r};
    experts::Gradients v;
    MatView<float>* lv[6] = {&v.a_gate, &v.b_gate, &v.a_up, &v.b_up, &v.a_down, &v.b_down};
    for (int i = 0; i < 6 && p.r; ++i)
      g[i].assign(rows[i] * cols[i], NAN), *lv[i] = {g[i].data(), rows[i], cols[i]};
    for (int i = 0; i < 3; ++i) base[i].assign(p.E * p.I * p.H, NAN);
    v.w_gate = {base[0].data(), p.E * p.I, p.H}, v.w_up = {base[1].data(), p.E * p.I, p.H};
    v.w_down = {base[2].data(), p.E * p.H, p.I};
    v.dx = {dx.data(), p.T, p.H}, v.dweights = {dw.data(), p.T, p.K};
    v.m_a = {ma.data(), p.T, p.E}, v.m_g = {mg.data(), p.T, p.E};
    return v;
  }
  std::vector<float> all() const {
    std::vector<float> a;
    for (const auto* v : {&y, &dx, &dw, &ma, &mg}) a.insert(a.end(), v->begin(), v->end());
    for (const auto& v : g) a.insert(a.end(), v.begin(), v.end());
    for (const auto& v : base) a.insert(a.end(), v.begin(), v.end());
    return a;
  }
};

// A request for dx and dweights only (either may be empty).
experts::Gradients only(MatView<float> dx, MatView<float> dw) {
  experts::Gradients g;
  g.dx = dx, g.dweights = dw;
  return g;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// forward_train, then a backward asking for every output, into o; saved
// keeps the state. The gradients' views into o.
experts::Gradients train_step(const Problem& p, Out& o, experts::Saved& saved) {
  o.y.assign(p.T * p.H, NAN);
  experts::forward_train(p.packed, p.lora_view(), p.X(), p.Idx(), p.W(), {o.y.data(), p.T, p.H},
                         saved);
  const auto g = o.views(p);
  experts::backward(p.packed, p.lora_view(), p.X(), p.DY(), saved, g);
  return g;
}

Out run(const Problem& p, std::optional<Isa> isa = {}) {
  Out o;
  o.y.assign(p.T * p.H, NAN);
  experts::Saved saved;
  experts::forward_train(p.packed, p.lora_view(), p.X(), p.Idx(), p.W(), {o.y.data(), p.T, p.H},
                         saved, {.isa = isa});
  experts::backward(p.packed, p.lora_view(), p.X(), p.DY(), saved, o.views(p));
  return o;
}

// p's LoRA factors (p.lora's order) with element `at` of factor `i` raised
// by 1: the caller's factors unlike those an op ran with.
struct ChangedLora {
  std::vector<bf16> f[6];
  experts::Lora view(const Problem& p) const {
    return experts::Lora::stacked(p.E, p.H, p.I, p.r, p.alpha, f[0].data(), f[1].data(),
                                  f[2].data(), f[3].data(), f[4].data(), f[5].data());
  }
};
ChangedLora changed_lora(const Problem& p, int i, std::size_t at) {
  ChangedLora c;
  for (int k = 0; k < 6; ++k) c.f[k] = p.lora[k];
  c.f[i][at] = bf16(c.f[i][at].to_float() + 1.0f);
  return c;
}

bool checked(std::string_view id) {
  for (const auto& c : clause_counts())
    if (c.id == id) return c.checked > 0;
  return false;
}

std::vector<Isa> kernel_isas() {
  std::vector<Isa> v = usable_isas();
  v.push_back(Isa::amx_emu);
  return v;
}

}  // namespace

TEST_CASE("experts.backward: every output within its derived bound, every ISA and routing class",
          "[experts][train]") {
  for (Isa isa : kernel_isas())
    for (Routing routing : {Routing::normal, Routing::tail, Routing::one_expert, Routing::idle})
      for (std::size_t r : {std::size_t{0}, std::size_t{4}}) {
        INFO(isa_name(isa) << " routing " << int(routing) << " r=" << r);
        const Problem p = make(8, 40, 24, 3, r, 13, routing);
        reset_clause_counts();
        ContractScope s{Level::full, Semantic::enforce};
        const Out o = run(p, isa);
        for (const char* id :
             {"experts.forward_train.within_bound", "experts.backward.within_bound",
              "experts.backward.dweights_masked", "experts.backward.empty_expert_zero"})
          CHECK(checked(id));
        for (std::size_t t = 0; t < p.T; ++t)
          for (std::size_t j = 0; j < p.K; ++j)
            if (p.idx[t * p.K + j] < 0) CHECK(o.dw[t * p.K + j] == 0.0f);
      }
}

TEST_CASE("experts.backward: a dy with rows wider than H is read by its stride (full)",
          "[experts][train]") {
  const Problem p = make(8, 40, 24, 3, 4, 13, Routing::tail);
  const Out dense = run(p);
  const std::size_t ld = p.H + 3;
  std::vector<float> wide(p.T * ld, NAN);  // NaN between the rows: read only if misread
  for (std::size_t t = 0; t < p.T; ++t)
    std::copy_n(p.dy.data() + t * p.H, p.H, wide.data() + t * ld);
  Out o;
  o.y.assign(p.T * p.H, NAN);
  experts::Saved saved;
  ContractScope s{Level::full, Semantic::enforce};
  experts::forward_train(p.packed, p.lora_view(), p.X(), p.Idx(), p.W(), {o.y.data(), p.T, p.H},
                         saved);
  experts::backward(p.packed, p.lora_view(), p.X(), {wide.data(), p.T, p.H, ld}, saved, o.views(p));
  CHECK(o.dx == dense.dx);
  CHECK(o.dw == dense.dw);
}

TEST_CASE(
    "experts.forward_train: the judge's model of a mixed-precision implementation bounds the "
    "kernel "
    "on every ISA; the fp32 model does not",
    "[experts][train][judge]") {
  for (Isa isa : kernel_isas())
    for (std::size_t r : {std::size_t{0}, std::size_t{4}}) {
      INFO(isa_name(isa) << " r=" << r);
      const Problem p = make(8, 40, 24, 3, r, 13, Routing::tail);
      const Out o = run(p, isa);
      // The inputs as another implementation would hand them to the judge.
      auto widen = [](const std::vector<bf16>& v) {
        std::vector<float> f(v.size());
        for (std::size_t i = 0; i < v.size(); ++i) f[i] = v[i].to_float();
        return f;
      };
      const std::vector<float> x = widen(p.x), wg = widen(p.wg), wu = widen(p.wu), wd = widen(p.wd);
      std::vector<float> lora[6];
      for (int i = 0; i < 6; ++i) lora[i] = widen(p.lora[i]);
      const auto shapes = contracts::lora_shapes(p.E, p.H, p.I, p.r);
      contracts::ExpertsTensors t{.E = p.E,
                                  .H = p.H,
                                  .I = p.I,
                                  .r = p.r,
                                  .alpha = p.alpha,
                                  .x = {x.data(), p.T, p.H},
                                  .idx = p.Idx(),
                                  .weights = p.W(),
                                  .w_gate = {wg.data(), p.E * p.I, p.H},
                                  .w_up = {wu.data(), p.E * p.I, p.H},
                                  .w_down = {wd.data(), p.E * p.H, p.I}};
      MatView<const float>* lv[] = {&t.a_gate, &t.b_gate, &t.a_up, &t.b_up, &t.a_down, &t.b_down};
      for (int i = 0; i < 6; ++i) *lv[i] = {lora[i].data(), shapes[i].rows, shapes[i].cols};
      auto utilisation = [&](const bounds::Precision& prec) {
        const auto ref = contracts::experts_model_forward(t, prec);
        std::vector<double> v(ref.size()), b(ref.size());
        for (std::size_t i = 0; i < ref.size(); ++i)
          v[i] = ref[i].v, b[i] = bounds::kReferenceSlack * ref[i].e;
        return compare::bounded(o.y, v, b).max_utilization;
      };
      CHECK(utilisation(bounds::kMixed) <= 1);
      CHECK(utilisation(bounds::kBf16) <= utilisation(bounds::kMixed));  // a wider family
      CHECK(utilisation(bounds::kFp32) > 1);  // h is rounded to bf16: not an fp32 computation
      // The backward's dx, dL/dw (§5) and every weight gradient (§6).
      const auto back = contracts::experts_model_backward(t, p.DY(), bounds::kMixed, true);
      std::vector<std::pair<const std::vector<float>*, const std::vector<bounds::Tracked>*>> outs{
          {&o.dx, &back.dx}, {&o.dw, &back.dweights}};
      for (int i = 0; i < 6 && p.r; ++i) outs.emplace_back(&o.g[i], &back.weight_grads[i]);
      for (int i = 0; i < 3; ++i) outs.emplace_back(&o.base[i], &back.weight_grads[6 + i]);
      for (const auto& [got, ref] : outs) {
        REQUIRE(got->size() == ref->size());
        std::vector<double> v(ref->size()), b(ref->size());
        for (std::size_t i = 0; i < ref->size(); ++i)
          v[i] = (*ref)[i].v, b[i] = bounds::kReferenceSlack * (*ref)[i].e;
        CHECK(compare::bounded(*got, v, b).max_utilization <= 1);
      }
    }
}

TEST_CASE(
    "experts.forward_train: the layer's expert part, bit for bit (y, dx, dL/dw, every weight "
    "gradient, M_A, M_G)",
    "[experts][train][layer]") {
  for (Isa isa : kernel_isas())
    for (RouterKind kind : {RouterKind::softmax_topk, RouterKind::sigmoid_topk}) {
      INFO(isa_name(isa) << " " << router_kind_name(kind));
      Problem p = make(8, 40, 24, 3, 4, 13, Routing::normal);
      const MoeConfig cfg{.experts = 8,
                          .hidden = 40,
                          .inter = 24,
                          .topk = 3,
                          .lora_rank = 4,
                          .lora_alpha = p.alpha,
                          .router = kind,
                          .groups = 2,
                          .topk_group = 2,
                          .scaling = 2.5,
                          .max_tokens = 13};
      std::mt19937_64 rng(7);
      std::normal_distribution<float> nd(0, 1);
      std::vector<float> wr(8 * 40), b(8), bias(8, 0.0f);
      for (auto& v : wr) v = nd(rng) * 0.2f;
      for (auto& v : b) v = nd(rng) * 0.1f;
      const auto lw =
          layer::Weights::stacked(cfg, p.packed, wr.data(), b.data(), bias.data(), p.lora_view());
      Out l;
      l.y.assign(p.T * p.H, NAN);
      layer::Saved ls;
      layer::forward(cfg, lw, p.X(), {l.y.data(), p.T, p.H}, ls, {.isa = isa});
      const auto eg = l.views(p);
      layer::Gradients lg;
      lg.dx = eg.dx, lg.m_a = eg.m_a, lg.m_g = eg.m_g, lg.w_gate = eg.w_gate, lg.w_up = eg.w_up,
      lg.w_down = eg.w_down;
      lg.a_gate = eg.a_gate, lg.b_gate = eg.b_gate, lg.a_up = eg.a_up, lg.b_up = eg.b_up,
      lg.a_down = eg.a_down;
      lg.b_down = eg.b_down;
      layer::backward(cfg, lw, p.X(), p.DY(), ls, lg, {.expert_path = true, .router_path = false});
      layer::backward(cfg, lw, p.X(), p.DY(), ls, {}, {.expert_path = false, .router_path = true});
      const float* ldw = ls.impl().arena.get<float>("router.dw", p.T * p.K);
      l.dw.assign(ldw, ldw + p.T * p.K);
      // The experts op on the layer's own routing.
      p.idx.assign(ls.idx().data, ls.idx().data + p.T * p.K);
      p.w.assign(ls.weights().data, ls.weights().data + p.T * p.K);
      const Out e = run(p, isa);
      CHECK(same_bits(l.all(), e.all()));
    }
}

TEST_CASE(
    "experts.backward: dweights and the expert path each alone give the bits of the full call",
    "[experts][train]") {
  const Problem p = make(8, 40, 24, 3, 4, 13, Routing::tail);
  const Out full = run(p);
  experts::Saved saved;
  std::vector<float> y(p.T * p.H), dw(p.T * p.K, NAN), dx(p.T * p.H, NAN);
  experts::forward_train(p.packed, p.lora_view(), p.X(), p.Idx(), p.W(), {y.data(), p.T, p.H},
                         saved);
  experts::backward(p.packed, p.lora_view(), p.X(), p.DY(), saved, only({}, {dw.data(), p.T, p.K}));
  CHECK(same_bits(dw, full.dw));
  experts::backward(p.packed, p.lora_view(), p.X(), p.DY(), saved, only({dx.data(), p.T, p.H}, {}));
  CHECK(same_bits(dx, full.dx));
  CHECK(same_bits(y, full.y));
}

TEST_CASE("experts.backward: the same bits on 1 thread and on all",
          "[experts][train][determinism]") {
  for (Isa isa : kernel_isas()) {
    const Problem p = make(16, 72, 40, 4, 8, 50, Routing::tail, 3);
    const Out many = run(p, isa);
    oneapi::tbb::global_control gc(oneapi::tbb::global_control::max_allowed_parallelism, 1);
    CHECK(same_bits(run(p, isa).all(), many.all()));
  }
}

// ---- clauses ----------------------------------------------------------------

TEST_CASE("experts.forward_train: preconditions fire and leave y untouched",
          "[experts][train][clauses]") {
  Problem p = make(8, 40, 24, 3, 4, 13, Routing::tail);
  std::vector<float> y(p.T * p.H, 7.0f);
  experts::Saved saved;
  auto fwd = [&](const Problem& q, const experts::Lora& l) {
    return [&, l] {
      experts::forward_train(q.packed, l, q.X(), q.Idx(), q.W(), {y.data(), q.T, q.H}, saved);
    };
  };
  auto expect = [&](const Problem& q, const char* clause, const experts::Lora& l) {
    test::expect_violation(fwd(q, l), clause, Level::check);
    CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 7.0f; }));
  };
  SECTION("shape") {
    experts::Lora l = p.lora_view();
    l.b_down.rows -= 1;
    expect(p, "experts.forward_train.shape", l);
  }
  SECTION("idx_in_range") {
    Problem q = make(8, 40, 24, 3, 4, 13, Routing::tail);
    q.idx[4] = 8;
    expect(q, "experts.forward_train.idx_in_range", q.lora_view());
    q.idx[4] = -1, q.idx[3] = -1, q.w[3] = q.w[4] = 0, q.idx[5] = 1;  // a valid slot after a -1
    expect(q, "experts.forward_train.idx_in_range", q.lora_view());
  }
  SECTION("idx_unique") {
    Problem q = make(8, 40, 24, 3, 4, 13, Routing::normal);
    q.idx[1] = q.idx[0];
    expect(q, "experts.forward_train.idx_unique", q.lora_view());
  }
  SECTION("weight_finite") {
    Problem q = make(8, 40, 24, 3, 4, 13, Routing::normal);
    q.w[2] = NAN;
    expect(q, "experts.forward_train.weight_finite", q.lora_view());
    q.w[2] = 0.5f, q.idx[2] = -1;  // a -1 slot with a weight
    expect(q, "experts.forward_train.weight_finite", q.lora_view());
  }
  SECTION("x_finite") {
    Problem q = make(8, 40, 24, 3, 4, 13, Routing::tail);
    q.x[17] = bf16(INFINITY);
    expect(q, "experts.forward_train.x_finite", q.lora_view());
  }
  SECTION("x_range: at audit; any finite x at check") {
    Problem q = make(8, 40, 24, 3, 4, 13, Routing::tail);
    q.x[17] = bf16(0x1p-70f);
    test::expect_violation(fwd(q, q.lora_view()), "experts.forward_train.x_range", Level::audit);
    CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 7.0f; }));
    q.x[17] = bf16(0x1p70f);
    test::expect_violation(fwd(q, q.lora_view()), "experts.forward_train.x_range", Level::audit);
    q.x[17] = bf16(0x1p-70f);
    ContractScope check{Level::check, Semantic::enforce};
    fwd(q, q.lora_view())();
    CHECK(std::all_of(y.begin(), y.end(), [](float v) { return std::isfinite(v); }));
  }
  SECTION("lora_finite") {
    Problem q = make(8, 40, 24, 3, 4, 13, Routing::tail);
    q.lora[3][5] = bf16(NAN);
    expect(q, "experts.forward_train.lora_finite", q.lora_view());
  }
  SECTION("lora_range: at audit, after lora_finite; any finite factor at check") {
    Problem q = make(8, 40, 24, 3, 4, 13, Routing::tail);
    q.lora[2][7] = bf16(0x1p-70f);
    q.lora[0][9] = bf16(0x1p70f);
    const auto v = test::expect_violation(fwd(q, q.lora_view()), "experts.forward_train.lora_range",
                                          Level::audit);
    CHECK(v.location == fmt::format("lora.a_gate[{}, {}]", 9 / q.H, 9 % q.H));
    CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 7.0f; }));
    q.lora[4][1] = bf16(NAN);  // a non-finite factor is lora_finite's, whatever comes first
    test::expect_violation(fwd(q, q.lora_view()), "experts.forward_train.lora_finite",
                           Level::audit);
    q.lora[4][1] = bf16(0.5f);
    ContractScope check{Level::check, Semantic::enforce};
    fwd(q, q.lora_view())();
  }
  SECTION("lora_finite: the first factor's first offender, whichever expert is packed first") {
    Problem q = make(8, 40, 24, 3, 4, 13, Routing::tail);
    // b_gate [E*I x r]: expert 6's row and a lower one of expert 2; a_down
    // (a later factor) at expert 0.
    q.lora[1][(6 * q.I + 1) * q.r + 2] = bf16(INFINITY);
    q.lora[1][(2 * q.I + 5) * q.r + 1] = bf16(0x1p-70f);  // below 2^-60
    q.lora[4][3] = bf16(NAN);
    const auto v = test::expect_violation(fwd(q, q.lora_view()),
                                          "experts.forward_train.lora_finite", Level::check);
    CHECK(v.location == fmt::format("lora.b_gate[{}, 2]", 6 * q.I + 1));
    CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 7.0f; }));
  }
  SECTION("scale_finite") {
    experts::Lora l = p.lora_view();
    l.alpha = 1e-300;  // an input, not a tolerance: float(alpha / r) underflows to 0
    expect(p, "experts.forward_train.scale_finite", l);
  }
  SECTION("no_alias") {
    Problem q = make(8, 40, 24, 3, 4, 13, Routing::tail);
    std::vector<float> buf(q.T * q.K + q.T * q.H);
    std::copy(q.w.begin(), q.w.end(), buf.begin());
    test::expect_violation(
        [&] {
          experts::forward_train(q.packed, q.lora_view(), q.X(), q.Idx(), {buf.data(), q.T, q.K},
                                 {buf.data() + 1, q.T, q.H}, saved);
        },
        "experts.forward_train.no_alias", Level::check);
  }
}

TEST_CASE("experts.forward_train: the packed LoRA's rank padding and the result clauses fire",
          "[experts][train][clauses]") {
  const Problem p = make(8, 40, 24, 3, 4, 13, Routing::normal);
  SECTION("lora_padding") {
    auto l = experts::PackedLora::pack(p.lora_view(), p.E, p.H, p.I, true);
    auto& w = l.experts[2].b_d;  // column 0's last depth-padding element
    detail::PackAccess::data(w)[(w.kp() / 2 - 1) * 2 * gemm::PackedWeights::kPanel + 1] =
        bf16(1.0f);
    auto v = test::expect_violation(
        [&] {
          detail::Checker c{"experts.forward_train"};
          MOECERT_CONTRACT(c, clauses::experts_train::kFwdLoraPadding) {
            contracts::lora_padding(c, clauses::experts_train::kFwdLoraPadding,
                                    experts::packed_factors(l));
          }
        },
        "experts.forward_train.lora_padding", Level::check);
    CHECK(v.location.rfind("expert 2 b_d", 0) == 0);
  }
  SECTION("lora_padding, judged as each expert's packs are written (the op's path)") {
    contracts::LoraPaddingScan scan;
    const auto judge = experts::judge_packs(nullptr, &scan);
    const auto packed =
        experts::PackedLora::pack(p.lora_view(), p.E, p.H, p.I, true, {},
                                  [&](std::size_t e, const experts::PackedLoraExpert& packs) {
                                    if (e == 2 || e == 5) {  // the lower expert is named
                                      auto& w = const_cast<gemm::PackedWeights&>(packs.a_d_t);
                                      detail::PackAccess::data(w)[w.size() - 1] = bf16(-2.0f);
                                    }
                                    judge(e, packs);
                                  });
    auto v = test::expect_violation(
        [&] {
          detail::Checker c{"experts.forward_train"};
          MOECERT_CONTRACT(c, clauses::experts_train::kFwdLoraPadding) {
            scan.report(c, clauses::experts_train::kFwdLoraPadding);
          }
        },
        "experts.forward_train.lora_padding", Level::check);
    CHECK(v.location.rfind("expert 2 a_d_t", 0) == 0);
    CHECK(v.observed == "-2");
  }
  experts::Saved saved;
  std::vector<float> y(p.T * p.H);
  experts::forward_train(p.packed, p.lora_view(), p.X(), p.Idx(), p.W(), {y.data(), p.T, p.H},
                         saved);
  auto post = [&] {
    detail::Checker c{"experts.forward_train"};
    contracts::experts_train_forward_post(c, p.packed, p.lora_view(), p.X(), {y.data(), p.T, p.H},
                                          experts::saved_view(saved.impl()));
  };
  SECTION("y_finite") {
    y[5] = NAN;
    test::expect_violation(post, "experts.forward_train.y_finite", Level::check);
  }
  SECTION("within_bound") {
    y[5] += 10.0f;  // far past the bound (|y| ~ 1 here, bound ~ 0.2)
    test::expect_violation(post, "experts.forward_train.within_bound", Level::full);
  }
  SECTION("probe") {
    // The saved state (c1 kept) against probes formed from factors that
    // differ from the ones the op ran with in one element of token 0's
    // first expert: each factor is seen by its own GEMM's probe.
    const auto e = static_cast<std::size_t>(p.idx[0]);
    {
      ContractScope s{Level::audit, Semantic::enforce};
      CHECK_NOTHROW(post());
    }
    const struct {
      int factor;        // index into p.lora: a_gate, b_gate, a_up, b_up, a_down, b_down
      std::size_t row;   // the factor's row (expert e's first, or its first column's)
      const char* gemm;  // the GEMM named
    } cases[] = {{0, e * p.r, "xa"},
                 {1, e * p.I, "gate_up"},
                 {3, e * p.I + 1, "gate_up"},
                 {4, e * p.r, "ha"},
                 {5, e * p.H, "down"}};
    for (const auto& cs : cases) {
      DYNAMIC_SECTION("factor " << cs.factor) {
        const std::size_t cols = cs.factor % 2 ? p.r : (cs.factor == 4 ? p.I : p.H);
        const ChangedLora changed = changed_lora(p, cs.factor, cs.row * cols);
        auto v2 = test::expect_violation(
            [&] {
              detail::Checker c{"experts.forward_train"};
              contracts::experts_train_forward_post(c, p.packed, changed.view(p), p.X(),
                                                    {y.data(), p.T, p.H},
                                                    experts::saved_view(saved.impl()));
            },
            "experts.forward_train.probe", Level::audit);
        CHECK(v2.location.find(fmt::format("e={} {} GEMM row", e, cs.gemm)) != std::string::npos);
      }
    }
  }
}

TEST_CASE("experts.backward: the probes pass at audit on every ISA, LoRA or none, either path",
          "[experts][train][numeric]") {
  for (const std::size_t r : {std::size_t{0}, std::size_t{4}})
    for (const Isa isa : kernel_isas()) {
      DYNAMIC_SECTION(isa_name(isa) << " r=" << r) {
        const Problem p = make(8, 72, 40, 3, r, 37, Routing::tail, 11 + r);
        ContractScope s{Level::audit, Semantic::enforce};
        reset_clause_counts();
        experts::Saved saved;
        Out o;
        o.y.assign(p.T * p.H, NAN);
        experts::forward_train(p.packed, p.lora_view(), p.X(), p.Idx(), p.W(),
                               {o.y.data(), p.T, p.H}, saved, {.isa = isa});
        CHECK_NOTHROW(experts::backward(p.packed, p.lora_view(), p.X(), p.DY(), saved, o.views(p)));
        // dL/dw alone: dh without the LoRA term.
        CHECK_NOTHROW(experts::backward(p.packed, p.lora_view(), p.X(), p.DY(), saved,
                                        only({}, {o.dw.data(), p.T, p.K})));
        // Every gradient but dx: the dx rows are judged without the scatter.
        experts::Gradients no_dx = o.views(p);
        no_dx.dx = {};
        CHECK_NOTHROW(experts::backward(p.packed, p.lora_view(), p.X(), p.DY(), saved, no_dx));
        CHECK(checked("experts.backward.probe"));
      }
    }
}

TEST_CASE("experts.backward: probe names the GEMM whose factor differs from the forward's",
          "[experts][train][numeric]") {
  const Problem p = make(8, 40, 24, 3, 4, 13, Routing::normal);
  const auto e = static_cast<std::size_t>(p.idx[0]);
  const struct {
    int factor;  // index into p.lora: a_gate, b_gate, a_up, b_up, a_down, b_down
    std::size_t at;
    const char* gemm;
  } cases[] = {{4, e * p.r * p.I, "dh"},
               {5, e * p.H * p.r, "dyb"},
               {0, e * p.r * p.H, "dx"},
               {3, e * p.I * p.r, "dgb"}};
  for (const auto& cs : cases) {
    DYNAMIC_SECTION("factor " << cs.factor) {
      const ChangedLora changed = changed_lora(p, cs.factor, cs.at);
      experts::Saved saved;
      Out o;
      o.y.assign(p.T * p.H, NAN);
      experts::forward_train(p.packed, p.lora_view(), p.X(), p.Idx(), p.W(), {o.y.data(), p.T, p.H},
                             saved);
      const auto v = test::expect_violation(
          [&] { experts::backward(p.packed, changed.view(p), p.X(), p.DY(), saved, o.views(p)); },
          "experts.backward.probe", Level::audit);
      CHECK(v.location.find(fmt::format("e={} {} GEMM row 0", e, cs.gemm)) != std::string::npos);
    }
  }
}

TEST_CASE("experts.forward_train: the probes pass at audit on every ISA, LoRA or none",
          "[experts][train][numeric]") {
  for (const std::size_t r : {std::size_t{0}, std::size_t{4}})
    for (const Isa isa : kernel_isas()) {
      DYNAMIC_SECTION(isa_name(isa) << " r=" << r) {
        const Problem p = make(8, 72, 40, 3, r, 37, Routing::tail, 7 + r);
        for (const bool training : {true, false}) {
          ContractScope s{Level::audit, Semantic::enforce};
          reset_clause_counts();
          experts::Saved saved;
          std::vector<float> y(p.T * p.H);
          // The op's own path: the gate/up sums from its epilogue.
          CHECK_NOTHROW(experts::forward_train(p.packed, p.lora_view(), p.X(), p.Idx(), p.W(),
                                               {y.data(), p.T, p.H}, saved,
                                               {.isa = isa, .training = training}));
          CHECK(checked("experts.forward_train.probe"));
        }
      }
    }
}

TEST_CASE("experts.backward: preconditions fire and leave the gradients untouched",
          "[experts][train][clauses]") {
  const Problem p = make(8, 40, 24, 3, 4, 13, Routing::tail);
  experts::Saved saved;
  std::vector<float> y(p.T * p.H), dx(p.T * p.H, 7.0f), dw(p.T * p.K, 7.0f);
  const experts::Gradients g = only({dx.data(), p.T, p.H}, {dw.data(), p.T, p.K});
  auto untouched = [&] {
    CHECK(std::all_of(dx.begin(), dx.end(), [](float v) { return v == 7.0f; }));
    CHECK(std::all_of(dw.begin(), dw.end(), [](float v) { return v == 7.0f; }));
  };
  auto bwd = [&](MatView<const float> dy, const experts::Lora& l) {
    return [&, dy, l] { experts::backward(p.packed, l, p.X(), dy, saved, g); };
  };
  SECTION("state: backward before forward") {
    test::expect_violation(bwd(p.DY(), p.lora_view()), "experts.backward.state", Level::check);
    untouched();
  }
  experts::forward_train(p.packed, p.lora_view(), p.X(), p.Idx(), p.W(), {y.data(), p.T, p.H},
                         saved);
  SECTION("state: another alpha, another T, packed without backward") {
    experts::Lora l = p.lora_view();
    l.alpha *= 2;
    test::expect_violation(bwd(p.DY(), l), "experts.backward.state", Level::check);
    test::expect_violation(
        [&] {
          experts::backward(p.packed, p.lora_view(), {p.x.data(), p.T - 1, p.H},
                            {p.dy.data(), p.T - 1, p.H}, saved, {});
        },
        "experts.backward.state", Level::check);
    const auto fwd_only =
        experts::PackedExperts::pack(p.E, {p.wg.data(), p.E * p.I, p.H},
                                     {p.wu.data(), p.E * p.I, p.H}, {p.wd.data(), p.E * p.H, p.I});
    test::expect_violation(
        [&] { experts::backward(fwd_only, p.lora_view(), p.X(), p.DY(), saved, g); },
        "experts.backward.state", Level::check);
    untouched();
  }
  SECTION("shape") {
    test::expect_violation(
        [&] {
          experts::backward(p.packed, p.lora_view(), p.X(), p.DY(), saved,
                            only({}, {dw.data(), p.T, p.K - 1}));
        },
        "experts.backward.shape", Level::check);
    untouched();
  }
  SECTION("dy_finite") {
    std::vector<float> dy = p.dy;
    dy[9] = NAN;
    test::expect_violation(bwd({dy.data(), p.T, p.H}, p.lora_view()), "experts.backward.dy_finite",
                           Level::check);
    untouched();
  }
  SECTION("no_alias") {
    test::expect_violation(
        [&] {
          experts::backward(p.packed, p.lora_view(), p.X(), p.DY(), saved,
                            only({dx.data(), p.T, p.H}, {dx.data(), p.T, p.K}));
        },
        "experts.backward.no_alias", Level::check);
    untouched();
  }
  SECTION("saved_finite: a saved buffer overwritten (failure mode 3)") {
    saved.impl().st.c1[saved.impl().st.grouping.begin[1] * saved.impl().st.ldc1] = NAN;
    if (saved.impl().st.grouping.count[1]) {
      test::expect_violation(bwd(p.DY(), p.lora_view()), "experts.backward.saved_finite",
                             Level::check);
      untouched();
    }
  }
  // h and ha are judged through dL/dw's sums where it is formed, in the
  // SwiGLU pass (h) where it is not; either way before any output is written.
  const auto& st = saved.impl().st;
  REQUIRE(st.grouping.count[1] > 0);
  const std::size_t q = st.grouping.begin[1];  // expert 1's first row
  auto expect_saved = [&](const experts::Gradients& gr, std::string_view where) {
    auto v = test::expect_violation(
        [&] { experts::backward(p.packed, p.lora_view(), p.X(), p.DY(), saved, gr); },
        "experts.backward.saved_finite", Level::check);
    CHECK(v.location == where);
    untouched();
  };
  SECTION("saved_finite: h, through dL/dw (dL/dw alone) and the SwiGLU pass (dx alone)") {
    st.h[gemm::a_offset(st.layout, st.ldh, q, 5)] = bf16(INFINITY);
    const std::string where = fmt::format("experts.h row {} col 5", q);
    expect_saved(only({}, {dw.data(), p.T, p.K}), where);
    expect_saved(only({dx.data(), p.T, p.H}, {}), where);
    expect_saved(g, where);
  }
  SECTION("saved_finite: ha through dL/dw, xa in the SwiGLU pass") {
    st.ha[q * p.r + 2] = NAN;
    expect_saved(only({}, {dw.data(), p.T, p.K}), fmt::format("lora.ha row {} col 2", q));
    st.ha[q * p.r + 2] = 0.5f;
    st.xa[q * 2 * p.r + 3] = -INFINITY;
    expect_saved(only({dx.data(), p.T, p.H}, {}), fmt::format("lora.xa row {} col 3", q));
  }
}

TEST_CASE("experts.backward: saved_intact catches a finite change to the saved gate/up rows",
          "[experts][train][memory]") {
  // failure mode 3 with a finite writer: another buffer's values land on c1
  // between the forward and the backward. One ulp is finite and within any
  // bound; the block digests the audited forward recorded still differ.
  for (const Isa isa : kernel_isas()) DYNAMIC_SECTION(isa_name(isa)) {
      const Problem p = make(8, 40, 24, 3, 4, 13, Routing::tail);
      experts::Saved saved;
      std::vector<float> y(p.T * p.H), dx(p.T * p.H, 7.0f), dw(p.T * p.K, 7.0f);
      const experts::Gradients g = only({dx.data(), p.T, p.H}, {dw.data(), p.T, p.K});
      auto forward = [&](Level level) {
        ContractScope s{level, Semantic::enforce};
        experts::forward_train(p.packed, p.lora_view(), p.X(), p.Idx(), p.W(), {y.data(), p.T, p.H},
                               saved, {.isa = isa});
      };
      auto backward = [&] { experts::backward(p.packed, p.lora_view(), p.X(), p.DY(), saved, g); };
      auto untouched = [&] {
        CHECK(std::all_of(dx.begin(), dx.end(), [](float v) { return v == 7.0f; }));
        CHECK(std::all_of(dw.begin(), dw.end(), [](float v) { return v == 7.0f; }));
      };
      forward(Level::audit);
      auto& st = saved.impl().st;
      REQUIRE(st.grouping.count[1] > 0);
      const std::size_t q = st.grouping.begin[1];
      REQUIRE(st.ldc1 == 64);  // I = 24: two panel pairs; column 37 is gate 21
      float& v = st.c1[q * st.ldc1 + 37];
      const float old = v;
      v = std::nextafter(v, INFINITY);
      auto violation =
          test::expect_violation(backward, "experts.backward.saved_intact", Level::audit);
      CHECK(violation.location == fmt::format("experts.c1 row {}", q));
      untouched();
      // A NaN there is saved_finite's, named by element.
      v = NAN;
      violation = test::expect_violation(backward, "experts.backward.saved_finite", Level::audit);
      CHECK(violation.location == fmt::format("experts.c1 row {} col 37", q));
      // h and the LoRA rows are scanned up front, c1 left to the SwiGLU pass.
      v = old;
      bf16& h = st.h[gemm::a_offset(st.layout, st.ldh, q, 5)];
      const bf16 h_old = h;
      h = bf16(INFINITY);
      violation = test::expect_violation(backward, "experts.backward.saved_finite", Level::audit);
      CHECK(violation.location == fmt::format("experts.h row {} col 5", q));
      untouched();
      // Restored, the backward runs, also with a NaN in h's K padding, which
      // it does not read (the up-front scan's regions hold it; its row scan
      // decides); a forward at check records nothing to judge.
      h = h_old;
      bf16& pad = st.h[gemm::a_offset(st.layout, st.ldh, q, p.I)];
      pad = bf16(NAN);
      reset_clause_counts();
      {
        ContractScope s{Level::audit, Semantic::enforce};
        CHECK_NOTHROW(backward());
      }
      pad = bf16{};
      CHECK(checked("experts.backward.saved_intact"));
      forward(Level::check);
      reset_clause_counts();
      st.c1[q * st.ldc1 + 37] = NAN;
      violation = test::expect_violation(backward, "experts.backward.saved_finite", Level::audit);
      CHECK(violation.location == fmt::format("experts.c1 row {} col 37", q));
      CHECK_FALSE(checked("experts.backward.saved_intact"));
    }
}

TEST_CASE("experts.backward: dh beyond fp32 marks rows, then grad_finite names the output",
          "[experts][train][clauses]") {
  // dy finite but so large that dh = dy W_d leaves fp32: dL/dw's sums are
  // not finite, the saved rows are, so saved_finite passes and grad_finite,
  // judged on the blocks as they are written, names the same first element
  // as a scan of its own.
  const Problem p = make(8, 40, 24, 3, 4, 13, Routing::tail);
  Out o;
  experts::Saved saved;
  const auto g = o.views(p);
  std::vector<float> y(p.T * p.H);
  experts::forward_train(p.packed, p.lora_view(), p.X(), p.Idx(), p.W(), {y.data(), p.T, p.H},
                         saved);
  std::vector<float> dy(p.dy.size(), 3e38f);
  ContractScope scope{{Level::check, Semantic::enforce}};
  std::string fused;
  try {
    experts::backward(p.packed, p.lora_view(), p.X(), {dy.data(), p.T, p.H}, saved, g);
    FAIL("no violation");
  } catch (const ContractViolation& v) {
    CHECK(v.clause() == "experts.backward.grad_finite");
    fused = v.violation().location;
  }
  auto v = test::expect_violation(
      [&] {
        detail::Checker c{"experts.backward"};
        contracts::experts_backward_post(c, p.packed, p.lora_view(), p.X(), {dy.data(), p.T, p.H},
                                         experts::saved_view(saved.impl()), g, nullptr);
      },
      "experts.backward.grad_finite", Level::check);
  CHECK(v.location == fused);
}

TEST_CASE("contracts: GradFiniteScan judges handed blocks and scans the rest",
          "[experts][train][clauses]") {
  std::vector<float> a(6 * 5, 1.0f), b(4 * 3, 1.0f);
  const MatView<const float> av(a.data(), 6, 5, 5), bv(b.data(), 4, 3, 3);
  auto first = [&](auto hand) {
    contracts::GradFiniteScan scan({{"a", av}, {"b", bv}});
    hand(scan);
    return test::expect_violation(
               [&] {
                 detail::Checker c{"experts.backward"};
                 scan.report(c, clauses::experts_train::kBwdGradFinite);
               },
               "experts.backward.grad_finite", Level::check)
        .location;
  };
  a[2 * 5 + 4] = NAN, a[4 * 5 + 1] = INFINITY, b[1] = NAN;
  // Blocks handed out of order: the least offender is kept.
  CHECK(first([&](contracts::GradFiniteScan& s) {
          s.written(a.data(), 3, 6, 0, 5);
          s.written(a.data(), 0, 3, 3, 5);
          s.written(a.data(), 0, 3, 0, 3);
        }) == "a[2, 4]");
  // Rows 0..2 never handed: a is scanned in a pass of its own.
  CHECK(first([&](contracts::GradFiniteScan& s) { s.written(a.data(), 3, 6, 0, 5); }) == "a[2, 4]");
  // Blocks handed by tasks, each task's count once it ends; a pointer that
  // is no output is ignored.
  CHECK(first([&](contracts::GradFiniteScan& s) {
          {
            contracts::GradFiniteScan::Task t(&s, a.data());
            t.add(3, 6, 0, 5);
            t.add(0, 3, 3, 5);
          }
          contracts::GradFiniteScan::Task t(&s, a.data()), none(&s, b.data() + 1);
          t.add(0, 3, 0, 3);
          none.add(0, 1, 0, 1);
        }) == "a[2, 4]");
  CHECK(first([&](contracts::GradFiniteScan& s) {
          contracts::GradFiniteScan::Task t(&s, a.data());
          t.add(4, 5, 0, 5);
        }) == "a[2, 4]");
  // Handed, then written again: reopen() forgets the first hand-over.
  a[2 * 5 + 4] = 1.0f, a[4 * 5 + 1] = 1.0f;
  a[0] = NAN;
  CHECK(first([&](contracts::GradFiniteScan& s) {
          s.written(a.data(), 0, 6, 0, 5);
          a[0] = 1.0f, a[5 * 5 + 2] = NAN;
          s.reopen(a.data());
          s.written(a.data(), 0, 6, 0, 5);
        }) == "a[5, 2]");
  a[5 * 5 + 2] = 1.0f;
  CHECK(first([&](contracts::GradFiniteScan& s) { s.written(a.data(), 0, 6, 0, 5); }) == "b[0, 1]");
}

// The problem's tensors as another implementation hands them to the judge.
contracts::judge::Tensors judge_inputs(const Problem& p) {
  namespace jg = contracts::judge;
  auto values = [](const std::vector<bf16>& v, std::size_t rows, std::size_t cols) {
    jg::Tensor t{.rows = rows, .cols = cols};
    for (const bf16 b : v) t.f.push_back(b.to_float());
    return t;
  };
  jg::Tensors in{{"x", values(p.x, p.T, p.H)},
                 {"w_gate", values(p.wg, p.E * p.I, p.H)},
                 {"w_up", values(p.wu, p.E * p.I, p.H)},
                 {"w_down", values(p.wd, p.E * p.H, p.I)},
                 {"weights", {.f = p.w, .rows = p.T, .cols = p.K}},
                 {"idx", {.i = p.idx, .rows = p.T, .cols = p.K}},
                 {"dy", {.f = p.dy, .rows = p.T, .cols = p.H}}};
  const auto shapes = contracts::lora_shapes(p.E, p.H, p.I, p.r);
  for (int i = 0; i < 6 && p.r; ++i)
    in[shapes[i].name] = values(p.lora[i], shapes[i].rows, shapes[i].cols);
  return in;
}

TEST_CASE(
    "experts.forward, forward_train, backward: the judge's rounding audit catches errors all "
    "toward zero",
    "[experts][train][judge]") {
  for (std::size_t r : {std::size_t{0}, std::size_t{4}}) {
    const Problem p = make(8, 40, 24, 3, r, 13, Routing::normal);
    Out o;
    experts::Saved saved;
    train_step(p, o, saved);
    const auto ref = ref::layer_reference(
        contracts::experts_data<bounds::Tracked>(p.packed, p.lora_view(), p.X(), p.DY(),
                                                 experts::saved_view(saved.impl())),
        true, {.base = true});
    // Half moecert's own bound toward zero on every element.
    auto toward_zero = [](const std::vector<bounds::Tracked>& e, std::size_t rows) {
      contracts::judge::Tensor t{.rows = rows, .cols = e.size() / rows};
      for (const auto& v : e)
        t.f.push_back(static_cast<float>(v.v - std::copysign(0.5 * v.e, v.v)));
      return t;
    };
    contracts::judge::Params params{{"precision", "mixed"}, {"alpha", fmt::format("{}", p.alpha)}};
    const std::string fwd = r ? "experts.forward_train" : "experts.forward";
    auto failed = [](const contracts::judge::Verdict& v, std::string_view id) {
      for (const auto& c : v.clauses)
        if (c.info.id == id) return !c.passed;
      return false;
    };
    const auto in = judge_inputs(p);
    auto v = contracts::judge::judge_op(fwd, in, {{"y", toward_zero(ref.y, p.T)}}, params);
    CHECK(failed(
        v, r ? "experts.forward_train.rounding_unbiased" : "experts.forward.rounding_unbiased"));
    // The kernel's own y: unbiased.
    v = contracts::judge::judge_op(fwd, in, {{"y", {.f = o.y, .rows = p.T, .cols = p.H}}}, params);
    CHECK(v.passed());
    v = contracts::judge::judge_op("experts.backward", in, {{"dx", toward_zero(ref.dx, p.T)}},
                                   params);
    CHECK(failed(v, "experts.backward.rounding_unbiased"));
    // audit=false (data the audit's model does not fit): not evaluated.
    auto no_audit = params;
    no_audit["audit"] = "false";
    v = contracts::judge::judge_op(fwd, in, {{"y", toward_zero(ref.y, p.T)}}, no_audit);
    for (const auto& c : v.clauses)
      if (std::string_view(c.info.id).ends_with("rounding_unbiased")) CHECK_FALSE(c.evaluated);
  }
}

TEST_CASE(
    "experts.forward, forward_train, backward: spread_explained fails an output between the "
    "probabilistic and the worst-case bound, scale_explained an error along y",
    "[experts][train][judge]") {
  // Declared fp32, H = 2048: the accumulations' probabilistic bound
  // (10 sqrt(n) u) is a fifth of the worst case (n u); one element moved
  // between the two.
  for (std::size_t r : {std::size_t{0}, std::size_t{4}}) {
    const Problem p = make(4, 2048, 24, 2, r, 6, Routing::normal);
    contracts::judge::Tensors in = judge_inputs(p);
    const contracts::judge::Params params{{"precision", "fp32"},
                                          {"alpha", fmt::format("{}", p.alpha)}};
    contracts::ExpertsTensors t = contracts::judge::experts_tensors(in, params, true);
    t.idx = p.Idx(), t.weights = p.W();
    // The exact values, one element moved to the middle of its two bounds.
    auto between = [](const std::vector<bounds::Tracked>& worst,
                      const std::vector<bounds::Tracked>& probable, std::size_t rows) {
      contracts::judge::Tensor o{.rows = rows, .cols = worst.size() / rows};
      std::size_t pick = 0;
      for (std::size_t i = 0; i < worst.size(); ++i) {
        o.f.push_back(static_cast<float>(worst[i].v));
        if (probable[i].e / worst[i].e < probable[pick].e / worst[pick].e) pick = i;
      }
      REQUIRE(probable[pick].e < 0.5 * worst[pick].e);
      o.f[pick] = static_cast<float>(worst[pick].v + 0.5 * (worst[pick].e + probable[pick].e));
      return o;
    };
    const auto y =
        between(contracts::experts_model_forward(t, bounds::kFp32),
                contracts::experts_model_forward(t, bounds::probable(bounds::kFp32)), p.T);
    const std::string fwd = r ? "experts.forward_train" : "experts.forward";
    auto failed = [](const contracts::judge::Verdict& v) {
      std::vector<std::string> ids;
      for (const auto& c : v.clauses)
        if (!c.passed) ids.emplace_back(c.info.id);
      return ids;
    };
    CHECK(failed(contracts::judge::judge_op(fwd, in, {{"y", y}}, params)) ==
          std::vector<std::string>{r ? "experts.forward_train.spread_explained"
                                     : "experts.forward.spread_explained"});
    // Every element scaled by 1 + beta, beta twice the projection's bound:
    // within the worst case, not along y (the audit sees the sign too).
    const auto pf = contracts::experts_model_forward_probable(t, bounds::kFp32);
    const double beta =
        2 * (pf.along_y.det + bounds::kProbableLambda * pf.along_y.rnd) / pf.along_y.norm2;
    contracts::judge::Tensor scaled{.rows = p.T, .cols = 2048};
    for (const auto& v : pf.y) scaled.f.push_back(static_cast<float>(v.v * (1 + beta)));
    const auto scale_failed = failed(contracts::judge::judge_op(fwd, in, {{"y", scaled}}, params));
    const auto has = [&](const std::string& id) {
      return std::find(scale_failed.begin(), scale_failed.end(), id) != scale_failed.end();
    };
    CHECK(has(r ? "experts.forward_train.scale_explained" : "experts.forward.scale_explained"));
    CHECK_FALSE(has(fwd + ".within_bound"));
    const auto worst = contracts::experts_model_backward(t, p.DY(), bounds::kFp32);
    const auto probable =
        contracts::experts_model_backward(t, p.DY(), bounds::probable(bounds::kFp32));
    CHECK(failed(contracts::judge::judge_op(
              "experts.backward", in, {{"dx", between(worst.dx, probable.dx, p.T)}}, params)) ==
          std::vector<std::string>{"experts.backward.spread_explained"});
    // Without LoRA, dx scaled by 1 + beta, beta twice its projection's
    // bound: within the element bounds, not along dx.
    if (r) continue;
    const auto& along = probable.along_dx;
    const double dbeta = 2 * (along.det + bounds::kProjectionLambda * along.rnd) / along.norm2;
    contracts::judge::Tensor dx{.rows = p.T, .cols = 2048};
    for (const auto& v : probable.dx) dx.f.push_back(static_cast<float>(v.v * (1 + dbeta)));
    const auto dx_failed =
        failed(contracts::judge::judge_op("experts.backward", in, {{"dx", dx}}, params));
    CHECK(std::find(dx_failed.begin(), dx_failed.end(), "experts.backward.scale_explained") !=
          dx_failed.end());
    CHECK(std::find(dx_failed.begin(), dx_failed.end(), "experts.backward.within_bound") ==
          dx_failed.end());
  }
}

TEST_CASE(
    "experts.backward: the judge reads weight gradients; an idle expert's, a wrong one and a "
    "missing LoRA are named",
    "[experts][train][judge]") {
  const Problem p = make(8, 40, 24, 3, 4, 13, Routing::idle);
  Out o;
  experts::Saved saved;
  train_step(p, o, saved);
  const auto names = contracts::grad_shapes(p.E, p.H, p.I, p.r);
  contracts::judge::Tensors out;
  for (int i = 0; i < 9; ++i)
    out[fmt::format("{}_grad", names[i].name)] = {
        .f = i < 6 ? o.g[i] : o.base[i - 6], .rows = names[i].rows, .cols = names[i].cols};
  const contracts::judge::Params params{{"precision", "mixed"},
                                        {"alpha", fmt::format("{}", p.alpha)}};
  const auto in = judge_inputs(p);
  auto failures = [&](const contracts::judge::Tensors& outputs) {
    std::vector<std::string> ids;
    for (const auto& c :
         contracts::judge::judge_op("experts.backward", in, outputs, params).clauses)
      if (!c.passed) ids.emplace_back(c.info.id);
    return ids;
  };
  CHECK(failures(out).empty());
  // The idle expert (Routing::idle: expert E - 1) with a nonzero gradient.
  auto idle = out;
  idle["b_up_grad"].f.back() = 1e-30f;  // any nonzero value: the clause asks for exactly 0
  using Ids = std::vector<std::string>;
  const Ids beyond_bounds{"experts.backward.within_bound", "experts.backward.spread_explained"};
  CHECK(failures(idle) ==
        Ids{"experts.backward.empty_expert_zero", beyond_bounds[0], beyond_bounds[1]});
  // Off by far more than the bounds (values about 3; the LoRA factors' bounds,
  // through three sums of bf16 operands, about 1).
  auto wrong = out;
  wrong["w_down_grad"].f[5] += 100;
  CHECK(failures(wrong) == beyond_bounds);
  auto lora_wrong = out;
  lora_wrong["a_gate_grad"].f[5] += 100;
  CHECK(failures(lora_wrong) == beyond_bounds);

  auto shape = out;
  shape["a_up_grad"].rows -= 1, shape["a_up_grad"].f.resize(shape["a_up_grad"].rows * p.H);
  CHECK(failures(shape) == std::vector<std::string>{"experts.backward.shape"});
}

TEST_CASE("experts.backward: the result clauses fire on wrong gradients",
          "[experts][train][clauses]") {
  const Problem p = make(8, 40, 24, 3, 4, 13, Routing::idle);
  Out o;
  experts::Saved saved;
  const auto g = train_step(p, o, saved);
  auto post = [&] {
    detail::Checker c{"experts.backward"};
    contracts::experts_backward_post(c, p.packed, p.lora_view(), p.X(), p.DY(),
                                     experts::saved_view(saved.impl()), g, nullptr);
  };
  SECTION("grad_finite") {
    o.g[1][3] = INFINITY;
    test::expect_violation(post, "experts.backward.grad_finite", Level::check);
  }
  SECTION("empty_expert_zero") {
    const std::size_t idle = p.E - 1;            // Routing::idle uses the first half only
    o.base[2][(idle * p.H + 1) * p.I] = 1e-30f;  // any nonzero value breaks an exact-zero clause
    auto v = test::expect_violation(post, "experts.backward.empty_expert_zero", Level::check);
    CHECK(v.location.rfind(fmt::format("expert {} w_down grad", idle), 0) == 0);
    o.base[2][(idle * p.H + 1) * p.I] = 0;
    o.ma[idle] = 0.25f;  // token 0 is not routed to an idle expert
    test::expect_violation(post, "experts.backward.empty_expert_zero", Level::check);
  }
  SECTION("dweights_masked") {
    Problem q = make(8, 40, 24, 3, 4, 13, Routing::tail);
    Out u;
    u.y.assign(q.T * q.H, NAN);
    experts::Saved s2;
    experts::forward_train(q.packed, q.lora_view(), q.X(), q.Idx(), q.W(), {u.y.data(), q.T, q.H},
                           s2);
    const auto g2 = u.views(q);
    experts::backward(q.packed, q.lora_view(), q.X(), q.DY(), s2, g2);
    std::size_t slot = 0;
    while (slot < q.T * q.K && q.idx[slot] >= 0) ++slot;
    REQUIRE(slot < q.T * q.K);
    u.dw[slot] = 0.5f;
    test::expect_violation(
        [&] {
          detail::Checker c{"experts.backward"};
          contracts::experts_backward_post(c, q.packed, q.lora_view(), q.X(), q.DY(),
                                           experts::saved_view(s2.impl()), g2, nullptr);
        },
        "experts.backward.dweights_masked", Level::check);
  }
  SECTION("within_bound") {
    std::size_t slot = 0;
    while (p.idx[slot] < 0) ++slot;
    o.dw[slot] += 10.0f;  // far past the bound
    test::expect_violation(post, "experts.backward.within_bound", Level::full);
  }
}

TEST_CASE(
    "experts: quantized base weights give, on every ISA, the bits of the bf16 pack of the "
    "dequantized weights, every output within its bound",
    "[experts][formats]") {
  constexpr WeightFormat kFormats[] = {WeightFormat::int8_channel, WeightFormat::int4_group,
                                       WeightFormat::fp8_e4m3_block128};
  for (WeightFormat f : kFormats)
    for (Isa isa : kernel_isas()) {
      DYNAMIC_SECTION(format_name(f) << " " << isa_name(isa)) {
        Problem p = make(4, 40, 136, 3, 4, 11, Routing::tail, 17);  // I past one 128-block
        std::mt19937_64 rng(23);
        // Scales near 1 / (the codes' magnitude sqrt(fan-in)): weights of the bf16 problem's size.
        const int lo = f == WeightFormat::fp8_e4m3_block128 ? -12 : -13;
        std::vector<fixture::QuantMatrix> q[3];
        std::vector<QuantView> views[3];
        std::vector<bf16>* dense[3] = {&p.wg, &p.wu, &p.wd};
        for (int m = 0; m < 3; ++m)
          for (std::size_t e = 0; e < p.E; ++e) {
            const std::size_t rows = m == 2 ? p.H : p.I, cols = m == 2 ? p.I : p.H;
            q[m].push_back(fixture::random_quantized(f, rows, cols, rng, lo, lo + 3));
            const auto w = q[m].back().dequantized();
            std::copy(w.begin(), w.end(), dense[m]->begin() + e * rows * cols);
          }
        for (int m = 0; m < 3; ++m)
          for (const auto& x : q[m]) views[m].push_back(x.view);
        ContractScope full{Level::full, Semantic::enforce};  // within_bound and probes too
        p.packed = experts::PackedExperts::pack(p.E, {p.wg.data(), p.E * p.I, p.H},
                                                {p.wu.data(), p.E * p.I, p.H},
                                                {p.wd.data(), p.E * p.H, p.I}, true);
        std::vector<float> y(p.T * p.H, NAN), y16(p.T * p.H, NAN);  // inference, no LoRA
        experts::forward(p.packed, p.X(), p.Idx(), p.W(), {y16.data(), p.T, p.H}, {.isa = isa});
        const Out bf16_pack = run(p, isa);
        p.packed = experts::PackedExperts::pack(views[0], views[1], views[2], true);
        REQUIRE(p.packed.format() == f);
        const Out quantized = run(p, isa);
        CHECK(same_bits(bf16_pack.all(), quantized.all()));
        experts::forward(p.packed, p.X(), p.Idx(), p.W(), {y.data(), p.T, p.H}, {.isa = isa});
        CHECK(same_bits(y, y16));
      }
    }
}

TEST_CASE("experts.pack: shape clause on quantized views", "[experts][formats][shape]") {
  std::mt19937_64 rng(29);
  const auto m = [&](WeightFormat f, std::size_t rows, std::size_t cols) {
    return fixture::random_quantized(f, rows, cols, rng, -8, -6);
  };
  const auto g = m(WeightFormat::int8_channel, 16, 32), u = m(WeightFormat::int8_channel, 16, 32),
             d = m(WeightFormat::int8_channel, 32, 16), d2 = m(WeightFormat::int8_channel, 32, 17),
             u4 = m(WeightFormat::int4_group, 16, 32);
  const auto expect = [](std::vector<QuantView> gs, std::vector<QuantView> us,
                         std::vector<QuantView> ds, std::string_view location) {
    const auto v = test::expect_violation([&] { (void)experts::PackedExperts::pack(gs, us, ds); },
                                          "experts.pack.shape", Level::check);
    CHECK(v.location == location);
  };
  expect({}, {}, {}, "");
  expect({g.view, g.view}, {u.view}, {d.view, d.view}, "");
  expect({g.view, g.view}, {u.view, u4.view}, {d.view, d.view}, "w_up[1]");
  expect({g.view, g.view}, {u.view, u.view}, {d.view, d2.view}, "w_down[1]");
  CHECK(experts::PackedExperts::pack({g.view}, {u.view}, {d.view}).experts() == 1);
}

TEST_CASE("experts: a quantized pack's codes and scales read back bitwise", "[experts][formats]") {
  std::mt19937_64 rng(31);
  for (WeightFormat f :
       {WeightFormat::int8_channel, WeightFormat::int4_group, WeightFormat::fp8_e4m3_block128}) {
    DYNAMIC_SECTION(format_name(f)) {
      const std::size_t E = 3, H = 200, I = 136;
      std::vector<fixture::QuantMatrix> q[3], back[3];
      std::vector<QuantView> views[3];
      std::vector<QuantOut> outs[3];
      for (int m = 0; m < 3; ++m)
        for (std::size_t e = 0; e < E; ++e) {
          q[m].push_back(fixture::random_quantized(f, m == 2 ? H : I, m == 2 ? I : H, rng, -9, -7));
          back[m].push_back(fixture::random_quantized(f, m == 2 ? H : I, m == 2 ? I : H, rng));
        }
      for (int m = 0; m < 3; ++m)
        for (std::size_t e = 0; e < E; ++e)
          views[m].push_back(q[m][e].view), outs[m].push_back(back[m][e].out());
      const auto packed = experts::PackedExperts::pack(views[0], views[1], views[2], false);
      packed.unpack(outs[0], outs[1], outs[2]);
      for (int m = 0; m < 3; ++m)
        for (std::size_t e = 0; e < E; ++e) {
          const QuantView &a = q[m][e].view, &b = back[m][e].view;
          for (std::size_t n = 0; n < a.rows; ++n)
            for (std::size_t k = 0; k < a.cols; ++k) {
              REQUIRE(a.code(n, k) == b.code(n, k));
              REQUIRE(a.scale(n, k) == b.scale(n, k));
            }
        }
    }
  }
}
