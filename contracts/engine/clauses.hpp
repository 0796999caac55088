// Every clause the library defines, by family. Ids, kinds, groups and
// levels here must match the tables next to the ops' declarations in
// include/moecert (tests/contracts_test.cpp checks that they agree).
#pragma once

#include <span>

#include "moecert/contracts.hpp"

namespace moecert::clauses {

constexpr ClauseInfo pre(std::string_view id, Group g, std::string_view text,
                         Level l = Level::check) {
  return {id, ClauseKind::pre, g, l, text};
}
constexpr ClauseInfo post(std::string_view id, Group g, std::string_view text,
                          Level l = Level::check) {
  return {id, ClauseKind::post, g, l, text};
}

namespace config {
inline constexpr ClauseInfo kExpertsRange =
    pre("core.config.experts_range", Group::shape, "1 <= E <= 65536");
inline constexpr ClauseInfo kHiddenRange =
    pre("core.config.hidden_range", Group::shape, "1 <= H <= 65536");
inline constexpr ClauseInfo kInterRange =
    pre("core.config.inter_range", Group::shape, "1 <= I <= 65536");
inline constexpr ClauseInfo kTopkRange =
    pre("core.config.topk_range", Group::shape, "1 <= K <= min(E, 64)");
inline constexpr ClauseInfo kRankRange =
    pre("core.config.rank_range", Group::shape, "0 <= r <= 256");
inline constexpr ClauseInfo kAlphaFinite =
    pre("core.config.alpha_finite", Group::shape, "alpha finite, > 0 when r > 0");
inline constexpr ClauseInfo kTokensRange =
    pre("core.config.tokens_range", Group::shape, "1 <= T_max <= 2^20");
inline constexpr ClauseInfo kRouterKind =
    pre("core.config.router_kind", Group::shape, "router is a known kind");
inline constexpr ClauseInfo kProductKeySquare =
    pre("core.config.product_key_square", Group::shape, "E = n*n");
inline constexpr ClauseInfo kGroupsDivide =
    pre("core.config.groups_divide", Group::shape, "G >= 1 divides E");
inline constexpr ClauseInfo kTopkGroupRange =
    pre("core.config.topk_group_range", Group::shape, "1 <= topk_group <= G, K <= topk_group*E/G");
inline constexpr ClauseInfo kScalingFinite =
    pre("core.config.scaling_finite", Group::shape, "c finite, > 0");

inline constexpr ClauseInfo kAll[] = {
    kExpertsRange, kHiddenRange, kInterRange,       kTopkRange,    kRankRange,      kAlphaFinite,
    kTokensRange,  kRouterKind,  kProductKeySquare, kGroupsDivide, kTopkGroupRange, kScalingFinite};
}  // namespace config

namespace gemm {
inline constexpr ClauseInfo kPackShape =
    pre("gemm.pack.shape", Group::shape, "stride >= cols; second of w's shape");
inline constexpr ClauseInfo kPackWFinite =
    pre("gemm.pack.w_finite", Group::finite, "every W element finite");
inline constexpr ClauseInfo kPackWRange =
    pre("gemm.pack.w_range", Group::numeric, "W element 0 or 2^-60 <= |w| <= 2^60", Level::audit);
inline constexpr ClauseInfo kPackRoundtrip =
    post("gemm.pack.roundtrip", Group::memory, "every W element reads back from the packed layout");
inline constexpr ClauseInfo kPackQShape =
    pre("gemm.pack.q_shape", Group::shape,
        "quantized format; stride >= row bytes; scale_stride >= scale columns; second alike");
inline constexpr ClauseInfo kPackQCode =
    pre("gemm.pack.q_code", Group::numeric, "integer codes in the format's range; e4m3 not NaN");
inline constexpr ClauseInfo kPackQScale =
    pre("gemm.pack.q_scale", Group::finite, "every scale finite and > 0");
inline constexpr ClauseInfo kPackChecksum = {"gemm.pack.checksum", ClauseKind::invariant,
                                             Group::memory, Level::audit,
                                             "packed bytes hash to the pack-time checksum"};
inline constexpr ClauseInfo kShape =
    pre("gemm.matmul.shape", Group::shape, "a.cols == w.k, c is a.rows x w.n");
inline constexpr ClauseInfo kAFinite =
    pre("gemm.matmul.a_finite", Group::finite, "every A element finite");
inline constexpr ClauseInfo kARange =
    pre("gemm.matmul.a_range", Group::numeric, "A element 0 or 2^-60 <= |a| <= 2^60", Level::audit);
inline constexpr ClauseInfo kNoAlias =
    pre("gemm.matmul.no_alias", Group::alias, "C shares no byte with A or W");
inline constexpr ClauseInfo kCFinite =
    post("gemm.matmul.c_finite", Group::finite, "every C element finite");
inline constexpr ClauseInfo kProbe =
    post("gemm.matmul.probe", Group::numeric, "Freivalds probe within bound", Level::audit);
inline constexpr ClauseInfo kWithinBound =
    post("gemm.matmul.within_bound", Group::numeric, "|C - ref| <= bounds::dot", Level::full);
inline constexpr ClauseInfo kAll[] = {kPackShape,  kPackWFinite, kPackWRange, kPackRoundtrip,
                                      kPackQShape, kPackQCode,   kPackQScale, kPackChecksum,
                                      kShape,      kAFinite,     kARange,     kNoAlias,
                                      kCFinite,    kProbe,       kWithinBound};
}  // namespace gemm

namespace experts {
inline constexpr ClauseInfo kShape =
    pre("experts.forward.shape", Group::shape, "x T x H, idx/weights T x K, y T x H");
inline constexpr ClauseInfo kIdxInRange =
    pre("experts.forward.idx_in_range", Group::index, "-1 <= idx < E, -1 only at the tail");
inline constexpr ClauseInfo kIdxUnique =
    pre("experts.forward.idx_unique", Group::index, "no expert twice in a row");
inline constexpr ClauseInfo kWeightFinite =
    pre("experts.forward.weight_finite", Group::finite, "weights finite, 0 at -1 slots");
inline constexpr ClauseInfo kXFinite =
    pre("experts.forward.x_finite", Group::finite, "every x element finite");
inline constexpr ClauseInfo kXRange = pre("experts.forward.x_range", Group::numeric,
                                          "x element 0 or 2^-60 <= |x| <= 2^60", Level::audit);
inline constexpr ClauseInfo kNoAlias =
    pre("experts.forward.no_alias", Group::alias, "y shares no byte with any input");
inline constexpr ClauseInfo kPermutation = {"experts.forward.permutation", ClauseKind::invariant,
                                            Group::index, Level::check,
                                            "grouping holds every valid slot once"};
inline constexpr ClauseInfo kYFinite =
    post("experts.forward.y_finite", Group::finite, "every y element finite");
inline constexpr ClauseInfo kProbe = post("experts.forward.probe", Group::numeric,
                                          "probes of both GEMMs within bound", Level::audit);
inline constexpr ClauseInfo kWithinBound =
    post("experts.forward.within_bound", Group::numeric, "|y - ref| <= chained bound", Level::full);
inline constexpr ClauseInfo kRounding =
    post("experts.forward.rounding_unbiased", Group::numeric,
         "y's errors not biased toward or away from zero", Level::full);
inline constexpr ClauseInfo kSpread =
    post("experts.forward.spread_explained", Group::numeric,
         "y within the declared precision's probabilistic bound", Level::full);
inline constexpr ClauseInfo kScaleExplained =
    post("experts.forward.scale_explained", Group::numeric,
         "y's error along the exact y within the probabilistic bound", Level::full);
inline constexpr ClauseInfo kPackShape =
    pre("experts.pack.shape", Group::shape,
        "per expert gate, up I x H and down H x I of one quantized format");
inline constexpr ClauseInfo kAll[] = {kShape,   kIdxInRange,     kIdxUnique,   kWeightFinite,
                                      kXFinite, kXRange,         kNoAlias,     kPermutation,
                                      kYFinite, kProbe,          kWithinBound, kRounding,
                                      kSpread,  kScaleExplained, kPackShape};
}  // namespace experts

namespace experts_train {
inline constexpr ClauseInfo kFwdShape = pre("experts.forward_train.shape", Group::shape,
                                            "x, y T x H; idx, weights T x K; LoRA of its shapes");
inline constexpr ClauseInfo kFwdIdxInRange =
    pre("experts.forward_train.idx_in_range", Group::index, "-1 <= idx < E, -1 only at the tail");
inline constexpr ClauseInfo kFwdIdxUnique =
    pre("experts.forward_train.idx_unique", Group::index, "no expert twice in a row");
inline constexpr ClauseInfo kFwdWeightFinite =
    pre("experts.forward_train.weight_finite", Group::finite, "weights finite, 0 at -1 slots");
inline constexpr ClauseInfo kFwdXFinite =
    pre("experts.forward_train.x_finite", Group::finite, "every x element finite");
inline constexpr ClauseInfo kFwdXRange = pre("experts.forward_train.x_range", Group::numeric,
                                             "x element 0 or 2^-60 <= |x| <= 2^60", Level::audit);
inline constexpr ClauseInfo kFwdLoraFinite =
    pre("experts.forward_train.lora_finite", Group::finite, "every LoRA element finite");
inline constexpr ClauseInfo kFwdLoraRange =
    pre("experts.forward_train.lora_range", Group::numeric,
        "LoRA element 0 or 2^-60 <= |a| <= 2^60", Level::audit);
inline constexpr ClauseInfo kFwdScale = pre("experts.forward_train.scale_finite", Group::numeric,
                                            "s = float(alpha / r) in [2^-60, 2^60]");
inline constexpr ClauseInfo kFwdNoAlias =
    pre("experts.forward_train.no_alias", Group::alias, "y shares no byte with any input");
inline constexpr ClauseInfo kFwdLoraPadding = {"experts.forward_train.lora_padding",
                                               ClauseKind::invariant, Group::numeric, Level::check,
                                               "packed LoRA rank padding is zero"};
inline constexpr ClauseInfo kFwdYFinite =
    post("experts.forward_train.y_finite", Group::finite, "every y finite");
inline constexpr ClauseInfo kFwdProbe =
    post("experts.forward_train.probe", Group::numeric,
         "probes of the base and LoRA GEMMs within bound", Level::audit);
inline constexpr ClauseInfo kFwdWithin =
    post("experts.forward_train.within_bound", Group::numeric, "y within bound", Level::full);
inline constexpr ClauseInfo kFwdRounding =
    post("experts.forward_train.rounding_unbiased", Group::numeric,
         "y's errors not biased toward or away from zero", Level::full);
inline constexpr ClauseInfo kBwdState = pre("experts.backward.state", Group::shape,
                                            "saved holds a training forward of these shapes and T");
inline constexpr ClauseInfo kBwdShape =
    pre("experts.backward.shape", Group::shape, "x, dy T x H; gradients of their shapes");
inline constexpr ClauseInfo kBwdDyFinite =
    pre("experts.backward.dy_finite", Group::finite, "every dy finite");
inline constexpr ClauseInfo kBwdNoAlias =
    pre("experts.backward.no_alias", Group::alias, "gradients disjoint from each other and inputs");
inline constexpr ClauseInfo kBwdSavedFinite =
    pre("experts.backward.saved_finite", Group::finite, "saved activations finite");
inline constexpr ClauseInfo kBwdSavedIntact =
    pre("experts.backward.saved_intact", Group::memory,
        "saved gate/up rows hold the forward's bits", Level::audit);
inline constexpr ClauseInfo kBwdGradFinite =
    post("experts.backward.grad_finite", Group::finite, "every gradient finite");
inline constexpr ClauseInfo kBwdEmptyZero =
    post("experts.backward.empty_expert_zero", Group::numeric, "no tokens: gradients exactly 0");
inline constexpr ClauseInfo kBwdDwMasked =
    post("experts.backward.dweights_masked", Group::numeric, "dweights 0 at -1 slots");
inline constexpr ClauseInfo kBwdProbe =
    post("experts.backward.probe", Group::numeric,
         "probes of the dh and dx row GEMMs and their LoRA products within bound", Level::audit);
inline constexpr ClauseInfo kBwdWithin =
    post("experts.backward.within_bound", Group::numeric, "outputs within bound", Level::full);
inline constexpr ClauseInfo kBwdRounding =
    post("experts.backward.rounding_unbiased", Group::numeric,
         "dx's, dweights' and the weight gradients' errors not biased toward or away from zero",
         Level::full);
inline constexpr ClauseInfo kFwdSpread =
    post("experts.forward_train.spread_explained", Group::numeric,
         "y within the declared precision's probabilistic bound", Level::full);
inline constexpr ClauseInfo kFwdScaleExplained =
    post("experts.forward_train.scale_explained", Group::numeric,
         "y's error along the exact y within the probabilistic bound", Level::full);
inline constexpr ClauseInfo kBwdSpread =
    post("experts.backward.spread_explained", Group::numeric,
         "outputs within the declared precision's probabilistic bound", Level::full);
inline constexpr ClauseInfo kBwdScaleExplained =
    post("experts.backward.scale_explained", Group::numeric,
         "dx's and dweights' errors along the exact dx and dweights within the probabilistic bound",
         Level::full);
inline constexpr ClauseInfo kAll[] = {
    kFwdShape,         kFwdIdxInRange, kFwdIdxUnique, kFwdWeightFinite,   kFwdXFinite,
    kFwdXRange,        kFwdLoraFinite, kFwdLoraRange, kFwdScale,          kFwdNoAlias,
    kFwdLoraPadding,   kFwdYFinite,    kFwdProbe,     kFwdWithin,         kBwdState,
    kBwdShape,         kBwdDyFinite,   kBwdNoAlias,   kBwdSavedFinite,    kBwdSavedIntact,
    kBwdGradFinite,    kBwdEmptyZero,  kBwdDwMasked,  kBwdProbe,          kBwdWithin,
    kFwdRounding,      kBwdRounding,   kFwdSpread,    kFwdScaleExplained, kBwdSpread,
    kBwdScaleExplained};
}  // namespace experts_train

namespace router {
#define MOECERT_ROUTER_CLAUSE(var, kind, id, group, text) \
  inline constexpr ClauseInfo var = kind(id, Group::group, text);
MOECERT_ROUTER_CLAUSE(kSmShape, pre, "router.softmax_topk.shape", shape,
                      "z T x E; idx, w T x K; 1 <= K <= E")
MOECERT_ROUTER_CLAUSE(kSmFinite, pre, "router.softmax_topk.scores_finite", finite, "every z finite")
MOECERT_ROUTER_CLAUSE(kSmNoAlias, pre, "router.softmax_topk.no_alias", alias,
                      "outputs disjoint from inputs and each other")
MOECERT_ROUTER_CLAUSE(kSmIdxValid, post, "router.softmax_topk.idx_valid", index,
                      "0 <= idx < E, -1 only at the tail")
MOECERT_ROUTER_CLAUSE(kSmIdxUnique, post, "router.softmax_topk.idx_unique", index,
                      "no expert twice in a row")
MOECERT_ROUTER_CLAUSE(kSmSorted, post, "router.softmax_topk.sorted", index,
                      "slots follow the total order")
MOECERT_ROUTER_CLAUSE(kSmTopk, post, "router.softmax_topk.topk_property", index,
                      "no unselected expert outranks the K-th")
MOECERT_ROUTER_CLAUSE(kSmWeights, post, "router.softmax_topk.weights_range", numeric,
                      "0 <= w <= 1; sum 1 or <= 1")
MOECERT_ROUTER_CLAUSE(kSmbShape, pre, "router.softmax_topk_backward.shape", shape,
                      "z, dz T x E; idx, g T x K")
MOECERT_ROUTER_CLAUSE(kSmbIdx, pre, "router.softmax_topk_backward.idx_valid", index,
                      "0 <= idx < E or -1 at the tail; unique")
MOECERT_ROUTER_CLAUSE(kSmbFinite, pre, "router.softmax_topk_backward.g_finite", finite,
                      "g finite, |g| <= 2^126; z finite")
MOECERT_ROUTER_CLAUSE(kSmbNoAlias, pre, "router.softmax_topk_backward.no_alias", alias,
                      "dz disjoint from inputs")
MOECERT_ROUTER_CLAUSE(kSmbUnselected, post, "router.softmax_topk_backward.unselected_grad", numeric,
                      "unselected: 0 (renormalised) or sign of -sum_S p g")
MOECERT_ROUTER_CLAUSE(kSgShape, pre, "router.sigmoid_topk.shape", shape,
                      "z T x E; bias E; idx, w T x K; groups valid")
MOECERT_ROUTER_CLAUSE(kSgFinite, pre, "router.sigmoid_topk.scores_finite", finite,
                      "every z and bias finite")
MOECERT_ROUTER_CLAUSE(kSgNoAlias, pre, "router.sigmoid_topk.no_alias", alias,
                      "outputs disjoint from inputs and each other")
MOECERT_ROUTER_CLAUSE(kSgIdxValid, post, "router.sigmoid_topk.idx_valid", index,
                      "0 <= idx < E, -1 only at the tail")
MOECERT_ROUTER_CLAUSE(kSgIdxUnique, post, "router.sigmoid_topk.idx_unique", index,
                      "no expert twice in a row")
MOECERT_ROUTER_CLAUSE(kSgSorted, post, "router.sigmoid_topk.sorted", index,
                      "slots follow the total order on s + bias")
MOECERT_ROUTER_CLAUSE(kSgTopk, post, "router.sigmoid_topk.topk_property", index,
                      "no eligible unselected expert outranks the K-th")
MOECERT_ROUTER_CLAUSE(kSgWeights, post, "router.sigmoid_topk.weights_range", numeric,
                      "0 <= w <= c; sum <= c (1 + §7)")
MOECERT_ROUTER_CLAUSE(kSgbShape, pre, "router.sigmoid_topk_backward.shape", shape,
                      "z, dz T x E; idx, g T x K")
MOECERT_ROUTER_CLAUSE(kSgbIdx, pre, "router.sigmoid_topk_backward.idx_valid", index,
                      "0 <= idx < E or -1 at the tail; unique")
MOECERT_ROUTER_CLAUSE(kSgbFinite, pre, "router.sigmoid_topk_backward.g_finite", finite,
                      "g finite, |g| <= 2^126; z finite, >= -87")
MOECERT_ROUTER_CLAUSE(kSgbNoAlias, pre, "router.sigmoid_topk_backward.no_alias", alias,
                      "dz disjoint from inputs")
MOECERT_ROUTER_CLAUSE(kSgbUnselected, post, "router.sigmoid_topk_backward.unselected_grad", numeric,
                      "dz_j == 0 for every unselected j")
MOECERT_ROUTER_CLAUSE(kSgbDzFinite, post, "router.sigmoid_topk_backward.dz_finite", finite,
                      "every dz finite (c |g - D| may exceed fp32)")
MOECERT_ROUTER_CLAUSE(kPkShape, pre, "router.product_key.shape", shape,
                      "sx, sy T x n; idx, w T x K; 1 <= K <= n*n")
MOECERT_ROUTER_CLAUSE(kPkFinite, pre, "router.product_key.scores_finite", finite,
                      "every sx, sy finite")
MOECERT_ROUTER_CLAUSE(kPkNoAlias, pre, "router.product_key.no_alias", alias,
                      "outputs disjoint from inputs and each other")
MOECERT_ROUTER_CLAUSE(kPkIdxValid, post, "router.product_key.idx_valid", index, "0 <= idx < n*n")
MOECERT_ROUTER_CLAUSE(kPkIdxUnique, post, "router.product_key.idx_unique", index,
                      "no expert twice in a row")
MOECERT_ROUTER_CLAUSE(kPkSorted, post, "router.product_key.sorted", index,
                      "slots follow the total order")
MOECERT_ROUTER_CLAUSE(kPkWeights, post, "router.product_key.weights_range", numeric,
                      "finite; softmax: in [0,1], sum 1")
MOECERT_ROUTER_CLAUSE(kPkbShape, pre, "router.product_key_backward.shape", shape,
                      "sx, sy, dsx, dsy T x n; idx, g T x K")
MOECERT_ROUTER_CLAUSE(kPkbIdx, pre, "router.product_key_backward.idx_in_range", index,
                      "-1 <= idx < n*n, -1 only at the tail; unique")
MOECERT_ROUTER_CLAUSE(kPkbFinite, pre, "router.product_key_backward.g_finite", finite,
                      "g finite, |g| <= 2^126; sx, sy finite")
MOECERT_ROUTER_CLAUSE(kPkbNoAlias, pre, "router.product_key_backward.no_alias", alias,
                      "dsx, dsy disjoint from inputs and each other")
MOECERT_ROUTER_CLAUSE(kPkbUnused, post, "router.product_key_backward.unused_zero", numeric,
                      "dsx/dsy == 0 where no valid slot points")
MOECERT_ROUTER_CLAUSE(kPkbGradFinite, post, "router.product_key_backward.grad_finite", finite,
                      "every dsx, dsy finite (g w, sums of slots may exceed fp32)")
#undef MOECERT_ROUTER_CLAUSE
inline constexpr ClauseInfo kSmWithin =
    post("router.softmax_topk.within_bound", Group::numeric,
         "every w within §3 of its slot's reference", Level::full);
inline constexpr ClauseInfo kSgWithin =
    post("router.sigmoid_topk.within_bound", Group::numeric,
         "every w within §3 of its slot's reference", Level::full);
inline constexpr ClauseInfo kPkTopk =
    post("router.product_key.topk_property", Group::index,
         "no unselected expert outranks the K-th (brute force over n^2)", Level::audit);
inline constexpr ClauseInfo kPkWithin =
    post("router.product_key.within_bound", Group::numeric,
         "every w within §3 of its slot's reference", Level::full);
inline constexpr ClauseInfo kSmbWithin =
    post("router.softmax_topk_backward.within_bound", Group::numeric,
         "every dz within §4.1 of the reference", Level::full);
inline constexpr ClauseInfo kSgbWithin =
    post("router.sigmoid_topk_backward.within_bound", Group::numeric,
         "every finite dz within §4.2 of the reference", Level::full);
inline constexpr ClauseInfo kPkbWithin =
    post("router.product_key_backward.within_bound", Group::numeric,
         "every finite dsx, dsy within §4.3 of the reference", Level::full);
inline constexpr ClauseInfo kAll[] = {
    kSmShape,    kSmFinite,      kSmNoAlias, kSmIdxValid,    kSmIdxUnique,   kSmSorted,
    kSmTopk,     kSmWeights,     kSmWithin,  kSmbShape,      kSmbIdx,        kSmbFinite,
    kSmbNoAlias, kSmbUnselected, kSmbWithin, kSgShape,       kSgFinite,      kSgNoAlias,
    kSgIdxValid, kSgIdxUnique,   kSgSorted,  kSgTopk,        kSgWeights,     kSgWithin,
    kSgbShape,   kSgbIdx,        kSgbFinite, kSgbNoAlias,    kSgbUnselected, kSgbDzFinite,
    kSgbWithin,  kPkShape,       kPkFinite,  kPkNoAlias,     kPkIdxValid,    kPkIdxUnique,
    kPkSorted,   kPkTopk,        kPkWeights, kPkWithin,      kPkbShape,      kPkbIdx,
    kPkbFinite,  kPkbNoAlias,    kPkbUnused, kPkbGradFinite, kPkbWithin};
}  // namespace router

namespace workspace {
inline constexpr ClauseInfo kTokensRange =
    pre("workspace.plan.tokens_range", Group::shape, "0 <= tokens <= T_max");
inline constexpr ClauseInfo kOverflow =
    pre("workspace.plan.overflow", Group::memory, "no size overflows 64 bits");
inline constexpr ClauseInfo kMemoryCap =
    pre("workspace.plan.memory_cap", Group::memory, "total_bytes <= memory cap");
inline constexpr ClauseInfo kDisjoint = {"workspace.plan.disjoint", ClauseKind::invariant,
                                         Group::memory, Level::check,
                                         "co-live buffers disjoint, inside the total, aligned"};
inline constexpr ClauseInfo kArenaDisjoint = {"workspace.arena.disjoint", ClauseKind::invariant,
                                              Group::alias, Level::check,
                                              "co-live bound buffers share no byte"};
inline constexpr ClauseInfo kArenaGuard = {"workspace.arena.guard", ClauseKind::invariant,
                                           Group::memory, Level::check, "guard zones intact"};
inline constexpr ClauseInfo kAll[] = {kTokensRange, kOverflow,      kMemoryCap,
                                      kDisjoint,    kArenaDisjoint, kArenaGuard};
}  // namespace workspace

namespace layer {
inline constexpr ClauseInfo kFwdShape = pre(
    "layer.forward.shape", Group::shape, "x, y T x H; router, LoRA, packed experts of the config");
inline constexpr ClauseInfo kFwdXFinite =
    pre("layer.forward.x_finite", Group::finite, "x, router weights and bias finite");
inline constexpr ClauseInfo kFwdXRange = pre("layer.forward.x_range", Group::numeric,
                                             "x element 0 or 2^-60 <= |x| <= 2^60", Level::audit);
inline constexpr ClauseInfo kFwdLoraFinite =
    pre("layer.forward.lora_finite", Group::finite, "every LoRA element finite");
inline constexpr ClauseInfo kFwdLoraRange =
    pre("layer.forward.lora_range", Group::numeric, "LoRA element 0 or 2^-60 <= |a| <= 2^60",
        Level::audit);
inline constexpr ClauseInfo kFwdScale =
    pre("layer.forward.scale_finite", Group::numeric, "s = float(alpha / r) finite, > 0");
inline constexpr ClauseInfo kFwdNoAlias =
    pre("layer.forward.no_alias", Group::alias, "y shares no byte with any input");
inline constexpr ClauseInfo kFwdLoraPadding = {"layer.forward.lora_padding", ClauseKind::invariant,
                                               Group::numeric, Level::check,
                                               "packed LoRA rank padding is zero"};
inline constexpr ClauseInfo kFwdYFinite =
    post("layer.forward.y_finite", Group::finite, "every y finite");
inline constexpr ClauseInfo kFwdProbe =
    post("layer.forward.probe", Group::numeric, "probes of the expert GEMMs and the router linear",
         Level::audit);
inline constexpr ClauseInfo kFwdWithin =
    post("layer.forward.within_bound", Group::numeric, "z and y within bound", Level::full);
inline constexpr ClauseInfo kFwdRounding =
    post("layer.forward.rounding_unbiased", Group::numeric,
         "y's errors not biased toward or away from zero", Level::full);
inline constexpr ClauseInfo kFwdSpread =
    post("layer.forward.spread_explained", Group::numeric,
         "y within the declared precision's probabilistic bound", Level::full);
inline constexpr ClauseInfo kFwdScaleExplained =
    post("layer.forward.scale_explained", Group::numeric,
         "y's error along the exact y within the probabilistic bound", Level::full);
inline constexpr ClauseInfo kBwdState = pre("layer.backward.state", Group::shape,
                                            "saved holds a training forward of this config and T");
inline constexpr ClauseInfo kBwdShape =
    pre("layer.backward.shape", Group::shape, "dy T x H; gradients of their weights' shapes");
inline constexpr ClauseInfo kBwdDyFinite =
    pre("layer.backward.dy_finite", Group::finite, "every dy finite");
inline constexpr ClauseInfo kBwdNoAlias =
    pre("layer.backward.no_alias", Group::alias, "gradients disjoint from each other and inputs");
inline constexpr ClauseInfo kBwdSavedFinite =
    pre("layer.backward.saved_finite", Group::finite, "saved activations finite");
inline constexpr ClauseInfo kBwdSavedIntact =
    pre("layer.backward.saved_intact", Group::memory, "saved gate/up rows hold the forward's bits",
        Level::audit);
inline constexpr ClauseInfo kBwdGradFinite =
    post("layer.backward.grad_finite", Group::finite, "every gradient finite");
inline constexpr ClauseInfo kBwdEmptyZero =
    post("layer.backward.empty_expert_zero", Group::numeric, "no tokens: LoRA gradients exactly 0");
inline constexpr ClauseInfo kBwdRouterMasked =
    post("layer.backward.router_masked", Group::numeric, "dL/dw 0 at -1 slots");
inline constexpr ClauseInfo kBwdProbe =
    post("layer.backward.probe", Group::numeric,
         "probes of the experts' row GEMMs and the router linear", Level::audit);
inline constexpr ClauseInfo kBwdWithin =
    post("layer.backward.within_bound", Group::numeric, "gradients within bound", Level::full);
inline constexpr ClauseInfo kBwdRounding =
    post("layer.backward.rounding_unbiased", Group::numeric,
         "dL/dw's, dx's and the experts' gradients' errors not biased toward or away from zero",
         Level::full);
inline constexpr ClauseInfo kBwdSpread =
    post("layer.backward.spread_explained", Group::numeric,
         "dL/dw, dx and the experts' gradients within the probabilistic bound", Level::full);
inline constexpr ClauseInfo kRlShape =
    pre("layer.router_linear.shape", Group::shape,
        "x T x H, W_r R x H, b R; z, dz T x R; grads of their shapes");
inline constexpr ClauseInfo kRlFinite =
    pre("layer.router_linear.finite", Group::finite, "x, W_r, b (forward), dz (backward) finite");
inline constexpr ClauseInfo kRlXRange = pre("layer.router_linear.x_range", Group::numeric,
                                            "x element 0 or 2^-60 <= |x| <= 2^60", Level::audit);
inline constexpr ClauseInfo kRlNoAlias = pre("layer.router_linear.no_alias", Group::alias,
                                             "outputs disjoint from each other and the inputs");
inline constexpr ClauseInfo kRlOutFinite =
    post("layer.router_linear.out_finite", Group::finite, "every output finite");
inline constexpr ClauseInfo kRlProbe = post("layer.router_linear.probe", Group::numeric,
                                            "probes of z, dx and dW_r; db's sums", Level::audit);
inline constexpr ClauseInfo kRlWithin = post("layer.router_linear.within_bound", Group::numeric,
                                             "every output within bound", Level::full);
inline constexpr ClauseInfo kAll[] = {
    kFwdShape,          kFwdXFinite,     kFwdXRange,      kFwdLoraFinite, kFwdLoraRange,
    kFwdScale,          kFwdNoAlias,     kFwdLoraPadding, kFwdYFinite,    kFwdProbe,
    kFwdWithin,         kBwdState,       kBwdShape,       kBwdDyFinite,   kBwdNoAlias,
    kBwdSavedFinite,    kBwdSavedIntact, kBwdGradFinite,  kBwdEmptyZero,  kBwdRouterMasked,
    kBwdProbe,          kBwdWithin,      kRlShape,        kRlFinite,      kRlXRange,
    kRlNoAlias,         kRlOutFinite,    kRlProbe,        kRlWithin,      kFwdSpread,
    kFwdScaleExplained, kBwdSpread,      kFwdRounding,    kBwdRounding};
}  // namespace layer

}  // namespace moecert::clauses
