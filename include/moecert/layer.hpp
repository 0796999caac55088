// The MoE layer: router linear + router + SwiGLU experts with LoRA, forward
// and backward. The backward splits into the expert path and the router
// path (docs/DESIGN.md, failure mode 5), each callable and checkable on its own.
//
//   z = x W_r^T + b                  router logits [T x R] (R = E, or 2n for product_key)
//   idx, w = router(z)               softmax_topk | sigmoid_topk | product_key (softmax weights)
//   g = x W_g^T + s (x A_g^T) B_g^T  per routed (t, e); u likewise with W_u, A_u, B_u
//   h = silu(g) * u
//   o = h W_d^T + s (h A_d^T) B_d^T
//   y_t = sum_j w[t,j] o_{t,idx[t,j]}
// with s = float(alpha / r). Kernel rounding points (the bounds follow
// them): x A^T and h A_d^T in fp32, then s * (.) rounded to bf16 for the
// second LoRA product, accumulated into the base GEMM's fp32 result; h in
// bf16. Backward: dy rows in bf16 for the GEMMs, dg and du in bf16, LoRA and
// router gradients accumulated in fp32 (fixed order), dw in binary64.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "moecert/config.hpp"
#include "moecert/experts.hpp"
#include "moecert/types.hpp"

namespace moecert::layer {

/// LoRA factors and scale (experts::Lora); a layer takes r and alpha from
/// its MoeConfig (layer.forward.shape checks that they agree).
using Lora = experts::Lora;

struct Weights {
  const experts::PackedExperts* experts = nullptr;  // packed with backward = true for a backward
  MatView<const float> router_w;                    // [R x H]
  View<const float> router_b;                       // [R]
  View<const float> router_bias;  // sigmoid_topk: selection bias [E]; empty otherwise
  Lora lora;

  /// Views of dense row-major arrays for `cfg`: router_w [R x H] (R = E, or
  /// 2n for product_key), router_b [R], router_bias [E] (taken for
  /// sigmoid_topk only; may be null otherwise), and `lora` (taken when r > 0).
  static Weights stacked(const MoeConfig& cfg, const experts::PackedExperts& experts,
                         const float* router_w, const float* router_b, const float* router_bias,
                         const Lora& lora);
};

/// Gradients. Each output is written entirely (the sum over the paths that
/// run; 0 where a path that does not run would contribute); an empty view
/// is not computed. Shapes as the matching weights; m_a, m_g [T x E].
/// The base weights' gradients are optional (full fine-tuning; empty views
/// for LoRA training): dW_g[e] = sum over e's rows of dg x^T, dW_u likewise
/// with du, dW_d[e] = sum of bf16(w dy) h^T, as GEMMs on the layer's kernel
/// with K = the expert's rows (as many FLOPs again as the backward's GEMMs).
struct Gradients {
  MatView<float> dx;                                          // [T x H]
  MatView<float> router_w;                                    // [R x H]
  View<float> router_b;                                       // [R]
  MatView<float> a_gate, b_gate, a_up, b_up, a_down, b_down;  // LoRA
  MatView<float> w_gate, w_up, w_down;  // base: [E*I x H], [E*I x H], [E*H x I]
  MatView<float> m_a, m_g;              // per-token statistics (docs/DESIGN.md)
};

/// What a forward keeps for the backward: the workspace arena with the
/// saved activations, the grouping, and the identity of the call.
class Saved {
 public:
  Saved();
  ~Saved();
  Saved(Saved&&) noexcept;
  Saved& operator=(Saved&&) noexcept;
  bool valid() const;
  std::size_t bytes() const;  // arena held
  MatView<const std::int32_t> idx() const;
  MatView<const float> weights() const;
  /// The router's logits z [T x R] of the last training forward, until a
  /// backward runs (its buffers reuse those bytes); else the empty view.
  MatView<const float> logits() const;
  /// dL/dw [T x K] and dz [T x R] of the last backward that ran the router
  /// path (dz: product_key's as [dsx | dsy]); else the empty view.
  MatView<const float> router_dw() const;
  MatView<const float> router_dz() const;
  struct Impl;
  Impl& impl() { return *impl_; }
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

struct ForwardOptions {
  std::optional<Isa> isa;        // as experts::ForwardOptions
  bool training = true;          // keep what the backward needs
  std::uint64_t memory_cap = 0;  // workspace.plan.memory_cap (0: none)
};

struct BackwardOptions {
  bool expert_path = true;  // dx through the experts, LoRA (and requested base-weight) gradients
  bool router_path = true;  // dw = <dy, o>, router backward, router linear backward
};

/// Forward. x [T x H] bf16, y [T x H] fp32 (written). Saves into `saved`.
///
/// Clauses (contracts/layer/layer.cpp; bounds: proofs/layer.md):
///   layer.forward.shape         pre   shape    x T x H with T <= T_max; y T x H; router weights R x H,
///                                              bias R; LoRA views of their shapes; packed experts of
///                                              this config
///   layer.forward.x_finite      pre   finite   every x, router weight and bias element finite
///   layer.forward.x_range       pre   numeric  every x element 0 or 2^-60 <= |x| <= 2^60, the range
///                                              the bounds hold in (audit)
///   layer.forward.lora_finite   pre   finite   every LoRA element finite (judged per expert while its
///                                              factors are packed)
///   layer.forward.lora_range    pre   numeric  every LoRA element 0 or 2^-60 <= |a| <= 2^60 (audit;
///                                              judged as lora_finite is)
///   layer.forward.scale_finite  pre   numeric  s = float(alpha / r) finite and > 0 (r > 0)
///   layer.forward.no_alias      pre   alias    y shares no byte with x or any weight
///   layer.forward.lora_padding  invariant numeric  the packed LoRA factors' depth padding (k >= r of
///                                                  every panel with a column n < N) is zero, each
///                                                  expert's packs as they are written (columns past
///                                                  N are never stored)
///   layer.forward.y_finite      post  finite   every y element finite
///   layer.forward.probe         post  numeric  Freivalds probes of the expert GEMMs and their LoRA
///                                              products, as experts.forward_train.probe, and of z,
///                                              as layer.router_linear.probe (audit)
///   layer.forward.within_bound  post  numeric  every y element within the chained bound (full)
///   layer.forward.spread_explained post numeric y within the declared precision's probabilistic
///                                              bound (the judge; proofs/bounds.md §12)
///   layer.forward.scale_explained post numeric <y - ref, ref> within the probabilistic bound (the
///                                              judge; proofs/bounds.md §12)
///   layer.forward.rounding_unbiased post numeric y's errors as often toward zero as away from it
///                                              (the judge; proofs/bounds.md §11)
/// and the clauses of the router, experts.forward and workspace.* it runs.
void forward(const MoeConfig& cfg, const Weights& w, MatView<const bf16> x, MatView<float> y,
             Saved& saved, const ForwardOptions& opt = {});

/// Backward from dy [T x H] fp32, with the forward's `saved` and the same x
/// and weights. It leaves `saved` as it found it: a backward may run again
/// on it (another dy, or the expert and router paths as separate calls) and
/// gives what it gives after a fresh forward.
///
/// Clauses:
///   layer.backward.state        pre   shape    saved holds a training forward of this config and T
///                                              (not: backward before forward, another config)
///   layer.backward.shape        pre   shape    dy T x H; every requested gradient of its weight's shape
///   layer.backward.dy_finite    pre   finite   every dy element finite
///   layer.backward.no_alias     pre   alias    gradients share no byte with each other, x, dy, weights
///                                              or the saved activations
///   layer.backward.saved_finite pre   finite   the saved activations read by the backward are finite
///                                              (a NaN there names the buffer: read-before-write,
///                                              failure mode 3); judged as the backward reads them,
///                                              before it writes an output (proofs/experts.md §7)
///   layer.backward.saved_intact pre   memory   the saved gate/up rows hold the bits the forward wrote
///                                              (audit, where the forward ran at audit; as
///                                              experts.backward.saved_intact)
///   layer.backward.grad_finite  post  finite   every gradient element finite
///   layer.backward.empty_expert_zero post numeric  an expert with no routed token has LoRA and
///                                              base-weight gradients exactly 0
///   layer.backward.router_masked post numeric  router path: dL/dw is 0 at -1 slots, and the router
///                                              backward's unselected-gradient clause holds
///                                              (failure modes 1, 5)
///   layer.backward.probe        post  numeric  the experts' dh and dx row GEMMs against their
///                                              probes, as experts.backward.probe, and on one call in
///                                              four the router linear's dx, dW_r and db as
///                                              layer.router_linear.probe (audit)
///   layer.backward.within_bound post  numeric  every gradient, and M_A, M_G, within its derived
///                                              bound of the reference backward (full)
///   layer.backward.spread_explained post numeric dL/dw, dx and the experts' gradients within
///                                              the declared precision's probabilistic bound (the
///                                              judge; proofs/bounds.md §12)
///   layer.backward.rounding_unbiased post numeric dL/dw's, dx's and the experts' gradients' errors
///                                              unbiased (a weight gradient's on one element per
///                                              row and column of an expert; the judge; proofs/
///                                              bounds.md §11)
/// and the clauses of the router backward it runs (dL/dw outside the router's domain is its
/// g_finite; a sigmoid router's dz beyond fp32 its dz_finite, before grad_finite could see it).
void backward(const MoeConfig& cfg, const Weights& w, MatView<const bf16> x,
              MatView<const float> dy, Saved& saved, const Gradients& grads,
              const BackwardOptions& opt = {});

/// The router linear's gradients, each optional (empty: not computed).
struct RouterLinearGrads {
  MatView<float> dx{};        // [T x H], accumulated: dx += dz W_r
  MatView<float> router_w{};  // [R x H], written: dW_r = dz^T x
  View<float> router_b{};     // [R], written: db = the column sums of dz
};

/// The layer's router linear on its own, computed as forward() and backward()
/// compute it, for a caller that composes the layer from its parts (expert
/// parallelism routes each rank's tokens with it and sums the ranks' dW_r).
/// Forward: z = x W_r^T + b, x [T x H] bf16, W_r [R x H], b [R], z [T x R]
/// fp32 (written); each element an fp32 sum of H + 1 terms in one fixed order,
/// so a row of z does not depend on the other rows. Backward from dz [T x R]
/// fp32 into `grads`: dx's sums run over the R outputs in order, dW_r's and
/// db's over the tokens in order.
///
/// Clauses (contracts/layer/router_linear.cpp; bounds: proofs/layer.md §4):
///   layer.router_linear.shape        pre   shape    x T x H; W_r R x H; b R (forward); z, dz T x R;
///                                                   every given gradient of its shape
///   layer.router_linear.finite       pre   finite   every x, W_r, b (forward) and dz (backward) element
///                                                   finite
///   layer.router_linear.x_range      pre   numeric  every x element 0 or 2^-60 <= |x| <= 2^60 (audit)
///   layer.router_linear.no_alias     pre   alias    the outputs share no byte with each other or
///                                                   any input
///   layer.router_linear.out_finite   post  finite   every output element finite
///   layer.router_linear.probe        post  numeric  Freivalds probes of z, dx (the op's addition) and
///                                                   dW_r: per product a dense one and a 4-column
///                                                   block in rotation, weight sides from the W_r and
///                                                   dz of the call; db within its sums' bound
///                                                   (audit; proofs/bounds.md §9.4)
///   layer.router_linear.within_bound post  numeric  every output element within gamma_n sum|terms|
///                                                   of its exact value, n its terms (full)
void router_linear_forward(MatView<const bf16> x, MatView<const float> w, View<const float> b,
                           MatView<float> z, std::optional<Isa> isa = {});
void router_linear_backward(MatView<const bf16> x, MatView<const float> w, MatView<const float> dz,
                            const RouterLinearGrads& grads, std::optional<Isa> isa = {});

}  // namespace moecert::layer
