// The routers' clauses on another implementation's tensors
// (contracts/judge/ops.hpp).
#include "contracts/judge/tensors.hpp"
#include "contracts/router/clauses.hpp"

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

void softmax_forward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& p) {
  require_fp32(p);
  const bool renorm = flag_param(p, "renormalize", true);
  const auto z = values(in, "inputs", "z"), w = values(out, "outputs", "w");
  const auto idx = indices(out, "outputs", "idx");
  softmax_topk_pre(c, z, z.bytes(), writable(idx), writable(w));
  if (!c.stop()) softmax_topk_post(c, z, idx, w, renorm);
}

void softmax_backward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& p) {
  require_fp32(p);
  const bool renorm = flag_param(p, "renormalize", true);
  const auto z = values(in, "inputs", "z"), g = values(in, "inputs", "g");
  const auto dz = values(out, "outputs", "dz");
  const auto idx = indices(in, "inputs", "idx");
  softmax_topk_backward_pre(c, z, idx, g, writable(dz));
  if (!c.stop()) softmax_topk_backward_post(c, z, idx, g, dz, renorm);
}

void sigmoid_forward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& p) {
  require_fp32(p);
  const auto params = sigmoid_params(p);
  const auto z = values(in, "inputs", "z"), w = values(out, "outputs", "w");
  const auto bias = vector_of(in, "inputs", "bias");
  const auto idx = indices(out, "outputs", "idx");
  sigmoid_topk_pre(c, z, z.bytes(), bias, params, writable(idx), writable(w));
  if (!c.stop()) sigmoid_topk_post(c, z, bias, params, idx, w);
}

void sigmoid_backward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& p) {
  require_fp32(p);
  const auto params = sigmoid_params(p);
  const auto z = values(in, "inputs", "z"), g = values(in, "inputs", "g");
  const auto dz = values(out, "outputs", "dz");
  const auto idx = indices(in, "inputs", "idx");
  sigmoid_topk_backward_pre(c, z, idx, g, writable(dz));
  if (!c.stop()) sigmoid_topk_backward_post(c, z, idx, g, params, dz);
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
      {"router.softmax_topk.forward", {softmax_forward, {"router.softmax_topk."}}},
      {"router.softmax_topk.backward", {softmax_backward, {"router.softmax_topk_backward."}}},
      {"router.sigmoid_topk.forward", {sigmoid_forward, {"router.sigmoid_topk."}}},
      {"router.sigmoid_topk.backward", {sigmoid_backward, {"router.sigmoid_topk_backward."}}},
      {"router.product_key.forward", {product_key_forward, {"router.product_key."}}},
      {"router.product_key.backward", {product_key_backward, {"router.product_key_backward."}}}};
}

}  // namespace moecert::contracts::judge
