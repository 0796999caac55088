// The routers' clauses on another implementation's tensors
// (contracts/judge/ops.hpp).
#include "contracts/judge/tensors.hpp"
#include "contracts/router/clauses.hpp"
#include "contracts/router/kind.hpp"

namespace moecert::contracts::judge {
namespace {

// The routers' arithmetic is fp32 (outputs may be stored narrower: the
// outputs' dtype says so).
void require_fp32(const Params& m) {
  const auto it = m.find("precision");
  if (it != m.end() && it->second != "fp32")
    throw std::invalid_argument(fmt::format(
        "precision={}: the routers' arithmetic is declared fp32 (outputs may be stored in bf16 "
        "or fp16: their dtype says so)",
        it->second));
}

// A router whose clauses read the logits z whole (softmax_topk,
// sigmoid_topk): its kind's forward and backward clauses
// (contracts/router/kind.hpp) on the tensors.
template <RouterKind K>
void whole_forward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& p) {
  require_fp32(p);
  const RouterKindInfo& kind = router_kind(K);
  const RouterSettings settings = kind.judge_settings(p);
  const auto z = values(in, "inputs", "z"), w = values(out, "outputs", "w");
  const auto bias = kind.expert_bias ? vector_of(in, "inputs", "bias") : View<const float>{};
  const auto idx = indices(out, "outputs", "idx");
  kind.forward_clauses(c, z, bias, settings, idx, w);
}

template <RouterKind K>
void whole_backward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& p) {
  require_fp32(p);
  const RouterKindInfo& kind = router_kind(K);
  const RouterSettings settings = kind.judge_settings(p);
  const auto z = values(in, "inputs", "z"), g = values(in, "inputs", "g");
  const auto dz = values(out, "outputs", "dz");
  const auto idx = indices(in, "inputs", "idx");
  kind.backward_clauses(c, z, idx, g, settings, dz);
}

void product_key_forward(detail::Checker& c, const Tensors& in, const Tensors& out,
                         const Params& p) {
  require_fp32(p);
  const auto mode = key_weights(p);
  const auto sx = values(in, "inputs", "sx"), sy = values(in, "inputs", "sy");
  const auto w = values(out, "outputs", "w");
  const auto idx = indices(out, "outputs", "idx");
  product_key_pre(c, sx, sy, sx.bytes(), sy.bytes(), mode, writable(idx), writable(w));
  if (!c.stop()) product_key_post(c, sx, sy, mode, idx, w);
}

void product_key_backward(detail::Checker& c, const Tensors& in, const Tensors& out,
                          const Params& p) {
  require_fp32(p);
  const auto mode = key_weights(p);
  const auto sx = values(in, "inputs", "sx"), sy = values(in, "inputs", "sy");
  const auto g = values(in, "inputs", "g");
  const auto dsx = values(out, "outputs", "dsx"), dsy = values(out, "outputs", "dsy");
  const auto idx = indices(in, "inputs", "idx");
  product_key_backward_pre(c, sx, sy, idx, g, writable(dsx), writable(dsy));
  if (!c.stop()) product_key_backward_post(c, sx, sy, idx, g, mode, dsx, dsy);
}

}  // namespace

std::map<std::string, OpEntry> router_entries() {
  return {
      {"router.softmax_topk.forward",
       {whole_forward<RouterKind::softmax_topk>, {"router.softmax_topk."}}},
      {"router.softmax_topk.backward",
       {whole_backward<RouterKind::softmax_topk>, {"router.softmax_topk_backward."}}},
      {"router.sigmoid_topk.forward",
       {whole_forward<RouterKind::sigmoid_topk>, {"router.sigmoid_topk."}}},
      {"router.sigmoid_topk.backward",
       {whole_backward<RouterKind::sigmoid_topk>, {"router.sigmoid_topk_backward."}}},
      {"router.product_key.forward", {product_key_forward, {"router.product_key."}}},
      {"router.product_key.backward", {product_key_backward, {"router.product_key_backward."}}}};
}

}  // namespace moecert::contracts::judge
