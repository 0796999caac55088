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

}  // namespace

const RouterOps& router_ops(RouterKind kind) {
  static const bool ordered = contracts::in_kind_order(kTable);
  MOECERT_ASSERT(ordered);
  const auto i = static_cast<std::size_t>(kind);
  MOECERT_ASSERT(i < kRouterKinds);
  return *kTable[i];
}

}  // namespace moecert::router
