// MoeConfig validation: a typical config passes, each clause fires alone.
#include "moecert/config.hpp"

#include <cmath>
#include <limits>

#include "contracts/router/kind.hpp"
#include "test_util.hpp"

using namespace moecert;

namespace {

MoeConfig typical() {
  MoeConfig c;
  c.experts = 64;
  c.hidden = 2048;
  c.inter = 1408;
  c.topk = 6;
  c.lora_rank = 8;
  c.lora_alpha = 16;
  c.max_tokens = 4096;
  return c;
}

MoeConfig deepseek_v3() {
  MoeConfig c = typical();
  c.router = RouterKind::sigmoid_topk;
  c.experts = 256;
  c.hidden = 7168;
  c.inter = 2048;
  c.topk = 8;
  c.groups = 8;
  c.topk_group = 4;
  c.scaling = 2.5;
  return c;
}

// Validates a config spoiled by `spoil`; returns the violation.
template <class F>
Violation spoiled(MoeConfig c, F spoil, std::string_view clause) {
  spoil(c);
  return test::expect_violation([&] { validate(c); }, clause, Level::check);
}

}  // namespace

TEST_CASE("core.config.validate: typical configs pass at every level", "[core][config][shape]") {
  for (Level l : {Level::check, Level::audit, Level::full}) {
    ContractScope scope{l, Semantic::enforce};
    CHECK_NOTHROW(validate(typical()));
    CHECK_NOTHROW(validate(deepseek_v3()));
    MoeConfig pk = typical();
    pk.router = RouterKind::product_key;
    pk.experts = 4096;
    CHECK_NOTHROW(validate(pk));
  }
  CHECK(typical().lora_scale() == 2.0);
}

TEST_CASE("core.config.validate: experts_range", "[core][config][shape]") {
  auto v = spoiled(
      typical(), [](MoeConfig& c) { c.experts = 0; }, "core.config.experts_range");
  CHECK(v.observed == "E=0");
  CHECK(v.expected == "1 <= E <= 65536");
  spoiled(
      typical(), [](MoeConfig& c) { c.experts = kMaxExperts + 1; }, "core.config.experts_range");
}

TEST_CASE("core.config.validate: hidden_range", "[core][config][shape]") {
  spoiled(
      typical(), [](MoeConfig& c) { c.hidden = -1; }, "core.config.hidden_range");
}

TEST_CASE("core.config.validate: inter_range", "[core][config][shape]") {
  spoiled(
      typical(), [](MoeConfig& c) { c.inter = kMaxDim + 1; }, "core.config.inter_range");
}

TEST_CASE("core.config.validate: topk_range", "[core][config][shape]") {
  spoiled(
      typical(), [](MoeConfig& c) { c.topk = 0; }, "core.config.topk_range");
  auto v = spoiled(
      typical(), [](MoeConfig& c) { c.topk = 65; }, "core.config.topk_range");
  CHECK(v.expected == "1 <= K <= 64");
  spoiled(
      typical(),
      [](MoeConfig& c) {
        c.experts = 4;
        c.topk = 5;
      },
      "core.config.topk_range");
}

TEST_CASE("core.config.validate: rank_range", "[core][config][shape]") {
  spoiled(
      typical(), [](MoeConfig& c) { c.lora_rank = -1; }, "core.config.rank_range");
  spoiled(
      typical(), [](MoeConfig& c) { c.lora_rank = 257; }, "core.config.rank_range");
}

TEST_CASE("core.config.validate: alpha_finite", "[core][config][shape]") {
  spoiled(
      typical(), [](MoeConfig& c) { c.lora_alpha = std::numeric_limits<double>::infinity(); },
      "core.config.alpha_finite");
  spoiled(
      typical(), [](MoeConfig& c) { c.lora_alpha = 0; }, "core.config.alpha_finite");
  MoeConfig no_lora = typical();
  no_lora.lora_rank = 0;
  no_lora.lora_alpha = 0;
  ContractScope scope{Level::check, Semantic::enforce};
  CHECK_NOTHROW(validate(no_lora));
}

TEST_CASE("core.config.validate: tokens_range", "[core][config][shape]") {
  spoiled(
      typical(), [](MoeConfig& c) { c.max_tokens = kMaxTokens + 1; }, "core.config.tokens_range");
}

TEST_CASE("core.config.validate: router_kind", "[core][config][shape]") {
  spoiled(
      typical(), [](MoeConfig& c) { c.router = static_cast<RouterKind>(3); },
      "core.config.router_kind");
}

TEST_CASE("core.config: the router kind table names, sizes and orders every kind",
          "[core][config]") {
  const auto kinds = contracts::router_kinds();
  REQUIRE(kinds.size() == kRouterKinds);
  std::string list;
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    const contracts::RouterKindInfo& k = *kinds[i];
    CHECK(static_cast<std::size_t>(k.kind) == i);
    CHECK(router_kind_name(k.kind) == k.name);
    CHECK(parse_router_kind(k.name) == k.kind);
    CHECK(&contracts::router_kind(k.kind) == &k);
    for (std::size_t e = 1; e <= 300; ++e)  // width and experts_of are inverse where E routes
      if (const std::size_t r = k.width(e)) CHECK(k.experts_of(r) == e);
    MoeConfig c = typical();
    c.router = k.kind;
    CHECK(router_width(c) == k.width(64));
    list += std::string(i ? ", " : "") + std::string(k.name);
  }
  CHECK(contracts::router_kind(RouterKind::product_key).width(10) == 0);  // not n*n
  CHECK(router_kind_name(static_cast<RouterKind>(kRouterKinds)) == "invalid");
  CHECK_FALSE(parse_router_kind("softmax"));
  const std::string named = contracts::router_kind_list();
  CHECK(named.starts_with("softmax_topk, "));
  CHECK(named.ends_with(" or " + std::string(kinds.back()->name)));
  auto v = spoiled(
      typical(), [](MoeConfig& c) { c.router = static_cast<RouterKind>(kRouterKinds); },
      "core.config.router_kind");
  CHECK(v.expected == named);
}

TEST_CASE("core.config.validate: product_key_square", "[core][config][shape]") {
  auto v = spoiled(
      typical(),
      [](MoeConfig& c) {
        c.router = RouterKind::product_key;
        c.experts = 4095;
      },
      "core.config.product_key_square");
  CHECK(v.observed == "E=4095");
}

TEST_CASE("core.config.validate: groups_divide", "[core][config][shape]") {
  spoiled(
      deepseek_v3(), [](MoeConfig& c) { c.groups = 3; }, "core.config.groups_divide");
  spoiled(
      deepseek_v3(), [](MoeConfig& c) { c.groups = 0; }, "core.config.groups_divide");
}

TEST_CASE("core.config.validate: topk_group_range", "[core][config][shape]") {
  spoiled(
      deepseek_v3(), [](MoeConfig& c) { c.topk_group = 9; }, "core.config.topk_group_range");
  spoiled(
      deepseek_v3(), [](MoeConfig& c) { c.topk_group = 0; }, "core.config.topk_group_range");
  // 1 group of 32 experts kept cannot supply K = 33.
  spoiled(
      deepseek_v3(),
      [](MoeConfig& c) {
        c.topk_group = 1;
        c.topk = 33;
      },
      "core.config.topk_group_range");
}

TEST_CASE("core.config.validate: scaling_finite", "[core][config][shape]") {
  spoiled(
      deepseek_v3(), [](MoeConfig& c) { c.scaling = std::nan(""); }, "core.config.scaling_finite");
}

TEST_CASE("core.config.validate: message is one actionable line", "[core][config][shape]") {
  auto v = spoiled(
      typical(), [](MoeConfig& c) { c.topk = 65; }, "core.config.topk_range");
  CHECK(v.one_line() ==
        "core.config.validate: precondition core.config.topk_range failed: K=65, expected 1 <= K "
        "<= 64");
  CHECK(v.op == "core.config.validate");
  CHECK(v.kind == ClauseKind::pre);
  CHECK(v.group == Group::shape);
  CHECK(v.level == Level::check);
  CHECK(v.semantic == Semantic::enforce);
  CHECK(std::string(v.source.file_name()).find("config.cpp") != std::string::npos);
  CHECK(v.source.line() > 0);
}
