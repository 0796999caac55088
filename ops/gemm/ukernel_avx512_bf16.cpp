// AVX-512 BF16 microkernel, 8 x 32 (16 zmm accumulators), and the same body
// for 1-7 rows (edge blocks: an expert's few routed rows).
//
// Per k pair kk: two zmm loads of B (two panels, 16 column pairs each), and
// for each row a 32-bit broadcast of A's pair (A[i][2kk], A[i][2kk+1]) and
// two VDPBF16PS. Accumulation order per element (docs/DESIGN.md, Kernels):
// acc = fma(a_odd, b_odd, acc), then acc = fma(a_even, b_even, acc), with
// denormal inputs and results flushed; one chain over k from 0 (or from C).
// Rows never meet, so a row's bits do not depend on how many rows the call
// has. Built with its own ISA flags (ops/gemm CMake); nothing else lives here.
#include <immintrin.h>

#include <array>
#include <utility>

#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {
namespace {

constexpr int kMr = 8;

template <int Rows>
inline void steps(__m512 (&acc)[Rows][2], const bf16* a, std::size_t lda, const bf16* b,
                  std::size_t panel_stride, std::size_t kp) {
  const bf16* b0 = b;
  const bf16* b1 = b + panel_stride;
  const std::size_t kpairs = kp / 2;
  for (std::size_t kk = 0; kk < kpairs; ++kk) {
    const __m512bh vb0 = (__m512bh)_mm512_loadu_si512(b0 + kk * 32);
    const __m512bh vb1 = (__m512bh)_mm512_loadu_si512(b1 + kk * 32);
    for (int i = 0; i < Rows; ++i) {
      int32_t pair;
      __builtin_memcpy(&pair, a + i * lda + 2 * kk, sizeof pair);
      const __m512bh va = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], va, vb0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], va, vb1);
    }
  }
}

template <int Rows, bool kAccumulate>
void run(const UkernelArgs& p) {
  __m512 acc[Rows][2];
  for (int i = 0; i < Rows; ++i)
    for (int h = 0; h < 2; ++h)
      acc[i][h] = kAccumulate ? _mm512_loadu_ps(p.c + i * p.ldc + h * 16) : _mm512_setzero_ps();
  steps<Rows>(acc, p.a, p.lda, p.b, p.panel_stride, p.kp);
  if (p.kp2) steps<Rows>(acc, p.a2, p.lda2, p.b2, p.panel_stride2, p.kp2);
  for (int i = 0; i < Rows; ++i)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(p.c + i * p.ldc + h * 16, acc[i][h]);
}

// run<rows, accumulate> for rows = 1..kMr, indexed [accumulate][rows - 1].
template <int... R>
constexpr auto by_rows(std::integer_sequence<int, R...>) {
  return std::array<std::array<UkernelFn, kMr>, 2>{{{run<R + 1, false>...}, {run<R + 1, true>...}}};
}
constexpr auto kRun = by_rows(std::make_integer_sequence<int, kMr>{});

}  // namespace

void ukernel_avx512_bf16_8x32(const UkernelArgs& p) { kRun[p.accumulate][kMr - 1](p); }

void ukernel_avx512_bf16_edge(const UkernelArgs& p) { kRun[p.accumulate][p.rows - 1](p); }

}  // namespace moecert::gemm
