// Scalar microkernel, 8 x 32, and the same body for 1-7 rows (edge
// blocks): the portable kernel every other one is compared with.
//
// C[i][j] (+)= sum_k A[i][k] W[j][k] over the packed layouts of ukernel.hpp.
// Accumulation order per element: one fp32 chain from 0 (or from C), in k
// order, each product (exact: bf16 x bf16) added with one rounding. No FMA
// (the project builds with -ffp-contract=off).
// Reads: A's rows [0, rows) at stride lda, elements [0, kp) of each (and
// of a2 to kp2); B's two panels of kp / 2 * 32 elements each (b2 likewise);
// C's rows [0, rows) x 32 only with accumulate.
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {
namespace {
constexpr std::size_t kMr = 8, kNr = 32;

// Row by row: each row's A pairs are read from that row alone and
// broadcast over its 32 columns. (A row loop inside the k loop let g++ 12
// -O3 vectorise across rows with loads of the row after the last one.)
void steps(float (&acc)[kMr][kNr], std::size_t rows, const bf16* a, std::size_t lda, const bf16* b,
           std::size_t panel_stride, std::size_t kp) {
  for (std::size_t i = 0; i < rows; ++i) {
    const bf16* ai = a + i * lda;
    float* ci = acc[i];
    for (std::size_t kk = 0; kk < kp / 2; ++kk) {
      const float a0 = ai[2 * kk].to_float(), a1 = ai[2 * kk + 1].to_float();
      for (std::size_t half = 0; half < kNr / kPanel; ++half) {
        const bf16* brow = b + half * panel_stride + kk * 2 * kPanel;
        for (std::size_t n = 0; n < kPanel; ++n) {
          float& c = ci[half * kPanel + n];
          c += a0 * brow[2 * n].to_float();
          c += a1 * brow[2 * n + 1].to_float();
        }
      }
    }
  }
}

void run(const UkernelArgs& p, std::size_t rows) {
  float acc[kMr][kNr];
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < kNr; ++j) acc[i][j] = p.accumulate ? p.c[i * p.ldc + j] : 0.0f;
  steps(acc, rows, p.a, p.lda, p.b, p.panel_stride, p.kp);
  if (p.kp2) steps(acc, rows, p.a2, p.lda2, p.b2, p.panel_stride2, p.kp2);
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < kNr; ++j) p.c[i * p.ldc + j] = acc[i][j];
}
}  // namespace

void ukernel_scalar_8x32(const UkernelArgs& p) { run(p, kMr); }

void ukernel_scalar_edge(const UkernelArgs& p) { run(p, p.rows); }

}  // namespace moecert::gemm
