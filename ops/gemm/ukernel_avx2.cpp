// AVX2 microkernel, 4 x 32, and the same body for 1-3 rows (edge blocks):
// the scalar kernel's arithmetic eight columns at a time, so its results
// equal scalar's bit for bit (gemm_test).
//
// Per element, as ukernel_scalar.cpp: one fp32 chain from 0 (or from C), in k
// order, c = c + a_even * b_even, then c = c + a_odd * b_odd, each product
// (exact: bf16 x bf16) and each addition one rounding: VMULPS then VADDPS,
// never an FMA. bf16 becomes fp32 by a shift (even, the pair's low half) or
// a mask (odd, the high half). The two 16-column panels are done one after
// the other, each with 4 rows x 2 ymm accumulators, the four converted B
// vectors of a k pair and the broadcast A pair in registers. Built with
// -mavx2 alone (ops/gemm CMake).
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <utility>

#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {
namespace {

constexpr int kMr = 4;

// acc[i][0..1] (+)= rows i < Rows of A times one panel's 16 columns, k pairs
// [0, kp / 2).
template <int Rows>
inline void panel_steps(__m256 (&acc)[Rows][2], const bf16* a, std::size_t lda, const bf16* b,
                        std::size_t kp) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (std::size_t kk = 0; kk < kp / 2; ++kk) {
    const __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kk * 32));
    const __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kk * 32 + 16));
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw0, 16));
    const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(raw0, high));
    const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(raw1, 16));
    const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(raw1, high));
    for (int i = 0; i < Rows; ++i) {
      std::uint32_t pair;
      __builtin_memcpy(&pair, a + i * lda + 2 * kk, sizeof pair);
      const __m256 ae = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(pair << 16)));
      const __m256 ao =
          _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(pair & 0xffff0000u)));
      acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_mul_ps(ae, even0));
      acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_mul_ps(ao, odd0));
      acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_mul_ps(ae, even1));
      acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_mul_ps(ao, odd1));
    }
  }
}

template <int Rows, bool kAccumulate>
void run(const UkernelArgs& p) {
  for (std::size_t half = 0; half < 2; ++half) {
    __m256 acc[Rows][2];
    for (int i = 0; i < Rows; ++i)
      for (int h = 0; h < 2; ++h)
        acc[i][h] = kAccumulate ? _mm256_loadu_ps(p.c + i * p.ldc + half * 16 + h * 8)
                                : _mm256_setzero_ps();
    panel_steps<Rows>(acc, p.a, p.lda, p.b + half * p.panel_stride, p.kp);
    if (p.kp2) panel_steps<Rows>(acc, p.a2, p.lda2, p.b2 + half * p.panel_stride2, p.kp2);
    for (int i = 0; i < Rows; ++i)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(p.c + i * p.ldc + half * 16 + h * 8, acc[i][h]);
  }
}

// run<rows, accumulate> for rows = 1..kMr, indexed [accumulate][rows - 1].
template <int... R>
constexpr auto by_rows(std::integer_sequence<int, R...>) {
  return std::array<std::array<UkernelFn, kMr>, 2>{{{run<R + 1, false>...}, {run<R + 1, true>...}}};
}
constexpr auto kRun = by_rows(std::make_integer_sequence<int, kMr>{});

}  // namespace

void ukernel_avx2_4x32(const UkernelArgs& p) { kRun[p.accumulate][kMr - 1](p); }

void ukernel_avx2_edge(const UkernelArgs& p) { kRun[p.accumulate][p.rows - 1](p); }

}  // namespace moecert::gemm
