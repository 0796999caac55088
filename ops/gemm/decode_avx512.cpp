// Quantized weight panels decoded into bf16, AVX-512, bit-identical to
// decode_scalar.cpp: a k pair of a panel (16 columns x 2 depths, 32 codes,
// one 64-byte line of bf16) per step, as two halves of 16 lanes (columns
// 0-7, then 8-15, each column's two depths side by side): codes widened to
// fp32 (int8 and int4 exactly, e4m3 from its fields), multiplied by their
// scales in fp32, rounded to bf16 to nearest even by VCVTNE2PS2BF16 where
// every product is zero or normal (throughout, for a pack whose scales
// ensure it: DecodeArgs::normal; else checked step by step), else (a
// denormal or NaN product, which that instruction would flush or quiet
// otherwise) with integer operations as bf16::from_float. One loop per
// format and rounding path. Own ISA flags.
#include "ops/gemm/bf16_avx512-inl.hpp"  // first: its pragmas precede <immintrin.h>
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {
namespace {

constexpr std::size_t kPrefetch = 2048, kPrefetchL2 = 8192;  // in bytes of codes

// 32 bf16 of the products lo (lanes 0-15) and hi (16-31).
inline __m512i round_pair(__m512 lo, __m512 hi) {
  // Zero or normal products round in one instruction; others (rare) as
  // bf16::from_float does.
  const __m512 tiny = _mm512_set1_ps(0x1p-126f);
  const __mmask16 odd_lo = _mm512_cmp_ps_mask(_mm512_abs_ps(lo), tiny, _CMP_NGE_UQ) &
                           _mm512_cmp_ps_mask(lo, _mm512_setzero_ps(), _CMP_NEQ_UQ);
  const __mmask16 odd_hi = _mm512_cmp_ps_mask(_mm512_abs_ps(hi), tiny, _CMP_NGE_UQ) &
                           _mm512_cmp_ps_mask(hi, _mm512_setzero_ps(), _CMP_NEQ_UQ);
  if (!(odd_lo | odd_hi)) return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  return _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(lo)), to_bf16(hi), 1);
}

// 16 e4m3 codes (bytes) as fp32: sign, then (e > 0) 2^(e - 7) (1 + m / 8)
// from the fields' bits, (e = 0, rare) m 2^-9.
inline __m512 e4m3(__m128i bytes) {
  const __m512i u = _mm512_cvtepu8_epi32(bytes);
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7f));
  __m512i v = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  if (is_sub) {
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
    v = _mm512_mask_blend_epi32(is_sub, v, _mm512_castps_si512(sub));
  }
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(v, sign));
}

// The 32 codes of one k pair as two halves of 16 fp32 values.
template <WeightFormat F>
inline void codes_f32(const std::uint8_t* c, __m512& lo, __m512& hi) {
  __m128i b0, b1;
  if constexpr (F == WeightFormat::int4_group) {  // 16 bytes, element 2j low, 2j + 1 high
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    const __m128i low = _mm_and_si128(b, _mm_set1_epi8(15));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    const __m128i eight = _mm_set1_epi8(8);  // 4-bit two's complement: (x ^ 8) - 8
    b0 = _mm_sub_epi8(_mm_xor_si128(_mm_unpacklo_epi8(low, high), eight), eight);
    b1 = _mm_sub_epi8(_mm_xor_si128(_mm_unpackhi_epi8(low, high), eight), eight);
  } else {
    b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16));
  }
  if constexpr (F == WeightFormat::fp8_e4m3_block128) {
    lo = e4m3(b0), hi = e4m3(b1);
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b0));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b1));
  }
}

// One panel p: its kp / 2 k pairs. Normal: every nonzero product is normal
// (DecodeArgs::normal), rounded in one instruction.
template <WeightFormat F, bool Normal>
void decode_panel(const DecodeArgs& a, std::size_t p) {
  constexpr bool nibbles = F == WeightFormat::int4_group;
  // Lane q of a half holds column q / 2 of the half's 8: the 16 column
  // scales spread over the two halves.
  const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
  const std::size_t e0 = p * a.kp * kPanel, n0 = p * kPanel;
  bf16* d = a.dst + (p - a.p0) * a.kp * kPanel;
  __m512 s_lo = _mm512_setzero_ps(), s_hi = s_lo;
  const std::size_t col = n0 / a.sblock;  // transposed: the panel's scale column
  std::size_t next = 0;                   // not transposed: where the next k block starts
  for (std::size_t kk = 0; kk < a.kp / 2; ++kk) {
    const std::size_t k = 2 * kk;
    if (a.transposed) {  // one scale per depth: k's in even lanes, k + 1's in odd ones
      s_lo = _mm512_mask_blend_ps(0xaaaa, _mm512_set1_ps(a.scales[a.srow[k] * a.sstride + col]),
                                  _mm512_set1_ps(a.scales[a.srow[k + 1] * a.sstride + col]));
      s_hi = s_lo;
    } else if (k == next) {  // the 16 columns' scales of this k block
      const std::size_t block = k / a.sblock;
      next = a.sblock > a.kp - k ? a.kp : k + a.sblock;
      alignas(64) float s[16];
      for (std::size_t i = 0; i < kPanel; ++i) s[i] = a.scales[a.srow[n0 + i] * a.sstride + block];
      const __m512 sv = _mm512_load_ps(s);
      s_lo = _mm512_permutexvar_ps(lo_cols, sv), s_hi = _mm512_permutexvar_ps(hi_cols, sv);
    }
    __m512 lo, hi;
    const std::uint8_t* c = a.codes + (nibbles ? (e0 + 32 * kk) / 2 : e0 + 32 * kk);
    // The codes stream from memory once: ask for them ahead (the hardware
    // prefetcher alone left one core at a third of its bandwidth on the AMX
    // machine).
    _mm_prefetch(reinterpret_cast<const char*>(c) + kPrefetch, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c) + kPrefetchL2, _MM_HINT_T1);
    codes_f32<F>(c, lo, hi);
    lo = _mm512_mul_ps(lo, s_lo), hi = _mm512_mul_ps(hi, s_hi);
    const __m512i out = Normal ? (__m512i)_mm512_cvtne2ps_pbh(hi, lo) : round_pair(lo, hi);
    _mm512_storeu_si512(d + 32 * kk, out);
  }
}

// Every panel of format F, on the rounding path the pack allows.
template <WeightFormat F>
void decode_panels(const DecodeArgs& a) {
  for (std::size_t p = a.p0; p < a.p1; ++p)
    a.normal ? decode_panel<F, true>(a, p) : decode_panel<F, false>(a, p);
}

}  // namespace

void decode_avx512(const DecodeArgs& a) {
  switch (a.format) {
    case WeightFormat::int8_channel:
      return decode_panels<WeightFormat::int8_channel>(a);
    case WeightFormat::int4_group:
      return decode_panels<WeightFormat::int4_group>(a);
    default:
      return decode_panels<WeightFormat::fp8_e4m3_block128>(a);
  }
}

}  // namespace moecert::gemm
