// Grouped expert forward: every usable ISA within the chained bound over odd
// shapes and routing classes; determinism across thread counts; clauses.
#include "contracts/experts/experts.hpp"

#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/task_arena.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "contracts/engine/checks.hpp"
#include "contracts/engine/compare.hpp"
#include "contracts/gemm/pack_audit.hpp"
#include "moecert/experts.hpp"
#include "moecert/isa.hpp"
#include "moecert/layer.hpp"
#include "ops/experts/forward.hpp"
#include "ops/experts/lora.hpp"
#include "ops/gemm/ukernel.hpp"
#include "test_util.hpp"

using namespace moecert;

namespace {

enum class Routing { random, one_expert, empty_slots, some_idle };

struct Problem {
  std::size_t e, h, i, k, t;
  std::vector<bf16> wg, wu, wd, x;
  std::vector<std::int32_t> idx;
  std::vector<float> w;
  experts::PackedExperts packed;
  MatView<const bf16> X() const { return {x.data(), t, h}; }
  MatView<const std::int32_t> Idx() const { return {idx.data(), t, k}; }
  MatView<const float> W() const { return {w.data(), t, k}; }
};

Problem make(std::uint64_t seed, std::size_t e, std::size_t h, std::size_t i, std::size_t k,
             std::size_t t, Routing routing) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0, 1);
  auto fill = [&](std::vector<bf16>& v, std::size_t n, float scale) {
    v.resize(n);
    for (auto& x : v) x = bf16(nd(rng) * scale);
  };
  Problem p{e, h, i, k, t, {}, {}, {}, {}, {}, {}, {}};
  fill(p.wg, e * i * h, 1 / std::sqrt(float(h)));
  fill(p.wu, e * i * h, 1 / std::sqrt(float(h)));
  fill(p.wd, e * h * i, 1 / std::sqrt(float(i)));
  fill(p.x, t * h, 1);
  p.idx.assign(t * k, -1);
  p.w.assign(t * k, 0.0f);
  for (std::size_t r = 0; r < t; ++r) {
    std::vector<std::int32_t> perm(e);
    for (std::size_t q = 0; q < e; ++q) perm[q] = static_cast<std::int32_t>(q);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::size_t valid = k;
    if (routing == Routing::empty_slots) valid = rng() % (k + 1);
    if (routing == Routing::one_expert) valid = 1, perm[0] = 0;
    if (routing == Routing::some_idle) {  // only the first half of the experts get tokens
      std::sort(perm.begin(), perm.begin() + std::min(e, (e + 1) / 2));
      std::shuffle(perm.begin(), perm.begin() + (e + 1) / 2, rng);
      valid = std::min(valid, (e + 1) / 2);
    }
    for (std::size_t j = 0; j < std::min(valid, e); ++j) {
      p.idx[r * k + j] = perm[j];
      p.w[r * k + j] = std::uniform_real_distribution<float>(0, 1)(rng);
    }
  }
  p.packed = experts::PackedExperts::pack(e, MatView<const bf16>(p.wg.data(), e * i, h),
                                          MatView<const bf16>(p.wu.data(), e * i, h),
                                          MatView<const bf16>(p.wd.data(), e * h, i));
  return p;
}

std::vector<float> run(const Problem& p, Isa isa, float fill = NAN) {
  std::vector<float> y(p.t * p.h, fill);
  experts::forward(p.packed, p.X(), p.Idx(), p.W(), MatView<float>(y.data(), p.t, p.h),
                   {.isa = isa});
  return y;
}

}  // namespace

TEST_CASE("experts.forward: every usable ISA within the chained bound",
          "[experts][forward][numeric]") {
  struct S {
    std::size_t e, h, i, k, t;
    Routing r;
  };
  const S shapes[] = {
      {1, 17, 5, 1, 1, Routing::random},        {3, 40, 33, 2, 7, Routing::random},
      {8, 64, 48, 3, 50, Routing::random},      {8, 33, 20, 2, 40, Routing::one_expert},
      {6, 48, 40, 3, 30, Routing::empty_slots}, {9, 32, 17, 2, 25, Routing::some_idle},
      {4, 24, 16, 2, 0, Routing::random}};
  std::uint64_t seed = 40;
  for (Isa isa : usable_isas()) {
    DYNAMIC_SECTION(isa_name(isa)) {
      for (const auto& s : shapes) {
        INFO("E=" << s.e << " H=" << s.h << " I=" << s.i << " K=" << s.k << " T=" << s.t
                  << " routing " << int(s.r));
        const Problem p = make(seed++, s.e, s.h, s.i, s.k, s.t, s.r);
        std::vector<float> y;
        {
          ContractScope full{Level::full, Semantic::enforce};  // probe and within_bound run inside
          y = run(p, isa);
        }
        const auto ref = contracts::experts_forward_reference(p.packed, p.X(), p.Idx(), p.W());
        const auto cmp = compare::bounded(y, ref.y, ref.bound);
        CHECK(cmp.pass());
        if (s.t > 0)
          CHECK(cmp.max_utilization > 0);  // the comparison saw real errors or exact results
        // Tokens with no valid slot get exactly zero.
        for (std::size_t t = 0; t < s.t; ++t)
          if (p.idx[t * s.k] == -1)
            for (std::size_t m = 0; m < s.h; ++m) REQUIRE(y[t * s.h + m] == 0.0f);
      }
    }
  }
}

TEST_CASE("experts.forward: bitwise identical for 1, 2 and 7 threads", "[experts][forward]") {
  const Problem p = make(50, 6, 96, 80, 2, 120, Routing::random);
  for (Isa isa : usable_isas()) {
    std::vector<std::vector<float>> out;
    for (int threads : {1, 2, 7}) {
      oneapi::tbb::global_control gc(oneapi::tbb::global_control::max_allowed_parallelism, threads);
      out.push_back(run(p, isa));
    }
    INFO(isa_name(isa));
    CHECK(std::memcmp(out[0].data(), out[1].data(), out[0].size() * 4) == 0);
    CHECK(std::memcmp(out[0].data(), out[2].data(), out[0].size() * 4) == 0);
  }
}

TEST_CASE("experts.forward: the same bits whether the gate/up output is kept or not",
          "[experts][forward]") {
  // Below audit the gate/up GEMM's C lives only in per-thread scratch blocks
  // (the probe, its only other reader, is off); at audit it goes to the
  // workspace. I = 300 gives two 256-column items per row block, 600 rows
  // two row blocks, one expert idle.
  const Problem p = make(51, 3, 64, 300, 2, 600, Routing::some_idle);
  for (Isa isa : usable_isas()) {
    std::vector<float> kept, scratch;
    {
      ContractScope audit{Level::audit, Semantic::enforce};
      kept = run(p, isa);
    }
    {
      ContractScope check{Level::check, Semantic::enforce};
      scratch = run(p, isa);
    }
    INFO(isa_name(isa));
    CHECK(std::memcmp(kept.data(), scratch.data(), kept.size() * 4) == 0);
  }
}

TEST_CASE("experts.forward: the default kernel choice and its stats", "[experts][forward]") {
  const Problem p = make(51, 8, 32, 16, 2, 10, Routing::random);
  std::vector<float> y(p.t * p.h);
  const auto st =
      experts::forward(p.packed, p.X(), p.Idx(), p.W(), MatView<float>(y.data(), p.t, p.h));
  CHECK(st.routed_rows == 20);
  CHECK(st.padded_rows % gemm::kernel_info(st.isa).mr == 0);
  CHECK(isa_usable(st.isa));
  // 2.5 routed rows per expert: the default kernel still (AVX-512 is slower
  // than AMX's 16-row edge block here: docs/PERFORMANCE.md).
  CHECK(st.isa == default_isa());
}

namespace {
// Runs forward on a spoiled copy and expects `clause`, with y untouched.
template <class Spoil>
void expect_pre(Spoil spoil, std::string_view clause) {
  Problem p = make(60, 4, 16, 8, 2, 6, Routing::random);
  std::vector<float> y(p.t * p.h, 3.0f);
  MatView<float> yv(y.data(), p.t, p.h);
  spoil(p, yv);
  test::expect_violation(
      [&] { experts::forward(p.packed, p.X(), p.Idx(), p.W(), yv, {.isa = Isa::scalar}); }, clause);
  for (float v : y) REQUIRE(v == 3.0f);
}
}  // namespace

TEST_CASE("experts.forward: shape clause", "[experts][forward][shape]") {
  expect_pre([](Problem& p, MatView<float>& y) { y.cols = p.h - 1; }, "experts.forward.shape");
}

TEST_CASE("experts.forward: idx_in_range clause", "[experts][forward][index]") {
  expect_pre([](Problem& p, MatView<float>&) { p.idx[3] = 4; }, "experts.forward.idx_in_range");
  expect_pre([](Problem& p, MatView<float>&) { p.idx[3] = -2; }, "experts.forward.idx_in_range");
  expect_pre(
      [](Problem& p, MatView<float>&) {
        p.idx[2] = -1;
        p.w[2] = 0;
      },
      "experts.forward.idx_in_range");  // -1 before a valid slot
}

TEST_CASE("experts.forward: idx_unique clause", "[experts][forward][index]") {
  expect_pre([](Problem& p, MatView<float>&) { p.idx[5] = p.idx[4]; },
             "experts.forward.idx_unique");
}

TEST_CASE("experts.forward: weight_finite clause", "[experts][forward][finite]") {
  expect_pre([](Problem& p, MatView<float>&) { p.w[1] = NAN; }, "experts.forward.weight_finite");
  expect_pre(
      [](Problem& p, MatView<float>&) {
        p.idx[1] = -1;
        p.w[1] = 0.5f;
      },
      "experts.forward.weight_finite");
}

TEST_CASE("experts.forward: x_finite and x_range clauses", "[experts][forward][finite]") {
  expect_pre([](Problem& p, MatView<float>&) { p.x[7] = bf16(INFINITY); },
             "experts.forward.x_finite");
  expect_pre([](Problem& p, MatView<float>&) { p.x[7] = bf16(0x1p-90f); },
             "experts.forward.x_range");
}

TEST_CASE("experts.forward: no_alias clause", "[experts][forward][alias]") {
  expect_pre(
      [](Problem& p, MatView<float>& y) {
        y.data = reinterpret_cast<float*>(p.x.data());
        y.rows = 1;
        y.cols = p.h;
        p.t = 1;
      },
      "experts.forward.no_alias");
}

TEST_CASE("experts.forward: permutation invariant catches a lost row",
          "[experts][forward][index]") {
  const Problem p = make(61, 4, 16, 8, 2, 6, Routing::random);
  auto g = experts::group_by_expert(p.Idx(), 4, 8);
  {
    detail::Checker c{"experts.forward"};
    ContractScope s{Level::check, Semantic::enforce};
    CHECK_NOTHROW(contracts::experts_forward_grouping(c, p.Idx(), experts::grouping_view(g)));
  }
  g.row_slot[g.slot_row[3]] = -1;  // a missing row in the counting sort
  test::expect_violation(
      [&] {
        detail::Checker c{"experts.forward"};
        contracts::experts_forward_grouping(c, p.Idx(), experts::grouping_view(g));
      },
      "experts.forward.permutation");
}

TEST_CASE("experts.forward: y_finite clause on overflow", "[experts][forward][finite]") {
  Problem p = make(62, 2, 32, 16, 1, 3, Routing::random);
  for (auto& v : p.w) v = 3e38f;  // finite weights whose products overflow
  for (auto& v : p.x) v = bf16(v.to_float() * 64);
  std::vector<float> y(p.t * p.h);
  test::expect_violation(
      [&] {
        experts::forward(p.packed, p.X(), p.Idx(), p.W(), MatView<float>(y.data(), p.t, p.h),
                         {.isa = Isa::scalar});
      },
      "experts.forward.y_finite", Level::check);
}

namespace {
// The state a correct run leaves for one expert and four tokens (mr = 8),
// computed in double and rounded: what the post-conditions judge.
struct ExactState {
  experts::ForwardState st;
  std::vector<bf16> a, h;
  std::vector<float> c1, o;
};
ExactState exact_state(const Problem& p) {
  ExactState ex;
  experts::ForwardState& st = ex.st;
  st.grouping = experts::group_by_expert(p.Idx(), p.e, 8);
  const auto& gu = p.packed.gate_up(0);
  const auto& dn = p.packed.down(0);
  st.layout = gemm::ALayout::rows;
  st.lda = gu.kp();
  st.ldc1 = gu.n();
  st.ldh = dn.kp();
  st.ldo = p.h;
  ex.a.assign(8 * st.lda, bf16(0.0f));
  ex.c1.assign(8 * st.ldc1, 0.0f);
  ex.h.assign(8 * st.ldh, bf16(0.0f));
  ex.o.assign(8 * st.ldo, 0.0f);
  st.a = ex.a.data();
  st.c1 = ex.c1.data();
  st.h = ex.h.data();
  st.o = ex.o.data();
  for (std::size_t r = 0; r < p.t; ++r) {
    for (std::size_t k = 0; k < p.h; ++k) st.a[r * st.lda + k] = p.x[r * p.h + k];
    for (std::size_t n = 0; n < gu.n(); ++n) {
      double s = 0;
      for (std::size_t k = 0; k < p.h; ++k)
        s += double(st.a[r * st.lda + k].to_float()) * gu.at(n, k).to_float();
      st.c1[r * st.ldc1 + n] = static_cast<float>(s);
    }
    for (std::size_t i = 0; i < p.i; ++i) {
      const std::size_t n = 2 * gemm::kPanel * (i / gemm::kPanel) + i % gemm::kPanel;
      const double g = st.c1[r * st.ldc1 + n], u = st.c1[r * st.ldc1 + n + gemm::kPanel];
      st.h[r * st.ldh + i] = bf16(static_cast<float>(g / (1 + std::exp(-g)) * u));
    }
    for (std::size_t m = 0; m < p.h; ++m) {
      double s = 0;
      for (std::size_t i = 0; i < p.i; ++i)
        s += double(st.h[r * st.ldh + i].to_float()) * dn.at(m, i).to_float();
      st.o[r * st.ldo + m] = static_cast<float>(s);
    }
  }
  return ex;
}
}  // namespace

TEST_CASE("experts.forward: probe catches a wrong GEMM result", "[experts][forward][numeric]") {
  const Problem p = make(64, 2, 32, 32, 1, 4, Routing::one_expert);  // c1: two 32-column blocks
  ExactState ex = exact_state(p);
  const experts::ForwardState& st = ex.st;
  std::vector<float> y(p.t * p.h);
  experts::forward(p.packed, p.X(), p.Idx(), p.W(), MatView<float>(y.data(), p.t, p.h),
                   {.isa = Isa::scalar});
  auto post_with = [&](const contracts::ExpertRows& rows) {
    return [&p, &y, rows] {
      detail::Checker c{"experts.forward"};
      contracts::experts_forward_post(c, p.packed, p.X(), p.Idx(), p.W(),
                                      MatView<const float>(y.data(), p.t, p.h), rows);
    };
  };
  SECTION("down, read from o") {
    auto post = post_with(experts::rows_view(st));
    {
      ContractScope s{Level::full, Semantic::enforce};
      CHECK_NOTHROW(post());  // the correct state passes both numeric clauses
    }
    st.o[2 * st.ldo + 7] += 0.5f;  // one wrong element of the down GEMM
    auto v = test::expect_violation(post, "experts.forward.probe", Level::audit);
    CHECK(v.location.find("down GEMM row 2") != std::string::npos);
  }
  SECTION("gate/up, from the sums the epilogue hands over") {
    contracts::ProbeStorage storage;
    contracts::ExpertsProbe probe(p.packed, storage);
    const auto& g = st.grouping;
    constexpr std::size_t kSpan = 2 * contracts::ExpertsProbe::kBlock;
    // What the op does with each finished 32-column block of C (here the
    // exact c1), spans of two blocks, leaving out block `skip` if given.
    auto hand_over = [&](std::size_t skip) {
      probe.size_rows(g.rows(), kSpan);
      for (std::size_t e = 0; e < p.e; ++e)
        for (std::size_t n = 0; n < st.ldc1; n += contracts::ExpertsProbe::kBlock)
          if (g.count[e] && n != skip)
            probe.add(e, g.begin[e], g.count[e], n, st.c1 + g.begin[e] * st.ldc1 + n, st.ldc1);
    };
    contracts::ExpertRows rows = experts::rows_view(st);
    rows.c1 = nullptr;  // as experts::forward leaves it
    rows.probe = &probe;
    auto post = post_with(rows);
    const std::size_t none = st.ldc1;
    hand_over(none);
    {
      ContractScope s{Level::audit, Semantic::enforce};
      CHECK_NOTHROW(post());
    }
    st.c1[2 * st.ldc1 + 7] += 0.5f;  // one wrong element of the gate/up GEMM
    hand_over(none);
    auto v = test::expect_violation(post, "experts.forward.probe", Level::audit);
    CHECK(v.location.find("gate_up GEMM row 2") != std::string::npos);
    st.c1[2 * st.ldc1 + 7] -= 0.5f;
    hand_over(0);  // a span whose first block the op never handed over stays NaN
    v = test::expect_violation(post, "experts.forward.probe", Level::audit);
    CHECK(v.location.find("gate_up GEMM row 0") != std::string::npos);
    hand_over(kSpan / 2);  // a later block of a span left out: its part missing from C r
    v = test::expect_violation(post, "experts.forward.probe", Level::audit);
    CHECK(v.location.find("gate_up GEMM row") != std::string::npos);
  }
}

TEST_CASE("experts.forward: within_bound catches a wrong output", "[experts][forward][numeric]") {
  const Problem p = make(65, 2, 32, 16, 1, 4, Routing::one_expert);
  const ExactState ex = exact_state(p);
  const experts::ForwardState& st = ex.st;
  std::vector<float> y(p.t * p.h);
  experts::forward(p.packed, p.X(), p.Idx(), p.W(), MatView<float>(y.data(), p.t, p.h),
                   {.isa = Isa::scalar});
  y[p.h + 5] += 0.25f;
  auto v = test::expect_violation(
      [&] {
        detail::Checker c{"experts.forward"};
        contracts::experts_forward_post(c, p.packed, p.X(), p.Idx(), p.W(),
                                        MatView<const float>(y.data(), p.t, p.h),
                                        experts::rows_view(st));
      },
      "experts.forward.within_bound", Level::full);
  CHECK(v.location == "t=1 h=5");
}

TEST_CASE("experts.forward: packed weights changed after packing are caught",
          "[experts][forward][memory]") {
  expect_pre(
      [](Problem& p, MatView<float>&) {
        detail::PackAccess::data(const_cast<gemm::PackedWeights&>(p.packed.down(1)))[0] =
            bf16(9.0f);
      },
      "gemm.pack.checksum");
}

// A ContractScope is per thread. Both packs run gemm.pack's clauses per
// matrix inside oneTBB tasks, which must check at the caller's settings, not
// the process-wide ones, on whichever thread takes them: counted over 256
// experts in a 4-thread arena (workers take some of them), both ways round.
// LoRA packs run no gemm.pack clause: the calling op's lora_finite and
// lora_padding judge every factor and pack per call.
TEST_CASE("expert packs: every task checks at the caller's contract settings; LoRA packs run none",
          "[experts][pack][contracts]") {
  struct Restore {
    ContractSettings s = contract_settings();
    ~Restore() { set_contract_settings(s); }
  } restore;
  MoeConfig cfg;
  cfg.experts = 256, cfg.hidden = 32, cfg.inter = 16, cfg.topk = 2, cfg.lora_rank = 2,
  cfg.lora_alpha = 4;
  const std::size_t e = 256, h = 32, i = 16, r = 2;
  std::vector<bf16> wg(e * i * h, bf16(0.5f)), wu(e * i * h, bf16(0.25f)),
      wd(e * h * i, bf16(0.125f));
  std::vector<bf16> lora[6];
  for (auto& f : lora) f.assign(e * r * std::max(h, i), bf16(0.5f));
  auto pack = [&] {
    (void)experts::PackedExperts::pack(e, {wg.data(), e * i, h}, {wu.data(), e * i, h},
                                       {wd.data(), e * h, i});
  };
  auto pack_lora = [&] {
    (void)experts::PackedLora::pack(
        experts::Lora::stacked(cfg, lora[0].data(), lora[1].data(), lora[2].data(), lora[3].data(),
                               lora[4].data(), lora[5].data()),
        e, h, i, false);
  };
  auto checked = [] {
    for (const auto& c : clause_counts())
      if (c.id == "gemm.pack.w_finite") return c.checked;
    return std::uint64_t{0};
  };
  oneapi::tbb::task_arena(4).execute([&] {
    for (const auto& [run, matrices] :
         {std::pair<std::function<void()>, std::size_t>{pack, 2}, {pack_lora, 0}}) {
      set_contract_level(Level::off);
      reset_clause_counts();
      {
        ContractScope s{Level::check};
        run();
      }
      CHECK(checked() == matrices * e);  // every matrix of every expert
      set_contract_level(Level::check);
      reset_clause_counts();
      {
        ContractScope s{Level::off};
        run();
      }
      CHECK(checked() == 0);
    }
    // A NaN in one expert's weights is refused whichever thread packs it.
    set_contract_level(Level::off);
    wd[(e - 1) * h * i] = bf16(std::numeric_limits<float>::quiet_NaN());
    test::expect_violation(pack, "gemm.pack.w_finite", Level::check);
  });
}
