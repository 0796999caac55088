// The AMX microkernel (ukernel_amx-inl.hpp) run on the software tile model:
// the same tile configuration, packing and loop bounds as on hardware, on
// any machine. No ISA flags.
#include "ops/gemm/ukernel_amx-inl.hpp"

namespace moecert::gemm {
namespace {

struct ModelTiles {
  template <int T>
  static void zero() {
    amx_model::zero(T);
  }
  template <int T>
  static void load(const void* p, std::size_t stride) {
    amx_model::load(T, p, stride);
  }
  template <int T>
  static void store(void* p, std::size_t stride) {
    amx_model::store(T, p, stride);
  }
  template <int C, int A, int B>
  static void dp() {
    amx_model::dpbf16ps(C, A, B);
  }
};

}  // namespace

void ukernel_amx_emu_32x32(const UkernelArgs& p) { amx::ukernel_32x32<ModelTiles>(p); }
void ukernel_amx_emu_edge(const UkernelArgs& p) { amx::ukernel_edge<ModelTiles>(p); }
void amx_emu_tile_begin() { amx_model::load_config(amx::tile_config()); }
void amx_emu_tile_end() { amx_model::release(); }

}  // namespace moecert::gemm
