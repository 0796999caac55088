/* A small C implementation of the experts op (SwiGLU experts with LoRA, the
 * caller's routing) for moecert.testing to judge through the C ABI's tensor
 * descriptors (include/moecert/moecert.h): x and the stacked weights bf16
 * ([T, H], [E*I, H], [E*I, H], [E*H, I]), idx int32 and weights fp32 [T, K]
 * (-1: an empty slot), LoRA factors bf16 (NULL: none), y fp32 [T, H].
 * Every intermediate in fp32, sums in index order: a "fp32" implementation.
 *
 *   example_experts_forward            correct
 *   example_experts_forward_unscaled   the bug of leaving out LoRA's alpha / r
 *
 * Returns 0, or -1 for descriptors it does not take. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moecert/moecert.h"

static float bf(const moecert_tensor* t, int64_t r, int64_t c) {
  uint16_t h;
  memcpy(&h, (const char*)t->data + 2 * (r * t->stride[0] + c * t->stride[1]), 2);
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static float f32(const moecert_tensor* t, int64_t r, int64_t c) {
  return ((const float*)t->data)[r * t->stride[0] + c * t->stride[1]];
}

/* v[o] = sum_k W[row0 + o][k] u[k] (+= when add) for o < n, W bf16. */
static void matvec(const moecert_tensor* w, int64_t row0, int64_t n, int64_t k, const float* u,
                   float* v, float scale, int add) {
  for (int64_t o = 0; o < n; ++o) {
    float s = 0;
    for (int64_t i = 0; i < k; ++i) s += bf(w, row0 + o, i) * u[i];
    v[o] = add ? v[o] + scale * s : s;
  }
}

static int forward(const moecert_tensor* x, const moecert_tensor* idx,
                   const moecert_tensor* weights, const moecert_tensor* w_gate,
                   const moecert_tensor* w_up, const moecert_tensor* w_down,
                   const moecert_lora* lora, moecert_tensor* y, int scaled) {
  if (x->dtype != MOECERT_BF16 || idx->dtype != MOECERT_I32 || weights->dtype != MOECERT_F32 ||
      y->dtype != MOECERT_F32)
    return -1;
  const int64_t T = x->shape[0], H = x->shape[1], K = idx->shape[1], I = w_down->shape[1];
  const int64_t r = lora ? lora->rank : 0;
  const float s = r && scaled ? (float)(lora->alpha / (double)r) : 1.0f;
  float *g = malloc(sizeof(float) * (size_t)(2 * I + H + 2 * r + 2 * H)), *u = g + I, *o = u + I,
        *xa = o + H, *ha = xa + r, *xt = ha + r;
  if (!g) return -1;
  for (int64_t t = 0; t < T; ++t) {
    float* yt = (float*)y->data + t * y->stride[0];
    for (int64_t h = 0; h < H; ++h) yt[h] = 0, xt[h] = bf(x, t, h);
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = ((const int32_t*)idx->data)[t * idx->stride[0] + j];
      if (e < 0) break;
      matvec(w_gate, e * I, I, H, xt, g, 1, 0);
      matvec(w_up, e * I, I, H, xt, u, 1, 0);
      if (r) {
        matvec(&lora->a_gate, e * r, r, H, xt, xa, 1, 0);
        matvec(&lora->b_gate, e * I, I, r, xa, g, s, 1);
        matvec(&lora->a_up, e * r, r, H, xt, xa, 1, 0);
        matvec(&lora->b_up, e * I, I, r, xa, u, s, 1);
      }
      for (int64_t i = 0; i < I; ++i) g[i] = g[i] / (1 + expf(-g[i])) * u[i];
      matvec(w_down, e * H, H, I, g, o, 1, 0);
      if (r) {
        matvec(&lora->a_down, e * r, r, I, g, ha, 1, 0);
        matvec(&lora->b_down, e * H, H, r, ha, o, s, 1);
      }
      const float wt = f32(weights, t, j);
      for (int64_t h = 0; h < H; ++h) yt[h] += wt * o[h];
    }
  }
  free(g);
  return 0;
}

int example_experts_forward(const moecert_tensor* x, const moecert_tensor* idx,
                            const moecert_tensor* weights, const moecert_tensor* w_gate,
                            const moecert_tensor* w_up, const moecert_tensor* w_down,
                            const moecert_lora* lora, moecert_tensor* y) {
  return forward(x, idx, weights, w_gate, w_up, w_down, lora, y, 1);
}

int example_experts_forward_unscaled(const moecert_tensor* x, const moecert_tensor* idx,
                                     const moecert_tensor* weights, const moecert_tensor* w_gate,
                                     const moecert_tensor* w_up, const moecert_tensor* w_down,
                                     const moecert_lora* lora, moecert_tensor* y) {
  return forward(x, idx, weights, w_gate, w_up, w_down, lora, y, 0);
}
