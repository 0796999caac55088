// The layer's bounds (proofs/layer.md): the reference of a kernel run with
// every element's bound of the kernel's error, conditioned on the kernel's
// routing (its logits, selection and weights).
#pragma once

#include <optional>

#include "contracts/engine/saved.hpp"
#include "contracts/numeric/tracked.hpp"
#include "contracts/reference/layer.hpp"
#include "moecert/layer.hpp"

namespace moecert::contracts {

/// The layer's inputs as reference data of scalar S (routing, logits and
/// weights from `saved`: the kernel's), dy optional.
template <class S>
ref::LayerData<S> layer_data(const MoeConfig& cfg, const layer::Weights& w, MatView<const bf16> x,
                             std::optional<MatView<const float>> dy, const LayerSaved& saved);

/// The reference forward (and backward with dy) with every element's bound
/// of the kernel's error (proofs/layer.md), conditioned on the kernel's
/// routing; `dw_kernel` (the kernel's dL/dw) enters the router backward's
/// rounding bound.
ref::LayerResult<bounds::Tracked> layer_bounds(const MoeConfig& cfg, const layer::Weights& w,
                                               MatView<const bf16> x,
                                               std::optional<MatView<const float>> dy,
                                               const LayerSaved& saved, ref::Paths paths,
                                               const float* dw_kernel);

}  // namespace moecert::contracts
