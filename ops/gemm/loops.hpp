// The loops around the microkernels: packing of A rows and the blocked
// traversal of one C block. ISA-free: the kernel comes in as KernelInfo.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moecert/gemm.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {

/// lda of packed A of depth kp. rows: kp plus 64 bytes, so that rows are
/// never a multiple of 4 KiB apart (rows at a power-of-two stride share L1
/// sets); tiles: one 16-row block.
inline std::size_t a_stride(ALayout l, std::size_t kp) { return l == ALayout::rows ? kp + 32 : kTileRows * kp; }
/// Elements of packed A with m_padded rows (a multiple of the kernel's MR).
inline std::size_t a_size(ALayout l, std::size_t m_padded, std::size_t kp) {
  return l == ALayout::rows ? m_padded * a_stride(l, kp) : m_padded * kp;
}

/// Copies rows of A (row rows[i] of `a`, or row i when rows is null) into dst
/// in layout l, K zero-padded to kp and rows m..m_padded-1 zero.
void pack_a(ALayout l, MatView<const bf16> a, const std::int32_t* rows, std::size_t m, std::size_t m_padded,
            std::size_t kp, bf16* dst);

/// C[0:m, n_begin:n_end) = A W^T for A packed in the kernel's layout (lda
/// from a_stride, K padded to w.kp(), rows padded to the kernel's MR) and
/// packed W; columns at or past n_valid are not written. n_begin is a
/// multiple of the kernel's NR. Calls the kernel's thread hooks around the
/// work.
/// With `accumulate`, C += A W^T (the products added to C's values, as the
/// kernel adds every K block: the fp32 model of proofs/bounds.md §1 with
/// C's value as one more term).
void gemm_block(const KernelInfo& kernel, const bf16* a, std::size_t m, const PackedWeights& w,
                std::size_t n_begin, std::size_t n_end, std::size_t n_valid, float* c, std::size_t ldc,
                bool accumulate = false);

/// pack_a from fp32 rows, in the kernel's layout: dst row i =
/// bf16(scale * src[rows[i] or i][0:k]) (one fp32 multiplication, then round
/// to nearest even; the kernel's to_bf16), zero-padded.
void pack_a_f32(const KernelInfo& kernel, const float* src, std::size_t ld, const std::int32_t* rows, std::size_t m,
                std::size_t m_padded, std::size_t k, std::size_t kp, float scale, bf16* dst);

inline std::size_t round_up(std::size_t x, std::size_t m) { return (x + m - 1) / m * m; }

}  // namespace moecert::gemm
