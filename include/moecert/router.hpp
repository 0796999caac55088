// Routers: softmax top-k, sigmoid group-limited top-k (DeepSeek-V3) and
// product-key top-k, forward and backward.
//
// Every router writes idx [T x K] (int32 expert ids) and w [T x K] (fp32
// weights), K = idx.cols. Selection uses one total order: score descending,
// then expert index ascending, so results are deterministic and ties are
// broken the same way everywhere. Slot j of a row holds the j-th expert in
// that order; -1 (weight 0) marks an empty slot, only at the tail of a row,
// and only where fewer than K experts are eligible, which happens in exactly
// one case: sigmoid_topk with K > topk_group * E / G (the kept groups hold
// fewer than K experts). Rows are independent: oneTBB over tokens, the same
// bits for any thread count. Derivations: proofs/router.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "moecert/types.hpp"

namespace moecert::router {

/// softmax_topk, forward. p = softmax(z) over the E logits of a row; the K
/// experts of largest p (selected on z, which orders them exactly like the
/// exact p); weights p_j, or p renormalised over the K selected (a softmax
/// of the selected logits) when `renormalize`. z [T x E] fp32 or bf16.
///
/// Clauses (contracts/router/softmax_topk.cpp):
///   router.softmax_topk.shape        pre   shape    z T x E; idx, w T x K; 1 <= K <= E
///   router.softmax_topk.scores_finite pre  finite   every z finite
///   router.softmax_topk.no_alias     pre   alias    idx, w share no byte with z or each other
///   router.softmax_topk.idx_valid    post  index    0 <= idx < E, or -1 only at the tail
///   router.softmax_topk.idx_unique   post  index    no expert twice in a row
///   router.softmax_topk.sorted       post  index    slots follow the total order (z desc, index asc)
///   router.softmax_topk.topk_property post index    no unselected expert outranks the K-th
///   router.softmax_topk.weights_range post numeric  0 <= w <= 1; sum 1 (renormalised, within
///                                                  proofs/bounds.md §7) or <= 1 (not renormalised)
///   router.softmax_topk.within_bound post numeric  (full) every w within proofs/router.md §3 of its
///                                                  own slot's binary64 reference (a weight written
///                                                  to another slot passes weights_range, not this)
void softmax_topk_forward(MatView<const float> z, MatView<std::int32_t> idx, MatView<float> w,
                          bool renormalize);
void softmax_topk_forward(MatView<const bf16> z, MatView<std::int32_t> idx, MatView<float> w,
                          bool renormalize);

/// softmax_topk, backward: given g = dL/dw [T x K] and the forward's z and
/// idx, dz [T x E] (written entirely). Renormalised: dz_i = w_i (g_i - sum_S w g)
/// for i in the selected set S, 0 elsewhere. Not renormalised (dense):
/// dz_j = p_j (g^_j - sum_S p g) for every j, g^ = g on S, 0 elsewhere; so
/// an unselected j gets dz_j = -p_j sum_S p g, which is 0 only if that sum
/// is 0. -1 slots contribute nothing.
///
/// Clauses (contracts/router/softmax_topk.cpp):
///   router.softmax_topk_backward.shape     pre   shape    z, dz T x E; idx, g T x K
///   router.softmax_topk_backward.idx_valid pre   index    0 <= idx < E or -1 only at the tail; unique
///   router.softmax_topk_backward.g_finite  pre   finite   every g finite, |g| <= 2^126 (g - sum_S w g
///                                                 stays in fp32 range); every z finite
///   router.softmax_topk_backward.no_alias  pre   alias    dz shares no byte with z, idx, g
///   router.softmax_topk_backward.unselected_grad post numeric renormalised: dz_j == 0 exactly for
///                                                 every j not selected (the judge's backward=dense:
///                                                 within a dense softmax's rounding noise,
///                                                 proofs/router.md §4.4); not renormalised: every
///                                                 unselected dz_j has the sign of -sum_S p g (or is 0)
///   router.softmax_topk_backward.within_bound post numeric (full) every dz within proofs/router.md
///                                                 §4.1 of the binary64 reference given g
void softmax_topk_backward(MatView<const float> z, MatView<const std::int32_t> idx,
                           MatView<const float> g, MatView<float> dz, bool renormalize);

/// Group-limited sigmoid top-k (DeepSeek-V3).
struct SigmoidTopkParams {
  std::size_t groups = 1;      // G, dividing E
  std::size_t topk_group = 1;  // groups kept, 1 <= topk_group <= G
  float scaling = 1.0f;        // c
};

/// sigmoid_topk, forward. s = sigma(z); selection by s + bias (bias [E] is
/// for selection only); group score = sum of the group's top two selection
/// scores (its top one for groups of one expert); the topk_group groups of
/// largest group score are kept (group score desc, group index asc); the K
/// best experts of kept groups by selection score; w_j = c s_j / sum_S s.
///
/// Clauses (contracts/router/sigmoid_topk.cpp):
///   router.sigmoid_topk.shape         pre   shape    z T x E; bias E; idx, w T x K; 1 <= K <= E;
///                                                  G >= 1 divides E; 1 <= topk_group <= G; c finite > 0
///   router.sigmoid_topk.scores_finite pre   finite   every bias finite; every z finite and >= -87
///                                                  (sigma(z) normal; below, weights are 0 / 0)
///   router.sigmoid_topk.no_alias      pre   alias    idx, w share no byte with z, bias or each other
///   router.sigmoid_topk.idx_valid     post  index    0 <= idx < E, or -1 only at the tail
///   router.sigmoid_topk.idx_unique    post  index    no expert twice in a row
///   router.sigmoid_topk.sorted        post  index    slots follow the total order on s + bias
///   router.sigmoid_topk.topk_property post  index    no eligible unselected expert outranks the K-th,
///                                                  and every selected expert is in a kept group
///   router.sigmoid_topk.weights_range post  numeric  0 <= w <= c; sum_S w <= c (1 + §7)
///   router.sigmoid_topk.within_bound  post  numeric  (full) every w within proofs/router.md §3 of its
///                                                    own slot's binary64 reference
void sigmoid_topk_forward(MatView<const float> z, View<const float> bias,
                          const SigmoidTopkParams& p, MatView<std::int32_t> idx, MatView<float> w);
void sigmoid_topk_forward(MatView<const bf16> z, View<const float> bias, const SigmoidTopkParams& p,
                          MatView<std::int32_t> idx, MatView<float> w);

/// sigmoid_topk, backward through the normalisation and sigma (the bias gets
/// no gradient): for i in S, dz_i = s_i (1 - s_i) (c / sum_S s)(g_i - D), D = sum_S g s / sum_S s,
/// computed as c ((g_i - D)(s_i / sum_S s))(1 - s_i) (no intermediate overflows); 0 elsewhere.
/// dz [T x E] written entirely.
///
/// Clauses (contracts/router/sigmoid_topk.cpp):
///   router.sigmoid_topk_backward.shape     pre   shape    z, dz T x E; idx, g T x K
///   router.sigmoid_topk_backward.idx_valid pre   index    0 <= idx < E or -1 only at the tail; unique
///   router.sigmoid_topk_backward.g_finite  pre   finite   every g finite, |g| <= 2^126; every z finite
///                                                 and >= -87
///   router.sigmoid_topk_backward.no_alias  pre   alias    dz shares no byte with z, idx, g
///   router.sigmoid_topk_backward.unselected_grad post numeric dz_j == 0 exactly for every j not selected
///   router.sigmoid_topk_backward.dz_finite post  finite   every dz finite (valid input can overflow:
///                                                 |dz_i| reaches c |g_i - D|; proofs/router.md §4.2)
///   router.sigmoid_topk_backward.within_bound post numeric (full) every finite dz within
///                                                 proofs/router.md §4.2 of the binary64 reference given g
void sigmoid_topk_backward(MatView<const float> z, MatView<const std::int32_t> idx,
                           MatView<const float> g, const SigmoidTopkParams& p, MatView<float> dz);

/// How product-key weights come from the selected scores s.
enum class KeyWeights : std::uint8_t {
  raw = 0,      // w = s
  exp = 1,      // w = exp(s) (halves given as log-probabilities)
  softmax = 2,  // w = softmax over the K selected s
};

/// "raw", "exp" or "softmax".
constexpr std::string_view key_weights_name(KeyWeights w) {
  switch (w) {
    case KeyWeights::raw:
      return "raw";
    case KeyWeights::exp:
      return "exp";
    case KeyWeights::softmax:
      return "softmax";
  }
  return "";
}

/// product_key, forward. sx, sy [T x n], E = n*n; expert e = ix*n + iy has
/// score sx[ix] + sy[iy], ranked by the exact sum (the fp32 sum can round
/// distinct sums together; the exact one keeps the order total). Exact top-K:
/// top-K of each half under (score desc, index asc), then top-K of the K*K
/// candidate sums; proofs/router.md §2 proves this equals brute force over
/// all n*n experts. Weights from the fp32 scores per `mode`.
///
/// Clauses (contracts/router/product_key.cpp):
///   router.product_key.shape         pre   shape    sx, sy T x n; idx, w T x K; 1 <= K <= n*n
///   router.product_key.scores_finite pre   finite   every sx, sy finite with |s| <= 2^126 (sums stay
///                                                  finite); exp weights: max sx + max sy <= 88
///   router.product_key.no_alias      pre   alias    idx, w share no byte with sx, sy or each other
///   router.product_key.idx_valid     post  index    0 <= idx < n*n
///   router.product_key.idx_unique    post  index    no expert twice in a row
///   router.product_key.sorted        post  index    slots follow the total order
///   router.product_key.topk_property post  index    no unselected expert outranks the K-th
///                                                 (audit: brute force over the n^2 experts)
///   router.product_key.weights_range post  numeric  finite; softmax: 0 <= w <= 1, sum 1 within §7
///   router.product_key.within_bound  post  numeric  (full) every w within proofs/router.md §3 of its
///                                                  own slot's binary64 reference (every mode)
void product_key_forward(MatView<const float> sx, MatView<const float> sy, KeyWeights mode,
                         MatView<std::int32_t> idx, MatView<float> w);
void product_key_forward(MatView<const bf16> sx, MatView<const bf16> sy, KeyWeights mode,
                         MatView<std::int32_t> idx, MatView<float> w);

/// product_key, backward: for each valid slot (t, j) with idx = ix*n + iy,
/// ds_j from g through the weight mode, then dsx[t,ix] += ds_j and
/// dsy[t,iy] += ds_j in slot order (no atomics). Slots with idx = -1 add
/// nothing. dsx, dsy [T x n] written entirely.
///
/// Clauses (contracts/router/product_key.cpp):
///   router.product_key_backward.shape       pre   shape    sx, sy, dsx, dsy T x n; idx, g T x K
///   router.product_key_backward.idx_in_range pre  index    -1 <= idx < n*n, -1 only at the tail; unique
///   router.product_key_backward.g_finite    pre   finite   every g finite, |g| <= 2^126; sx, sy finite
///   router.product_key_backward.no_alias    pre   alias    dsx, dsy share no byte with any input or each other
///   router.product_key_backward.unused_zero post  numeric  dsx[t,i] == 0 (dsy[t,i] == 0) exactly if no
///                                                 valid slot of row t has ix == i (iy == i)
///   router.product_key_backward.grad_finite post  finite   every dsx, dsy finite (valid input can
///                                                 overflow: g w with exp weights, sums of up to K slots)
///   router.product_key_backward.within_bound post numeric (full) every finite dsx, dsy within
///                                                 proofs/router.md §4.3 of the binary64 reference given g
void product_key_backward(MatView<const float> sx, MatView<const float> sy,
                          MatView<const std::int32_t> idx, MatView<const float> g, KeyWeights mode,
                          MatView<float> dsx, MatView<float> dsy);

}  // namespace moecert::router
