// Clauses of the router ops (declared in include/moecert/router.hpp).
#pragma once

#include "contracts/engine/engine.hpp"
#include "contracts/engine/params.hpp"
#include "moecert/router.hpp"

namespace moecert::contracts {

void softmax_topk_pre(detail::Checker& c, MatView<const float> z, ByteRange z_bytes,
                      MatView<std::int32_t> idx, MatView<float> w);
void softmax_topk_post(detail::Checker& c, MatView<const float> z, MatView<const std::int32_t> idx,
                       MatView<const float> w, bool renormalize);
void softmax_topk_backward_pre(detail::Checker& c, MatView<const float> z,
                               MatView<const std::int32_t> idx, MatView<const float> g,
                               MatView<float> dz);
/// dense: the implementation differentiates the dense softmax (the judge's
/// backward=dense; renormalised only): unselected experts may carry its
/// rounding noise, every gradient within proofs/router.md §4.4.
void softmax_topk_backward_post(detail::Checker& c, MatView<const float> z,
                                MatView<const std::int32_t> idx, MatView<const float> g,
                                MatView<const float> dz, bool renormalize, bool dense = false);

void sigmoid_topk_pre(detail::Checker& c, MatView<const float> z, ByteRange z_bytes,
                      View<const float> bias, const router::SigmoidTopkParams& p,
                      MatView<std::int32_t> idx, MatView<float> w);
void sigmoid_topk_post(detail::Checker& c, MatView<const float> z, View<const float> bias,
                       const router::SigmoidTopkParams& p, MatView<const std::int32_t> idx,
                       MatView<const float> w);
void sigmoid_topk_backward_pre(detail::Checker& c, MatView<const float> z,
                               MatView<const std::int32_t> idx, MatView<const float> g,
                               MatView<float> dz);
void sigmoid_topk_backward_post(detail::Checker& c, MatView<const float> z,
                                MatView<const std::int32_t> idx, MatView<const float> g,
                                const router::SigmoidTopkParams& p, MatView<const float> dz);

void product_key_pre(detail::Checker& c, MatView<const float> sx, MatView<const float> sy,
                     ByteRange in_x, ByteRange in_y, router::KeyWeights mode,
                     MatView<std::int32_t> idx, MatView<float> w);
void product_key_post(detail::Checker& c, MatView<const float> sx, MatView<const float> sy,
                      router::KeyWeights mode, MatView<const std::int32_t> idx,
                      MatView<const float> w);
void product_key_backward_pre(detail::Checker& c, MatView<const float> sx, MatView<const float> sy,
                              MatView<const std::int32_t> idx, MatView<const float> g,
                              MatView<float> dsx, MatView<float> dsy);
void product_key_backward_post(detail::Checker& c, MatView<const float> sx, MatView<const float> sy,
                               MatView<const std::int32_t> idx, MatView<const float> g,
                               router::KeyWeights mode, MatView<const float> dsx,
                               MatView<const float> dsy);

/// The judge's params of sigmoid_topk: groups (1), topk_group (1), scaling (1).
router::SigmoidTopkParams sigmoid_params(const Params& m);

/// The judge's params of product_key: weights softmax (default), exp or raw.
router::KeyWeights key_weights(const Params& m);

}  // namespace moecert::contracts
