/* A small C implementation of the renormalised softmax top-k router for
 * moecert.testing to judge through the C ABI's tensor descriptors
 * (include/moecert/moecert.h): logits z fp32 [T, E], ids int32 and
 * weights fp32 [T, K], upstream gradient g fp32 [T, K], dz fp32 [T, E].
 *
 *   example_softmax_topk_forward           the K largest logits (ties: the
 *                                          lower index), slots in that
 *                                          order, softmax over the K
 *   example_softmax_topk_backward          dz of those weights for g: zero
 *                                          off the selection
 *   example_softmax_topk_backward_unmasked the renormalised backward written
 *                                          through the dense softmax without
 *                                          its mask: unselected experts get
 *                                          -p_i sum_j w_j g_j
 *   example_sigmoid_topk_forward           one group (DeepSeek-V3's router
 *                                          with G = 1): the K largest
 *                                          sigmoid(z) + bias[e], weights
 *                                          s_j / sum of the K s (scaling 1)
 *   example_sigmoid_topk_backward          dz of those weights: zero off the
 *                                          selection
 *
 * Returns 0, or -1 for descriptors it does not take. */
#include <math.h>
#include <stdint.h>

#include "moecert/moecert.h"
#include "tensor.h"

static float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

/* Row t's score of expert e: z, or (bias given) sigmoid(z) + bias[e]. */
static float score(const moecert_tensor* z, const moecert_tensor* bias, int64_t t, int32_t e) {
  return bias ? sigmoid(f32(z, t, e)) + ((const float*)bias->data)[e * bias->stride[1]]
              : f32(z, t, e);
}

/* The k best scores of row t in ids, best first (ties: the lower index). */
static void select_k(const moecert_tensor* z, const moecert_tensor* bias, int64_t t, int64_t k,
                     int32_t* ids) {
  for (int64_t j = 0; j < k; ++j) { /* selection sort: the best not yet taken */
    int32_t best = -1;
    for (int32_t e = 0; e < z->shape[1]; ++e) {
      int taken = 0;
      for (int64_t q = 0; q < j; ++q) taken |= ids[q] == e;
      if (!taken && (best < 0 || score(z, bias, t, e) > score(z, bias, t, best))) best = e;
    }
    ids[j] = best;
  }
}

int example_softmax_topk_forward(const moecert_tensor* z, const moecert_tensor* bias, int64_t k,
                                 moecert_tensor* idx, moecert_tensor* w) {
  (void)bias;
  if (z->dtype != MOECERT_F32 || idx->dtype != MOECERT_I32 || w->dtype != MOECERT_F32) return -1;
  const int64_t T = z->shape[0];
  for (int64_t t = 0; t < T; ++t) {
    int32_t* ids = (int32_t*)idx->data + t * idx->stride[0];
    float* wt = (float*)w->data + t * w->stride[0];
    select_k(z, NULL, t, k, ids);
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += wt[j] = expf(f32(z, t, ids[j]) - f32(z, t, ids[0]));
    for (int64_t j = 0; j < k; ++j) wt[j] /= sum;
  }
  return 0;
}

/* Whether a router backward takes these descriptors: z, g, dz fp32, idx int32. */
static int backward_takes(const moecert_tensor* z, const moecert_tensor* idx,
                          const moecert_tensor* g, const moecert_tensor* dz) {
  return z->dtype == MOECERT_F32 && idx->dtype == MOECERT_I32 && g->dtype == MOECERT_F32 &&
         dz->dtype == MOECERT_F32;
}

static int backward(const moecert_tensor* z, const moecert_tensor* idx, const moecert_tensor* g,
                    moecert_tensor* dz, int masked) {
  if (!backward_takes(z, idx, g, dz)) return -1;
  const int64_t T = z->shape[0], E = z->shape[1], K = idx->shape[1];
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* ids = (const int32_t*)idx->data + t * idx->stride[0];
    float* d = (float*)dz->data + t * dz->stride[0];
    float top = f32(z, t, ids[0]), sum = 0, all = 0, wg = 0;
    for (int64_t j = 0; j < K; ++j) top = fmaxf(top, f32(z, t, ids[j]));
    for (int64_t j = 0; j < K; ++j) sum += expf(f32(z, t, ids[j]) - top);
    for (int32_t e = 0; e < E; ++e) all += expf(f32(z, t, e) - top);
    for (int64_t j = 0; j < K; ++j) wg += expf(f32(z, t, ids[j]) - top) / sum * f32(g, t, j);
    /* w_j = p_j / sum_selected p: dL/dz_j = w_j (g_j - sum w g) on the
     * selection; unmasked, every expert also gets -p_i sum w g. */
    for (int32_t e = 0; e < E; ++e) d[e] = masked ? 0 : -expf(f32(z, t, e) - top) / all * wg;
    for (int64_t j = 0; j < K; ++j) {
      const float wj = expf(f32(z, t, ids[j]) - top) / sum;
      d[ids[j]] = wj * (f32(g, t, j) - wg);
    }
  }
  return 0;
}

int example_softmax_topk_backward(const moecert_tensor* z, const moecert_tensor* idx,
                                  const moecert_tensor* g, moecert_tensor* dz) {
  return backward(z, idx, g, dz, 1);
}

int example_softmax_topk_backward_unmasked(const moecert_tensor* z, const moecert_tensor* idx,
                                           const moecert_tensor* g, moecert_tensor* dz) {
  return backward(z, idx, g, dz, 0);
}

int example_sigmoid_topk_forward(const moecert_tensor* z, const moecert_tensor* bias, int64_t k,
                                 moecert_tensor* idx, moecert_tensor* w) {
  if (z->dtype != MOECERT_F32 || !bias || bias->dtype != MOECERT_F32 || idx->dtype != MOECERT_I32 ||
      w->dtype != MOECERT_F32)
    return -1;
  for (int64_t t = 0; t < z->shape[0]; ++t) {
    int32_t* ids = (int32_t*)idx->data + t * idx->stride[0];
    float* wt = (float*)w->data + t * w->stride[0];
    select_k(z, bias, t, k, ids);
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += wt[j] = sigmoid(f32(z, t, ids[j]));
    for (int64_t j = 0; j < k; ++j) wt[j] /= sum;
  }
  return 0;
}

int example_sigmoid_topk_backward(const moecert_tensor* z, const moecert_tensor* idx,
                                  const moecert_tensor* g, moecert_tensor* dz) {
  if (!backward_takes(z, idx, g, dz)) return -1;
  const int64_t T = z->shape[0], E = z->shape[1], K = idx->shape[1];
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* ids = (const int32_t*)idx->data + t * idx->stride[0];
    float* d = (float*)dz->data + t * dz->stride[0];
    float sum = 0, wg = 0;
    for (int64_t j = 0; j < K; ++j) sum += sigmoid(f32(z, t, ids[j]));
    for (int64_t j = 0; j < K; ++j) wg += sigmoid(f32(z, t, ids[j])) / sum * f32(g, t, j);
    /* w_j = s_j / S: dL/ds_j = (g_j - sum w g) / S, ds/dz = s (1 - s). */
    for (int32_t e = 0; e < E; ++e) d[e] = 0;
    for (int64_t j = 0; j < K; ++j) {
      const float sj = sigmoid(f32(z, t, ids[j]));
      d[ids[j]] = (f32(g, t, j) - wg) / sum * sj * (1 - sj);
    }
  }
  return 0;
}
