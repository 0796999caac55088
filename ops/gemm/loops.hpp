// The loops around the microkernels: packing of A rows and the blocked
// traversal of one C block. ISA-free: the kernel comes in as KernelInfo.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moecert/gemm.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {

/// Row stride for packed A of depth kp: kp plus 64 bytes, so that rows are
/// never a multiple of 4 KiB apart (16 tile rows at a power-of-two stride
/// land in one L1 set).
inline std::size_t a_stride(std::size_t kp) { return kp + 32; }

/// Copies rows of A (row rows[i] of `a`, or row i when rows is null) into
/// dst [m_padded x lda], K zero-padded to kp and rows m..m_padded-1 zero
/// (up to kp; the stride padding beyond kp is never read).
void pack_a(MatView<const bf16> a, const std::int32_t* rows, std::size_t m, std::size_t m_padded,
            std::size_t kp, std::size_t lda, bf16* dst);

/// C[0:m, n_begin:n_end) = A W^T for packed A (row stride lda, K padded to
/// w.kp(), rows padded to the kernel's MR) and packed W; columns at or past
/// n_valid are not written. n_begin is a multiple of the kernel's NR. Calls
/// the kernel's thread hooks around the work.
void gemm_block(const KernelInfo& kernel, const bf16* a, std::size_t lda, std::size_t m, const PackedWeights& w,
                std::size_t n_begin, std::size_t n_end, std::size_t n_valid, float* c, std::size_t ldc);

inline std::size_t round_up(std::size_t x, std::size_t m) { return (x + m - 1) / m * m; }

}  // namespace moecert::gemm
