// Gradient sums over rows through the kernel's rank_sums: the weight
// gradients of the expert path and the router linear's.
#pragma once

#include <algorithm>
#include <cstddef>

#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {

// Sums over the rows q of [q0, q0 + m) in order, through the kernel's
// rank_sums: acc[k][j] (k < r, j < n1 - n0) = sum_q s[q][k] * v_q[n0 + j],
// v_q given as a pointer to the element at a column (row_at(q, col)).
// Rows in the kernel's `tiles` layout are contiguous only within 32
// columns (chunk = 32, column col sitting at col + shift of the row); plain
// rows throughout (chunk = 0).
//
// The rows go in blocks of kRows, all columns per block: the kernel walks
// the rows once per 32 columns, and over a block's rows those pieces stay
// in L1 and its pages in the TLB (all T rows at once, 4 KiB apart, missed
// the TLB on every row: the router-linear gradient at T = 4096 took 21x the
// time of T = 1024). acc holds the sums between blocks: fp32 stores and
// reloads, the same bits.
template <class RowAt>
void row_sums(const KernelInfo& kernel, std::size_t q0, std::size_t m, std::size_t r,
              const float* s, std::size_t lds, const float* vscale, bool v_bf16, RowAt row_at,
              std::size_t chunk, std::size_t shift, std::size_t n0, std::size_t n1, float* acc,
              std::size_t ldacc) {
  constexpr std::size_t kRows = 64;
  const void* ptr[kRows];
  for (std::size_t b0 = 0; b0 < m; b0 += kRows) {
    const std::size_t bm = std::min(kRows, m - b0);
    for (std::size_t j = n0; j < n1;) {
      const std::size_t len = chunk ? std::min(n1 - j, chunk - (j + shift) % chunk) : n1 - j;
      for (std::size_t q = 0; q < bm; ++q) ptr[q] = row_at(q0 + b0 + q, j);
      RankSumArgs a;
      a.m = bm, a.r = r, a.n = len, a.v = ptr, a.v_bf16 = v_bf16,
      a.vscale = vscale ? vscale + b0 : nullptr;
      a.s = s + b0 * lds, a.lds = lds, a.acc = acc + (j - n0), a.ldacc = ldacc;
      kernel.rank_sums(a);
      j += len;
    }
  }
}

}  // namespace moecert::gemm
