// SwiGLU epilogue, portable: h[i] = bf16(silu(g[i]) * u[i]) with the exp of
// exp_poly.hpp, bit-identical to the AVX-512 epilogue.
#include "ops/gemm/exp_poly.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {

void swiglu_scalar(const float* g, const float* u, bf16* h, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) h[i] = bf16(exp_poly::swiglu(g[i], u[i]));
}

}  // namespace moecert::gemm
