// Clauses of layer.forward and layer.backward (include/moecert/layer.hpp).
#pragma once

#include "contracts/bounds/layer.hpp"
#include "contracts/engine.hpp"
#include "contracts/reference/layer.hpp"
#include "contracts/saved.hpp"
#include "moecert/layer.hpp"

namespace moecert::contracts {

void layer_forward_pre(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                       MatView<const bf16> x, MatView<float> y);
void layer_forward_post(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                        MatView<const bf16> x, MatView<const float> y, const LayerSaved& s);
void layer_backward_pre(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                        MatView<const bf16> x, MatView<const float> dy, const LayerSaved& saved,
                        const layer::Gradients& g);
/// layer.backward.saved_finite, after the backward's first step began (its
/// fresh buffers poisoned: a saved buffer that shares their memory shows).
void layer_backward_saved(detail::Checker& c, const MoeConfig& cfg, MatView<const bf16> x,
                          const LayerSaved& saved);
void layer_backward_post(detail::Checker& c, const MoeConfig& cfg, const layer::Weights& w,
                         MatView<const bf16> x, MatView<const float> dy, const LayerSaved& saved,
                         const layer::Gradients& g, const layer::BackwardOptions& opt);

}  // namespace moecert::contracts
