// MoeConfig: the shape of one MoE layer, validated once before anything is
// sized from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "moecert/types.hpp"

namespace moecert {

enum class RouterKind : std::uint8_t { softmax_topk = 0, sigmoid_topk = 1, product_key = 2 };
inline constexpr std::size_t kRouterKinds = 3;  // values 0 .. kRouterKinds - 1

std::string_view router_kind_name(RouterKind);
std::optional<RouterKind> parse_router_kind(std::string_view);

struct MoeConfig;
/// Outputs R of the router's linear layer: E, or 2n for a product-key router
/// of n^2 experts.
std::size_t router_width(const MoeConfig& cfg);

/// Limits every valid config stays within (the workspace proof covers them).
inline constexpr std::int64_t kMaxExperts = 65536;
inline constexpr std::int64_t kMaxDim = 65536;  // H and I
inline constexpr std::int64_t kMaxTopk = 64;
inline constexpr std::int64_t kMaxRank = 256;
inline constexpr std::int64_t kMaxTokens = std::int64_t{1} << 20;

/// One MoE layer: E experts of SwiGLU (H -> I -> H), top-K routing, optional
/// LoRA of rank r with scale alpha / r on gate, up and down.
struct MoeConfig {
  std::int64_t experts = 0;    // E
  std::int64_t hidden = 0;     // H
  std::int64_t inter = 0;      // I
  std::int64_t topk = 0;       // K
  std::int64_t lora_rank = 0;  // r; 0 = no LoRA
  double lora_alpha = 0.0;     // alpha
  RouterKind router = RouterKind::softmax_topk;
  bool renormalize = true;      // softmax_topk: weights renormalised over the K selected
  std::int64_t groups = 1;      // sigmoid_topk: expert groups G
  std::int64_t topk_group = 1;  // sigmoid_topk: groups kept
  double scaling = 1.0;         // sigmoid_topk: routed scaling factor c
  std::int64_t max_tokens = 0;  // T_max

  /// LoRA scale alpha / r (0 when r = 0).
  double lora_scale() const {
    return lora_rank > 0 ? lora_alpha / static_cast<double>(lora_rank) : 0.0;
  }
};

/// Validates `cfg` (op `core.config.validate`, level check, group shape).
/// Clauses (contracts/layer/config.cpp):
///   core.config.experts_range     pre  shape  1 <= E <= 65536
///   core.config.hidden_range      pre  shape  1 <= H <= 65536
///   core.config.inter_range       pre  shape  1 <= I <= 65536
///   core.config.topk_range        pre  shape  1 <= K <= min(E, 64)
///   core.config.rank_range        pre  shape  0 <= r <= 256
///   core.config.alpha_finite      pre  shape  alpha finite, and alpha > 0 when r > 0
///   core.config.tokens_range      pre  shape  1 <= T_max <= 2^20
///   core.config.router_kind       pre  shape  router is one of the three kinds
///   core.config.product_key_square pre shape  product_key: E = n*n for an integer n
///   core.config.groups_divide     pre  shape  sigmoid_topk: G >= 1 and G divides E
///   core.config.topk_group_range  pre  shape  sigmoid_topk: 1 <= topk_group <= G and
///                                             K <= topk_group * E / G
///   core.config.scaling_finite    pre  shape  sigmoid_topk: c finite and c > 0
/// Example:
///   moecert::MoeConfig cfg{.experts = 64, .hidden = 2048, .inter = 1408, .topk = 6,
///                          .max_tokens = 4096};
///   moecert::validate(cfg);  // throws ContractViolation under enforce if invalid
void validate(const MoeConfig& cfg);

}  // namespace moecert
