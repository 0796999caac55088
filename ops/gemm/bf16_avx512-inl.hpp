// Rounding of 16 fp32 lanes to bf16 as bf16::from_float does (to nearest
// even, with integer operations; NaN kept quiet), for the AVX-512 files
// only: include it first, in a file with their ISA flags (it silences, for
// the rest of that file, GCC 12's warnings on its own intrinsics).
#pragma once

#if defined(__GNUC__) && \
    !defined(__clang__)  // GCC 12 warns of the _mm*_undefined_* values in its own intrinsics
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

namespace moecert::gemm {
namespace {  // each including file's own copy, compiled with its flags

inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

}  // namespace
}  // namespace moecert::gemm
