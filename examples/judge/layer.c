/* A small C implementation of the MoE layer's forward (router linear,
 * renormalised softmax top-k, the experts op) for moecert.testing to judge
 * through the C ABI's tensor descriptors (include/moecert/moecert.h): x bf16
 * [T, H], router_w fp32 [E, H], router_b fp32 [1, E], the experts' weights
 * and LoRA as examples/judge/experts.c takes them; z fp32 [T, E], idx int32
 * and weights fp32 [T, K], y fp32 [T, H] written. Composes
 * examples/judge/routers.c and experts.c.
 *
 *   example_layer_forward           z = x W_r^T + b in fp32, then the router
 *                                   and the experts on that z
 *   example_layer_forward_no_bias   the bug of leaving the router's bias out
 *
 * Returns 0, or -1 for descriptors it does not take. */
#include <stdint.h>
#include <string.h>

#include "moecert/moecert.h"

int example_softmax_topk_forward(const moecert_tensor* z, const moecert_tensor* bias, int64_t k,
                                 moecert_tensor* idx, moecert_tensor* w);
int example_experts_forward(const moecert_tensor* x, const moecert_tensor* idx,
                            const moecert_tensor* weights, const moecert_tensor* w_gate,
                            const moecert_tensor* w_up, const moecert_tensor* w_down,
                            const moecert_lora* lora, moecert_tensor* y);

static float bf(const moecert_tensor* t, int64_t r, int64_t c) {
  uint16_t h;
  memcpy(&h, (const char*)t->data + 2 * (r * t->stride[0] + c * t->stride[1]), 2);
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static int forward(const moecert_tensor* x, const moecert_tensor* router_w,
                   const moecert_tensor* router_b, const moecert_tensor* w_gate,
                   const moecert_tensor* w_up, const moecert_tensor* w_down,
                   const moecert_lora* lora, int64_t k, moecert_tensor* z, moecert_tensor* idx,
                   moecert_tensor* weights, moecert_tensor* y, int bias) {
  if (x->dtype != MOECERT_BF16 || router_w->dtype != MOECERT_F32 ||
      router_b->dtype != MOECERT_F32 || z->dtype != MOECERT_F32)
    return -1;
  const int64_t T = x->shape[0], H = x->shape[1], E = router_w->shape[0];
  const float* w = (const float*)router_w->data;
  const float* b = (const float*)router_b->data;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      float s = bias ? b[e * router_b->stride[1]] : 0.0f;
      for (int64_t h = 0; h < H; ++h)
        s += bf(x, t, h) * w[e * router_w->stride[0] + h * router_w->stride[1]];
      ((float*)z->data)[t * z->stride[0] + e * z->stride[1]] = s;
    }
  const int status = example_softmax_topk_forward(z, NULL, k, idx, weights);
  return status ? status : example_experts_forward(x, idx, weights, w_gate, w_up, w_down, lora, y);
}

int example_layer_forward(const moecert_tensor* x, const moecert_tensor* router_w,
                          const moecert_tensor* router_b, const moecert_tensor* w_gate,
                          const moecert_tensor* w_up, const moecert_tensor* w_down,
                          const moecert_lora* lora, int64_t k, moecert_tensor* z,
                          moecert_tensor* idx, moecert_tensor* weights, moecert_tensor* y) {
  return forward(x, router_w, router_b, w_gate, w_up, w_down, lora, k, z, idx, weights, y, 1);
}

int example_layer_forward_no_bias(const moecert_tensor* x, const moecert_tensor* router_w,
                                  const moecert_tensor* router_b, const moecert_tensor* w_gate,
                                  const moecert_tensor* w_up, const moecert_tensor* w_down,
                                  const moecert_lora* lora, int64_t k, moecert_tensor* z,
                                  moecert_tensor* idx, moecert_tensor* weights, moecert_tensor* y) {
  return forward(x, router_w, router_b, w_gate, w_up, w_down, lora, k, z, idx, weights, y, 0);
}
