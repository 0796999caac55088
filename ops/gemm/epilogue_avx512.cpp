// SwiGLU epilogue, AVX-512: 16 lanes of exp_poly.hpp's exact operation
// sequence (rint, two FMAs, Horner with FMAs, scale by 2^n), then silu * u
// and round-to-nearest-even to bf16 with integer operations (VCVTNEPS2BF16
// would flush denormals, which bf16::from_float does not). Own ISA flags.
#include <immintrin.h>

#include "ops/gemm/exp_poly.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {
namespace {

inline __m512 exp16(__m512 x) {
  using namespace exp_poly;
  const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kMax), _CMP_NLT_UQ);  // x >= kMax or NaN
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kMin), _CMP_LT_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512 xc = _mm512_mask_blend_ps(over | under, x, _mm512_setzero_ps());
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kC[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC[i]));
  __m512 e = _mm512_scalef_ps(p, n);
  e = _mm512_mask_blend_ps(under, e, _mm512_setzero_ps());
  e = _mm512_mask_blend_ps(over, e, _mm512_set1_ps(INFINITY));
  return _mm512_mask_blend_ps(nan, e, x);
}

// bf16::from_float on 16 lanes, packed into 16 uint16.
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// -x as scalar code computes it: a sign flip, also of NaN and of zero.
inline __m512 neg(__m512 x) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

}  // namespace

void swiglu_avx512(const float* g, const float* u, bf16* h, std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i), uv = _mm512_loadu_ps(u + i);
    const __m512 s = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(neg(gv))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), to_bf16(_mm512_mul_ps(_mm512_mul_ps(gv, s), uv)));
  }
  for (; i < n; ++i) h[i] = bf16(exp_poly::swiglu(g[i], u[i]));
}

}  // namespace moecert::gemm
