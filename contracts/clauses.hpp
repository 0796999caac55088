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
inline constexpr ClauseInfo kExpertsRange = pre("core.config.experts_range", Group::shape, "1 <= E <= 65536");
inline constexpr ClauseInfo kHiddenRange = pre("core.config.hidden_range", Group::shape, "1 <= H <= 65536");
inline constexpr ClauseInfo kInterRange = pre("core.config.inter_range", Group::shape, "1 <= I <= 65536");
inline constexpr ClauseInfo kTopkRange = pre("core.config.topk_range", Group::shape, "1 <= K <= min(E, 64)");
inline constexpr ClauseInfo kRankRange = pre("core.config.rank_range", Group::shape, "0 <= r <= 256");
inline constexpr ClauseInfo kAlphaFinite = pre("core.config.alpha_finite", Group::shape, "alpha finite, > 0 when r > 0");
inline constexpr ClauseInfo kTokensRange = pre("core.config.tokens_range", Group::shape, "1 <= T_max <= 2^20");
inline constexpr ClauseInfo kRouterKind = pre("core.config.router_kind", Group::shape, "router is a known kind");
inline constexpr ClauseInfo kProductKeySquare = pre("core.config.product_key_square", Group::shape, "E = n*n");
inline constexpr ClauseInfo kGroupsDivide = pre("core.config.groups_divide", Group::shape, "G >= 1 divides E");
inline constexpr ClauseInfo kTopkGroupRange = pre("core.config.topk_group_range", Group::shape, "1 <= topk_group <= G, K <= topk_group*E/G");
inline constexpr ClauseInfo kScalingFinite = pre("core.config.scaling_finite", Group::shape, "c finite, > 0");

inline constexpr ClauseInfo kAll[] = {kExpertsRange, kHiddenRange,      kInterRange,    kTopkRange,
                                      kRankRange,    kAlphaFinite,      kTokensRange,   kRouterKind,
                                      kProductKeySquare, kGroupsDivide, kTopkGroupRange, kScalingFinite};
}  // namespace config

namespace gemm {
inline constexpr ClauseInfo kPackShape = pre("gemm.pack.shape", Group::shape, "stride >= cols; second of w's shape");
inline constexpr ClauseInfo kPackWFinite = pre("gemm.pack.w_finite", Group::finite, "every W element finite");
inline constexpr ClauseInfo kPackWRange = pre("gemm.pack.w_range", Group::numeric, "W element 0 or 2^-60 <= |w| <= 2^60");
inline constexpr ClauseInfo kPackChecksum = {"gemm.pack.checksum", ClauseKind::invariant, Group::memory, Level::audit,
                                             "packed bytes hash to the pack-time checksum"};
inline constexpr ClauseInfo kShape = pre("gemm.matmul.shape", Group::shape, "a.cols == w.k, c is a.rows x w.n");
inline constexpr ClauseInfo kAFinite = pre("gemm.matmul.a_finite", Group::finite, "every A element finite");
inline constexpr ClauseInfo kARange = pre("gemm.matmul.a_range", Group::numeric, "A element 0 or 2^-60 <= |a| <= 2^60");
inline constexpr ClauseInfo kNoAlias = pre("gemm.matmul.no_alias", Group::alias, "C shares no byte with A or W");
inline constexpr ClauseInfo kCFinite = post("gemm.matmul.c_finite", Group::finite, "every C element finite");
inline constexpr ClauseInfo kProbe = post("gemm.matmul.probe", Group::numeric, "Freivalds probe within bound", Level::audit);
inline constexpr ClauseInfo kWithinBound = post("gemm.matmul.within_bound", Group::numeric, "|C - ref| <= bounds::dot", Level::full);
inline constexpr ClauseInfo kAll[] = {kPackShape, kPackWFinite, kPackWRange, kPackChecksum, kShape, kAFinite, kARange,
                                      kNoAlias, kCFinite, kProbe, kWithinBound};
}  // namespace gemm

namespace experts {
inline constexpr ClauseInfo kShape = pre("experts.forward.shape", Group::shape, "x T x H, idx/weights T x K, y T x H");
inline constexpr ClauseInfo kIdxInRange = pre("experts.forward.idx_in_range", Group::index, "-1 <= idx < E, -1 only at the tail");
inline constexpr ClauseInfo kIdxUnique = pre("experts.forward.idx_unique", Group::index, "no expert twice in a row");
inline constexpr ClauseInfo kWeightFinite = pre("experts.forward.weight_finite", Group::finite, "weights finite, 0 at -1 slots");
inline constexpr ClauseInfo kXFinite = pre("experts.forward.x_finite", Group::finite, "every x element finite");
inline constexpr ClauseInfo kXRange = pre("experts.forward.x_range", Group::numeric, "x element 0 or 2^-60 <= |x| <= 2^60");
inline constexpr ClauseInfo kNoAlias = pre("experts.forward.no_alias", Group::alias, "y shares no byte with any input");
inline constexpr ClauseInfo kPermutation = {"experts.forward.permutation", ClauseKind::invariant, Group::index, Level::check,
                                            "grouping holds every valid slot once"};
inline constexpr ClauseInfo kYFinite = post("experts.forward.y_finite", Group::finite, "every y element finite");
inline constexpr ClauseInfo kProbe = post("experts.forward.probe", Group::numeric, "probes of both GEMMs within bound", Level::audit);
inline constexpr ClauseInfo kWithinBound = post("experts.forward.within_bound", Group::numeric, "|y - ref| <= chained bound", Level::full);
inline constexpr ClauseInfo kAll[] = {kShape, kIdxInRange, kIdxUnique, kWeightFinite, kXFinite, kXRange,
                                      kNoAlias, kPermutation, kYFinite, kProbe, kWithinBound};
}  // namespace experts

}  // namespace moecert::clauses
