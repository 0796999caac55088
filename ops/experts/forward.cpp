// Grouped SwiGLU expert forward: group, gather, gate+up GEMM with the SwiGLU
// epilogue, down GEMM, weighted combine in slot order.
#include "ops/experts/forward.hpp"

#include <oneapi/tbb/enumerable_thread_specific.h>
#include <oneapi/tbb/parallel_for.h>

#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "contracts/engine/clauses.hpp"
#include "contracts/experts/experts.hpp"
#include "moecert/isa.hpp"
#include "ops/core/prefetch.hpp"
#include "ops/core/task.hpp"
#include "ops/experts/lora.hpp"
#include "ops/gemm/loops.hpp"
#include "ops/workspace/planner.hpp"

using moecert::gemm::round_up;

namespace moecert::experts {

Workspace::Workspace() : impl_(std::make_unique<Impl>()) {}
Workspace::~Workspace() = default;
Workspace::Workspace(Workspace&&) noexcept = default;
Workspace& Workspace::operator=(Workspace&&) noexcept = default;
std::size_t Workspace::bytes() const { return impl_->arena.capacity(); }

ForwardStats forward(const PackedExperts& w, MatView<const bf16> x, MatView<const std::int32_t> idx,
                     MatView<const float> weights, MatView<float> y, const ForwardOptions& opt) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  moecert::detail::Checker chk{"experts.forward"};
  contracts::experts_forward_pre(chk, w, x, idx, weights, y);
  if (chk.stop()) return {};
  const std::size_t t_count = x.rows, k = idx.cols;
  ForwardStats stats;
  stats.isa = opt.isa.value_or(default_isa());
  const gemm::KernelInfo& kernel = gemm::kernel_info(stats.isa);
  Workspace temporary_ws;
  Workspace::Impl& ws = (opt.workspace ? *opt.workspace : temporary_ws).impl();
  ws.arena.bind(workspace::plan_shape({w.experts(), w.hidden(), w.inter(), k, 0, t_count, 0}, false,
                                      0, chk, w.format()),
                chk);
  // The gate/up GEMM's fp32 output is never kept: the audit probe gathers
  // its side of it from the epilogue.
  std::optional<contracts::ExpertsProbe> probe;
  if (chk.will_check(moecert::clauses::experts::kProbe)) probe.emplace(w, ws.probe_sums);
  forward_impl(w, nullptr, x, idx, weights, y, kernel, ws.arena, ws.state, false,
               probe ? &*probe : nullptr);
  ws.arena.leave(chk);
  stats.routed_rows = ws.state.grouping.routed;
  stats.padded_rows = ws.state.grouping.rows();
  contracts::ExpertRows rows = rows_view(ws.state);
  rows.probe = probe ? &*probe : nullptr;
  contracts::experts_forward_post(chk, w, x, idx, weights, y, rows);
  return stats;
}

namespace {

// What the steps of the forward share: the inputs, the kernel, the grouping
// and the buffers in st, with the strides and row blocks derived from them.
struct Steps {
  const PackedExperts& w;
  const PackedLora* lora;
  MatView<const bf16> x;
  const gemm::KernelInfo& kernel;
  ForwardState& st;
  const Grouping& g;
  std::size_t k, hidden, inter, rank;
  std::size_t kp1, kp2;                      // K of the gate/up and the down GEMM (padded)
  std::size_t kr1, kr2;                      // K of the LoRA second products (2r and r, padded)
  std::size_t mb;                            // rows per work item (a multiple of MR)
  bf16* lb_gu = nullptr;                     // bf16(s xa) in the kernel's A layout
  bf16* lb_d = nullptr;                      // bf16(s ha) in the kernel's A layout
  std::vector<Tile> row_blocks = {};         // up to mb rows of one expert, one column
  contracts::ExpertsProbe* probe = nullptr;  // takes each finished gate/up block (audit)

  gemm::ALayout layout() const { return kernel.a_layout; }
  // First element of padded row r in the packed A and h buffers (r is a
  // multiple of the kernel's MR wherever a block starts).
  bf16* a_row(std::size_t r) const { return st.a + gemm::a_offset(layout(), st.lda, r, 0); }
  bf16* h_at(std::size_t r, std::size_t col) const {
    return st.h + gemm::a_offset(layout(), st.ldh, r, col);
  }
  bf16* lb_gu_row(std::size_t r) const {
    return lb_gu + gemm::a_offset(layout(), gemm::a_stride(layout(), kr1), r, 0);
  }
  bf16* lb_d_row(std::size_t r) const {
    return lb_d + gemm::a_offset(layout(), gemm::a_stride(layout(), kr2), r, 0);
  }
  // Rows a block writes: its routed rows, and the expert's padding rows too
  // if it is the expert's last block.
  std::size_t padded_rows(const Tile& tl) const {
    return tl.m1 < g.count[tl.e] ? tl.m1 - tl.m0 : g.begin[tl.e + 1] - g.begin[tl.e] - tl.m0;
  }
};

// Step 2. Per block of up to mb rows of an expert: gather its token rows
// (padding rows and columns zero); with LoRA, while those rows are in L2, the
// first factor xa = x [A_g; A_u]^T in fp32 (saved) and the second product's
// A operand lb = bf16(s xa) in the kernel's layout.
void gather(const Steps& s) {
  for_each_tile(s.row_blocks, [&](const Tile& tl) {
    const std::size_t r0 = s.g.begin[tl.e] + tl.m0, m = tl.m1 - tl.m0, r2 = 2 * s.rank;
    std::vector<std::int32_t> tokens(m);
    for (std::size_t r = 0; r < m; ++r)
      tokens[r] = s.g.row_slot[r0 + r] / static_cast<std::int32_t>(s.k);
    gemm::pack_a(s.layout(), s.x, tokens.data(), m, s.padded_rows(tl), s.kp1, s.a_row(r0));
    if (!s.rank) return;
    gemm::gemm_block(s.kernel, s.a_row(r0), m, s.lora->experts[tl.e].a_gu, 0, r2, r2,
                     s.st.xa + r0 * r2, r2);
    gemm::pack_a_f32(s.kernel, s.st.xa + r0 * r2, r2, nullptr, m, s.padded_rows(tl), r2, s.kr1,
                     s.st.scale, s.lb_gu_row(r0));
  });
}

// Step 3. Gate+up GEMM (+ the LoRA product accumulated into the same fp32
// block), then, on each finished 32-column block (a panel pair: 16 gate
// columns, then the same 16 up columns) while it is in L1, h = silu(g) * u,
// written into h in the kernel's A layout for the down GEMM. Work items:
// (expert, up to 512 rows, 128 or 256 columns by gemm::item_cols,
// pair-aligned). Tall items make each weight column block stream from memory
// once per expert, not once per row block; narrow ones leave enough items for
// every thread. Without st.c1 each item's C goes to a scratch block of the
// thread (up to 512 x 256 fp32, L2-sized) instead: the SwiGLU is then its
// only reader, and the same bits come out.
void gate_up(const Steps& s) {
  const ForwardState& st = s.st;
  const std::size_t nb = gemm::item_cols(s.kp1);
  struct Scratch {  // grown to the largest item a thread meets, never value-initialised
    std::unique_ptr<float[]> data;
    std::size_t size = 0;
  };
  oneapi::tbb::enumerable_thread_specific<Scratch> scratch;
  for_each_tile(tiles(s.g.count, st.ldc1, s.mb, nb), [&](const Tile& tl) {
    const std::size_t r0 = s.g.begin[tl.e] + tl.m0;
    float* cb;  // C of this item: its row 0 at row r0 of c1, column col0
    std::size_t ldc = st.ldc1, col0 = 0;
    if (st.c1) {
      cb = st.c1 + r0 * st.ldc1;
    } else {
      Scratch& sc = scratch.local();
      const std::size_t need = round_up(tl.m1 - tl.m0, s.kernel.mr) * nb;
      if (sc.size < need) sc.data.reset(new float[need]), sc.size = need;
      cb = sc.data.get(), ldc = nb, col0 = tl.n0;
    }
    auto swiglu = [&](std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1) {
      for (std::size_t n = j0; n < j1; n += 2 * gemm::kPanel) {
        const std::size_t col = n / 2;  // first intermediate index of the pair (16 in one A tile)
        if (col >= s.inter) continue;
        for (std::size_t i = i0; i < i1; ++i) {
          const float* c = cb + (i * ldc + (n - col0));
          s.kernel.swiglu(c, c + gemm::kPanel, s.h_at(r0 + i, col),
                          std::min(gemm::kPanel, s.inter - col));
        }
      }
    };
    auto to_probe = [&](std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1) {
      for (std::size_t n = j0; n < j1; n += 2 * gemm::kPanel)
        s.probe->add(tl.e, r0 + i0, i1 - i0, n, cb + (i0 * ldc + (n - col0)), ldc);
    };
    gemm::BlockOptions bo{.c_col0 = col0, .epilogue = swiglu};
    if (s.probe) bo.block_done = to_probe;
    if (s.rank) bo.a2 = s.lb_gu_row(r0), bo.w2 = &s.lora->experts[tl.e].b_gu;
    gemm::gemm_block(s.kernel, s.a_row(r0), tl.m1 - tl.m0, s.w.gate_up(tl.e), tl.n0, tl.n1, st.ldc1,
                     cb, ldc, bo);
  });
}

// Step 4a. Per row block: zero h's K padding (columns I..kp2) and the padding
// rows, which the down GEMM reads (a stale NaN there would reach valid
// outputs as 0 * NaN); then, with LoRA, ha = h A_d^T (saved) and
// lb = bf16(s ha) from those h rows.
void pad_h(const Steps& s) {
  for_each_tile(s.row_blocks, [&](const Tile& tl) {
    const std::size_t r0 = s.g.begin[tl.e] + tl.m0, m = tl.m1 - tl.m0, r = s.rank;
    for (std::size_t i = 0; i < s.padded_rows(tl); ++i)
      for (std::size_t col = i < m ? s.inter : 0; col < s.kp2; ++col) *s.h_at(r0 + i, col) = bf16{};
    if (!r) return;
    gemm::gemm_block(s.kernel, s.h_at(r0, 0), m, s.lora->experts[tl.e].a_d, 0, r, r,
                     s.st.ha + r0 * r, r);
    gemm::pack_a_f32(s.kernel, s.st.ha + r0 * r, r, nullptr, m, s.padded_rows(tl), r, s.kr2,
                     s.st.scale, s.lb_d_row(r0));
  });
}

// Step 4b. Down GEMM, o = h W_d^T (+ LoRA: o += lb B_d^T in the same blocks).
void down(const Steps& s) {
  for_each_tile(tiles(s.g.count, s.hidden, s.mb, gemm::item_cols(s.kp2)), [&](const Tile& tl) {
    const std::size_t r0 = s.g.begin[tl.e] + tl.m0;
    gemm::BlockOptions bo;
    if (s.rank) bo.a2 = s.lb_d_row(r0), bo.w2 = &s.lora->experts[tl.e].b_d;
    gemm::gemm_block(s.kernel, s.h_at(r0, 0), tl.m1 - tl.m0, s.w.down(tl.e), tl.n0, tl.n1, s.hidden,
                     s.st.o + r0 * s.st.ldo, s.st.ldo, bo);
  });
}

// Step 5. Combine in token order, slots in order j = 0..K-1, fp32 from zero.
void combine(const Steps& s, MatView<const float> weights, MatView<float> y) {
  const std::size_t t_count = y.rows, k = s.k, hidden = s.hidden;
  const Grouping& g = s.g;
  const ForwardState& st = s.st;
  oneapi::tbb::parallel_for(
      std::size_t{0}, t_count, moecert::detail::task([&](std::size_t t) {
        float* yt = y.row(t);
        if (t + 1 < t_count)  // the next token's rows
          for (std::size_t j = 0; j < k; ++j)
            if (const std::int64_t next = g.slot_row[(t + 1) * k + j]; next >= 0)
              moecert::detail::prefetch_lines(st.o + static_cast<std::size_t>(next) * st.ldo,
                                              hidden * sizeof(float));
        std::fill(yt, yt + hidden, 0.0f);
        for (std::size_t j = 0; j < k; ++j) {
          const std::int64_t row = g.slot_row[t * k + j];
          if (row < 0) continue;
          const float wt = weights(t, j);
          const float* o = st.o + static_cast<std::size_t>(row) * st.ldo;
          for (std::size_t m = 0; m < hidden; ++m) yt[m] += wt * o[m];
        }
      }));
}

}  // namespace

// The schedule: each step takes its buffers from the arena as it enters the
// step's phase (the planner's live intervals), then runs.
void forward_impl(const PackedExperts& w, const PackedLora* lora, MatView<const bf16> x,
                  MatView<const std::int32_t> idx, MatView<const float> weights, MatView<float> y,
                  const gemm::KernelInfo& kernel, workspace::Arena& arena, ForwardState& st,
                  bool keep_c1, contracts::ExpertsProbe* probe) {
  moecert::detail::Checker chk{"experts.forward"};
  // 1. Group the routed slots by expert (stable counting sort).
  st.grouping = group_by_expert(idx, w.experts(), kernel.mr);
  const Grouping& g = st.grouping;
  contracts::experts_forward_grouping(chk, idx, grouping_view(g));
  const std::size_t rank = lora ? lora->rank : 0, rows = g.rows();
  Steps s{.w = w,
          .lora = lora,
          .x = x,
          .kernel = kernel,
          .st = st,
          .g = g,
          .k = idx.cols,
          .hidden = w.hidden(),
          .inter = w.inter(),
          .rank = rank,
          .kp1 = w.experts() ? w.gate_up(0).kp() : 0,
          .kp2 = w.experts() ? w.down(0).kp() : 0,
          .kr1 = round_up(2 * rank, gemm::kKStep),
          .kr2 = round_up(rank, gemm::kKStep),
          .mb = round_up(512, kernel.mr),
          .probe = probe};
  s.row_blocks = tiles(g.count, 1, s.mb, 1);
  if (probe) probe->size_rows(rows, gemm::item_cols(s.kp1));
  const gemm::ALayout layout = kernel.a_layout;
  st.layout = layout;
  st.lda = gemm::a_stride(layout, s.kp1);
  st.ldc1 = w.experts() ? w.gate_up(0).n() : 0;
  st.ldh = gemm::a_stride(layout, s.kp2);
  st.ldo = s.hidden;
  st.rank = rank;
  st.scale = lora ? lora->scale : 0.0f;

  arena.enter(workspace::f_gather, chk);
  st.a = arena.get<bf16>("experts.a", gemm::a_size(layout, rows, s.kp1));
  if (rank) {
    st.xa = arena.get<float>("lora.xa", rows * 2 * rank);
    s.lb_gu = arena.get<bf16>("lora.lb_gu", gemm::a_size(layout, rows, s.kr1));
  }
  gather(s);

  arena.enter(workspace::f_gate_up, chk);
  st.c1 = keep_c1 ? arena.get<float>("experts.c1", rows * st.ldc1) : nullptr;
  st.h = arena.get<bf16>("experts.h", gemm::a_size(layout, rows, s.kp2));
  gate_up(s);

  arena.enter(workspace::f_down, chk);
  st.o = arena.get<float>("experts.o", rows * st.ldo);
  if (rank) {
    st.ha = arena.get<float>("lora.ha", rows * rank);
    s.lb_d = arena.get<bf16>("lora.lb_d", gemm::a_size(layout, rows, s.kr2));
  }
  pad_h(s);
  down(s);

  arena.enter(workspace::f_combine, chk);
  combine(s, weights, y);
}

}  // namespace moecert::experts
