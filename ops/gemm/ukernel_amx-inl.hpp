// The AMX microkernel body, 32 x 32 (and a 16-row form for edge blocks),
// written once and templated on its tile backend: hardware tiles
// (ukernel_amx_bf16.cpp) or the software model (ukernel_amx_emu.cpp), so the
// emulator runs this very code.
//
// C tiles 0-3 (16 x 16 fp32 each) hold the 32 x 32 block of C; per 32-wide
// k step, A tiles 4, 5 (16 rows x 32 bf16) and B tiles 6, 7 (16 k pairs x 16
// columns, VNNI: one packed panel's 16 rows of 64 bytes) feed four
// TDPBF16PS. A comes in the `tiles` layout (ukernel.hpp): each A tile is 1
// KiB contiguous, so a k step touches 4 KiB in 4 runs instead of 64 lines
// on 32 pages. Accumulation order per element: for each k step in order,
// C = C + (even + odd) over that step's 16 pairs (amx_tile_model.hpp); a
// second product's k steps follow on the same C tiles. Starting from zeroed
// tiles, C is written without being read. The caller's side work (the
// previous block's epilogue) runs between the first product's k steps.
#pragma once

#include "ops/gemm/amx_tile_model.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm::amx {

inline constexpr std::size_t kMr = 32, kNr = 32;

/// All eight tiles 16 rows x 64 bytes.
inline TileConfig tile_config() {
  TileConfig c;
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  return c;
}

// The k steps of one product (A in the tiles layout, B packed panels) into
// C tiles 0-3 (0-1 with 16 rows); with `side`, its call i after step i (the
// vector units are free while the tiles multiply).
template <class Tiles, int Rows>
inline void steps(const bf16* a, std::size_t lda, const bf16* b, std::size_t panel_stride,
                  std::size_t kp, const UkernelArgs* side = nullptr) {
  constexpr bool two = Rows == 32;
  constexpr std::size_t kTile = kTileRows * kKStep;  // elements per A tile
  const bf16* a0 = a;                                // rows 0-15: tile per k step, contiguous
  const bf16* a1 = a + lda;                          // rows 16-31 (32 rows only)
  const bf16* b0 = b;
  const bf16* b1 = b + panel_stride;
  for (std::size_t k = 0; k < kp; k += kKStep) {
    // Prefetch the next k step's tiles into L1: a tile register cannot
    // be loaded again until the products reading it are done, so without
    // this every TILELOADD waits for L2 (measured on the AMX machine:
    // 0.30 -> 0.43 TFLOP/s on one core, 4.4 -> 5.3 on 16).
    if (k + kKStep < kp) {
      const std::size_t kn = k + kKStep;
      for (std::size_t r = 0; r < 16; ++r) {
        __builtin_prefetch(a0 + (kn / kKStep) * kTile + r * kKStep, 0, 3);
        if constexpr (two) __builtin_prefetch(a1 + (kn / kKStep) * kTile + r * kKStep, 0, 3);
        __builtin_prefetch(b0 + kn * kPanel + r * 2 * kPanel, 0, 3);
        __builtin_prefetch(b1 + kn * kPanel + r * 2 * kPanel, 0, 3);
      }
    }
    Tiles::template load<4>(a0 + (k / kKStep) * kTile, 64);
    if constexpr (two) Tiles::template load<5>(a1 + (k / kKStep) * kTile, 64);
    Tiles::template load<6>(b0 + k * kPanel, 64);  // 16 rows of 64 bytes from k/2
    Tiles::template load<7>(b1 + k * kPanel, 64);
    Tiles::template dp<0, 4, 6>();
    Tiles::template dp<1, 4, 7>();
    if constexpr (two) {
      Tiles::template dp<2, 5, 6>();
      Tiles::template dp<3, 5, 7>();
    }
    if (side && k / kKStep < side->side_n) side->side(side->side_ctx, k / kKStep);
  }
}

// Rows = 32 (the kernel) or 16 (edge blocks of at most 16 rows: C tiles 0
// and 1, A tile 4 only; every element's products and their order are the
// 32-row kernel's, so its rows come out bit for bit the same).
template <class Tiles, int Rows>
inline void ukernel_rows(const UkernelArgs& p) {
  static_assert(Rows == 16 || Rows == 32);
  constexpr bool two = Rows == 32;
  const std::size_t ldc_bytes = p.ldc * sizeof(float);
  float* c0 = p.c;
  float* c1 = p.c + 16;
  float* c2 = p.c + 16 * p.ldc;
  float* c3 = p.c + 16 * p.ldc + 16;
  if (p.accumulate) {
    Tiles::template load<0>(c0, ldc_bytes);
    Tiles::template load<1>(c1, ldc_bytes);
    if constexpr (two) {
      Tiles::template load<2>(c2, ldc_bytes);
      Tiles::template load<3>(c3, ldc_bytes);
    }
  } else {
    Tiles::template zero<0>();
    Tiles::template zero<1>();
    if constexpr (two) {
      Tiles::template zero<2>();
      Tiles::template zero<3>();
    }
  }
  steps<Tiles, Rows>(p.a, p.lda, p.b, p.panel_stride, p.kp, p.side ? &p : nullptr);
  if (p.kp2) steps<Tiles, Rows>(p.a2, p.lda2, p.b2, p.panel_stride2, p.kp2);
  Tiles::template store<0>(c0, ldc_bytes);
  Tiles::template store<1>(c1, ldc_bytes);
  if constexpr (two) {
    Tiles::template store<2>(c2, ldc_bytes);
    Tiles::template store<3>(c3, ldc_bytes);
  }
  for (std::size_t i = p.kp / kKStep; i < p.side_n; ++i) p.side(p.side_ctx, i);
}

template <class Tiles>
inline void ukernel_32x32(const UkernelArgs& p) {
  ukernel_rows<Tiles, 32>(p);
}
/// Edge blocks: 16 rows where p.rows <= 16, else all 32.
template <class Tiles>
inline void ukernel_edge(const UkernelArgs& p) {
  if (p.rows <= 16)
    ukernel_rows<Tiles, 16>(p);
  else
    ukernel_rows<Tiles, 32>(p);
}

}  // namespace moecert::gemm::amx
