// Grouped SwiGLU expert forward: group, gather, gate+up GEMM with the SwiGLU
// epilogue, down GEMM, weighted combine in slot order.
#include "ops/experts/forward.hpp"

#include <oneapi/tbb/enumerable_thread_specific.h>
#include <oneapi/tbb/parallel_for.h>

#include <cstring>
#include <memory>
#include <vector>

#include "contracts/clauses.hpp"
#include "contracts/experts.hpp"
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
  ws.arena.bind(
      workspace::plan_shape({w.experts(), w.hidden(), w.inter(), k, 0, t_count, 0}, false, 0, chk),
      chk);
  // The gate/up GEMM's fp32 output is kept only for the audit probe.
  forward_impl(w, nullptr, x, idx, weights, y, kernel, ws.arena, ws.state,
               chk.level() >= moecert::clauses::experts::kProbe.level);
  ws.arena.leave(chk);
  stats.routed_rows = ws.state.grouping.routed;
  stats.padded_rows = ws.state.grouping.rows();
  contracts::experts_forward_post(chk, w, x, idx, weights, y, ws.state);
  return stats;
}

void forward_impl(const PackedExperts& w, const PackedLora* lora, MatView<const bf16> x,
                  MatView<const std::int32_t> idx, MatView<const float> weights, MatView<float> y,
                  const gemm::KernelInfo& kernel, workspace::Arena& arena, ForwardState& st,
                  bool keep_c1) {
  moecert::detail::Checker chk{"experts.forward"};
  const std::size_t t_count = x.rows, k = idx.cols, hidden = w.hidden(), inter = w.inter();
  const std::size_t rank = lora ? lora->rank : 0;
  // 1. Group the routed slots by expert (stable counting sort).
  st.grouping = group_by_expert(idx, w.experts(), kernel.mr);
  const Grouping& g = st.grouping;
  contracts::experts_forward_grouping(chk, idx, g);
  const std::size_t rows = g.rows();
  const gemm::ALayout layout = kernel.a_layout;
  const std::size_t kp1 = w.experts() ? w.gate_up(0).kp() : 0,
                    kp2 = w.experts() ? w.down(0).kp() : 0;
  const std::size_t kr1 = round_up(2 * rank, gemm::kKStep), kr2 = round_up(rank, gemm::kKStep);
  st.layout = layout;
  st.lda = gemm::a_stride(layout, kp1);
  st.ldc1 = w.experts() ? w.gate_up(0).n() : 0;
  st.ldh = gemm::a_stride(layout, kp2);
  st.ldo = hidden;
  st.rank = rank;
  st.scale = lora ? lora->scale : 0.0f;
  arena.enter(workspace::f_gather, chk);
  st.a = arena.get<bf16>("experts.a", gemm::a_size(layout, rows, kp1));
  // First element of padded row r in the packed A and h buffers (r is a
  // multiple of the kernel's MR wherever a block starts).
  auto a_row = [&](std::size_t r) { return st.a + gemm::a_offset(layout, st.lda, r, 0); };
  auto h_at = [&](std::size_t r, std::size_t col) {
    return st.h + gemm::a_offset(layout, st.ldh, r, col);
  };
  bf16* lb_gu = nullptr;
  const std::size_t ld_lb1 = gemm::a_stride(layout, kr1);
  if (rank) {
    st.xa = arena.get<float>("lora.xa", rows * 2 * rank);
    lb_gu = arena.get<bf16>("lora.lb_gu", gemm::a_size(layout, rows, kr1));
  }

  // 2. Per block of up to mb rows of an expert: gather its token rows
  //    (padding rows and columns zero); with LoRA, while those rows are in
  //    L2, the first factor xa = x [A_g; A_u]^T in fp32 (saved) and the
  //    second product's A operand lb = bf16(s xa) in the kernel's layout.
  //    The last block of an expert also writes its padding rows.
  const std::size_t mb = round_up(512, kernel.mr);
  auto padded_rows = [&](const Tile& tl) {
    return tl.m1 < g.count[tl.e] ? tl.m1 - tl.m0 : g.begin[tl.e + 1] - g.begin[tl.e] - tl.m0;
  };
  const std::vector<Tile> row_blocks = tiles(g, 1, mb, 1);
  for_each_tile(row_blocks, [&](const Tile& tl) {
    const std::size_t r0 = g.begin[tl.e] + tl.m0, m = tl.m1 - tl.m0;
    std::vector<std::int32_t> tokens(m);
    for (std::size_t r = 0; r < m; ++r)
      tokens[r] = g.row_slot[r0 + r] / static_cast<std::int32_t>(k);
    gemm::pack_a(layout, x, tokens.data(), m, padded_rows(tl), kp1, a_row(r0));
    if (!rank) return;
    gemm::gemm_block(kernel, a_row(r0), m, lora->experts[tl.e].a_gu, 0, 2 * rank, 2 * rank,
                     st.xa + r0 * 2 * rank, 2 * rank);
    gemm::pack_a_f32(kernel, st.xa + r0 * 2 * rank, 2 * rank, nullptr, m, padded_rows(tl), 2 * rank,
                     kr1, st.scale, lb_gu + gemm::a_offset(layout, ld_lb1, r0, 0));
  });

  arena.enter(workspace::f_gate_up, chk);
  st.c1 = keep_c1 ? arena.get<float>("experts.c1", rows * st.ldc1) : nullptr;
  st.h = arena.get<bf16>("experts.h", gemm::a_size(layout, rows, kp2));

  // 3. Gate+up GEMM (+ the LoRA product accumulated into the same fp32
  //    block), then, on each finished 32-column block (a panel pair: 16
  //    gate columns, then the same 16 up columns) while it is in L1,
  //    h = silu(g) * u, written into h in the kernel's A layout for the down
  //    GEMM. Work items: (expert, up to 512 rows, 128 or 256 columns by
  //    gemm::item_cols, pair-aligned). Tall items make each weight column
  //    block stream from memory once per expert, not once per row block;
  //    narrow ones leave enough items for every thread.
  //    Without keep_c1 each item's C goes to a scratch block of the thread
  //    (up to 512 x 256 fp32, L2-sized) instead of c1 in memory: the SwiGLU
  //    is then its only reader, and the same bits come out.
  const std::size_t nb = gemm::item_cols(kp1);
  struct Scratch {  // grown to the largest item a thread meets, never value-initialised
    std::unique_ptr<float[]> data;
    std::size_t size = 0;
  };
  oneapi::tbb::enumerable_thread_specific<Scratch> scratch;
  for_each_tile(tiles(g, st.ldc1, mb, nb), [&](const Tile& tl) {
    const std::size_t r0 = g.begin[tl.e] + tl.m0;
    float* cb;  // C of this item: its row 0 at row r0 of c1, column col0
    std::size_t ldc = st.ldc1, col0 = 0;
    if (keep_c1) {
      cb = st.c1 + r0 * st.ldc1;
    } else {
      Scratch& s = scratch.local();
      const std::size_t need = round_up(tl.m1 - tl.m0, kernel.mr) * nb;
      if (s.size < need) s.data.reset(new float[need]), s.size = need;
      cb = s.data.get(), ldc = nb, col0 = tl.n0;
    }
    auto swiglu = [&](std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1) {
      for (std::size_t n = j0; n < j1; n += 2 * gemm::kPanel) {
        const std::size_t col = n / 2;  // first intermediate index of the pair (16 in one A tile)
        if (col >= inter) continue;
        for (std::size_t i = i0; i < i1; ++i) {
          const float* c = cb + (i * ldc + (n - col0));
          kernel.swiglu(c, c + gemm::kPanel, h_at(r0 + i, col),
                        std::min(gemm::kPanel, inter - col));
        }
      }
    };
    gemm::BlockOptions bo{.c_col0 = col0, .epilogue = swiglu};
    if (rank)
      bo.a2 = lb_gu + gemm::a_offset(layout, ld_lb1, r0, 0), bo.w2 = &lora->experts[tl.e].b_gu;
    gemm::gemm_block(kernel, a_row(r0), tl.m1 - tl.m0, w.gate_up(tl.e), tl.n0, tl.n1, st.ldc1, cb,
                     ldc, bo);
  });

  // 4. Down GEMM (+ LoRA: ha = h A_d^T saved, lb = bf16(s ha), o += lb B_d^T).
  arena.enter(workspace::f_down, chk);
  st.o = arena.get<float>("experts.o", rows * st.ldo);
  bf16* lb_d = nullptr;
  const std::size_t ld_lb2 = gemm::a_stride(layout, kr2);
  if (rank) {
    st.ha = arena.get<float>("lora.ha", rows * rank);
    lb_d = arena.get<bf16>("lora.lb_d", gemm::a_size(layout, rows, kr2));
  }
  // Per row block: zero h's K padding (columns I..kp2) and the padding rows,
  // which the down GEMM reads (a stale NaN there would reach valid outputs
  // as 0 * NaN); then, with LoRA, ha and lb from those h rows.
  for_each_tile(row_blocks, [&](const Tile& tl) {
    const std::size_t r0 = g.begin[tl.e] + tl.m0, m = tl.m1 - tl.m0;
    for (std::size_t r = 0; r < padded_rows(tl); ++r)
      for (std::size_t col = r < m ? inter : 0; col < kp2; ++col) *h_at(r0 + r, col) = bf16{};
    if (!rank) return;
    gemm::gemm_block(kernel, h_at(r0, 0), m, lora->experts[tl.e].a_d, 0, rank, rank,
                     st.ha + r0 * rank, rank);
    gemm::pack_a_f32(kernel, st.ha + r0 * rank, rank, nullptr, m, padded_rows(tl), rank, kr2,
                     st.scale, lb_d + gemm::a_offset(layout, ld_lb2, r0, 0));
  });
  for_each_tile(tiles(g, hidden, mb, gemm::item_cols(kp2)), [&](const Tile& tl) {
    const std::size_t r0 = g.begin[tl.e] + tl.m0;
    gemm::BlockOptions bo;
    if (rank)
      bo.a2 = lb_d + gemm::a_offset(layout, ld_lb2, r0, 0), bo.w2 = &lora->experts[tl.e].b_d;
    gemm::gemm_block(kernel, h_at(r0, 0), tl.m1 - tl.m0, w.down(tl.e), tl.n0, tl.n1, hidden,
                     st.o + r0 * st.ldo, st.ldo, bo);
  });

  // 5. Combine in token order, slots in order j = 0..K-1, fp32 from zero.
  arena.enter(workspace::f_combine, chk);
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

}  // namespace moecert::experts
