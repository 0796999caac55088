// The C ABI of the three routers (include/moecert/router.hpp).
#include "moecert/router.hpp"

#include <fmt/format.h>

#include "capi/abi.hpp"
#include "moecert/moecert.h"

using namespace moecert;
using capi::guarded;
using capi::InvalidArgument;
using capi::mat;
using capi::vec;

namespace {

// Logits given as f32 or bf16: calls f with the matching view.
template <class F>
void with_scores(const moecert_tensor* z, const char* name, F&& f) {
  if (capi::present(z) && z->dtype == MOECERT_BF16)
    f(mat<const bf16>(z, name));
  else
    f(mat<const float>(z, name));
}

router::SigmoidTopkParams sigmoid_params(int64_t groups, int64_t topk_group, float scaling) {
  if (groups < 1 || topk_group < 1)
    throw InvalidArgument(fmt::format("groups {}, topk_group {}", groups, topk_group));
  return {static_cast<std::size_t>(groups), static_cast<std::size_t>(topk_group), scaling};
}

router::KeyWeights key_weights(int32_t mode) {
  if (mode < 0 || mode > 2)
    throw InvalidArgument(fmt::format("mode {}, expected 0 raw, 1 exp or 2 softmax", mode));
  return static_cast<router::KeyWeights>(mode);
}

}  // namespace

extern "C" {

moecert_status moecert_softmax_topk_forward(const moecert_tensor* z, const moecert_tensor* idx,
                                            const moecert_tensor* w, int32_t renormalize) {
  return guarded("moecert_softmax_topk_forward", [&] {
    with_scores(z, "z", [&](auto zv) {
      router::softmax_topk_forward(zv, mat<std::int32_t>(idx, "idx"), mat<float>(w, "w"),
                                   renormalize != 0);
    });
  });
}

moecert_status moecert_softmax_topk_backward(const moecert_tensor* z, const moecert_tensor* idx,
                                             const moecert_tensor* g, const moecert_tensor* dz,
                                             int32_t renormalize) {
  return guarded("moecert_softmax_topk_backward", [&] {
    capi::Ids ids;
    router::softmax_topk_backward(mat<const float>(z, "z"), ids.view(idx, "idx", {dz}),
                                  mat<const float>(g, "g"), mat<float>(dz, "dz"), renormalize != 0);
  });
}

moecert_status moecert_sigmoid_topk_forward(const moecert_tensor* z, const moecert_tensor* bias,
                                            int64_t groups, int64_t topk_group, float scaling,
                                            const moecert_tensor* idx, const moecert_tensor* w) {
  return guarded("moecert_sigmoid_topk_forward", [&] {
    const auto p = sigmoid_params(groups, topk_group, scaling);
    with_scores(z, "z", [&](auto zv) {
      router::sigmoid_topk_forward(zv, vec<const float>(bias, "bias"), p,
                                   mat<std::int32_t>(idx, "idx"), mat<float>(w, "w"));
    });
  });
}

moecert_status moecert_sigmoid_topk_backward(const moecert_tensor* z, const moecert_tensor* idx,
                                             const moecert_tensor* g, int64_t groups,
                                             int64_t topk_group, float scaling,
                                             const moecert_tensor* dz) {
  return guarded("moecert_sigmoid_topk_backward", [&] {
    capi::Ids ids;
    router::sigmoid_topk_backward(
        mat<const float>(z, "z"), ids.view(idx, "idx", {dz}), mat<const float>(g, "g"),
        sigmoid_params(groups, topk_group, scaling), mat<float>(dz, "dz"));
  });
}

moecert_status moecert_product_key_forward(const moecert_tensor* sx, const moecert_tensor* sy,
                                           int32_t mode, const moecert_tensor* idx,
                                           const moecert_tensor* w) {
  return guarded("moecert_product_key_forward", [&] {
    const auto m = key_weights(mode);
    if (capi::present(sx) && sx->dtype == MOECERT_BF16)
      router::product_key_forward(mat<const bf16>(sx, "sx"), mat<const bf16>(sy, "sy"), m,
                                  mat<std::int32_t>(idx, "idx"), mat<float>(w, "w"));
    else
      router::product_key_forward(mat<const float>(sx, "sx"), mat<const float>(sy, "sy"), m,
                                  mat<std::int32_t>(idx, "idx"), mat<float>(w, "w"));
  });
}

moecert_status moecert_product_key_backward(const moecert_tensor* sx, const moecert_tensor* sy,
                                            const moecert_tensor* idx, const moecert_tensor* g,
                                            int32_t mode, const moecert_tensor* dsx,
                                            const moecert_tensor* dsy) {
  return guarded("moecert_product_key_backward", [&] {
    capi::Ids ids;
    router::product_key_backward(mat<const float>(sx, "sx"), mat<const float>(sy, "sy"),
                                 ids.view(idx, "idx", {dsx, dsy}), mat<const float>(g, "g"),
                                 key_weights(mode), mat<float>(dsx, "dsx"), mat<float>(dsy, "dsy"));
  });
}

}  // extern "C"
