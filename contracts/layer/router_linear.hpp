// Clauses of layer.router_linear (include/moecert/layer.hpp): the layer's
// router linear run on its own, and the bounded reference of its logits,
// which layer.forward's within_bound shares.
#pragma once

#include <vector>

#include "contracts/engine/engine.hpp"
#include "contracts/layer/router_linear_probe.hpp"
#include "contracts/numeric/tracked.hpp"
#include "moecert/layer.hpp"

namespace moecert::contracts {

void router_linear_forward_pre(detail::Checker& c, MatView<const bf16> x, MatView<const float> w,
                               View<const float> b, MatView<float> z);
void router_linear_forward_post(detail::Checker& c, MatView<const bf16> x, MatView<const float> w,
                                View<const float> b, MatView<const float> z);
void router_linear_backward_pre(detail::Checker& c, MatView<const bf16> x, MatView<const float> w,
                                MatView<const float> dz, const layer::RouterLinearGrads& g);
/// The dx the backward accumulates into, as it was before (only where
/// layer.router_linear.within_bound runs: its reference needs it).
std::vector<float> router_linear_dx_before(detail::Checker& c, MatView<const float> dx);
void router_linear_backward_post(detail::Checker& c, MatView<const bf16> x, MatView<const float> w,
                                 MatView<const float> dz, const layer::RouterLinearGrads& g,
                                 const std::vector<float>& dx_before,
                                 const RouterLinearProbe* probe = nullptr);

/// z = x W_r^T + b exactly (binary64, products of a bf16 and an fp32 exact)
/// with each element's bound: an fp32 sum of H + 1 terms (proofs/bounds.md §1).
std::vector<bounds::Tracked> router_logits_reference(MatView<const bf16> x, MatView<const float> w,
                                                     View<const float> b);

/// The backward's outputs exactly (binary64) with each element's bound, dz
/// taken as exact: dx = dx_before + dz W_r (R + 1 terms; empty without
/// dx_before), dW_r = dz^T x and db = the column sums of dz (T terms each);
/// proofs/layer.md §4.
struct RouterLinearGradsReference {
  std::vector<bounds::Tracked> dx, router_w, router_b;
};
RouterLinearGradsReference router_linear_grads_reference(MatView<const bf16> x,
                                                         MatView<const float> w,
                                                         MatView<const float> dz,
                                                         const std::vector<float>& dx_before);

}  // namespace moecert::contracts
