// The AMX microkernel (ukernel_amx-inl.hpp) on hardware tiles. Built with
// -mamx-tile -mamx-bf16 on this file only; dispatch.cpp calls it only after
// CPUID, XCR0 and the arch_prctl permission all succeeded.
#include "ops/gemm/ukernel_amx-inl.hpp"

namespace moecert::gemm {
namespace {

// Tile instructions as inline assembly with exact memory operands and
// "memory" clobbers. GCC 12's <amxtileintrin.h> declares LDTILECFG's operand
// as 8 bytes, so the compiler deleted the stores of rows/colsb as dead and
// the first tile instruction faulted (seen on the AMX machine), and its
// TILELOADD/TILESTORED tell the compiler nothing about the memory they touch.
struct HardwareTiles {
  template <int T>
  static void zero() {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  static void load(const void* p, std::size_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* p, std::size_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int C, int A, int B>
  static void dp() {  // TDPBF16PS tmmC, tmmA, tmmB (AT&T order: B, A, C)
    __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};

}  // namespace

void ukernel_amx_bf16_32x32(const UkernelArgs& p) { amx::ukernel_32x32<HardwareTiles>(p); }
void ukernel_amx_bf16_edge(const UkernelArgs& p) { amx::ukernel_edge<HardwareTiles>(p); }

void amx_bf16_tile_begin() {
  const TileConfig cfg = amx::tile_config();
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
}

void amx_bf16_tile_end() { __asm__ volatile("tilerelease" ::: "memory"); }

}  // namespace moecert::gemm
