// Clauses of MoeConfig validation (op core.config.validate).
#include "moecert/config.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "contracts/engine/clauses.hpp"
#include "contracts/engine/engine.hpp"
#include "contracts/router/kind.hpp"

namespace moecert {

namespace {

// Checks lo <= v <= hi for clause `c`, naming the field.
template <class T>
void check_range(detail::Checker& chk, const ClauseInfo& c, std::string_view field, T v, T lo,
                 T hi) {
  if (v < lo || v > hi)
    chk.fail(c, "", fmt::format("{}={}", field, v), fmt::format("{} <= {} <= {}", lo, field, hi));
}
}  // namespace

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
    if (static_cast<std::size_t>(cfg.router) >= kRouterKinds)
      chk.fail(c::kRouterKind, "", fmt::format("router={}", static_cast<unsigned>(cfg.router)),
               contracts::router_kind_list());
  }
  if (static_cast<std::size_t>(cfg.router) < kRouterKinds)
    contracts::router_kind(cfg.router).validate(chk, cfg);
}

}  // namespace moecert
