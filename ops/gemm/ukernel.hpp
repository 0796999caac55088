// The one microkernel signature, and what each kernel declares about itself.
//
// Packed layouts (ops/gemm/pack.cpp):
//  - B (weights W [N x K], C = A W^T) in panels of 16 columns. Panel p holds,
//    for each k pair kk = 0..kp/2-1, the 16 pairs (W[16p+n][2kk], W[16p+n][2kk+1])
//    for n = 0..15: 64 bytes per kk, kp/2 * 64 bytes per panel (VNNI; one AMX
//    B tile per 32 k; one zmm per kk). N is padded to 16 and K to 32 with zeros.
//  - A [M x K], K zero-padded to kp, rows padded with zeros to the kernel's
//    MR, in the kernel's ALayout: `rows` (row-major, row stride lda >= kp) or
//    `tiles` (AMX: each 16-row x 32-k tile contiguous, 1 KiB, k steps in
//    order within a 16-row block, lda = elements per 16-row block = 16 kp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "moecert/gemm.hpp"
#include "moecert/types.hpp"

namespace moecert::gemm {

inline constexpr std::size_t kPanel = PackedWeights::kPanel;  // columns per packed B panel
inline constexpr std::size_t kKStep = 32;                     // K padding (one AMX tile of bf16)
inline constexpr std::size_t kTileRows = 16;

enum class ALayout : std::uint8_t { rows, tiles };

/// Offset of A element (r, k) in a packed A of the given layout and lda.
constexpr std::size_t a_offset(ALayout l, std::size_t lda, std::size_t r, std::size_t k) {
  return l == ALayout::rows ? r * lda + k
                            : (r / kTileRows) * lda + (k / kKStep) * (kTileRows * kKStep) +
                                  (r % kTileRows) * kKStep + k % kKStep;
}

// What a kernel reads: A's rows of the block (MR, or the edge kernel's own
// count: UkernelArgs::rows for scalar, AVX2 and AVX-512, 16 or 32 for AMX) from
// `a`, elements [0, kp) of each in its layout, and no other row; the two
// panels' kp / 2 * 32 elements each from `b`; a2 and b2 likewise to kp2; C's
// MR x NR block at ldc only with `accumulate`. So every buffer a caller of
// the loops hands over must hold A's rows padded to MR (loops.hpp a_size),
// W's columns padded to 32 (PackedWeights), and a full C block wherever a
// block is full (gemm_block passes edge blocks through a scratch block, zero
// past C's valid part). Prefetches may name addresses past these; they never
// fault. Guard-page tests hold every kernel to this (gemm_test, [memory]).
struct UkernelArgs {
  const bf16* a;             // MR rows from column k0, in the kernel's ALayout
  std::size_t lda;           // rows: row stride; tiles: 16-row block stride (elements)
  const bf16* b;             // NR / 16 consecutive panels
  std::size_t panel_stride;  // elements from one panel to the next (= kp * 16)
  std::size_t kp;            // K, padded to kKStep
  float* c;                  // MR x NR, stride ldc elements
  std::size_t ldc;
  bool accumulate;  // false: C is written without being read (it may hold NaN)
  // KernelInfo::ukernel_edge only: the rows of the block wanted, 1..MR-1.
  std::size_t rows = 0;
  // An optional second product into the same C (kp2 > 0): after the K steps
  // of (a, b), those of (a2, b2), before C is stored. Every bit as a second
  // call with accumulate, since C's store and reload between them are exact
  // (the LoRA products, without the round trip of C through memory).
  const bf16* a2 = nullptr;  // like a: the same MR rows, depth kp2
  std::size_t lda2 = 0;
  const bf16* b2 = nullptr;  // like b
  std::size_t panel_stride2 = 0;
  std::size_t kp2 = 0;
  // Optional work hidden under the tile products (KernelInfo::side_steps):
  // side(side_ctx, i) for i = 0..side_n-1, in order, call i after the i-th
  // k step of the first product and the rest after C is stored. The work
  // must not touch this call's operands or C (gemm_block: the previous
  // block's epilogue, one row per call).
  void (*side)(const void* ctx, std::size_t i) = nullptr;
  const void* side_ctx = nullptr;
  std::size_t side_n = 0;
};

using UkernelFn = void (*)(const UkernelArgs&);

/// h[i] = bf16(silu(g[i]) * u[i]) for i < n (proofs/bounds.md §5): the
/// expert forward's epilogue. Every implementation is bit-identical
/// (exp_poly.hpp), so the choice never changes a result.
using SwigluFn = void (*)(const float* g, const float* u, bf16* h, std::size_t n);

/// The SwiGLU backward of n elements (exp_poly::swiglu_backward, then bf16):
/// dg[i], du[i] from gate g[i], up u[i], dh[i] and the row's routing weight
/// w. Bit-identical across implementations, like SwigluFn.
using SwigluBackwardFn = void (*)(const float* g, const float* u, const float* dh, float w,
                                  bf16* dg, bf16* du, std::size_t n);

/// Sums over rows of rank-r outer products, the shape of every LoRA and
/// router-linear weight gradient: for q = 0..m-1 in order, k < r, j < n,
///   acc[k * ldacc + j] = acc[k * ldacc + j] + s[q * lds + k] * v_q[j],
/// v_q[j] = vscale[q] * v[q][j] (or v[q][j] when vscale is null), each
/// multiplication and addition one fp32 rounding. v[q] points at n
/// contiguous elements of type bf16 or float. Every element's order is
/// fixed, so implementations agree bit for bit.
struct RankSumArgs {
  std::size_t m = 0, r = 0, n = 0;
  const void* const* v = nullptr;  // m row pointers
  bool v_bf16 = false;
  const float* vscale = nullptr;  // m factors, or null
  const float* s = nullptr;
  std::size_t lds = 0;
  float* acc = nullptr;
  std::size_t ldacc = 0;
};
using RankSumFn = void (*)(const RankSumArgs&);

/// dst[i] = bf16(scale * src[i]) for i < n: fp32 rows rounded into a GEMM's
/// A operand. Bit-identical across implementations.
using ScaleToBf16Fn = void (*)(const float* src, float scale, bf16* dst, std::size_t n);

/// Dot products of nx rows x_i with nw rows w_e = w + e * ldw, n long:
/// out[i * ldo + e] = sum_h x_i[h] w_e[h] in fp32 as 16 partial sums (lane
/// h mod 16, h in order; a multiplication, then an addition), then the
/// fixed tree 8, 4, 2, 1 (the router linear; proofs/bounds.md §1). Every
/// product on its own: bit-identical across implementations and block
/// shapes (the AVX-512 one keeps 4 x 4 of them in registers).
using Dot16Fn = void (*)(const float* const* x, std::size_t nx, const float* w, std::size_t ldw,
                         std::size_t nw, std::size_t n, float* out, std::size_t ldo);

/// Panels [p0, p1) of a quantized pack decoded into bf16 panels at dst
/// ((p1 - p0) kp 16 elements): element q of panel p is the pack's element
/// p kp 16 + q, bf16(fp32(code value * scale)) (formats.hpp), its scale
/// table[srow[n] sstride + k / sblock] (transposed: table[srow[k] sstride +
/// n / sblock]) for its packed column n and depth k. Bit-identical across
/// implementations.
struct DecodeArgs {
  WeightFormat format;
  const std::uint8_t* codes;  // the pack's, from panel 0
  std::size_t kp, p0, p1;
  const float* scales;
  std::size_t sstride, sblock;  // sblock >= 16, a multiple of 32 or all of the dimension
  const std::uint32_t* srow;
  bool transposed;
  bf16* dst;
  bool normal;  // every nonzero product code * scale is normal (scales finite and at least
                // 2^-126 over the least nonzero code): none needs the denormal rounding
};
using DecodeFn = void (*)(const DecodeArgs&);

/// A kernel as registered in dispatch.cpp.
struct KernelInfo {
  Isa isa;
  std::size_t mr, nr;  // block of C per call
  std::size_t kc;      // K block of the loops (multiple of kKStep); 0: all of K in one call
  std::size_t
      mc;  // rows per block of the loops, outside the column blocks, where the item's B fits
           // kItemBBytes (loops.hpp); a multiple of mr; 0: all rows
  ALayout a_layout;  // how A is packed for it
  UkernelFn ukernel;
  // Or null: for edge blocks of UkernelArgs::rows < MR rows. C's rows
  // [0, rows) come out bit for bit as the full kernel's (each row's products
  // and their order are its own); it may compute rows past them up to MR
  // (AMX: 16 or 32), never fewer (AVX-512, AVX2 and scalar: exactly `rows`, so an
  // expert's 1-7 routed rows cost 1-7 rows, not 8: at T = 48, K = 6, E = 64
  // about 4.5 rows per expert).
  UkernelFn ukernel_edge;
  bool
      side_steps;  // runs UkernelArgs::side between its k steps (AMX: the vector units idle meanwhile)
  void (*thread_begin)();  // before a thread's first call in a work item (AMX: tile config)
  void (*thread_end)();    // after its last (AMX: tile release)
  SwigluFn swiglu;         // the epilogue to pair with it
  SwigluBackwardFn swiglu_backward;
  RankSumFn rank_sums;    // the gradient sums of the layer backward
  ScaleToBf16Fn to_bf16;  // fp32 rows into A operands (pack_a_f32)
  Dot16Fn dot16;          // the router linear's dot products
  DecodeFn decode;        // quantized panels into bf16 (loops.cpp)
  const char* name;       // e.g. "ukernel_amx_bf16_32x32"
};

/// The kernel of `isa` (amx_bf16 only where usable: dispatch refuses otherwise).
const KernelInfo& kernel_info(Isa isa);

// One exported function per microkernel file.
void ukernel_scalar_8x32(const UkernelArgs&);
void ukernel_scalar_edge(const UkernelArgs&);
void ukernel_avx2_4x32(const UkernelArgs&);
void ukernel_avx2_edge(const UkernelArgs&);
void ukernel_avx512_bf16_8x32(const UkernelArgs&);
void ukernel_avx512_bf16_edge(const UkernelArgs&);
void ukernel_amx_bf16_32x32(const UkernelArgs&);
void ukernel_amx_bf16_edge(const UkernelArgs&);
void ukernel_amx_emu_32x32(const UkernelArgs&);
void ukernel_amx_emu_edge(const UkernelArgs&);
void swiglu_scalar(const float* g, const float* u, bf16* h, std::size_t n);
void swiglu_avx512(const float* g, const float* u, bf16* h, std::size_t n);
void swiglu_backward_scalar(const float* g, const float* u, const float* dh, float w, bf16* dg,
                            bf16* du, std::size_t n);
void swiglu_backward_avx512(const float* g, const float* u, const float* dh, float w, bf16* dg,
                            bf16* du, std::size_t n);
void rank_sums_scalar(const RankSumArgs&);
void rank_sums_avx512(const RankSumArgs&);
void scale_to_bf16_scalar(const float* src, float scale, bf16* dst, std::size_t n);
void scale_to_bf16_avx512(const float* src, float scale, bf16* dst, std::size_t n);
void decode_scalar(const DecodeArgs&);
void decode_avx512(const DecodeArgs&);
void dot16_scalar(const float* const* x, std::size_t nx, const float* w, std::size_t ldw,
                  std::size_t nw, std::size_t n, float* out, std::size_t ldo);
void dot16_avx512(const float* const* x, std::size_t nx, const float* w, std::size_t ldw,
                  std::size_t nw, std::size_t n, float* out, std::size_t ldo);
void amx_bf16_tile_begin();
void amx_bf16_tile_end();
void amx_emu_tile_begin();
void amx_emu_tile_end();

}  // namespace moecert::gemm
