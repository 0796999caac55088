/* Element access to the C ABI's tensor descriptors for the example C
 * implementations (experts.c, routers.c, layer.c). */
#ifndef MOECERT_EXAMPLES_JUDGE_TENSOR_H
#define MOECERT_EXAMPLES_JUDGE_TENSOR_H

#include <stdint.h>
#include <string.h>

#include "moecert/moecert.h"

/* Element (r, c) of a bf16 tensor, widened to fp32 (exact). */
static inline float bf(const moecert_tensor* t, int64_t r, int64_t c) {
  uint16_t h;
  memcpy(&h, (const char*)t->data + 2 * (r * t->stride[0] + c * t->stride[1]), 2);
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Element (r, c) of an fp32 tensor. */
static inline float f32(const moecert_tensor* t, int64_t r, int64_t c) {
  return ((const float*)t->data)[r * t->stride[0] + c * t->stride[1]];
}

#endif
