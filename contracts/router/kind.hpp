// A router kind's description: what the layer, the judge, the bounds, the
// planner, the C ABI and Python read about one kind, registered once in the
// kind table (contracts/router/kinds.cpp). What a kind computes is registered
// beside its op (ops/router/kinds.hpp); the judge never calls it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "contracts/engine/engine.hpp"
#include "contracts/engine/params.hpp"
#include "moecert/config.hpp"
#include "moecert/router.hpp"

namespace moecert::bounds {
struct WeightsRow;
}  // namespace moecert::bounds

namespace moecert::contracts {

/// A kind's settings: from a MoeConfig (the layer) or the judge's params.
struct RouterSettings {
  bool renormalize = true;              // softmax_topk
  bool dense_backward = false;          // softmax_topk: judged as a dense softmax's gradient
  router::SigmoidTopkParams sigmoid{};  // sigmoid_topk
  double scaling = 1;  // sigmoid_topk: c as the bounds read it (the kernel's float c, or the ABI's)
  router::KeyWeights keys = router::KeyWeights::softmax;  // product_key
};

/// The layer's settings of its router: the config's (a layer's product-key
/// router weighs its keys by softmax).
RouterSettings router_settings(const MoeConfig& cfg);

/// One router kind inside the layer. z, the router linear's output, is
/// T x R; dz is T x R too, except where `split_dz`: then the gradients of
/// z's two halves are stored as two T x R/2 blocks.
struct RouterKindInfo {
  RouterKind kind;
  std::string_view name;  // op family router.<name>; the C ABI's and Python's name
  /// Router outputs R for E experts; 0 if the kind cannot route E experts.
  std::size_t (*width)(std::size_t experts);
  /// The experts E that R router outputs route (width's inverse).
  std::size_t (*experts_of)(std::size_t width);
  bool expert_bias;  // reads a per-expert selection bias router_bias (E values)
  bool split_dz;     // dz stored as the halves' two T x R/2 blocks
  /// The kind's clauses of core.config.validate (include/moecert/config.hpp).
  void (*validate)(detail::Checker&, const MoeConfig&);
  /// The kind's settings from the judge's params (docs/JUDGE.md); a
  /// malformed value throws std::invalid_argument naming it.
  RouterSettings (*judge_settings)(const Params& params);
  /// The names of the params judge_settings reads.
  std::span<const std::string_view> judge_params;
  /// The kind's settings from the C ABI's one number (moecert_router_bounds'
  /// param, include/moecert/moecert.h).
  RouterSettings (*abi_settings)(double param);
  /// The kind's forward clauses, pre then post, on an implementation's z,
  /// bias, idx and weights (the judge of a layer).
  void (*forward_clauses)(detail::Checker&, MatView<const float> z, View<const float> bias,
                          const RouterSettings&, MatView<const std::int32_t> idx,
                          MatView<const float> w);
  /// The kind's backward clauses, pre then post, on z, idx, g = dL/dw and
  /// dz (T x R).
  void (*backward_clauses)(detail::Checker&, MatView<const float> z,
                           MatView<const std::int32_t> idx, MatView<const float> g,
                           const RouterSettings&, MatView<const float> dz);
  /// The backward kernel's own rounding of one row's dz (R values) given
  /// z's row, the row's valid prefix v of ids and g (proofs/router.md §4).
  std::vector<double> (*dz_rounding)(const float* z, std::size_t R, const std::int32_t* idx,
                                     const float* g, std::size_t v, const RouterSettings&);
  /// One row's binary64 reference weights (K values, given z's row as the
  /// kernel read it and the selection) and each one's bound (proofs/router.md §3).
  bounds::WeightsRow (*weights_row)(const float* z, std::size_t R, const std::int32_t* idx,
                                    std::size_t k, const RouterSettings&);
  /// One row's binary64 reference dz (R values, in dz's order: with
  /// `split_dz`, the first half's R/2 then the second's).
  std::vector<double> (*dz_reference)(const float* z, std::size_t R, const std::int32_t* idx,
                                      const float* g, std::size_t k, const RouterSettings&);
};

/// Whether each entry of a table of kinds (descriptions, ops) sits at its
/// kind's value.
template <class Table>
bool in_kind_order(const Table& table) {
  for (std::size_t i = 0; i < std::size(table); ++i)
    if (static_cast<std::size_t>(table[i]->kind) != i) return false;
  return true;
}

/// The kind table, in RouterKind's order.
std::span<const RouterKindInfo* const> router_kinds();

/// The description of `kind` (a valid RouterKind).
const RouterKindInfo& router_kind(RouterKind kind);

/// Every kind's name, as messages list them: "softmax_topk, sigmoid_topk or
/// product_key".
std::string router_kind_list();

}  // namespace moecert::contracts
