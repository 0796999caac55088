// Clauses of layer.forward and layer.backward (include/moecert/layer.hpp).
#pragma once

#include "contracts/engine/engine.hpp"
#include "contracts/engine/saved.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/layer/bounds.hpp"
#include "contracts/layer/router_linear_probe.hpp"
#include "contracts/reference/layer.hpp"
#include "moecert/layer.hpp"

namespace moecert::contracts {

void layer_forward_pre(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                       MatView<const bf16> x, MatView<float> y);
void layer_forward_post(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                        MatView<const bf16> x, MatView<const float> y, const LayerSaved& s);
void layer_backward_pre(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                        MatView<const bf16> x, MatView<const float> dy, const LayerSaved& saved,
                        const layer::Gradients& g);
void layer_backward_post(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                         MatView<const bf16> x, MatView<const float> dy, const LayerSaved& saved,
                         const layer::Gradients& g, const layer::BackwardOptions& opt,
                         GradFiniteScan* grads_judge = nullptr,
                         const BackwardProbe* probe = nullptr,
                         const RouterLinearProbe* linear_probe = nullptr);
/// layer.backward's outputs in grad_finite's order: dx, the router
/// linear's gradients, m_a, m_g, then the experts' weight gradients.
std::vector<GradFiniteScan::Output> layer_grad_outputs(const MoeConfig& cfg,
                                                       const layer::Gradients& g);

}  // namespace moecert::contracts
