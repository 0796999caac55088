// What each router kind computes inside the layer, registered beside its op
// (ops/router/<kind>.cpp) and listed once in the ops' kind table
// (ops/router/kinds.cpp). The kind's description (name, width, clauses,
// bounds) is contracts/router/kind.hpp.
#pragma once

#include <cstdint>

#include "contracts/router/kind.hpp"

namespace moecert::router {

struct RouterOps {
  RouterKind kind;
  /// Selection and weights from the logits z (T x R); bias: the kind's
  /// per-expert selection bias, if it reads one.
  void (*forward)(const contracts::RouterSettings&, MatView<const float> z, View<const float> bias,
                  MatView<std::int32_t> idx, MatView<float> w);
  /// dz from g = dL/dw (T x K): T x R at dz, or the halves' two T x R/2
  /// blocks where the kind's description says `split_dz`.
  void (*backward)(const contracts::RouterSettings&, MatView<const float> z,
                   MatView<const std::int32_t> idx, MatView<const float> g, float* dz);
};

/// What `kind` (a valid RouterKind) computes.
const RouterOps& router_ops(RouterKind kind);

}  // namespace moecert::router
