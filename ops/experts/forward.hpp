// What the expert forward computed besides y: the grouping and the
// intermediate buffers (in the workspace), for the contracts to judge and
// the backward to reuse.
#pragma once

#include <cstddef>
#include <vector>

#include "contracts/engine/saved.hpp"
#include "contracts/gemm/gemm.hpp"
#include "moecert/experts.hpp"
#include "ops/core/tiles.hpp"
#include "ops/experts/grouping.hpp"
#include "ops/gemm/ukernel.hpp"
#include "ops/workspace/arena.hpp"

namespace moecert::experts {

using moecert::detail::for_each_tile;
using moecert::detail::Tile;
using moecert::detail::tiles;

struct ForwardState {
  Grouping grouping;
  gemm::ALayout layout = gemm::ALayout::rows;  // of a and h (the kernel's)
  std::size_t lda = 0, ldc1 = 0, ldh = 0, ldo = 0;
  bf16* a = nullptr;    // gathered x rows in `layout` (lda), K padding zero
  float* c1 = nullptr;  // gate/up GEMM output [rows x ldc1], interleaved 16-column panels
  bf16* h = nullptr;    // silu(g) * u in bf16, in `layout` (ldh), K padding zero
  float* o = nullptr;   // down GEMM output [rows x ldo]
  // LoRA (rank > 0): fp32 products of the first LoRA factor, saved for the
  // backward; the second product's A operand is bf16(scale * these).
  std::size_t rank = 0;
  float scale = 0.0f;
  float* xa = nullptr;  // [rows x 2r] x [A_g; A_u]^T
  float* ha = nullptr;  // [rows x r]  h A_d^T
  bf16 a_at(std::size_t r, std::size_t k) const { return a[gemm::a_offset(layout, lda, r, k)]; }
  bf16 h_at(std::size_t r, std::size_t k) const { return h[gemm::a_offset(layout, ldh, r, k)]; }
};

struct PackedLora;

/// The forward on a bound arena (steps f_gather .. f_combine): the body of
/// experts::forward and of the layer's forward. `lora` may be null. Without
/// keep_c1 the gate/up GEMM's fp32 output never reaches st.c1 (null then):
/// for callers that read only y, h and o afterwards. With `probe`, each
/// finished 32-column block of that output is handed to it (audit).
void forward_impl(const PackedExperts& w, const PackedLora* lora, MatView<const bf16> x,
                  MatView<const std::int32_t> idx, MatView<const float> weights, MatView<float> y,
                  const gemm::KernelInfo& kernel, workspace::Arena& arena, ForwardState& st,
                  bool keep_c1 = true, contracts::ExpertsProbe* probe = nullptr);

/// The grouping and the saved rows as the contracts read them
/// (ops/experts/saved_view.cpp).
contracts::GroupingView grouping_view(const Grouping& g);
contracts::ExpertRows rows_view(const ForwardState& st);
/// bf16 rows at `ld` in `layout` (an A operand's) as the contracts read them.
contracts::OperandRows operand_rows(const bf16* p, std::size_t ld, gemm::ALayout layout);

struct Workspace::Impl {
  ForwardState state;
  workspace::Arena arena;
  contracts::ProbeStorage probe_sums;  // the audit probes' sums
};

}  // namespace moecert::experts
