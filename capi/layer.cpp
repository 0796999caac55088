// The C ABI of the MoE layer (include/moecert/layer.hpp) and its config.
#include "moecert/layer.hpp"

#include <fmt/format.h>

#include "capi/abi.hpp"
#include "moecert/config.hpp"
#include "moecert/moecert.h"

using namespace moecert;
using capi::guarded;
using capi::handle;
using capi::InvalidArgument;
using capi::mat;
using capi::vec;

namespace {

// A saved state's rows `from` into the descriptor t, when t is given;
// `missing` (if not null) says why `from` may be absent.
template <class T>
void copy_saved(MatView<const T> from, const moecert_tensor* t, const char* name,
                const char* missing = nullptr) {
  const auto to = mat<T>(t, name, false);
  if (to.empty() && to.data == nullptr) return;
  if (missing && from.data == nullptr) throw InvalidArgument(fmt::format("{}: {}", name, missing));
  if (to.rows != from.rows || to.cols != from.cols)
    throw InvalidArgument(
        fmt::format("{}: {}x{}, expected {}x{}", name, to.rows, to.cols, from.rows, from.cols));
  for (std::size_t i = 0; i < from.rows; ++i)
    for (std::size_t j = 0; j < from.cols; ++j) to(i, j) = from(i, j);
}

}  // namespace

namespace moecert::capi {

MoeConfig config_of(const moecert_config* c) {
  const auto& in = handle(c, "cfg");
  if (in.router < 0 || static_cast<std::size_t>(in.router) >= kRouterKinds)
    throw InvalidArgument(
        fmt::format("cfg.router {}, expected 0..{}", in.router, kRouterKinds - 1));
  MoeConfig cfg;
  cfg.experts = in.experts, cfg.hidden = in.hidden, cfg.inter = in.inter, cfg.topk = in.topk;
  cfg.lora_rank = in.lora_rank, cfg.lora_alpha = in.lora_alpha,
  cfg.router = static_cast<RouterKind>(in.router);
  cfg.renormalize = in.renormalize != 0, cfg.groups = in.groups, cfg.topk_group = in.topk_group;
  cfg.scaling = in.scaling, cfg.max_tokens = in.max_tokens;
  return cfg;
}

layer::Weights weights_of(const moecert_layer_weights* w, const experts::Lora& lora) {
  const auto& in = handle(w, "weights");
  layer::Weights out;
  out.experts = &handle(in.experts, "weights.experts").packed;
  out.router_w = mat<const float>(&in.router_w, "router_w");
  out.router_b = vec<const float>(&in.router_b, "router_b");
  out.router_bias = vec<const float>(&in.router_bias, "router_bias", false);
  out.lora = lora;
  return out;
}

layer::Gradients layer_grads(const moecert_layer_grads& g, RoundedDx& dx) {
  layer::Gradients out;
  out.router_w = mat<float>(&g.router_w, "router_w grad", false);
  out.router_b = vec<float>(&g.router_b, "router_b grad", false);
  expert_path_grads(g, dx, out);
  return out;
}

}  // namespace moecert::capi

extern "C" {

moecert_status moecert_config_validate(const moecert_config* cfg) {
  return guarded("moecert_config_validate", [&] { validate(capi::config_of(cfg)); });
}

moecert_status moecert_config_router_width(const moecert_config* cfg, int64_t* width) {
  return guarded("moecert_config_router_width", [&] {
    if (!width) throw InvalidArgument("width: null");
    const MoeConfig c = capi::config_of(cfg);
    validate(c);
    *width = static_cast<std::int64_t>(router_width(c));
  });
}

moecert_status moecert_layer_saved_new(moecert_layer_saved** out) {
  return guarded("moecert_layer_saved_new", [&] {
    if (!out) throw InvalidArgument("out: null");
    *out = new moecert_layer_saved;
  });
}

void moecert_layer_saved_free(moecert_layer_saved* s) { delete s; }

moecert_status moecert_layer_saved_routing(const moecert_layer_saved* s, const moecert_tensor* idx,
                                           const moecert_tensor* weights) {
  return guarded("moecert_layer_saved_routing", [&] {
    const auto& saved = handle(s, "saved").saved;
    if (!saved.valid()) throw InvalidArgument("saved: holds no training forward");
    copy_saved(saved.idx(), idx, "idx");
    copy_saved(saved.weights(), weights, "weights");
  });
}

moecert_status moecert_layer_saved_router(const moecert_layer_saved* s, const moecert_tensor* z,
                                          const moecert_tensor* dweights,
                                          const moecert_tensor* dz) {
  return guarded("moecert_layer_saved_router", [&] {
    const auto& saved = handle(s, "saved").saved;
    copy_saved(saved.logits(), z, "z", "no training forward since the last backward");
    copy_saved(saved.router_dw(), dweights, "dweights",
               "no backward with the router path since the forward");
    copy_saved(saved.router_dz(), dz, "dz", "no backward with the router path since the forward");
  });
}

moecert_status moecert_layer_forward(const moecert_config* cfg, const moecert_layer_weights* w,
                                     const moecert_tensor* x, const moecert_tensor* y,
                                     moecert_layer_saved* saved,
                                     const moecert_train_options* options) {
  return guarded("moecert_layer_forward", [&] {
    const auto t = capi::train_options(options);
    auto& h = handle(saved, "saved");
    layer::forward(capi::config_of(cfg), capi::weights_of(w, h.lora.forward(capi::lora_in(w))),
                   mat<const bf16>(x, "x"), mat<float>(y, "y"), h.saved,
                   {.isa = t.isa, .training = t.training, .memory_cap = t.memory_cap});
  });
}

moecert_status moecert_layer_backward(const moecert_config* cfg, const moecert_layer_weights* w,
                                      const moecert_tensor* x, const moecert_tensor* dy,
                                      moecert_layer_saved* saved, const moecert_layer_grads* grads,
                                      int32_t expert_path, int32_t router_path) {
  return guarded("moecert_layer_backward", [&] {
    auto& h = handle(saved, "saved");
    const auto views = capi::layer_grads(handle(grads, "grads"), h.dx);
    layer::backward(capi::config_of(cfg), capi::weights_of(w, h.lora.again(capi::lora_in(w))),
                    mat<const bf16>(x, "x"), mat<const float>(dy, "dy"), h.saved, views,
                    {.expert_path = expert_path != 0, .router_path = router_path != 0});
    h.dx.finish();
  });
}

moecert_status moecert_router_linear_forward(const moecert_tensor* x,
                                             const moecert_tensor* router_w,
                                             const moecert_tensor* router_b,
                                             const moecert_tensor* z, int32_t isa) {
  return guarded("moecert_router_linear_forward", [&] {
    layer::router_linear_forward(mat<const bf16>(x, "x"), mat<const float>(router_w, "router_w"),
                                 vec<const float>(router_b, "router_b"), mat<float>(z, "z"),
                                 capi::isa_of(isa));
  });
}

moecert_status moecert_router_linear_backward(const moecert_tensor* x,
                                              const moecert_tensor* router_w,
                                              const moecert_tensor* dz, const moecert_tensor* dx,
                                              const moecert_tensor* d_router_w,
                                              const moecert_tensor* d_router_b, int32_t isa) {
  return guarded("moecert_router_linear_backward", [&] {
    layer::router_linear_backward(mat<const bf16>(x, "x"), mat<const float>(router_w, "router_w"),
                                  mat<const float>(dz, "dz"),
                                  {.dx = mat<float>(dx, "dx", false),
                                   .router_w = mat<float>(d_router_w, "d_router_w", false),
                                   .router_b = vec<float>(d_router_b, "d_router_b", false)},
                                  capi::isa_of(isa));
  });
}

}  // extern "C"
