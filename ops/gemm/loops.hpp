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
inline std::size_t a_stride(ALayout l, std::size_t kp) {
  return l == ALayout::rows ? kp + 32 : kTileRows * kp;
}
/// Elements of packed A with m_padded rows (a multiple of the kernel's MR).
inline std::size_t a_size(ALayout l, std::size_t m_padded, std::size_t kp) {
  return l == ALayout::rows ? m_padded * a_stride(l, kp) : m_padded * kp;
}

/// Bytes of packed B (kp x columns of bf16) up to which a work item's B
/// stays in L2 while the loops take its row blocks one by one past all of
/// its columns (KernelInfo::mc): half the AMX machine's 2 MiB per core.
inline constexpr std::size_t kItemBBytes = std::size_t{1} << 20;
/// Columns per GEMM work item over depth kp: 128 where the item's B then
/// fits kItemBBytes (K up to 4096), else 256 (B stays in L3 either way, and
/// wider items read A less often). On AMX hardware, rows outside, 128
/// columns are faster than 256 for the dx GEMM (K = 2I, 1.4 MiB of B at
/// 256), the down and dh GEMMs, and for gate/up at T = 1024 (twice the items
/// for 16 threads); even for gate/up at T = 4096.
inline std::size_t item_cols(std::size_t kp) {
  return 128 * kp * sizeof(bf16) <= kItemBBytes ? 128 : 256;
}

/// Copies rows of A (row rows[i] of `a`, or row i when rows is null) into dst
/// in layout l, K zero-padded to kp and rows m..m_padded-1 zero.
void pack_a(ALayout l, MatView<const bf16> a, const std::int32_t* rows, std::size_t m,
            std::size_t m_padded, std::size_t kp, bf16* dst);

/// A non-owning reference to a callable (the callable outlives the call).
template <class Sig>
class FunctionRef;
template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  FunctionRef() = default;
  template <class F>
  FunctionRef(const F& f)  // NOLINT: implicit, like a reference
      : obj_(&f),
        call_([](const void* o, Args... a) -> R { return (*static_cast<const F*>(o))(a...); }) {}
  explicit operator bool() const { return call_ != nullptr; }
  R operator()(Args... a) const { return call_(obj_, a...); }

 private:
  const void* obj_ = nullptr;
  R (*call_)(const void*, Args...) = nullptr;
};

/// What gemm_block does besides C = A W^T; the defaults do nothing more.
struct BlockOptions {
  /// C += A W^T: the products added to C's values, as the kernel adds every
  /// K block (the fp32 model of proofs/bounds.md §1 with C's value as one
  /// more term).
  bool accumulate = false;
  /// The column of W that C's first element holds: C element (i, j) is at
  /// c[i * ldc + j - c_col0] (a C buffer of one item's columns, c_col0 =
  /// n_begin). The epilogue still sees W's column numbers.
  std::size_t c_col0 = 0;
  /// A second product added to each C block in the same microkernel call,
  /// before C is stored: C += A2 W2^T, A2 packed like A (same rows, its own
  /// depth w2->kp()), W2 with at least n_end columns. Every bit as a second
  /// gemm_block call with `accumulate` (the LoRA products).
  const bf16* a2 = nullptr;
  const PackedWeights* w2 = nullptr;
  /// Called on each finished block of C (after both products), for all its
  /// rows at once or row by row (each row once; kernels with side_steps run
  /// it under the next block's products): rows [i0, i1) of this call's A,
  /// columns [j0, j1) with j0 a multiple of the kernel's NR and j1 <= n_valid
  /// (the SwiGLU epilogue). It may read only that block of C.
  FunctionRef<void(std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1)> epilogue{};
  /// Called once on each finished block with all its rows, after
  /// `epilogue` ran on them (with side_steps, after the kernel call that ran
  /// them): the same arguments and the same block of C, e.g. the audit
  /// probe's sums, whose cost per call a row-by-row epilogue would pay per
  /// row.
  FunctionRef<void(std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1)> block_done{};
};

/// C[0:m, n_begin:n_end) = A W^T for A packed in the kernel's layout (lda
/// from a_stride, K padded to w.kp(), rows padded to the kernel's MR) and
/// packed W; columns at or past n_valid are not written. n_begin is a
/// multiple of the kernel's NR. Calls the kernel's thread hooks around the
/// work.
void gemm_block(const KernelInfo& kernel, const bf16* a, std::size_t m, const PackedWeights& w,
                std::size_t n_begin, std::size_t n_end, std::size_t n_valid, float* c,
                std::size_t ldc, const BlockOptions& opt = {});

/// pack_a from fp32 rows, in the kernel's layout: dst row i =
/// bf16(scale * src[rows[i] or i][0:k]) (one fp32 multiplication, then round
/// to nearest even; the kernel's to_bf16), zero-padded.
void pack_a_f32(const KernelInfo& kernel, const float* src, std::size_t ld,
                const std::int32_t* rows, std::size_t m, std::size_t m_padded, std::size_t k,
                std::size_t kp, float scale, bf16* dst);

inline std::size_t round_up(std::size_t x, std::size_t m) { return (x + m - 1) / m * m; }

}  // namespace moecert::gemm
