/* A small C implementation of the experts op (SwiGLU experts with LoRA, the
 * caller's routing) for moecert.testing to judge through the C ABI's tensor
 * descriptors (include/moecert/moecert.h): x and the stacked weights bf16
 * ([T, H], [E*I, H], [E*I, H], [E*H, I]), idx int32 and weights fp32 [T, K]
 * (-1: an empty slot), LoRA factors bf16 (NULL: none), y fp32 [T, H].
 * Every intermediate in fp32, sums in index order: a "fp32" implementation.
 *
 *   example_experts_forward            correct
 *   example_experts_forward_unscaled   the bug of leaving out LoRA's alpha / r
 *   example_experts_backward           dx and dL/dw for dy fp32 [T, H] (dx fp32 [T, H],
 *                                      dweights fp32 [T, K]), correct
 *   example_experts_backward_no_lora_dx  the bug of leaving the LoRA path out of dx
 *
 * Returns 0, or -1 for descriptors it does not take. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moecert/moecert.h"
#include "tensor.h"

/* v[o] = sum_k W[row0 + o][k] u[k] (+= scale times it when add) for o < n, W bf16. */
static void matvec(const moecert_tensor* w, int64_t row0, int64_t n, int64_t k, const float* u,
                   float* v, float scale, int add) {
  for (int64_t o = 0; o < n; ++o) {
    float s = 0;
    for (int64_t i = 0; i < k; ++i) s += bf(w, row0 + o, i) * u[i];
    v[o] = add ? v[o] + scale * s : s;
  }
}

/* v[k] += scale sum_o W[row0 + o][k] u[o] for k < kd, o < n (W transposed). */
static void matvec_t(const moecert_tensor* w, int64_t row0, int64_t n, int64_t kd, const float* u,
                     float* v, float scale) {
  for (int64_t k = 0; k < kd; ++k) {
    float s = 0;
    for (int64_t o = 0; o < n; ++o) s += bf(w, row0 + o, k) * u[o];
    v[k] += scale * s;
  }
}

/* One token's pass through expert e: g, u (before the activation), h, o;
 * xg, xu, ha: the LoRA A products. */
typedef struct {
  int64_t H, I, r;
  float s;
  float *g, *u, *h, *o, *xg, *xu, *ha, *t1; /* t1: 2 r of scratch */
} Work;

static void expert(const moecert_tensor* w_gate, const moecert_tensor* w_up,
                   const moecert_tensor* w_down, const moecert_lora* lora, int64_t e,
                   const float* xt, Work* w) {
  const int64_t H = w->H, I = w->I, r = w->r;
  matvec(w_gate, e * I, I, H, xt, w->g, 1, 0);
  matvec(w_up, e * I, I, H, xt, w->u, 1, 0);
  if (r) {
    matvec(&lora->a_gate, e * r, r, H, xt, w->xg, 1, 0);
    matvec(&lora->b_gate, e * I, I, r, w->xg, w->g, w->s, 1);
    matvec(&lora->a_up, e * r, r, H, xt, w->xu, 1, 0);
    matvec(&lora->b_up, e * I, I, r, w->xu, w->u, w->s, 1);
  }
  for (int64_t i = 0; i < I; ++i) w->h[i] = w->g[i] / (1 + expf(-w->g[i])) * w->u[i];
  matvec(w_down, e * H, H, I, w->h, w->o, 1, 0);
  if (r) {
    matvec(&lora->a_down, e * r, r, I, w->h, w->ha, 1, 0);
    matvec(&lora->b_down, e * H, H, r, w->ha, w->o, w->s, 1);
  }
}

static int valid(const moecert_tensor* x, const moecert_tensor* idx, const moecert_tensor* weights,
                 const moecert_tensor* out) {
  return x->dtype == MOECERT_BF16 && idx->dtype == MOECERT_I32 && weights->dtype == MOECERT_F32 &&
         out->dtype == MOECERT_F32;
}

static float* work(Work* w, int64_t H, int64_t I, const moecert_lora* lora, int scaled) {
  w->H = H, w->I = I, w->r = lora ? lora->rank : 0;
  w->s = w->r && scaled ? (float)(lora->alpha / (double)w->r) : 1.0f;
  float* m = malloc(sizeof(float) * (size_t)(3 * I + H + 5 * w->r + 1));
  if (!m) return NULL;
  w->g = m, w->u = w->g + I, w->h = w->u + I, w->o = w->h + I, w->xg = w->o + H;
  w->xu = w->xg + w->r, w->ha = w->xu + w->r, w->t1 = w->ha + w->r;
  return m;
}

static int forward(const moecert_tensor* x, const moecert_tensor* idx,
                   const moecert_tensor* weights, const moecert_tensor* w_gate,
                   const moecert_tensor* w_up, const moecert_tensor* w_down,
                   const moecert_lora* lora, moecert_tensor* y, int scaled) {
  if (!valid(x, idx, weights, y)) return -1;
  const int64_t T = x->shape[0], H = x->shape[1], K = idx->shape[1], I = w_down->shape[1];
  Work w;
  float *m = work(&w, H, I, lora, scaled), *xt = malloc(sizeof(float) * (size_t)H);
  if (!m || !xt) return free(m), free(xt), -1;
  for (int64_t t = 0; t < T; ++t) {
    float* yt = (float*)y->data + t * y->stride[0];
    for (int64_t h = 0; h < H; ++h) yt[h] = 0, xt[h] = bf(x, t, h);
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = ((const int32_t*)idx->data)[t * idx->stride[0] + j];
      if (e < 0) break;
      expert(w_gate, w_up, w_down, lora, e, xt, &w);
      const float wt = f32(weights, t, j);
      for (int64_t h = 0; h < H; ++h) yt[h] += wt * w.o[h];
    }
  }
  free(m), free(xt);
  return 0;
}

/* dx and dL/dw of forward for dy; lora_dx = 0 leaves the LoRA path out of dx. */
static int backward(const moecert_tensor* x, const moecert_tensor* idx,
                    const moecert_tensor* weights, const moecert_tensor* w_gate,
                    const moecert_tensor* w_up, const moecert_tensor* w_down,
                    const moecert_lora* lora, const moecert_tensor* dy, moecert_tensor* dx,
                    moecert_tensor* dweights, int lora_dx) {
  if (!valid(x, idx, weights, dx) || dy->dtype != MOECERT_F32 || dweights->dtype != MOECERT_F32)
    return -1;
  const int64_t T = x->shape[0], H = x->shape[1], K = idx->shape[1], I = w_down->shape[1];
  Work w;
  float *m = work(&w, H, I, lora, 1), *xt = malloc(sizeof(float) * (size_t)(2 * H + 3 * I));
  if (!m || !xt) return free(m), free(xt), -1;
  float *dot = xt + H, *dh = dot + H, *dg = dh + I, *du = dg + I;
  const int64_t r = w.r;
  for (int64_t t = 0; t < T; ++t) {
    float* dxt = (float*)dx->data + t * dx->stride[0];
    float* dwt = (float*)dweights->data + t * dweights->stride[0];
    for (int64_t h = 0; h < H; ++h) dxt[h] = 0, xt[h] = bf(x, t, h);
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = ((const int32_t*)idx->data)[t * idx->stride[0] + j];
      dwt[j] = 0;
      if (e < 0) continue;
      expert(w_gate, w_up, w_down, lora, e, xt, &w);
      const float wt = f32(weights, t, j);
      for (int64_t h = 0; h < H; ++h) dwt[j] += f32(dy, t, h) * w.o[h], dot[h] = wt * f32(dy, t, h);
      for (int64_t i = 0; i < I; ++i) dh[i] = 0;
      matvec_t(w_down, e * H, H, I, dot, dh, 1);
      if (r) {
        for (int64_t q = 0; q < r; ++q) w.t1[q] = 0;
        matvec_t(&lora->b_down, e * H, H, r, dot, w.t1, 1);
        matvec_t(&lora->a_down, e * r, r, I, w.t1, dh, w.s);
      }
      for (int64_t i = 0; i < I; ++i) {
        const float sg = 1 / (1 + expf(-w.g[i]));
        dg[i] = dh[i] * w.u[i] * sg * (1 + w.g[i] * (1 - sg));
        du[i] = dh[i] * w.g[i] * sg;
      }
      matvec_t(w_gate, e * I, I, H, dg, dxt, 1);
      matvec_t(w_up, e * I, I, H, du, dxt, 1);
      if (r && lora_dx) {
        for (int64_t q = 0; q < 2 * r; ++q) w.t1[q] = 0;
        matvec_t(&lora->b_gate, e * I, I, r, dg, w.t1, 1);
        matvec_t(&lora->b_up, e * I, I, r, du, w.t1 + r, 1);
        matvec_t(&lora->a_gate, e * r, r, H, w.t1, dxt, w.s);
        matvec_t(&lora->a_up, e * r, r, H, w.t1 + r, dxt, w.s);
      }
    }
  }
  free(m), free(xt);
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

int example_experts_backward(const moecert_tensor* x, const moecert_tensor* idx,
                             const moecert_tensor* weights, const moecert_tensor* w_gate,
                             const moecert_tensor* w_up, const moecert_tensor* w_down,
                             const moecert_lora* lora, const moecert_tensor* dy, moecert_tensor* dx,
                             moecert_tensor* dweights) {
  return backward(x, idx, weights, w_gate, w_up, w_down, lora, dy, dx, dweights, 1);
}

int example_experts_backward_no_lora_dx(const moecert_tensor* x, const moecert_tensor* idx,
                                        const moecert_tensor* weights, const moecert_tensor* w_gate,
                                        const moecert_tensor* w_up, const moecert_tensor* w_down,
                                        const moecert_lora* lora, const moecert_tensor* dy,
                                        moecert_tensor* dx, moecert_tensor* dweights) {
  return backward(x, idx, weights, w_gate, w_up, w_down, lora, dy, dx, dweights, 0);
}
