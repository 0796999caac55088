// The router kind table and what is derived from it: names, widths, the
// layer's settings.
#include <algorithm>
#include <array>

#include "contracts/router/kind.hpp"

namespace moecert {

namespace contracts {

// Each kind's description, defined in its clauses' file
// (contracts/router/<kind>.cpp).
extern const RouterKindInfo kSoftmaxTopkKind;
extern const RouterKindInfo kSigmoidTopkKind;
extern const RouterKindInfo kProductKeyKind;

namespace {

// One row per kind, in RouterKind's order (checked at first use).
const std::array<const RouterKindInfo*, kRouterKinds> kTable = {
    &kSoftmaxTopkKind,
    &kSigmoidTopkKind,
    &kProductKeyKind,
};

}  // namespace

std::span<const RouterKindInfo* const> router_kinds() {
  static const bool ordered = in_kind_order(kTable);
  MOECERT_ASSERT(ordered);
  return kTable;
}

const RouterKindInfo& router_kind(RouterKind kind) {
  const auto i = static_cast<std::size_t>(kind);
  MOECERT_ASSERT(i < kRouterKinds);
  return *router_kinds()[i];
}

std::string router_kind_list() {
  std::string s;
  const auto kinds = router_kinds();
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    if (i > 0) s.append(i + 1 == kinds.size() ? " or " : ", ");
    s.append(kinds[i]->name);
  }
  return s;
}

RouterSettings router_settings(const MoeConfig& cfg) {
  RouterSettings s;
  s.renormalize = cfg.renormalize;
  s.sigmoid = {static_cast<std::size_t>(cfg.groups), static_cast<std::size_t>(cfg.topk_group),
               static_cast<float>(cfg.scaling)};
  s.scaling = s.sigmoid.scaling;
  return s;
}

}  // namespace contracts

std::string_view router_kind_name(RouterKind k) {
  return static_cast<std::size_t>(k) < kRouterKinds ? contracts::router_kind(k).name : "invalid";
}

std::optional<RouterKind> parse_router_kind(std::string_view s) {
  for (const contracts::RouterKindInfo* k : contracts::router_kinds())
    if (k->name == s) return k->kind;
  return std::nullopt;
}

std::size_t router_width(const MoeConfig& cfg) {
  const auto e = static_cast<std::size_t>(std::max<std::int64_t>(cfg.experts, 0));
  if (static_cast<std::size_t>(cfg.router) >= kRouterKinds) return e;
  return contracts::router_kind(cfg.router).width(e);
}

}  // namespace moecert
