// Clauses of MoeConfig validation (op core.config.validate).
#include "moecert/config.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "contracts/clauses.hpp"
#include "contracts/engine.hpp"

namespace moecert {

namespace {
constexpr std::string_view kRouterNames[] = {"softmax_topk", "sigmoid_topk", "product_key"};
static_assert(std::size(kRouterNames) == kRouterKinds);

// Checks lo <= v <= hi for clause `c`, naming the field.
template <class T>
void check_range(detail::Checker& chk, const ClauseInfo& c, std::string_view field, T v, T lo,
                 T hi) {
  if (v < lo || v > hi)
    chk.fail(c, "", fmt::format("{}={}", field, v), fmt::format("{} <= {} <= {}", lo, field, hi));
}
}  // namespace

std::string_view router_kind_name(RouterKind k) {
  const auto i = static_cast<std::size_t>(k);
  return i < kRouterKinds ? kRouterNames[i] : "invalid";
}

std::size_t router_width(const MoeConfig& cfg) {
  const auto e = static_cast<std::size_t>(std::max<std::int64_t>(cfg.experts, 0));
  if (cfg.router != RouterKind::product_key) return e;
  return 2 * static_cast<std::size_t>(std::llround(std::sqrt(static_cast<double>(e))));
}

std::optional<RouterKind> parse_router_kind(std::string_view s) {
  for (std::size_t i = 0; i < kRouterKinds; ++i)
    if (kRouterNames[i] == s) return static_cast<RouterKind>(i);
  return std::nullopt;
}

void validate(const MoeConfig& cfg) {
  namespace c = clauses::config;
  detail::Checker chk{"core.config.validate"};
  MOECERT_CONTRACT(chk, c::kExpertsRange) {
    check_range<std::int64_t>(chk, c::kExpertsRange, "E", cfg.experts, 1, kMaxExperts);
  }
  MOECERT_CONTRACT(chk, c::kHiddenRange) {
    check_range<std::int64_t>(chk, c::kHiddenRange, "H", cfg.hidden, 1, kMaxDim);
  }
  MOECERT_CONTRACT(chk, c::kInterRange) {
    check_range<std::int64_t>(chk, c::kInterRange, "I", cfg.inter, 1, kMaxDim);
  }
  MOECERT_CONTRACT(chk, c::kTopkRange) {
    const std::int64_t hi = std::min(std::max<std::int64_t>(cfg.experts, 1), kMaxTopk);
    check_range<std::int64_t>(chk, c::kTopkRange, "K", cfg.topk, 1, hi);
  }
  MOECERT_CONTRACT(chk, c::kRankRange) {
    check_range<std::int64_t>(chk, c::kRankRange, "r", cfg.lora_rank, 0, kMaxRank);
  }
  MOECERT_CONTRACT(chk, c::kAlphaFinite) {
    if (!std::isfinite(cfg.lora_alpha) || (cfg.lora_rank > 0 && !(cfg.lora_alpha > 0)))
      chk.fail(c::kAlphaFinite, "", fmt::format("alpha={}", cfg.lora_alpha),
               cfg.lora_rank > 0 ? "finite alpha > 0" : "finite alpha");
  }
  MOECERT_CONTRACT(chk, c::kTokensRange) {
    check_range<std::int64_t>(chk, c::kTokensRange, "T_max", cfg.max_tokens, 1, kMaxTokens);
  }
  MOECERT_CONTRACT(chk, c::kRouterKind) {
    if (static_cast<unsigned>(cfg.router) > 2)
      chk.fail(c::kRouterKind, "", fmt::format("router={}", static_cast<unsigned>(cfg.router)),
               "softmax_topk (0), sigmoid_topk (1) or product_key (2)");
  }
  if (cfg.router == RouterKind::product_key) {
    MOECERT_CONTRACT(chk, c::kProductKeySquare) {
      const auto n = static_cast<std::int64_t>(
          std::llround(std::sqrt(static_cast<double>(std::max<std::int64_t>(cfg.experts, 0)))));
      if (cfg.experts < 1 || n * n != cfg.experts)
        chk.fail(c::kProductKeySquare, "", fmt::format("E={}", cfg.experts), "E = n*n");
    }
  }
  if (cfg.router == RouterKind::sigmoid_topk) {
    MOECERT_CONTRACT(chk, c::kGroupsDivide) {
      if (cfg.groups < 1 || cfg.experts % cfg.groups != 0)
        chk.fail(c::kGroupsDivide, "", fmt::format("G={} E={}", cfg.groups, cfg.experts),
                 "G >= 1 dividing E");
    }
    MOECERT_CONTRACT(chk, c::kTopkGroupRange) {
      const std::int64_t per_group = cfg.groups >= 1 ? cfg.experts / cfg.groups : 0;
      if (cfg.topk_group < 1 || cfg.topk_group > cfg.groups ||
          cfg.topk > cfg.topk_group * per_group)
        chk.fail(c::kTopkGroupRange, "",
                 fmt::format("topk_group={} G={} K={}", cfg.topk_group, cfg.groups, cfg.topk),
                 fmt::format("1 <= topk_group <= G and K <= topk_group * E / G = {}",
                             cfg.topk_group * per_group));
    }
    MOECERT_CONTRACT(chk, c::kScalingFinite) {
      if (!std::isfinite(cfg.scaling) || !(cfg.scaling > 0))
        chk.fail(c::kScalingFinite, "", fmt::format("c={}", cfg.scaling), "finite c > 0");
    }
  }
}

}  // namespace moecert
