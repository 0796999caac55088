// The ops' router kind table: one row per kind, in RouterKind's order.
#include "ops/router/kinds.hpp"

#include <array>

namespace moecert::router {

// Each kind's ops, defined beside them (ops/router/<kind>.cpp).
extern const RouterOps kSoftmaxTopkOps;
extern const RouterOps kSigmoidTopkOps;
extern const RouterOps kProductKeyOps;

namespace {

const std::array<const RouterOps*, kRouterKinds> kTable = {
    &kSoftmaxTopkOps,
    &kSigmoidTopkOps,
    &kProductKeyOps,
};

bool in_order() {
  for (std::size_t i = 0; i < kTable.size(); ++i)
    if (static_cast<std::size_t>(kTable[i]->kind) != i) return false;
  return true;
}

}  // namespace

const RouterOps& router_ops(RouterKind kind) {
  static const bool ordered = in_order();
  MOECERT_ASSERT(ordered);
  const auto i = static_cast<std::size_t>(kind);
  MOECERT_ASSERT(i < kRouterKinds);
  return *kTable[i];
}

}  // namespace moecert::router
