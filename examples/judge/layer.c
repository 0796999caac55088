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
 *   example_layer_backward          for dy fp32 [T, H]: the forward's z, idx
 *                                   and weights, then dL/dw and the experts'
 *                                   dx, dz by the router's backward, dx plus
 *                                   dz W_r, and dW_r = dz^T x, db = sum dz
 *   example_layer_backward_no_router_dx  the bug of leaving dz W_r out of dx
 *   example_layer_forward_sigmoid, example_layer_backward_sigmoid
 *                                   the same with routers.c's sigmoid top-k
 *                                   router and its correction bias
 *                                   router_bias fp32 [1, E] (after router_b)
 *
 * Returns 0, or -1 for descriptors it does not take. */
#include <stdint.h>
#include <string.h>

#include "moecert/moecert.h"
#include "tensor.h"

int example_softmax_topk_forward(const moecert_tensor* z, const moecert_tensor* bias, int64_t k,
                                 moecert_tensor* idx, moecert_tensor* w);
int example_softmax_topk_backward(const moecert_tensor* z, const moecert_tensor* idx,
                                  const moecert_tensor* g, moecert_tensor* dz);
int example_sigmoid_topk_forward(const moecert_tensor* z, const moecert_tensor* bias, int64_t k,
                                 moecert_tensor* idx, moecert_tensor* w);
int example_sigmoid_topk_backward(const moecert_tensor* z, const moecert_tensor* idx,
                                  const moecert_tensor* g, moecert_tensor* dz);
int example_experts_forward(const moecert_tensor* x, const moecert_tensor* idx,
                            const moecert_tensor* weights, const moecert_tensor* w_gate,
                            const moecert_tensor* w_up, const moecert_tensor* w_down,
                            const moecert_lora* lora, moecert_tensor* y);
int example_experts_backward(const moecert_tensor* x, const moecert_tensor* idx,
                             const moecert_tensor* weights, const moecert_tensor* w_gate,
                             const moecert_tensor* w_up, const moecert_tensor* w_down,
                             const moecert_lora* lora, const moecert_tensor* dy, moecert_tensor* dx,
                             moecert_tensor* dweights);

/* Element (r, c) of an fp32 tensor to write. */
static float* at(moecert_tensor* t, int64_t r, int64_t c) {
  return (float*)t->data + r * t->stride[0] + c * t->stride[1];
}

/* z = x W_r^T (+ b), then the router's selection on z: softmax top-k, or
 * with a correction bias the sigmoid top-k. */
static int route(const moecert_tensor* x, const moecert_tensor* router_w,
                 const moecert_tensor* router_b, const moecert_tensor* router_bias, int64_t k,
                 moecert_tensor* z, moecert_tensor* idx, moecert_tensor* weights, int bias) {
  if (x->dtype != MOECERT_BF16 || router_w->dtype != MOECERT_F32 ||
      router_b->dtype != MOECERT_F32 || z->dtype != MOECERT_F32)
    return -1;
  const int64_t T = x->shape[0], H = x->shape[1], E = router_w->shape[0];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      float s = bias ? ((const float*)router_b->data)[e * router_b->stride[1]] : 0.0f;
      for (int64_t h = 0; h < H; ++h) s += bf(x, t, h) * f32(router_w, e, h);
      *at(z, t, e) = s;
    }
  return router_bias ? example_sigmoid_topk_forward(z, router_bias, k, idx, weights)
                     : example_softmax_topk_forward(z, NULL, k, idx, weights);
}

static int forward(const moecert_tensor* x, const moecert_tensor* router_w,
                   const moecert_tensor* router_b, const moecert_tensor* router_bias,
                   const moecert_tensor* w_gate, const moecert_tensor* w_up,
                   const moecert_tensor* w_down, const moecert_lora* lora, int64_t k,
                   moecert_tensor* z, moecert_tensor* idx, moecert_tensor* weights,
                   moecert_tensor* y, int bias) {
  const int status = route(x, router_w, router_b, router_bias, k, z, idx, weights, bias);
  return status ? status : example_experts_forward(x, idx, weights, w_gate, w_up, w_down, lora, y);
}

/* The layer's gradients for dy (see the file's comment); router_dx = 0
 * leaves dz W_r out of dx. */
static int backward(const moecert_tensor* x, const moecert_tensor* router_w,
                    const moecert_tensor* router_b, const moecert_tensor* router_bias,
                    const moecert_tensor* w_gate, const moecert_tensor* w_up,
                    const moecert_tensor* w_down, const moecert_lora* lora, int64_t k,
                    const moecert_tensor* dy, moecert_tensor* z, moecert_tensor* idx,
                    moecert_tensor* weights, moecert_tensor* dx, moecert_tensor* dweights,
                    moecert_tensor* dz, moecert_tensor* dw_r, moecert_tensor* db_r, int router_dx) {
  int status = route(x, router_w, router_b, router_bias, k, z, idx, weights, 1);
  if (!status)
    status =
        example_experts_backward(x, idx, weights, w_gate, w_up, w_down, lora, dy, dx, dweights);
  if (!status)
    status = router_bias ? example_sigmoid_topk_backward(z, idx, dweights, dz)
                         : example_softmax_topk_backward(z, idx, dweights, dz);
  if (status) return status;
  const int64_t T = x->shape[0], H = x->shape[1], E = router_w->shape[0];
  for (int64_t e = 0; e < E; ++e) {
    *at(db_r, 0, e) = 0;
    for (int64_t h = 0; h < H; ++h) *at(dw_r, e, h) = 0;
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      const float d = *at(dz, t, e);
      *at(db_r, 0, e) += d;
      for (int64_t h = 0; h < H; ++h) {
        *at(dw_r, e, h) += d * bf(x, t, h);
        if (router_dx) *at(dx, t, h) += d * f32(router_w, e, h);
      }
    }
  return 0;
}

int example_layer_forward(const moecert_tensor* x, const moecert_tensor* router_w,
                          const moecert_tensor* router_b, const moecert_tensor* w_gate,
                          const moecert_tensor* w_up, const moecert_tensor* w_down,
                          const moecert_lora* lora, int64_t k, moecert_tensor* z,
                          moecert_tensor* idx, moecert_tensor* weights, moecert_tensor* y) {
  return forward(x, router_w, router_b, NULL, w_gate, w_up, w_down, lora, k, z, idx, weights, y, 1);
}

int example_layer_forward_no_bias(const moecert_tensor* x, const moecert_tensor* router_w,
                                  const moecert_tensor* router_b, const moecert_tensor* w_gate,
                                  const moecert_tensor* w_up, const moecert_tensor* w_down,
                                  const moecert_lora* lora, int64_t k, moecert_tensor* z,
                                  moecert_tensor* idx, moecert_tensor* weights, moecert_tensor* y) {
  return forward(x, router_w, router_b, NULL, w_gate, w_up, w_down, lora, k, z, idx, weights, y, 0);
}

int example_layer_backward(const moecert_tensor* x, const moecert_tensor* router_w,
                           const moecert_tensor* router_b, const moecert_tensor* w_gate,
                           const moecert_tensor* w_up, const moecert_tensor* w_down,
                           const moecert_lora* lora, int64_t k, const moecert_tensor* dy,
                           moecert_tensor* z, moecert_tensor* idx, moecert_tensor* weights,
                           moecert_tensor* dx, moecert_tensor* dweights, moecert_tensor* dz,
                           moecert_tensor* dw_r, moecert_tensor* db_r) {
  return backward(x, router_w, router_b, NULL, w_gate, w_up, w_down, lora, k, dy, z, idx, weights,
                  dx, dweights, dz, dw_r, db_r, 1);
}

int example_layer_backward_no_router_dx(
    const moecert_tensor* x, const moecert_tensor* router_w, const moecert_tensor* router_b,
    const moecert_tensor* w_gate, const moecert_tensor* w_up, const moecert_tensor* w_down,
    const moecert_lora* lora, int64_t k, const moecert_tensor* dy, moecert_tensor* z,
    moecert_tensor* idx, moecert_tensor* weights, moecert_tensor* dx, moecert_tensor* dweights,
    moecert_tensor* dz, moecert_tensor* dw_r, moecert_tensor* db_r) {
  return backward(x, router_w, router_b, NULL, w_gate, w_up, w_down, lora, k, dy, z, idx, weights,
                  dx, dweights, dz, dw_r, db_r, 0);
}

int example_layer_forward_sigmoid(const moecert_tensor* x, const moecert_tensor* router_w,
                                  const moecert_tensor* router_b, const moecert_tensor* router_bias,
                                  const moecert_tensor* w_gate, const moecert_tensor* w_up,
                                  const moecert_tensor* w_down, const moecert_lora* lora, int64_t k,
                                  moecert_tensor* z, moecert_tensor* idx, moecert_tensor* weights,
                                  moecert_tensor* y) {
  if (!router_bias) return -1;
  return forward(x, router_w, router_b, router_bias, w_gate, w_up, w_down, lora, k, z, idx, weights,
                 y, 1);
}

int example_layer_backward_sigmoid(const moecert_tensor* x, const moecert_tensor* router_w,
                                   const moecert_tensor* router_b,
                                   const moecert_tensor* router_bias, const moecert_tensor* w_gate,
                                   const moecert_tensor* w_up, const moecert_tensor* w_down,
                                   const moecert_lora* lora, int64_t k, const moecert_tensor* dy,
                                   moecert_tensor* z, moecert_tensor* idx, moecert_tensor* weights,
                                   moecert_tensor* dx, moecert_tensor* dweights, moecert_tensor* dz,
                                   moecert_tensor* dw_r, moecert_tensor* db_r) {
  if (!router_bias) return -1;
  return backward(x, router_w, router_b, router_bias, w_gate, w_up, w_down, lora, k, dy, z, idx,
                  weights, dx, dweights, dz, dw_r, db_r, 1);
}
