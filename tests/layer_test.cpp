// MoE layer with LoRA: kernels against the bounded reference on every usable
// ISA and router, determinism, the reference's gradients against 50-digit
// central finite differences (each path on its own), per-token statistics
// against a brute-force one-token-at-a-time backward, and every clause.
#include "contracts/layer/layer.hpp"

#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/task_arena.h>
#include <xmmintrin.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "contracts/bounds/experts.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/gemm/pack_audit.hpp"
#include "contracts/layer/router_linear.hpp"
#include "moecert/isa.hpp"
#include "moecert/layer.hpp"
#include "ops/layer/state.hpp"
#include "ops/workspace/arena.hpp"
#include "support/layer_problem.hpp"
#include "test_util.hpp"

using namespace moecert;
using ref::Hp;

namespace {

using Problem = fixture::LayerProblem;

Problem make(RouterKind kind, std::size_t E, std::size_t H, std::size_t I, std::size_t K,
             std::size_t r, std::size_t T, std::uint64_t seed = 1) {
  return fixture::random_layer(fixture::layer_config(kind, E, H, I, K, r, T), T, seed);
}

struct Grads {
  std::vector<float> dx, wr, b, ag, bg, au, bu, ad, bd, wg, wu, wd, m_a, m_g;
  layer::Gradients views(const Problem& p) {
    dx.assign(p.T * p.H, NAN), wr.assign(p.R * p.H, NAN), b.assign(p.R, NAN);
    m_a.assign(p.T * p.E, NAN), m_g.assign(p.T * p.E, NAN);
    for (auto* v : {&ag, &au}) v->assign(p.E * p.r * p.H, NAN);
    for (auto* v : {&bg, &bu}) v->assign(p.E * p.I * p.r, NAN);
    ad.assign(p.E * p.r * p.I, NAN), bd.assign(p.E * p.H * p.r, NAN);
    wg.assign(p.E * p.I * p.H, NAN), wu.assign(p.E * p.I * p.H, NAN),
        wd.assign(p.E * p.H * p.I, NAN);
    layer::Gradients g;
    g.dx = {dx.data(), p.T, p.H};
    g.router_w = {wr.data(), p.R, p.H};
    g.router_b = {b.data(), p.R};
    g.m_a = {m_a.data(), p.T, p.E};
    g.m_g = {m_g.data(), p.T, p.E};
    g.w_gate = {wg.data(), p.E * p.I, p.H}, g.w_up = {wu.data(), p.E * p.I, p.H},
    g.w_down = {wd.data(), p.E * p.H, p.I};
    if (p.r) {
      g.a_gate = {ag.data(), p.E * p.r, p.H}, g.b_gate = {bg.data(), p.E * p.I, p.r};
      g.a_up = {au.data(), p.E * p.r, p.H}, g.b_up = {bu.data(), p.E * p.I, p.r};
      g.a_down = {ad.data(), p.E * p.r, p.I}, g.b_down = {bd.data(), p.E * p.H, p.r};
    }
    return g;
  }
  bool operator==(const Grads&) const = default;
};

struct Run {
  std::vector<float> y;
  Grads g;
  layer::Saved saved;
};

// ask: what the backward is asked for (all gradients unless it drops some).
Run run(const Problem& p, std::optional<Isa> isa = {}, layer::BackwardOptions bo = {},
        const std::function<void(layer::Gradients&)>& ask = {}) {
  Run out;
  out.y.assign(p.T * p.H, NAN);
  const auto w = p.weights();
  layer::forward(p.cfg, w, p.X(), {out.y.data(), p.T, p.H}, out.saved, {.isa = isa});
  layer::Gradients g = out.g.views(p);
  if (ask) ask(g);
  layer::backward(p.cfg, w, p.X(), p.DY(), out.saved, g, bo);
  return out;
}

const RouterKind kKinds[] = {RouterKind::softmax_topk, RouterKind::sigmoid_topk,
                             RouterKind::product_key};

std::vector<Isa> kernel_isas() {
  std::vector<Isa> v = usable_isas();
  v.push_back(Isa::amx_emu);
  return v;
}

}  // namespace

TEST_CASE("layer: forward and backward within the derived bounds, every ISA and router",
          "[layer]") {
  for (RouterKind kind : kKinds)
    for (Isa isa : kernel_isas())
      for (std::size_t r : {std::size_t{0}, std::size_t{4}}) {
        INFO(router_kind_name(kind) << " " << isa_name(isa) << " r=" << r);
        const Problem p = make(kind, kind == RouterKind::product_key ? 9 : 8, 40, 24, 3, r, 13);
        ContractScope s{Level::full, Semantic::enforce};
        const Run a = run(p, isa);
        CHECK(std::isfinite(a.y[0]));
        // Each path on its own, checked against its own reference.
        CHECK_NOTHROW(run(p, isa, {.expert_path = true, .router_path = false}));
        CHECK_NOTHROW(run(p, isa, {.expert_path = false, .router_path = true}));
      }
}

TEST_CASE("layer: more rows than one block of the gradient sums or of the forward", "[layer]") {
  // The LoRA and router-linear gradient sums walk their rows in blocks of 64
  // (backward.cpp row_sums): 150 tokens, 4 experts of about 75 rows. The
  // forward gathers each expert's rows, with LoRA its first factors, in
  // blocks of 512 (experts/forward.cpp): with E = K = 2 every token goes to
  // both experts, 600 rows each, a full block and a padded one. Level full:
  // every output and gradient against the reference within its bound.
  struct {
    std::size_t experts, tokens;
  } const shapes[] = {{4, 150}, {2, 600}};
  for (const auto& sh : shapes)
    for (Isa isa : kernel_isas()) {
      INFO(isa_name(isa) << " E=" << sh.experts << " T=" << sh.tokens);
      const Problem p = make(RouterKind::softmax_topk, sh.experts, 40, 24, 2, 4, sh.tokens);
      ContractScope s{Level::full, Semantic::enforce};
      const Run a = run(p, isa);
      CHECK(std::isfinite(a.g.wr[0]));
      CHECK(std::isfinite(a.g.ag[0]));
    }
}

TEST_CASE("layer: the paths sum to the full backward", "[layer]") {
  const Problem p = make(RouterKind::softmax_topk, 8, 32, 24, 2, 4, 16);
  const Run full = run(p, Isa::scalar), ex = run(p, Isa::scalar, {true, false}),
            rt = run(p, Isa::scalar, {false, true});
  for (std::size_t i = 0; i < full.g.dx.size(); ++i) {
    INFO(i);
    // dx = the expert rows summed, then the router part added in one fp32
    // addition: exactly the sum of the two paths' results.
    CHECK(full.g.dx[i] == ex.g.dx[i] + rt.g.dx[i]);
  }
  CHECK(full.g.ag == ex.g.ag);
  CHECK(full.g.wg == ex.g.wg);
  CHECK(full.g.wd == ex.g.wd);
  CHECK(full.g.wr == rt.g.wr);
  for (float v : rt.g.ag) CHECK(v == 0.0f);  // no expert path: LoRA gradients 0
  for (float v : rt.g.wu) CHECK(v == 0.0f);  // and base-weight gradients 0
  for (float v : ex.g.wr) CHECK(v == 0.0f);  // no router path: router gradients 0
}

// A backward leaves the forward's saved state as it found it: run again on
// it (another dy, or the two paths as separate calls) it gives what it gives
// after a fresh forward, and the arena's guards and poison start over (a
// second backward once tripped workspace.arena.guard: the guards of its
// buffers were not rewritten).
TEST_CASE("layer: backward again on the same forward, whole or path by path", "[layer]") {
  for (RouterKind kind : kKinds) {
    const Problem p = make(kind, kind == RouterKind::product_key ? 9 : 8, 64, 40, 2, 4, 40);
    const auto w = p.weights();
    for (Isa isa : kernel_isas()) {
      INFO(router_kind_name(kind) << " " << isa_name(isa));
      ContractScope scope{Level::audit, Semantic::enforce};
      const Run full = run(p, isa), ex = run(p, isa, {true, false}),
                rt = run(p, isa, {false, true});
      std::vector<float> y(p.T * p.H);
      layer::Saved saved;
      layer::forward(p.cfg, w, p.X(), {y.data(), p.T, p.H}, saved, {.isa = isa});
      Grads again[4];
      const layer::BackwardOptions opts[4] = {{}, {}, {true, false}, {false, true}};
      for (int i = 0; i < 4; ++i) {
        layer::Gradients g = again[i].views(p);
        REQUIRE_NOTHROW(layer::backward(p.cfg, w, p.X(), p.DY(), saved, g, opts[i]));
      }
      CHECK(again[0] == full.g);
      CHECK(again[1] == full.g);
      CHECK(again[2] == ex.g);
      CHECK(again[3] == rt.g);
    }
  }
}

TEST_CASE("layer: a subset of the gradients equals the full backward's, the rest untouched",
          "[layer]") {
  // The two A-factor gradients share one pass over the x rows: asking for
  // one of them only must give the same bits, and write nothing else.
  const Problem p = make(RouterKind::softmax_topk, 8, 32, 24, 2, 4, 16);
  for (Isa isa : kernel_isas()) {
    INFO(isa_name(isa));
    const Run full = run(p, isa);
    for (int which = 0; which < 2; ++which) {
      const Run part = run(p, isa, {}, [&](layer::Gradients& g) {
        (which ? g.a_gate : g.a_up) = {};
        g.b_up = {};
      });
      CHECK(std::memcmp((which ? part.g.au : part.g.ag).data(),
                        (which ? full.g.au : full.g.ag).data(),
                        full.g.ag.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(part.g.bg.data(), full.g.bg.data(), full.g.bg.size() * sizeof(float)) == 0);
      for (float v : which ? part.g.ag : part.g.au) REQUIRE(std::isnan(v));
      for (float v : part.g.bu) REQUIRE(std::isnan(v));
    }
  }
}

TEST_CASE("layer: bitwise identical for 1, 2 and 7 threads", "[layer]") {
  for (RouterKind kind : kKinds) {
    const Problem p = make(kind, kind == RouterKind::product_key ? 16 : 12, 64, 40, 4, 8, 40);
    std::vector<Run> runs;
    for (int threads : {1, 2, 7}) {
      oneapi::tbb::global_control gc(oneapi::tbb::global_control::max_allowed_parallelism, threads);
      runs.push_back(run(p, Isa::scalar));
    }
    for (std::size_t i = 1; i < runs.size(); ++i) {
      CHECK(runs[i].y == runs[0].y);
      CHECK(runs[i].g == runs[0].g);
    }
  }
}

// The ops compute in round-to-nearest with denormals kept, whatever the
// caller set (ops/core/task.hpp): a thread running with flush-to-zero,
// denormals-are-zero and rounding toward zero gets the same bits, both in
// the implicit arena (its workers keep the defaults) and in an arena created
// under those settings (its workers take them), and gets its settings back.
TEST_CASE("layer: the caller's floating-point environment changes no bit", "[layer]") {
  constexpr unsigned kOdd =
      0x1F80 | 0x8000 | 0x6000 | 0x0040;  // masks; FTZ, round toward zero, DAZ
  for (RouterKind kind : kKinds) {
    const Problem p = make(kind, kind == RouterKind::product_key ? 16 : 12, 64, 40, 4, 8, 40);
    for (Isa isa : usable_isas()) {
      const Run want = run(p, isa);
      const unsigned csr = _mm_getcsr();
      _mm_setcsr(kOdd);
      Run caller = run(p, isa), arena;
      oneapi::tbb::task_arena(3).execute([&] { arena = run(p, isa); });
      const unsigned after = _mm_getcsr();
      _mm_setcsr(csr);
      INFO(isa_name(isa) << ", router " << static_cast<int>(kind));
      CHECK((after & ~0x3Fu) == kOdd);
      CHECK(caller.y == want.y);
      CHECK(caller.g == want.g);
      CHECK(arena.y == want.y);
      CHECK(arena.g == want.g);
    }
  }
}

TEST_CASE("layer: an inference forward gives the training forward's y bit for bit", "[layer]") {
  // Without training the gate/up GEMM's C stays in per-thread scratch blocks
  // (nothing reads c1 afterwards); I = 300 makes two column items.
  const Problem p = make(RouterKind::softmax_topk, 6, 64, 300, 2, 8, 70);
  const auto w = p.weights();
  for (Isa isa : usable_isas()) {
    std::vector<float> y_train(p.T * p.H, NAN), y_infer(p.T * p.H, NAN);
    layer::Saved s1, s2;
    layer::forward(p.cfg, w, p.X(), {y_train.data(), p.T, p.H}, s1, {.isa = isa, .training = true});
    layer::forward(p.cfg, w, p.X(), {y_infer.data(), p.T, p.H}, s2,
                   {.isa = isa, .training = false});
    INFO(isa_name(isa));
    CHECK(std::memcmp(y_train.data(), y_infer.data(), y_train.size() * 4) == 0);
  }
}

namespace {

// 50-digit data of a tiny problem with the kernel's routing (idx) and the
// reference's own logits and weights.
ref::LayerData<Hp> hp_data(const Problem& p, const layer::Saved& saved) {
  const auto w = p.weights();
  const auto dd = contracts::layer_data<double>(p.cfg, w, p.X(), p.DY(), layer::saved_view(saved));
  ref::LayerData<Hp> d;
  d.T = dd.T, d.H = dd.H, d.I = dd.I, d.E = dd.E, d.K = dd.K, d.r = dd.r, d.R = dd.R;
  d.kind = dd.kind, d.renormalize = dd.renormalize, d.scaling = dd.scaling, d.scale = dd.scale;
  auto cv = [](const std::vector<double>& v) { return std::vector<Hp>(v.begin(), v.end()); };
  d.x = cv(dd.x), d.wr = cv(dd.wr), d.b = cv(dd.b), d.wg = cv(dd.wg), d.wu = cv(dd.wu),
  d.wd = cv(dd.wd);
  d.ag = cv(dd.ag), d.bg = cv(dd.bg), d.au = cv(dd.au), d.bu = cv(dd.bu), d.ad = cv(dd.ad),
  d.bd = cv(dd.bd);
  d.idx = dd.idx;
  d.dy = cv(dd.dy);
  return d;
}

Hp loss(const ref::LayerData<Hp>& d) {
  const auto f = ref::layer_reference(d, false);
  Hp l = 0;
  for (std::size_t i = 0; i < f.y.size(); ++i) l += d.dy[i] * f.y[i];
  return l;
}

// Central difference of f over parameter v[i] against `analytic`.
template <class F>
void check_fd(const char* what, std::vector<Hp>& v, const std::vector<Hp>& analytic, F f) {
  const Hp h("1e-20");
  for (std::size_t i = 0; i < v.size(); ++i) {
    const Hp keep = v[i];
    v[i] = keep + h;
    const Hp up = f();
    v[i] = keep - h;
    const Hp down = f();
    v[i] = keep;
    const Hp fd = (up - down) / (2 * h);
    const double a = ref::to_double(analytic[i]), diff = ref::to_double(abs(fd - analytic[i]));
    INFO(what << "[" << i << "] analytic " << a << " fd " << ref::to_double(fd));
    REQUIRE(diff <= 1e-10 * std::max(std::fabs(a), 1e-30));
  }
}

}  // namespace

TEST_CASE(
    "layer: reference gradients agree with 50-digit central differences, each path on its own",
    "[layer][fd]") {
  for (RouterKind kind : kKinds) {
    INFO(router_kind_name(kind));
    const Problem p = make(kind, 4, 8, 6, 2, 2, 3, 11);
    Run k = run(p, Isa::scalar);  // the kernel's routing
    ref::LayerData<Hp> d = hp_data(p, k.saved);
    const auto full = ref::layer_reference(d, true);
    // dL/dw: perturb the weights themselves.
    {
      ref::LayerData<Hp> dw = d;
      dw.w_given = full.w;
      check_fd("dL/dw", dw.w_given, full.dw, [&] { return loss(dw); });
    }
    // Expert path: the routing weights frozen at their value.
    {
      ref::LayerData<Hp> de = d;
      de.w_given = full.w;
      const auto an = ref::layer_reference(de, true, {true, false});
      check_fd("expert dx", de.x, an.dx, [&] { return loss(de); });
      check_fd("dA_gate", de.ag, an.dag, [&] { return loss(de); });
      check_fd("dB_gate", de.bg, an.dbg, [&] { return loss(de); });
      check_fd("dA_up", de.au, an.dau, [&] { return loss(de); });
      check_fd("dB_up", de.bu, an.dbu, [&] { return loss(de); });
      check_fd("dA_down", de.ad, an.dad, [&] { return loss(de); });
      check_fd("dB_down", de.bd, an.dbd, [&] { return loss(de); });
      const auto base =
          ref::layer_reference(de, true, {.expert = true, .router = false, .base = true});
      check_fd("dW_gate", de.wg, base.dwg, [&] { return loss(de); });
      check_fd("dW_up", de.wu, base.dwu, [&] { return loss(de); });
      check_fd("dW_down", de.wd, base.dwd, [&] { return loss(de); });
    }
    // Router path: L_r = sum w(z(x, W_r, b)) dL/dw with dL/dw frozen.
    {
      ref::LayerData<Hp> dr = d;
      const auto an = ref::layer_reference(dr, true, {false, true});
      auto lr = [&] {
        const auto f = ref::layer_reference(dr, false);
        Hp l = 0;
        for (std::size_t i = 0; i < f.w.size(); ++i) l += f.w[i] * full.dw[i];
        return l;
      };
      check_fd("router dx", dr.x, an.dx, lr);
      check_fd("dW_r", dr.wr, an.dwr, lr);
      check_fd("db", dr.b, an.db, lr);
    }
    // Both paths: the full gradient of L.
    check_fd("dx", d.x, full.dx, [&] { return loss(d); });
  }
}

TEST_CASE("layer: per-token statistics equal a one-token-at-a-time reference backward",
          "[layer][stats]") {
  for (std::size_t r : {std::size_t{0}, std::size_t{4}}) {
    const Problem p = make(RouterKind::softmax_topk, 6, 24, 16, 2, r, 9, 5);
    Run k = run(p, Isa::scalar);
    const auto w = p.weights();
    const auto bound =
        contracts::layer_bounds(p.cfg, w, p.X(), p.DY(), layer::saved_view(k.saved), {}, nullptr);
    const auto all =
        contracts::layer_data<double>(p.cfg, w, p.X(), p.DY(), layer::saved_view(k.saved));
    for (std::size_t t = 0; t < p.T; ++t) {
      // The token alone, with the kernel's routing.
      ref::LayerData<Hp> d = hp_data(p, k.saved);
      d.T = 1;
      d.x.assign(d.x.begin() + t * p.H, d.x.begin() + (t + 1) * p.H);
      d.dy.assign(d.dy.begin() + t * p.H, d.dy.begin() + (t + 1) * p.H);
      d.idx.assign(all.idx.begin() + t * p.K, all.idx.begin() + (t + 1) * p.K);
      for (std::size_t j = 0; j < p.K; ++j) d.w_given.push_back(Hp(all.w_given[t * p.K + j]));
      for (std::size_t e = 0; e < p.R; ++e) d.z_given.push_back(Hp(all.z_given[t * p.R + e]));
      const auto one = ref::layer_reference(d, true, {true, false});
      for (std::size_t j = 0; j < p.K; ++j) {
        const std::size_t e = static_cast<std::size_t>(d.idx[j]);
        // ||per-token gradient||^2 of each trainable matrix of expert e (its
        // rows in the stacked gradient), summed: LoRA factors, or with r = 0
        // the base matrices (from dg, du, w dy: the rank-1 identity is what
        // is under test, so the base case recomputes it from scratch).
        Hp g2 = 0;
        auto frob = [&](const std::vector<Hp>& m, std::size_t rows, std::size_t cols) {
          for (std::size_t q = e * rows * cols; q < (e + 1) * rows * cols; ++q) g2 += m[q] * m[q];
        };
        if (r) {
          frob(one.dag, r, p.H), frob(one.dbg, p.I, r), frob(one.dau, r, p.H);
          frob(one.dbu, p.I, r), frob(one.dad, r, p.I), frob(one.dbd, p.H, r);
        } else {
          continue;  // base-weight statistics: checked against the Tracked reference below
        }
        const double brute = ref::to_double(sqrt(g2));
        const double got = k.g.m_g[t * p.E + e],
                     b = bound.m_g[t * p.E + e].e * bounds::kReferenceSlack;
        INFO("t=" << t << " e=" << e << " kernel " << got << " brute force " << brute << " bound "
                  << b);
        CHECK(std::fabs(got - brute) <= b);
        CHECK(b <= 0.5 * brute);  // the bound says something (worst-case propagation: 10-15% here)
      }
    }
    // Every (t, e): kernel M_A, M_G within the bounded reference; 0 off the routing.
    for (std::size_t i = 0; i < p.T * p.E; ++i) {
      CHECK(std::fabs(k.g.m_a[i] - bound.m_a[i].v) <= bound.m_a[i].e * bounds::kReferenceSlack);
      CHECK(std::fabs(k.g.m_g[i] - bound.m_g[i].v) <= bound.m_g[i].e * bounds::kReferenceSlack);
    }
  }
}

// ---- clauses ----------------------------------------------------------------

TEST_CASE("layer: forward clauses", "[layer][contracts]") {
  Problem p = make(RouterKind::softmax_topk, 8, 32, 24, 2, 4, 8);
  std::vector<float> y(p.T * p.H, 7.0f);
  const std::vector<float> before = y;
  layer::Saved saved;
  auto fwd = [&](const Problem& q, std::vector<float>& out) {
    layer::forward(q.cfg, q.weights(), q.X(), {out.data(), q.T, q.H}, saved);
  };
  // The forward's postconditions on y and saved as they stand.
  auto post = [&] {
    detail::Checker c{"layer.forward"};
    contracts::layer_forward_post(c, p.cfg, p.weights(), p.X(), {y.data(), p.T, p.H},
                                  layer::saved_view(saved));
  };
  SECTION("shape") {
    Problem& q = p;
    q.cfg.hidden = 31;
    test::expect_violation([&] { fwd(q, y); }, "layer.forward.shape", Level::check);
    CHECK(y == before);
  }
  SECTION("x_finite") {
    Problem& q = p;
    q.x[5] = bf16(NAN);
    test::expect_violation([&] { fwd(q, y); }, "layer.forward.x_finite", Level::check);
    CHECK(y == before);
  }
  SECTION("shape: an unknown router kind observed stops the forward before it routes") {
    Problem& q = p;
    q.cfg.router = static_cast<RouterKind>(kRouterKinds);
    const auto count = violation_count("layer.forward.shape");
    {
      ContractScope scope{Level::check, Semantic::observe};
      fwd(q, y);
    }
    CHECK(violation_count("layer.forward.shape") == count + 1);
    CHECK_FALSE(saved.valid());
    CHECK(y == before);
  }
  SECTION("x_range: at audit; any finite x at check") {
    Problem& q = p;
    q.x[5] = bf16(0x1p-80f);
    const auto v =
        test::expect_violation([&] { fwd(q, y); }, "layer.forward.x_range", Level::audit);
    CHECK(v.location == "x[0, 5]");
    CHECK(y == before);
    ContractScope check{Level::check, Semantic::enforce};
    fwd(q, y);
    CHECK(std::all_of(y.begin(), y.end(), [](float v) { return std::isfinite(v); }));
  }
  SECTION("lora_range: at audit; any finite factor at check") {
    Problem& q = p;
    q.lora[5][3] = bf16(0x1p80f);
    auto v = test::expect_violation([&] { fwd(q, y); }, "layer.forward.lora_range", Level::audit);
    CHECK(v.location == "lora.b_down[0, 3]");
    CHECK(y == before);
    ContractScope check{Level::check, Semantic::enforce};
    fwd(q, y);
  }
  SECTION("lora_finite") {
    Problem& q = p;
    q.lora[5][3] = bf16(INFINITY);
    auto v = test::expect_violation([&] { fwd(q, y); }, "layer.forward.lora_finite", Level::check);
    CHECK(v.location == "lora.b_down[0, 3]");
    CHECK(y == before);
  }
  SECTION("scale_finite") {
    Problem& q = p;
    q.cfg.lora_alpha = 1e-300;  // alpha / r underflows in fp32
    test::expect_violation([&] { fwd(q, y); }, "layer.forward.scale_finite", Level::check);
    CHECK(y == before);
  }
  SECTION("no_alias") {
    std::vector<float> buf(p.T * p.H + 8);
    Problem& q = p;
    auto w = q.weights();
    w.router_b = {reinterpret_cast<const float*>(buf.data()) + 3, q.R};
    test::expect_violation(
        [&] {
          layer::forward(q.cfg, w, q.X(), {buf.data(), q.T, q.H}, saved);
        },
        "layer.forward.no_alias", Level::check);
  }
  SECTION("lora_padding") {
    auto l = experts::PackedLora::pack(p.weights().lora, p.E, p.H, p.I, true);
    auto& w = l.experts[3].b_d;  // column 0's last depth-padding element
    detail::PackAccess::data(w)[(w.kp() / 2 - 1) * 2 * gemm::PackedWeights::kPanel + 1] =
        bf16(1.0f);
    auto v = test::expect_violation(
        [&] {
          detail::Checker c{"layer.forward"};
          MOECERT_CONTRACT(c, clauses::layer::kFwdLoraPadding) {
            contracts::lora_padding(c, clauses::layer::kFwdLoraPadding, experts::packed_factors(l));
          }
        },
        "layer.forward.lora_padding", Level::check);
    CHECK(v.location.rfind("expert 3 b_d", 0) == 0);
  }
  SECTION("y_finite") {
    Problem& q = p;
    for (auto& v : q.x) v = bf16(0x1p60f);
    for (auto& v : q.wg) v = bf16(0x1p60f);
    for (auto& v : q.wu) v = bf16(0x1p60f);
    q.packed = experts::PackedExperts::pack(q.E, {q.wg.data(), q.E * q.I, q.H},
                                            {q.wu.data(), q.E * q.I, q.H},
                                            {q.wd.data(), q.E * q.H, q.I}, true);
    for (auto& v : q.wr) v = 0;
    test::expect_violation([&] { fwd(q, y); }, "layer.forward.y_finite", Level::check);
  }
  SECTION("within_bound") {
    ContractScope s{Level::full, Semantic::enforce};
    fwd(p, y);
    // Two bounds away from the reference.
    const auto ref = contracts::layer_bounds(p.cfg, p.weights(), p.X(), std::nullopt,
                                             layer::saved_view(saved), {}, nullptr);
    y[3 * p.H + 1] = static_cast<float>(ref.y[3 * p.H + 1].v + 2 * ref.y[3 * p.H + 1].e);
    auto v = test::expect_violation(post, "layer.forward.within_bound", Level::full);
    CHECK(v.location == "y[3, 1]");
  }
  SECTION("probe") {
    fwd(p, y);
    {
      ContractScope s{Level::audit, Semantic::enforce};
      CHECK_NOTHROW(post());
    }
    // B_d of every expert, first column, unlike the one the op ran with.
    for (std::size_t e = 0; e < p.E; ++e) {
      bf16& v = p.lora[5][e * p.H * p.r];
      v = bf16(v.to_float() + 1.0f);
    }
    auto v = test::expect_violation(post, "layer.forward.probe", Level::audit);
    CHECK(v.location.find(" down GEMM row 0 columns [0, ") != std::string::npos);
  }
  SECTION("probe: the router linear") {
    fwd(p, y);
    // A router bias unlike the one the op ran with: every row of z is off.
    p.b[1] += 1.0f;
    auto v = test::expect_violation(post, "layer.forward.probe", Level::audit);
    CHECK(v.location == "z row 0 columns [0, 8)");
  }
}

TEST_CASE("layer: backward clauses", "[layer][contracts]") {
  const Problem p = make(RouterKind::product_key, 16, 32, 24, 3, 4, 10);
  const auto w = p.weights();
  std::vector<float> y(p.T * p.H);
  layer::Saved saved;
  Grads g;
  layer::Gradients gv = g.views(p);
  const std::vector<float> dx_before = g.dx;
  auto bwd = [&](layer::Saved& s, MatView<const float> dy) {
    layer::backward(p.cfg, w, p.X(), dy, s, gv);
  };
  SECTION("state: backward before forward, another config, an inference forward") {
    auto v =
        test::expect_violation([&] { bwd(saved, p.DY()); }, "layer.backward.state", Level::check);
    CHECK(v.observed == "no forward saved");
    layer::forward(p.cfg, w, p.X(), {y.data(), p.T, p.H}, saved,
                   {.isa = std::nullopt, .training = false});
    test::expect_violation([&] { bwd(saved, p.DY()); }, "layer.backward.state", Level::check);
    const Problem q = make(RouterKind::product_key, 16, 32, 24, 2, 4, 10);
    layer::forward(q.cfg, q.weights(), q.X(), {y.data(), q.T, q.H}, saved);
    v = test::expect_violation([&] { bwd(saved, p.DY()); }, "layer.backward.state", Level::check);
    CHECK(v.observed == "saved by a forward of another config");
    CHECK(std::isnan(g.dx[0]));  // nothing written
  }
  layer::forward(p.cfg, w, p.X(), {y.data(), p.T, p.H}, saved);
  SECTION("probe") {
    {
      ContractScope s{Level::audit, Semantic::enforce};
      CHECK_NOTHROW(bwd(saved, p.DY()));
    }
    // A_d of every expert, first element, unlike the one the forward packed.
    std::vector<bf16> ad = p.lora[4];
    for (std::size_t e = 0; e < p.E; ++e)
      ad[e * p.r * p.I] = bf16(ad[e * p.r * p.I].to_float() + 1);
    layer::Weights changed = w;
    changed.lora.a_down.data = ad.data();
    auto v =
        test::expect_violation([&] { layer::backward(p.cfg, changed, p.X(), p.DY(), saved, gv); },
                               "layer.backward.probe", Level::audit);
    CHECK(v.location.find(" dh GEMM row 0 columns [0, ") != std::string::npos);
  }
  SECTION("shape") {
    test::expect_violation(
        [&] {
          bwd(saved, {p.dy.data(), p.T - 1, p.H});
        },
        "layer.backward.shape", Level::check);
    gv.w_down = {g.wd.data(), p.E * p.H, p.I - 1};  // a base-weight gradient of the wrong shape
    auto v =
        test::expect_violation([&] { bwd(saved, p.DY()); }, "layer.backward.shape", Level::check);
    CHECK(v.observed ==
          fmt::format("w_down grad {}x{}, expected {}x{}", p.E * p.H, p.I - 1, p.E * p.H, p.I));
    CHECK(std::isnan(g.wd[0]));
  }
  SECTION("dy_finite") {
    std::vector<float> dy = p.dy;
    dy[17] = NAN;
    test::expect_violation(
        [&] {
          bwd(saved, {dy.data(), p.T, p.H});
        },
        "layer.backward.dy_finite", Level::check);
    CHECK(std::isnan(g.dx[0]));
  }
  SECTION("no_alias") {
    gv.router_b = {g.dx.data() + 2, p.R};
    auto v = test::expect_violation([&] { bwd(saved, p.DY()); }, "layer.backward.no_alias",
                                    Level::check);
    CHECK(v.location == "dx and router_b grad");
  }
  SECTION("grad_finite, empty_expert_zero, router_masked hold on a valid run") {
    ContractScope s{Level::check, Semantic::enforce};
    CHECK_NOTHROW(bwd(saved, p.DY()));
    for (auto* c : {"layer.backward.grad_finite", "layer.backward.empty_expert_zero",
                    "layer.backward.router_masked"})
      CHECK(violation_count(c) == 0);
  }
  SECTION("grad_finite") {
    std::vector<float> dy(p.dy.size(),
                          3e38f);  // finite, but dx overflows (expert path only: dw would too)
    test::expect_violation(
        [&] {
          layer::backward(p.cfg, w, p.X(), {dy.data(), p.T, p.H}, saved, gv, {true, false});
        },
        "layer.backward.grad_finite", Level::check);
  }
  SECTION("empty_expert_zero and router_masked fire on wrong outputs") {
    bwd(saved, p.DY());
    const auto& gr = saved.impl().st.grouping;
    std::size_t idle = 0;
    while (idle < p.E && gr.count[idle]) ++idle;
    REQUIRE(idle < p.E);  // 10 tokens x 3 slots over 16 experts leave one idle (seed 1)
    g.ag[idle * p.r * p.H] = 1e-30f;
    auto v = test::expect_violation(
        [&] {
          detail::Checker c{"layer.backward"};
          contracts::layer_backward_post(c, p.cfg, w, p.X(), p.DY(), layer::saved_view(saved), gv,
                                         {});
        },
        "layer.backward.empty_expert_zero", Level::check);
    CHECK(v.location.rfind(fmt::format("expert {} a_gate grad", idle), 0) == 0);
    g.ag[idle * p.r * p.H] = 0;
    g.wu[(idle * p.I + 2) * p.H + 3] = -1e-30f;  // and a base weight's
    v = test::expect_violation(
        [&] {
          detail::Checker c{"layer.backward"};
          contracts::layer_backward_post(c, p.cfg, w, p.X(), p.DY(), layer::saved_view(saved), gv,
                                         {});
        },
        "layer.backward.empty_expert_zero", Level::check);
    CHECK(v.location == fmt::format("expert {} w_up grad ({}, 3)", idle, idle * p.I + 2));
    g.wu[(idle * p.I + 2) * p.H + 3] = 0;
    // failure mode 1: a gradient reaching a -1 slot.
    auto& s = saved.impl();
    const auto dropped = static_cast<std::size_t>(s.idx[p.K - 1]);
    g.m_a[dropped] = g.m_g[dropped] =
        0;  // token 0's statistics for the expert it no longer routes to
    s.idx[p.K - 1] = -1;
    const_cast<float*>(s.arena.get<float>("router.dw", p.T * p.K))[p.K - 1] = 0.5f;
    test::expect_violation(
        [&] {
          detail::Checker c{"layer.backward"};
          contracts::layer_backward_post(c, p.cfg, w, p.X(), p.DY(), layer::saved_view(saved), gv,
                                         {});
        },
        "layer.backward.router_masked", Level::check);
  }
  SECTION("within_bound") {
    ContractScope s{Level::full, Semantic::enforce};
    bwd(saved, p.DY());
    const auto ref = contracts::layer_bounds(p.cfg, w, p.X(), p.DY(), layer::saved_view(saved), {},
                                             saved.impl().arena.get<float>("router.dw", p.T * p.K));
    g.bd[5] = static_cast<float>(ref.dbd[5].v - 2 * ref.dbd[5].e);
    auto v = test::expect_violation(
        [&] {
          detail::Checker c{"layer.backward"};
          contracts::layer_backward_post(c, p.cfg, w, p.X(), p.DY(), layer::saved_view(saved), gv,
                                         {});
        },
        "layer.backward.within_bound", Level::full);
    CHECK(v.location == "b_down grad[1, 1]");  // element 5 of a 4-column matrix
    g.bd[5] = static_cast<float>(ref.dbd[5].v);
    const auto base =
        contracts::layer_bounds(p.cfg, w, p.X(), p.DY(), layer::saved_view(saved), {.base = true},
                                saved.impl().arena.get<float>("router.dw", p.T * p.K));
    std::size_t at = 0;  // the element whose bound is tightest relative to its value
    for (std::size_t i = 1; i < base.dwg.size(); ++i)
      if (base.dwg[i].e * std::fabs(base.dwg[at].v) < base.dwg[at].e * std::fabs(base.dwg[i].v))
        at = i;
    REQUIRE(base.dwg[at].e < 0.1 * std::fabs(base.dwg[at].v));  // a bound well inside the value
    g.wg[at] =
        static_cast<float>(base.dwg[at].v + 3 * base.dwg[at].e + 1e-6 * std::fabs(base.dwg[at].v));
    v = test::expect_violation(
        [&] {
          detail::Checker c{"layer.backward"};
          contracts::layer_backward_post(c, p.cfg, w, p.X(), p.DY(), layer::saved_view(saved), gv,
                                         {});
        },
        "layer.backward.within_bound", Level::full);
    CHECK(v.location == fmt::format("w_gate grad[{}, {}]", at / p.H, at % p.H));
  }
}

namespace {

// The router linear alone on p's x and router weights: z, and from dz its
// gradients (dx accumulated into dx0).
struct Linear {
  std::vector<float> z, dx, dwr, db;
};

Linear router_linear(const Problem& p, const std::vector<float>& dz, const std::vector<float>& dx0,
                     Isa isa) {
  Linear o;
  o.z.assign(p.T * p.R, NAN), o.dx = dx0, o.dwr.assign(p.R * p.H, NAN), o.db.assign(p.R, NAN);
  const MatView<const float> w{p.wr.data(), p.R, p.H};
  layer::router_linear_forward(p.X(), w, {p.b.data(), p.R}, {o.z.data(), p.T, p.R}, isa);
  layer::router_linear_backward(p.X(), w, {dz.data(), p.T, p.R},
                                {.dx = {o.dx.data(), p.T, p.H},
                                 .router_w = {o.dwr.data(), p.R, p.H},
                                 .router_b = {o.db.data(), p.R}},
                                isa);
  return o;
}

std::vector<float> normal(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> v(n);
  for (auto& q : v) q = nd(rng);
  return v;
}

}  // namespace

TEST_CASE(
    "layer.router_linear: the layer's logits bit for bit; gradients within bound, any thread count",
    "[layer][router_linear]") {
  for (RouterKind kind : kKinds)
    for (Isa isa : kernel_isas()) {
      INFO(router_kind_name(kind) << " " << isa_name(isa));
      const Problem p = make(kind, kind == RouterKind::product_key ? 9 : 8, 40, 24, 3, 4, 21);
      const auto dz = normal(p.T * p.R, 7), dx0 = normal(p.T * p.H, 8);
      ContractScope s{Level::full, Semantic::enforce};  // within_bound runs on every output
      const Run layer_run = run(p, isa);
      const Linear a = router_linear(p, dz, dx0, isa);
      CHECK(std::memcmp(a.z.data(), layer_run.saved.impl().logits, a.z.size() * sizeof(float)) ==
            0);
      oneapi::tbb::global_control one(oneapi::tbb::global_control::max_allowed_parallelism, 1);
      const Linear b = router_linear(p, dz, dx0, isa);
      CHECK(a.z == b.z);
      CHECK(a.dx == b.dx);
      CHECK(a.dwr == b.dwr);
      CHECK(a.db == b.db);
    }
}

TEST_CASE("layer.router_linear: clauses", "[layer][router_linear][contracts]") {
  Problem p = make(RouterKind::softmax_topk, 8, 32, 24, 3, 4, 9);
  auto dz = normal(p.T * p.R, 3);
  std::vector<float> z(p.T * p.R), dx(p.T * p.H, 0.0f), dwr(p.R * p.H), db(p.R);
  auto fwd = [&](MatView<float> out) {
    layer::router_linear_forward(p.X(), {p.wr.data(), p.R, p.H}, {p.b.data(), p.R}, out);
  };
  auto bwd = [&](const layer::RouterLinearGrads& g) {
    layer::router_linear_backward(p.X(), {p.wr.data(), p.R, p.H}, {dz.data(), p.T, p.R}, g);
  };
  const layer::RouterLinearGrads all{.dx = {dx.data(), p.T, p.H},
                                     .router_w = {dwr.data(), p.R, p.H},
                                     .router_b = {db.data(), p.R}};
  SECTION("shape") {
    test::expect_violation(
        [&] {
          fwd({z.data(), p.T, p.R - 1});
        },
        "layer.router_linear.shape", Level::check);
    test::expect_violation(
        [&] {
          bwd({.router_b = {db.data(), p.R - 1}});
        },
        "layer.router_linear.shape", Level::check);
  }
  SECTION("finite") {
    p.x[5] = bf16(NAN);
    const auto v = test::expect_violation(
        [&] {
          fwd({z.data(), p.T, p.R});
        },
        "layer.router_linear.finite", Level::check);
    CHECK(v.location == "x[0, 5]");
    p.x[5] = bf16(1.0f), dz[2 * p.R + 1] = INFINITY;
    test::expect_violation([&] { bwd(all); }, "layer.router_linear.finite", Level::check);
  }
  SECTION("x_range") {
    p.x[5] = bf16(0x1p-90f);
    const auto v = test::expect_violation(
        [&] {
          fwd({z.data(), p.T, p.R});
        },
        "layer.router_linear.x_range", Level::audit);
    CHECK(v.location == "x[0, 5]");
    test::expect_violation([&] { bwd(all); }, "layer.router_linear.x_range", Level::audit);
    ContractScope check{Level::check, Semantic::enforce};
    fwd({z.data(), p.T, p.R});
  }
  SECTION("no_alias") {
    test::expect_violation(
        [&] {
          fwd({p.wr.data(), p.T, p.R});
        },
        "layer.router_linear.no_alias", Level::check);
    test::expect_violation(
        [&] {
          bwd({.dx = {dx.data(), p.T, p.H}, .router_w = {dx.data(), p.R, p.H}});
        },
        "layer.router_linear.no_alias", Level::check);
  }
  SECTION("out_finite") {
    for (auto& v : p.x) v = bf16(0x1p60f);
    for (auto& v : p.wr) v = 0x1p100f;
    test::expect_violation(
        [&] {
          fwd({z.data(), p.T, p.R});
        },
        "layer.router_linear.out_finite", Level::check);
  }
  SECTION("within_bound") {
    const MatView<const float> w{p.wr.data(), p.R, p.H};
    fwd({z.data(), p.T, p.R});
    const auto ref = contracts::router_logits_reference(p.X(), w, {p.b.data(), p.R});
    // Two bounds away from the reference (1e-30 more: outside it even where the bound is 0).
    z[2 * p.R + 3] = static_cast<float>(ref[2 * p.R + 3].v + 2 * ref[2 * p.R + 3].e + 1e-30);
    auto v = test::expect_violation(
        [&] {
          detail::Checker c{"layer.router_linear.forward"};
          contracts::router_linear_forward_post(c, p.X(), w, {p.b.data(), p.R},
                                                {z.data(), p.T, p.R});
        },
        "layer.router_linear.within_bound", Level::full);
    CHECK(v.location == "z[2, 3]");
    const std::vector<float> before = dx;
    bwd(all);
    db[1] += 1.0f;
    v = test::expect_violation(
        [&] {
          detail::Checker c{"layer.router_linear.backward"};
          contracts::router_linear_backward_post(c, p.X(), w, {dz.data(), p.T, p.R}, all, before);
        },
        "layer.router_linear.within_bound", Level::full);
    CHECK(v.location == "router_b grad[0, 1]");
  }
  SECTION("probe") {
    const MatView<const float> w{p.wr.data(), p.R, p.H};
    const View<const float> b{p.b.data(), p.R};
    {
      ContractScope s{Level::audit, Semantic::enforce};
      CHECK_NOTHROW(fwd({z.data(), p.T, p.R}));
      CHECK_NOTHROW(bwd(all));
    }
    auto judge_z = [&] {
      detail::Checker c{"layer.router_linear.forward"};
      contracts::router_linear_forward_post(c, p.X(), w, b, {z.data(), p.T, p.R});
    };
    // One logit a unit off, far outside its row's allowance (values O(1), H = 32).
    z[2 * p.R + 3] += 1.0f;
    auto v = test::expect_violation(judge_z, "layer.router_linear.probe", Level::audit);
    CHECK(v.location == fmt::format("z row 2 columns [0, {})", p.R));
    // The backward's three outputs, each a unit off in turn.
    const std::vector<float> before = dx;
    bwd(all);
    auto judge_grads = [&](float& wrong, const char* clause_location) {
      wrong += 1.0f;
      auto judged = [&] {
        contracts::RouterLinearProbe probe(w, {before.data(), p.T, p.H});
        probe.judge(p.X(), {{dz.data(), p.T, p.R}, {}}, all);
        detail::Checker c{"layer.router_linear.backward"};
        contracts::router_linear_backward_post(c, p.X(), w, {dz.data(), p.T, p.R}, all, {}, &probe);
      };
      v = test::expect_violation(judged, "layer.router_linear.probe", Level::audit);
      CHECK(v.location == clause_location);
      wrong -= 1.0f;
    };
    judge_grads(dx[4 * p.H + 7], "dx row 4 columns [0, 32)");
    judge_grads(dwr[5 * p.H + 9], "router_w grad column 9 rows [0, 8)");
    judge_grads(db[6], "router_b grad[6]");
  }
}

TEST_CASE("layer: failure mode 3, two co-live buffers made to share memory",
          "[layer][contracts][memory]") {
  const Problem p = make(RouterKind::softmax_topk, 8, 32, 24, 2, 4, 12);
  const auto w = p.weights();
  std::vector<float> y(p.T * p.H);
  Grads g;
  const layer::Gradients gv = g.views(p);
  // bwd.dy (fresh at the backward's first step) placed on the saved gate/up
  // outputs, which the backward still needs.
  SECTION("caught by the alias clause of the arena, naming both buffers") {
    layer::Saved saved;
    saved.impl().arena.alias_for_testing("experts.c1", "bwd.dy");
    auto v = test::expect_violation(
        [&] {
          layer::forward(p.cfg, w, p.X(), {y.data(), p.T, p.H}, saved);
        },
        "workspace.arena.disjoint", Level::check);
    CHECK(v.location == "experts.c1 and bwd.dy");
  }
  // At audit c1 is judged as the SwiGLU backward reads it, the other saved
  // rows before the backward writes.
  for (const Level level : {Level::check, Level::audit})
    DYNAMIC_SECTION(
        "independently, by NaN poison and the saved-finite clause, naming the buffer, at "
        << level_name(level)) {
      layer::Saved saved;
      saved.impl().arena.alias_for_testing("experts.c1", "bwd.dy");
      ContractSettings no_alias{level, Semantic::enforce};
      no_alias.groups &= ~(1u << static_cast<int>(Group::alias));
      ContractScope s{no_alias};
      layer::forward(p.cfg, w, p.X(), {y.data(), p.T, p.H}, saved);
      try {
        layer::backward(p.cfg, w, p.X(), p.DY(), saved, gv);
        FAIL("no violation");
      } catch (const ContractViolation& v) {
        INFO(v.what());
        CHECK(v.clause() == "layer.backward.saved_finite");
        CHECK(v.violation().location.rfind("experts.c1 row 0", 0) == 0);
      }
      CHECK(std::isnan(g.dx[0]));  // nothing written
    }
  SECTION("a finite writer: the row digests of saved_intact (audit)") {
    layer::Saved saved;
    {
      ContractScope s{Level::audit, Semantic::enforce};
      layer::forward(p.cfg, w, p.X(), {y.data(), p.T, p.H}, saved);
    }
    const auto& st = saved.impl().st;
    const std::size_t q = static_cast<std::size_t>(
        std::find(st.grouping.row_slot.begin(), st.grouping.row_slot.end(), 0) -
        st.grouping.row_slot.begin());  // the row of token 0's first slot
    REQUIRE(q < st.grouping.rows());
    float& c = st.c1[q * st.ldc1 + 3];
    c = std::nextafter(c, INFINITY);
    const auto v =
        test::expect_violation([&] { layer::backward(p.cfg, w, p.X(), p.DY(), saved, gv); },
                               "layer.backward.saved_intact", Level::audit);
    CHECK(v.location == fmt::format("experts.c1 row {}", q));
    CHECK(std::isnan(g.dx[0]));
  }
}

TEST_CASE("layer: amx_bf16 bitwise equal to amx_emu (on a machine with AMX)", "[layer][amx]") {
  if (!isa_usable(Isa::amx_bf16)) {
    WARN("amx_bf16 not usable here: " << isa_name(default_isa())
                                      << " machine; run on the AMX machine");
    return;
  }
  for (RouterKind kind : kKinds) {
    const Problem p = make(kind, kind == RouterKind::product_key ? 16 : 12, 96, 72, 4, 8, 70);
    const Run hw = run(p, Isa::amx_bf16), emu = run(p, Isa::amx_emu);
    CHECK(hw.y == emu.y);
    CHECK(hw.g == emu.g);
  }
}
