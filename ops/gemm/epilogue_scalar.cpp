// Element-wise kernels, portable: the SwiGLU epilogue and its backward with
// the exp of exp_poly.hpp, the rank-r gradient sums and the scaled rounding
// of fp32 rows to bf16; each bit-identical
// to its AVX-512 twin (epilogue_avx512.cpp).
#include "ops/gemm/exp_poly.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {

void swiglu_scalar(const float* g, const float* u, bf16* h, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) h[i] = bf16(exp_poly::swiglu(g[i], u[i]));
}

void swiglu_backward_scalar(const float* g, const float* u, const float* dh, float w, bf16* dg,
                            bf16* du, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    float a, b;
    exp_poly::swiglu_backward(g[i], u[i], dh[i], w, a, b);
    dg[i] = bf16(a);
    du[i] = bf16(b);
  }
}

void scale_to_bf16_scalar(const float* src, float scale, bf16* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = bf16(scale * src[i]);
}

namespace {
float dot16_one(const float* x, const float* w, std::size_t n) {
  float acc[16] = {};
  std::size_t h = 0;
  for (; h + 16 <= n; h += 16)
    for (int l = 0; l < 16; ++l) acc[l] += x[h + l] * w[h + l];
  for (int l = 0; h < n; ++h, ++l) acc[l] += x[h] * w[h];
  for (int width = 8; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  return acc[0];
}
}  // namespace

void dot16_scalar(const float* const* x, std::size_t nx, const float* w, std::size_t ldw,
                  std::size_t nw, std::size_t n, float* out, std::size_t ldo) {
  for (std::size_t i = 0; i < nx; ++i)
    for (std::size_t e = 0; e < nw; ++e) out[i * ldo + e] = dot16_one(x[i], w + e * ldw, n);
}

void rank_sums_scalar(const RankSumArgs& p) {
  for (std::size_t q = 0; q < p.m; ++q) {
    const auto* vb = static_cast<const bf16*>(p.v[q]);
    const auto* vf = static_cast<const float*>(p.v[q]);
    for (std::size_t k = 0; k < p.r; ++k) {
      const float s = p.s[q * p.lds + k];
      float* acc = p.acc + k * p.ldacc;
      for (std::size_t j = 0; j < p.n; ++j) {
        float v = p.v_bf16 ? vb[j].to_float() : vf[j];
        if (p.vscale) v = p.vscale[q] * v;
        acc[j] = acc[j] + s * v;
      }
    }
  }
}

}  // namespace moecert::gemm
