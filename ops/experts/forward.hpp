// What the expert forward computed besides y: the grouping and the
// intermediate buffers (in the workspace), for the contracts to judge and
// the backward to reuse.
#pragma once

#include <cstddef>

#include "moecert/experts.hpp"
#include "ops/experts/grouping.hpp"
#include "ops/gemm/ukernel.hpp"
#include "ops/workspace/arena.hpp"

namespace moecert::experts {

struct ForwardState {
  Grouping grouping;
  gemm::ALayout layout = gemm::ALayout::rows;  // of a and h (the kernel's)
  std::size_t lda = 0, ldc1 = 0, ldh = 0, ldo = 0;
  bf16* a = nullptr;    // gathered x rows in `layout` (lda), K padding zero
  float* c1 = nullptr;  // gate/up GEMM output [rows x ldc1], interleaved 16-column panels
  bf16* h = nullptr;    // silu(g) * u in bf16, in `layout` (ldh), K padding zero
  float* o = nullptr;   // down GEMM output [rows x ldo]
  bf16 a_at(std::size_t r, std::size_t k) const { return a[gemm::a_offset(layout, lda, r, k)]; }
  bf16 h_at(std::size_t r, std::size_t k) const { return h[gemm::a_offset(layout, ldh, r, k)]; }
};

struct Workspace::Impl {
  ForwardState state;
  workspace::Arena arena;
};

}  // namespace moecert::experts
