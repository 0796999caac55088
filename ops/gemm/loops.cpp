// Loops around the microkernel (BLIS shape): K blocks, MC-row blocks,
// NR-wide column blocks, MR-tall row blocks, one microkernel call each.
// Each element of C is written by exactly one call, and its accumulation
// order is the kernel's alone: results do not depend on the partition.
#include "ops/gemm/loops.hpp"

#include <algorithm>
#include <cstring>
#include <memory>

#include "ops/core/aligned.hpp"
#include "ops/core/prefetch.hpp"

namespace moecert::gemm {

void pack_a(ALayout l, MatView<const bf16> a, const std::int32_t* rows, std::size_t m,
            std::size_t m_padded, std::size_t kp, bf16* dst) {
  const std::size_t lda = a_stride(l, kp);
  const bf16 zero{};
  for (std::size_t i = 0; i < m_padded; ++i) {
    const bf16* src = i < m ? a.row(rows ? static_cast<std::size_t>(rows[i]) : i) : nullptr;
    const std::size_t valid = src ? a.cols : 0;
    if (rows && i + 1 < m)
      detail::prefetch_lines(a.row(static_cast<std::size_t>(rows[i + 1])), a.cols * sizeof(bf16));
    if (l == ALayout::rows) {  // one contiguous row
      bf16* d = dst + i * lda;
      if (valid) std::memcpy(static_cast<void*>(d), src, valid * sizeof(bf16));
      std::fill(d + valid, d + kp, zero);
    } else if (valid == kp) {  // the row's 32-element pieces, one per tile; a fixed-size copy each
      for (std::size_t k0 = 0; k0 < kp; k0 += kKStep)
        std::memcpy(static_cast<void*>(dst + a_offset(l, lda, i, k0)), src + k0,
                    kKStep * sizeof(bf16));
    } else {  // the same with K padding
      for (std::size_t k0 = 0; k0 < kp; k0 += kKStep) {
        bf16* d = dst + a_offset(l, lda, i, k0);
        const std::size_t n = k0 < valid ? std::min(kKStep, valid - k0) : 0;
        if (n) std::memcpy(static_cast<void*>(d), src + k0, n * sizeof(bf16));
        std::fill(d + n, d + kKStep, zero);
      }
    }
  }
}

void pack_a_f32(const KernelInfo& kernel, const float* src, std::size_t ld,
                const std::int32_t* rows, std::size_t m, std::size_t m_padded, std::size_t k,
                std::size_t kp, float scale, bf16* dst) {
  const ALayout l = kernel.a_layout;
  const std::size_t lda = a_stride(l, kp), piece = l == ALayout::rows ? kp : kKStep;
  const bf16 zero{};
  for (std::size_t i = 0; i < m_padded; ++i) {
    const float* s = i < m ? src + (rows ? static_cast<std::size_t>(rows[i]) : i) * ld : nullptr;
    if (rows && i + 1 < m)
      detail::prefetch_lines(src + static_cast<std::size_t>(rows[i + 1]) * ld, k * sizeof(float));
    for (std::size_t k0 = 0; k0 < kp; k0 += piece) {  // contiguous pieces of the packed row
      bf16* d = dst + a_offset(l, lda, i, k0);
      const std::size_t n = s && k0 < k ? std::min(piece, k - k0) : 0;
      if (n) kernel.to_bf16(s + k0, scale, d, n);
      std::fill(d + n, d + piece, zero);
    }
  }
}

namespace {

// B's panels from panel p0 on, as the kernels read them: a bf16 pack's own,
// or a quantized pack's decoded into this thread's buffer (panels [p0, p1)).
struct Panels {
  const bf16* data;
  std::size_t p0;
};

Panels panels(const KernelInfo& kernel, const PackedWeights& w, std::size_t p0, std::size_t p1) {
  if (!w.quantized()) return {w.data(), 0};
  thread_local std::unique_ptr<bf16[], detail::AlignedFree> buffer;
  thread_local std::size_t capacity = 0;
  const std::size_t need = (p1 - p0) * w.kp() * kPanel;
  if (need > capacity) {
    buffer.reset(static_cast<bf16*>(detail::allocate(need * sizeof(bf16))));
    capacity = need;
  }
  w.decode_panels(p0, p1, buffer.get(), kernel.decode);
  return {buffer.get(), p0};
}

// Loop 3's kernel arguments for the column block at n0 of the K block
// [k0, k0 + kc): B's sub-panel and, in the last K block, the second
// product's panel (whole K) as well.
UkernelArgs column_block_args(const KernelInfo& kernel, const PackedWeights& w, Panels b,
                              const BlockOptions& opt, std::size_t n0, std::size_t k0,
                              std::size_t kc, bool last) {
  const std::size_t kp = w.kp();
  UkernelArgs args{};
  args.lda = a_stride(kernel.a_layout, kp);
  args.b = b.data + (n0 / kPanel - b.p0) * kp * kPanel + k0 * kPanel;
  args.panel_stride = kp * kPanel;
  args.kp = kc;
  args.accumulate = opt.accumulate || k0 > 0;
  if (opt.w2 && last) {  // the second product, in the same kernel call
    const std::size_t kp2 = opt.w2->kp();
    args.lda2 = a_stride(kernel.a_layout, kp2);
    args.b2 = opt.w2->data() + (n0 / kPanel) * kp2 * kPanel;
    args.panel_stride2 = kp2 * kPanel;
    args.kp2 = kp2;
  }
  return args;
}

// An mm x nn block smaller than MR x NR: computed in the scratch block
// `edge` (MR x NR, row stride NR), C's valid part copied in (when
// accumulating; the rest zero, since a kernel may read all of it) and out.
// Fewer rows than MR run the kernel's edge variant, if it has one.
void edge_block(const KernelInfo& kernel, UkernelArgs& args, float* cblk, std::size_t ldc,
                std::size_t mm, std::size_t nn, float* edge) {
  const std::size_t mr = kernel.mr, nr = kernel.nr;
  float* blk = edge + 0;
  if (args.accumulate) {
    for (std::size_t i = 0; i < mm; ++i) {
      std::memcpy(blk + i * nr, cblk + i * ldc, nn * sizeof(float));
      std::fill(blk + i * nr + nn, blk + (i + 1) * nr, 0.0f);
    }
    std::fill(blk + mm * nr, blk + mr * nr, 0.0f);
  }
  args.c = blk;
  args.ldc = nr;
  const bool short_block = mm < mr && kernel.ukernel_edge;
  args.rows = mm;
  (short_block ? kernel.ukernel_edge : kernel.ukernel)(args);
  for (std::size_t i = 0; i < mm; ++i)
    std::memcpy(cblk + i * ldc, blk + i * nr, nn * sizeof(float));
}

}  // namespace

void gemm_block(const KernelInfo& kernel, const bf16* a, std::size_t m, const PackedWeights& w,
                std::size_t n_begin, std::size_t n_end, std::size_t n_valid, float* c,
                std::size_t ldc, const BlockOptions& opt) {
  const std::size_t mr = kernel.mr, nr = kernel.nr, kp = w.kp(),
                    lda = a_stride(kernel.a_layout, kp);
  alignas(64) float edge[32 * 32];  // MR x NR scratch for partial blocks (MR, NR <= 32)
  kernel.thread_begin();
  // Assumptions: a holds round_up(m, mr) rows of kp elements in the kernel's
  // layout; w has np >=
  // n_end columns; n_begin % nr == 0; n_begin >= opt.c_col0; kernel.kc %
  // kKStep == 0.
  // Loop 1: K in blocks of the kernel's kc (all of K when 0), so that the A
  // rows of the item stay in L2 and a B sub-panel (kc x NR) in L1. C is
  // accumulated across K blocks in fp32: an exact store and reload, so the
  // accumulation order and every bit of the result are unchanged. The
  // second product and the epilogue follow each block's last K block.
  // A block's epilogue runs, where the kernel hides side work under its
  // tile products, one row per k step during the next kernel call (the
  // last block's after the loops); elsewhere right after the block's call.
  // It reads only that block of C, final by then. block_done follows on the
  // whole block once its rows' epilogues ran.
  struct Pending {
    const BlockOptions* opt;
    std::size_t m0, rows, n0, n1;
  } pending{&opt, 0, 0, 0, 0}, in_call{};
  auto epilogue_row = [](const void* ctx, std::size_t i) {
    const auto* b = static_cast<const Pending*>(ctx);
    if (b->opt->epilogue) b->opt->epilogue(b->m0 + i, b->m0 + i + 1, b->n0, b->n1);
  };
  auto finish = [&opt](const Pending& b) {
    if (b.rows && opt.block_done) opt.block_done(b.m0, b.m0 + b.rows, b.n0, b.n1);
  };
  const bool after = opt.epilogue || opt.block_done;  // anything to run on a finished block
  // Rows outside the column blocks only where the item's B stays in L2.
  const bool rows_outside = kernel.mc && (n_end - n_begin) * kp * sizeof(bf16) <= kItemBBytes;
  const std::size_t kc_step = kernel.kc ? kernel.kc : kp, mc = rows_outside ? kernel.mc : m;
  // The panels the column blocks read (a quantized pack's decoded once here).
  const std::size_t p0 = n_begin / kPanel;
  const Panels b =
      panels(kernel, w, p0,
             std::max(p0, std::min(w.np(), round_up(std::min(n_end, n_valid), nr)) / kPanel));
  for (std::size_t k0 = 0; k0 < kp; k0 += kc_step) {
    const std::size_t kc = std::min(kc_step, kp - k0);
    const bool last = k0 + kc == kp;
    // Loop 2: blocks of the kernel's mc rows (all rows when 0 or when the
    // item's B would not stay in L2), each taken past every column block
    // before the next.
    for (std::size_t mc0 = 0; mc0 < m; mc0 += mc) {
      // Loop 3: NR-wide column blocks (panel pairs).
      for (std::size_t n0 = n_begin; n0 < n_end; n0 += nr) {
        const std::size_t nn = std::min(nr, std::min(n_end, n_valid) - std::min(n0, n_valid));
        if (nn == 0) break;
        UkernelArgs args = column_block_args(kernel, w, b, opt, n0, k0, kc, last);
        // Loop 4: MR-tall row blocks, one microkernel call each.
        for (std::size_t m0 = mc0; m0 < std::min(m, mc0 + mc); m0 += mr) {
          const std::size_t mm = std::min(mr, m - m0);
          args.a = a + a_offset(kernel.a_layout, lda, m0, k0);
          in_call = pending;  // the previous block's epilogue, if any, in this call
          pending.rows = 0;
          args.side = in_call.rows ? +epilogue_row : nullptr;
          args.side_ctx = &in_call;
          args.side_n = in_call.rows;
          if (args.kp2) args.a2 = opt.a2 + a_offset(kernel.a_layout, args.lda2, m0, 0);
          float* const cblk = c + (m0 * ldc + (n0 - opt.c_col0));  // C's element (m0, n0)
          if (mm == mr && nn == nr) {                              // full block: straight into C
            args.c = cblk;
            args.ldc = ldc;
            kernel.ukernel(args);
          } else {
            edge_block(kernel, args, cblk, ldc, mm, nn, edge);
          }
          finish(in_call);  // its rows' epilogues ran in this call
          if (after && last) {
            if (kernel.side_steps) {
              pending = {&opt, m0, mm, n0, n0 + nn};
            } else {
              if (opt.epilogue) opt.epilogue(m0, m0 + mm, n0, n0 + nn);
              finish({&opt, m0, mm, n0, n0 + nn});
            }
          }
        }
      }
    }
  }
  if (pending.rows && opt.epilogue)
    opt.epilogue(pending.m0, pending.m0 + pending.rows, pending.n0, pending.n1);
  finish(pending);
  kernel.thread_end();
}

}  // namespace moecert::gemm
