// The AMX microkernel (ukernel_amx-inl.hpp) on hardware tiles. Built with
// -mamx-tile -mamx-bf16 on this file only; dispatch.cpp calls it only after
// CPUID, XCR0 and the arch_prctl permission all succeeded.
#include <immintrin.h>

#include "ops/gemm/ukernel_amx-inl.hpp"

namespace moecert::gemm {
namespace {

// The tile intrinsics take the tile number as a literal (it is pasted into
// the instruction), so each template argument maps to a literal here.
#define MOECERT_EACH_TILE(OP) \
  switch (T) {                \
    case 0: OP(0); break;     \
    case 1: OP(1); break;     \
    case 2: OP(2); break;     \
    case 3: OP(3); break;     \
    case 4: OP(4); break;     \
    case 5: OP(5); break;     \
    case 6: OP(6); break;     \
    case 7: OP(7); break;     \
  }

struct HardwareTiles {
  template <int T>
  static void zero() {
#define MOECERT_ZERO(n) _tile_zero(n)
    MOECERT_EACH_TILE(MOECERT_ZERO)
#undef MOECERT_ZERO
  }
  template <int T>
  static void load(const void* p, std::size_t stride) {
    const long s = static_cast<long>(stride);
#define MOECERT_LOAD(n) _tile_loadd(n, p, s)
    MOECERT_EACH_TILE(MOECERT_LOAD)
#undef MOECERT_LOAD
  }
  template <int T>
  static void store(void* p, std::size_t stride) {
    const long s = static_cast<long>(stride);
#define MOECERT_STORE(n) _tile_stored(n, p, s)
    MOECERT_EACH_TILE(MOECERT_STORE)
#undef MOECERT_STORE
  }
  // The four products of the 32 x 32 kernel (ukernel_amx-inl.hpp).
  template <int C, int A, int B>
  static void dp() {
    if constexpr (C == 0 && A == 4 && B == 6) _tile_dpbf16ps(0, 4, 6);
    else if constexpr (C == 1 && A == 4 && B == 7) _tile_dpbf16ps(1, 4, 7);
    else if constexpr (C == 2 && A == 5 && B == 6) _tile_dpbf16ps(2, 5, 6);
    else if constexpr (C == 3 && A == 5 && B == 7) _tile_dpbf16ps(3, 5, 7);
    else static_assert(C < 0, "tile triple not used by the 32x32 kernel");
  }
};
#undef MOECERT_EACH_TILE

}  // namespace

void ukernel_amx_bf16_32x32(const UkernelArgs& p) { amx::ukernel_32x32<HardwareTiles>(p); }

void amx_bf16_tile_begin() {
  const TileConfig cfg = amx::tile_config();
  _tile_loadconfig(&cfg);
}

void amx_bf16_tile_end() { _tile_release(); }

}  // namespace moecert::gemm
