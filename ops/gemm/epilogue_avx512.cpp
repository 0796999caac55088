// Element-wise kernels, AVX-512, each bit-identical to its portable twin
// (epilogue_scalar.cpp). SwiGLU and its backward: 16 lanes of exp_poly.hpp's
// exact operation sequence (rint, two FMAs, Horner with FMAs, scale by 2^n),
// then the same products and round-to-nearest-even to bf16 with integer
// operations (VCVTNEPS2BF16 would flush denormals, which bf16::from_float
// does not). Rank-r sums: 16 columns per register, the rows' order kept.
// Scaled rounding to bf16: the same integer rounding.
// Own ISA flags.
#include "ops/core/prefetch.hpp"
#include "ops/gemm/bf16_avx512-inl.hpp"  // first: its pragmas precede <immintrin.h>
#include "ops/gemm/exp_poly.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {
namespace {

inline __m512 exp16(__m512 x) {
  using namespace exp_poly;
  const __mmask16 over =
      _mm512_cmp_ps_mask(x, _mm512_set1_ps(kMax), _CMP_NLT_UQ);  // x >= kMax or NaN
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kMin), _CMP_LT_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512 xc = _mm512_mask_blend_ps(over | under, x, _mm512_setzero_ps());
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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
// -x as scalar code computes it: a sign flip, also of NaN and of zero.
inline __m512 neg(__m512 x) {
  return _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

// 16 bf16 (as uint16) widened to fp32.
inline __m512 from_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 sigmoid_neg_exp(__m512 g) {  // 1 / (1 + exp(-g))
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp16(neg(g))));
}

// Columns [j0, j0 + 16 * R) of every k < KR (KR accumulator rows), masked
// past n: the loop over rows q innermost, so the accumulators stay in
// registers. Full blocks load without masks: with a masked load in the
// loop, GCC 12 kept acc in a stack array and stored all of it on every row.
template <int KR, int R, bool Bf16, bool Scale, bool Full>
void rank_block(const RankSumArgs& p, std::size_t k0, std::size_t j0) {
  static_assert(R == 2);  // the prefetch below covers 32 columns
  constexpr std::size_t kAhead = 2;
  __mmask16 mask[R];
  __m512 acc[KR][R];
  for (int c = 0; c < R; ++c) {
    const std::size_t j = j0 + 16 * c;
    mask[c] = j >= p.n ? 0 : p.n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (p.n - j)) - 1);
  }
  for (int k = 0; k < KR; ++k)
    for (int c = 0; c < R; ++c)
      acc[k][c] = _mm512_maskz_loadu_ps(mask[c], p.acc + (k0 + k) * p.ldacc + j0 + 16 * c);
  for (std::size_t q = 0; q < p.m; ++q) {
    if (q + kAhead <
        p.m) {  // this block's columns of a later row (rows are often scattered, one page each)
      constexpr std::size_t kBytes = Bf16 ? sizeof(bf16) : sizeof(float);
      moecert::detail::prefetch_lines(static_cast<const char*>(p.v[q + kAhead]) + j0 * kBytes,
                                      32 * kBytes);
    }
    __m512 v[R];
    for (int c = 0; c < R; ++c) {
      const std::size_t j = j0 + 16 * c;
      const bf16* vb = static_cast<const bf16*>(p.v[q]) + j;
      const float* vf = static_cast<const float*>(p.v[q]) + j;
      if constexpr (Bf16 && Full)
        v[c] = from_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb)));
      else if constexpr (Bf16)
        v[c] = from_bf16(_mm256_maskz_loadu_epi16(mask[c], vb));
      else if constexpr (Full)
        v[c] = _mm512_loadu_ps(vf);
      else
        v[c] = _mm512_maskz_loadu_ps(mask[c], vf);
      if constexpr (Scale) v[c] = _mm512_mul_ps(_mm512_set1_ps(p.vscale[q]), v[c]);
    }
    const float* s = p.s + q * p.lds + k0;
    for (int k = 0; k < KR; ++k) {
      const __m512 sk = _mm512_set1_ps(s[k]);
      for (int c = 0; c < R; ++c) acc[k][c] = _mm512_add_ps(acc[k][c], _mm512_mul_ps(sk, v[c]));
    }
  }
  for (int k = 0; k < KR; ++k)
    for (int c = 0; c < R; ++c)
      _mm512_mask_storeu_ps(p.acc + (k0 + k) * p.ldacc + j0 + 16 * c, mask[c], acc[k][c]);
}

template <int KR, bool Bf16, bool Scale>
void rank_cols(const RankSumArgs& p, std::size_t k0) {
  std::size_t j0 = 0;
  for (; j0 + 32 <= p.n; j0 += 32) rank_block<KR, 2, Bf16, Scale, true>(p, k0, j0);
  if (j0 < p.n) rank_block<KR, 2, Bf16, Scale, false>(p, k0, j0);
}

template <int KR>
void rank_rows(const RankSumArgs& p, std::size_t k0) {
  if (p.v_bf16)
    p.vscale ? rank_cols<KR, true, true>(p, k0) : rank_cols<KR, true, false>(p, k0);
  else
    p.vscale ? rank_cols<KR, false, true>(p, k0) : rank_cols<KR, false, false>(p, k0);
}

}  // namespace

void rank_sums_avx512(const RankSumArgs& p) {
  std::size_t k0 = 0;
  for (; k0 + 8 <= p.r; k0 += 8) rank_rows<8>(p, k0);
  switch (p.r - k0) {  // the last 1..7 accumulator rows
    case 1:
      rank_rows<1>(p, k0);
      break;
    case 2:
      rank_rows<2>(p, k0);
      break;
    case 3:
      rank_rows<3>(p, k0);
      break;
    case 4:
      rank_rows<4>(p, k0);
      break;
    case 5:
      rank_rows<5>(p, k0);
      break;
    case 6:
      rank_rows<6>(p, k0);
      break;
    case 7:
      rank_rows<7>(p, k0);
      break;
    default:
      break;
  }
}

void scale_to_bf16_avx512(const float* src, float scale, bf16* dst, std::size_t n) {
  const __m512 sv = _mm512_set1_ps(scale);
  for (std::size_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256i h = to_bf16(_mm512_mul_ps(sv, _mm512_maskz_loadu_ps(m, src + i)));
    _mm256_mask_storeu_epi16(dst + i, m, h);
  }
}

namespace {
// The scalar twin's fixed tree a[l] += a[l + w] for w = 8, 4, 2, 1, in
// registers (through a stack array, GCC kept all TX x TW accumulators in
// memory and stored each one on every step of the dot16 loop).
inline float tree16(__m512 a) {
  const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
  const __m128 a2 =
      _mm_add_ps(a4, _mm_movehl_ps(a4, a4));  // lanes 0, 1: a4[0] + a4[2], a4[1] + a4[3]
  return _mm_cvtss_f32(_mm_add_ss(a2, _mm_movehdup_ps(a2)));  // a2[0] + a2[1]
}

// One 16-wide step h of TX x TW dot products; Masked: only the lanes in m
// (the last, partial step). Full steps load without masks: with a masked
// load in the loop, GCC 12 kept acc in a stack array, stored on every step.
template <int TX, int TW, bool Masked>
inline void dot16_step(__m512 (&acc)[TX][TW], const float* const* x, const float* w,
                       std::size_t ldw, std::size_t h, __mmask16 m) {
  __m512 wv[TW];
  for (int e = 0; e < TW; ++e)
    wv[e] = Masked ? _mm512_maskz_loadu_ps(m, w + e * ldw + h) : _mm512_loadu_ps(w + e * ldw + h);
  for (int i = 0; i < TX; ++i) {
    const __m512 xv = Masked ? _mm512_maskz_loadu_ps(m, x[i] + h) : _mm512_loadu_ps(x[i] + h);
    for (int e = 0; e < TW; ++e)
      acc[i][e] = Masked ? _mm512_mask_add_ps(acc[i][e], m, acc[i][e], _mm512_mul_ps(xv, wv[e]))
                         : _mm512_add_ps(acc[i][e], _mm512_mul_ps(xv, wv[e]));
  }
}

// TX x TW dot products at once, each its own accumulator: lane l sums the
// terms h = l mod 16 in order, lanes past n untouched (as in the scalar loop).
template <int TX, int TW>
void dot16_block(const float* const* x, const float* w, std::size_t ldw, std::size_t n, float* out,
                 std::size_t ldo) {
  __m512 acc[TX][TW];
  for (int i = 0; i < TX; ++i)
    for (int e = 0; e < TW; ++e) acc[i][e] = _mm512_setzero_ps();
  std::size_t h = 0;
  for (; h + 16 <= n; h += 16) dot16_step<TX, TW, false>(acc, x, w, ldw, h, 0xffff);
  if (h < n)
    dot16_step<TX, TW, true>(acc, x, w, ldw, h, static_cast<__mmask16>((1u << (n - h)) - 1));
  for (int i = 0; i < TX; ++i)
    for (int e = 0; e < TW; ++e) out[i * ldo + e] = tree16(acc[i][e]);
}
}  // namespace

void dot16_avx512(const float* const* x, std::size_t nx, const float* w, std::size_t ldw,
                  std::size_t nw, std::size_t n, float* out, std::size_t ldo) {
  constexpr std::size_t kX = 4, kW = 4;
  std::size_t i = 0;
  for (; i + kX <= nx; i += kX) {
    std::size_t e = 0;
    for (; e + kW <= nw; e += kW)
      dot16_block<kX, kW>(x + i, w + e * ldw, ldw, n, out + i * ldo + e, ldo);
    for (; e < nw; ++e) dot16_block<kX, 1>(x + i, w + e * ldw, ldw, n, out + i * ldo + e, ldo);
  }
  for (; i < nx; ++i)
    for (std::size_t e = 0; e < nw; ++e)
      dot16_block<1, 1>(x + i, w + e * ldw, ldw, n, out + i * ldo + e, ldo);
}

void swiglu_backward_avx512(const float* g, const float* u, const float* dh, float w, bf16* dg,
                            bf16* du, std::size_t n) {
  std::size_t i = 0;
  const __m512 wv = _mm512_set1_ps(w), one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i), uv = _mm512_loadu_ps(u + i);
    const __m512 dhv = _mm512_mul_ps(wv, _mm512_loadu_ps(dh + i));
    const __m512 s = sigmoid_neg_exp(gv);
    const __m512 silu = _mm512_mul_ps(gv, s);
    const __m512 dsilu =
        _mm512_mul_ps(s, _mm512_add_ps(one, _mm512_mul_ps(gv, _mm512_sub_ps(one, s))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dg + i),
                        to_bf16(_mm512_mul_ps(_mm512_mul_ps(dhv, uv), dsilu)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(du + i), to_bf16(_mm512_mul_ps(dhv, silu)));
  }
  swiglu_backward_scalar(g + i, u + i, dh + i, w, dg + i, du + i, n - i);
}

void swiglu_avx512(const float* g, const float* u, bf16* h, std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i), uv = _mm512_loadu_ps(u + i);
    const __m512 s =
        _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(neg(gv))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i),
                        to_bf16(_mm512_mul_ps(_mm512_mul_ps(gv, s), uv)));
  }
  for (; i < n; ++i) h[i] = bf16(exp_poly::swiglu(g[i], u[i]));
}

}  // namespace moecert::gemm
