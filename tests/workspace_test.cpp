// Workspace planner and arena: the plan's invariants on concrete configs,
// its clauses, guard zones, poison, and the alias hook of failure mode 3.
#include "contracts/workspace/workspace.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "moecert/experts.hpp"
#include "moecert/workspace.hpp"
#include "ops/workspace/arena.hpp"
#include "ops/workspace/planner.hpp"
#include "support/quantized.hpp"
#include "test_util.hpp"

using namespace moecert;
using workspace::Plan;

namespace {

MoeConfig big_config() {
  // failure mode 4: the config a peer kernel needed 48 GB for.
  return {.experts = 256,
          .hidden = 7168,
          .inter = 2048,
          .topk = 8,
          .lora_rank = 16,
          .lora_alpha = 32,
          .max_tokens = 25600};
}

// Every co-live pair disjoint, every buffer inside the total, aligned:
// checked here by brute force, independently of the clause. And a backward
// may run again on the same forward (layer_test): no buffer of the backward
// touches a saved one's bytes or guard zone, even after the saved one's
// last step.
void check_plan(const Plan& p) {
  auto extent_end = [](const workspace::Buffer& b) {
    return b.offset + workspace::round_up(b.bytes, workspace::kAlign) + workspace::kGuard;
  };
  for (std::size_t i = 0; i < p.buffers.size(); ++i) {
    const auto& a = p.buffers[i];
    REQUIRE(a.offset % 64 == 0);
    REQUIRE(a.offset + a.bytes <= p.total_bytes);
    for (std::size_t j = i + 1; j < p.buffers.size(); ++j) {
      const auto& b = p.buffers[j];
      if (a.first <= b.last && b.first <= a.last && a.bytes && b.bytes) {
        INFO(a.name << " and " << b.name);
        REQUIRE((a.offset + a.bytes <= b.offset || b.offset + b.bytes <= a.offset));
      }
      const bool saved_a = a.first <= workspace::f_combine && a.last >= workspace::b_gather;
      const bool saved_b = b.first <= workspace::f_combine && b.last >= workspace::b_gather;
      if ((saved_a && b.first >= workspace::b_gather) ||
          (saved_b && a.first >= workspace::b_gather)) {
        INFO(a.name << " and " << b.name << " (saved and backward)");
        REQUIRE((extent_end(a) <= b.offset || extent_end(b) <= a.offset));
      }
    }
  }
}

}  // namespace

TEST_CASE("workspace.plan: failure mode 4 config fits in 16 GiB besides packed weights",
          "[workspace]") {
  ContractScope s{Level::check, Semantic::enforce};
  const Plan p = workspace::plan(big_config(), 25600);
  check_plan(p);
  INFO("total " << p.total_bytes << " bytes");
  CHECK(p.total_bytes <= (std::uint64_t{16} << 30));
  CHECK(p.total_bytes >= p.peak_live_bytes);
  // The arena is within 20% of the lower bound any placement needs.
  CHECK(static_cast<double>(p.total_bytes) <= 1.2 * static_cast<double>(p.peak_live_bytes));
  // Saved activations: the gate/up outputs of every routed row (T K rows,
  // each expert's group padded to 32) in fp32.
  const std::uint64_t rows = 25600 * 8 + 256 * 31;
  CHECK(p.find("experts.c1")->bytes == rows * 2 * 2048 * 4);
  CHECK(p.find("bwd.dx_rows")->bytes == rows * 7168 * 4);
  const Plan f = workspace::plan(big_config(), 25600, {.training = false});
  check_plan(f);
  CHECK(f.total_bytes < p.total_bytes);
  CHECK(f.find("bwd.dy") == nullptr);
}

TEST_CASE("workspace.plan: random configs give disjoint co-live buffers", "[workspace]") {
  ContractScope s{Level::check, Semantic::enforce};
  std::mt19937_64 rng(7);
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  for (int n = 0; n < 3000; ++n) {
    MoeConfig c;
    c.experts = pick(1, 1024);
    c.hidden = pick(1, 65536);
    c.inter = pick(1, 65536);
    c.topk = pick(1, std::min<std::int64_t>(c.experts, 64));
    c.lora_rank = pick(0, 256);
    c.lora_alpha = c.lora_rank ? 16.0 : 0.0;
    c.max_tokens = pick(1, 1 << 20);
    const Plan p = workspace::plan(c, pick(0, c.max_tokens), {.training = n % 2 == 0});
    check_plan(p);
  }
}

TEST_CASE("workspace.plan: clauses", "[workspace][contracts]") {
  MoeConfig c = big_config();
  SECTION("tokens_range") {
    auto v = test::expect_violation([&] { workspace::plan(c, 25601); },
                                    "workspace.plan.tokens_range", Level::check);
    CHECK(v.observed == "tokens=25601");
  }
  SECTION("memory_cap: a violation before anything is allocated") {
    auto v = test::expect_violation([&] { workspace::plan(c, 25600, {.memory_cap = 8ull << 30}); },
                                    "workspace.plan.memory_cap", Level::check);
    CHECK(v.expected == fmt::format("<= {}", 8ull << 30));
    ContractScope s{Level::check, Semantic::enforce};
    CHECK_NOTHROW(workspace::plan(c, 25600, {.memory_cap = 16ull << 30}));
  }
  SECTION("overflow: sizes past the limits (reachable under observe only)") {
    c.experts = std::int64_t{1} << 40;
    c.hidden = std::int64_t{1} << 40;
    c.topk = 64;
    c.max_tokens = std::int64_t{1} << 40;
    ContractScope s{Level::check, Semantic::observe};
    const auto before = violation_count("workspace.plan.overflow");
    const auto config_before = violation_count("core.config.experts_range");
    const Plan p = workspace::plan(c, std::int64_t{1} << 40);
    CHECK(p.buffers.empty());
    CHECK(violation_count("workspace.plan.overflow") == before + 1);
    CHECK(violation_count("core.config.experts_range") == config_before + 1);
    // Under enforce, the config clause stops it first.
    test::expect_violation([&] { workspace::plan(c, 1); }, "core.config.experts_range",
                           Level::check);
  }
  SECTION("disjoint: the plan invariant names the overlapping pair") {
    ContractScope s{Level::check, Semantic::enforce};
    Plan p = workspace::plan(c, 1024);
    p.buffers[4].offset = p.buffers[3].offset;  // experts.h onto experts.c1, both live
    auto v = test::expect_violation(
        [&] {
          detail::Checker chk{"workspace.plan"};
          contracts::plan_post(chk, p, false, 0);
        },
        "workspace.plan.disjoint", Level::check);
    CHECK(v.location == "experts.c1 and experts.h");
  }
}

TEST_CASE(
    "workspace.arena: poison at check is one 64-byte line per 4 KiB, at audit per 512 B, "
    "rotating; at full every word",
    "[workspace][contracts]") {
  const MoeConfig c{.experts = 8,
                    .hidden = 512,
                    .inter = 384,
                    .topk = 2,
                    .lora_rank = 4,
                    .lora_alpha = 8,
                    .max_tokens = 64};
  const Plan p = workspace::plan(c, 64);
  const std::size_t bytes = p.find("experts.c1")->bytes, words = bytes / 4;
  REQUIRE(bytes > workspace::kSparseAbove);
  workspace::Arena arena;
  // c1's words holding the poison after one more bind at `level`, c1 zeroed before.
  auto poisoned = [&](Level level) {
    ContractScope s{level, Semantic::enforce};
    detail::Checker chk{"test.arena"};
    std::vector<std::size_t> at;
    for (int pass = 0; pass < 2; ++pass) {
      arena.bind(p, chk);
      arena.enter(workspace::f_route, chk);
      arena.enter(workspace::f_gate_up, chk);
      auto* c1 = arena.get<std::uint32_t>("experts.c1", words);
      if (pass == 0) std::fill(c1, c1 + words, 0u);
      for (std::size_t i = 0; pass == 1 && i < words; ++i)
        if (c1[i] == workspace::kPoison) at.push_back(i);
    }
    return at;
  };
  // Line ((binds - 1) mod (stride / 64)) of every stride, all its 16
  // words, the next line each bind.
  auto rotating = [&](Level level, std::size_t stride_bytes) {
    const auto first = poisoned(level), second = poisoned(level);
    const std::size_t stride = stride_bytes / 4, line = 16;
    REQUIRE(first.size() == line * ((words + stride - 1) / stride));
    REQUIRE(second.size() == first.size());
    for (std::size_t j = 0; j < first.size(); ++j) {
      CHECK(first[j] / stride == j / line);
      CHECK(first[j] % line == j % line);
      // two binds later: two 64-byte lines on, modulo the stride
      CHECK((second[j] - first[j] + stride) % stride == 2 * line % stride);
    }
  };
  SECTION("check: one line in every 4 KiB") { rotating(Level::check, workspace::kSparseStride); }
  SECTION("audit: one line in every 512 B") { rotating(Level::audit, workspace::kAuditStride); }
  SECTION("full: every word") { CHECK(poisoned(Level::full).size() == words); }
  SECTION("a buffer up to 64 KiB: every word at check too") {
    ContractScope s{Level::check, Semantic::enforce};
    detail::Checker chk{"test.arena"};
    arena.bind(p, chk);
    arena.enter(workspace::f_route, chk);
    const std::size_t n = p.find("router.idx")->bytes / 4;
    REQUIRE(n * 4 <= workspace::kSparseAbove);
    const auto* idx = arena.get<std::uint32_t>("router.idx", n);
    CHECK(std::count(idx, idx + n, workspace::kPoison) == static_cast<std::ptrdiff_t>(n));
  }
}

TEST_CASE("workspace.arena: guards, poison, and the alias hook", "[workspace][contracts]") {
  const MoeConfig c{.experts = 8,
                    .hidden = 64,
                    .inter = 48,
                    .topk = 2,
                    .lora_rank = 4,
                    .lora_alpha = 8,
                    .max_tokens = 16};
  ContractScope s{Level::check, Semantic::enforce};
  const Plan p = workspace::plan(c, 16);
  workspace::Arena arena;
  detail::Checker chk{"test.arena"};
  arena.bind(p, chk);
  arena.enter(workspace::f_route, chk);
  const auto* idx_buf = p.find("router.idx");
  auto* idx = arena.get<std::int32_t>("router.idx", 32);
  SECTION("fresh buffers hold the NaN pattern under contracts") {
    std::uint32_t word;
    std::memcpy(&word, idx, 4);
    CHECK(word == workspace::kPoison);
    arena.enter(workspace::f_gate_up, chk);
    const float* c1 = arena.get<float>("experts.c1", 1);
    CHECK(std::isnan(c1[0]));
  }
  SECTION("no poison with contracts off") {
    ContractScope off{Level::off, Semantic::enforce};
    workspace::Arena a2;
    detail::Checker c2{"test.arena"};
    a2.bind(p, c2);
    a2.enter(workspace::f_route, c2);
    auto* w = a2.get<std::int32_t>("router.weights", 32);
    w[0] = 5;
    a2.enter(workspace::f_gather, c2);
    CHECK(w[0] == 5);
  }
  SECTION("a write past a buffer's end damages its guard: named with the step") {
    // 32 int32 = 128 bytes: the guard starts right after them.
    REQUIRE(idx_buf->bytes == 128);
    idx[32] = 0;
    auto v = test::expect_violation([&] { arena.enter(workspace::f_gather, chk); },
                                    "workspace.arena.guard", Level::check);
    CHECK(v.location == "after router.idx, at forward.gather");
  }
  SECTION("failure mode 3: two co-live buffers made to share memory") {
    workspace::Arena bad;
    bad.alias_for_testing("experts.c1", "lora.xa");
    auto v =
        test::expect_violation([&] { bad.bind(p, chk); }, "workspace.arena.disjoint", Level::check);
    CHECK(v.location == "experts.c1 and lora.xa");
  }
}

TEST_CASE("workspace.plan: packed_weight_bytes is what a pack of each format holds",
          "[workspace][formats]") {
  std::mt19937_64 rng(3);
  const std::size_t E = 2, H = 200, I = 136;  // partial blocks and panels everywhere
  for (const FormatInfo& f : kFormatTable) {
    if (f.format == WeightFormat::bf16) continue;
    DYNAMIC_SECTION(f.name) {
      std::vector<fixture::QuantMatrix> q[3];
      std::vector<QuantView> v[3];
      for (int m = 0; m < 3; ++m)
        for (std::size_t e = 0; e < E; ++e)
          q[m].push_back(
              fixture::random_quantized(f.format, m == 2 ? H : I, m == 2 ? I : H, rng, -9, -7));
      for (int m = 0; m < 3; ++m)
        for (const auto& x : q[m]) v[m].push_back(x.view);  // the matrices in place
      MoeConfig cfg;
      cfg.experts = E, cfg.hidden = H, cfg.inter = I, cfg.topk = 1, cfg.max_tokens = 8;
      for (bool training : {false, true}) {
        const auto packed = experts::PackedExperts::pack(v[0], v[1], v[2], training);
        const Plan p = workspace::plan(cfg, 8, {.training = training, .format = f.format});
        CHECK(p.packed_weight_bytes == packed.bytes());
      }
    }
  }
}

TEST_CASE(
    "workspace.plan: DeepSeek-V3's routed experts per layer in each format, within 2% of "
    "the format's own size",
    "[workspace][formats]") {
  // E256 H7168 I2048, the forward orientations (an inference or a frozen
  // base's forward): the codes, plus scales and the packs' row index.
  MoeConfig cfg;
  cfg.experts = 256, cfg.hidden = 7168, cfg.inter = 2048, cfg.topk = 8, cfg.max_tokens = 1;
  const double weights = 3.0 * 256 * 7168 * 2048;
  struct Want {
    WeightFormat f;
    double scales;  // scales per expert in the checkpoint's layout
    std::uint64_t bytes;
  };
  const Want want[] = {
      {WeightFormat::bf16, 0, 22548578304},
      {WeightFormat::int8_channel, 2.0 * 2048 + 7168, 11297357824},
      {WeightFormat::int4_group, 2.0 * 2048 * 56 + 7168 * 16, 6001000448},
      {WeightFormat::fp8_e4m3_block128, 2.0 * 16 * 56 + 56 * 16, 11288576000},
  };
  for (const Want& w : want) {
    INFO(format_name(w.f));
    const Plan p = workspace::plan(cfg, 1, {.training = false, .format = w.f});
    CHECK(p.packed_weight_bytes == w.bytes);
    const double own = weights * format_info(w.f).code_bits / 8 + 256 * w.scales * 4;
    CHECK(double(p.packed_weight_bytes) <= 1.02 * own);
  }
}
