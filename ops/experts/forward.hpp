// What the expert forward computed besides y: the grouping and the
// intermediate buffers, for the contracts to judge (and the backward to reuse).
#pragma once

#include <vector>

#include "moecert/experts.hpp"
#include "ops/experts/grouping.hpp"

namespace moecert::experts {

struct ForwardState {
  Grouping grouping;
  std::size_t lda = 0, ldc1 = 0, ldh = 0, ldo = 0;
  std::vector<bf16> a;    // gathered x rows [rows x lda], K padding zero
  std::vector<float> c1;  // gate/up GEMM output [rows x ldc1], interleaved 16-column panels
  std::vector<bf16> h;    // silu(g) * u in bf16 [rows x ldh], K padding zero
  std::vector<float> o;   // down GEMM output [rows x ldo]
};

}  // namespace moecert::experts
