// Grouped SwiGLU expert forward: group, gather, gate+up GEMM with the SwiGLU
// epilogue, down GEMM, weighted combine in slot order.
#include "ops/experts/forward.hpp"

#include <cstring>

#include <oneapi/tbb/parallel_for.h>

#include "contracts/experts.hpp"
#include "moecert/isa.hpp"
#include "ops/gemm/loops.hpp"
#include "ops/workspace/planner.hpp"

using moecert::gemm::round_up;

namespace moecert::experts {
namespace {

// Work item: rows [m0, m1) of one expert's group, columns [n0, n1).
struct Tile {
  std::size_t e, m0, m1, n0, n1;
};

// Tiles of every expert's rows x n columns; no two share an output element.
std::vector<Tile> tiles(const Grouping& g, std::size_t n, std::size_t mb, std::size_t nb) {
  std::vector<Tile> out;
  for (std::size_t e = 0; e < g.experts; ++e)
    for (std::size_t m0 = 0; m0 < g.count[e]; m0 += mb)
      for (std::size_t n0 = 0; n0 < n; n0 += nb)
        out.push_back({e, m0, std::min(g.count[e], m0 + mb), n0, std::min(n, n0 + nb)});
  return out;
}

template <class F>
void for_each_tile(const std::vector<Tile>& ts, F f) {
  oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, ts.size(), 1),
                            [&](const oneapi::tbb::blocked_range<std::size_t>& r) {
                              for (std::size_t i = r.begin(); i < r.end(); ++i) f(ts[i]);
                            });
}

Isa choose_isa(const ForwardOptions& opt, std::size_t routed, std::size_t experts) {
  if (opt.isa) return *opt.isa;
  const Isa d = default_isa();
  if (d == Isa::amx_bf16 && routed <= 4 * experts && isa_usable(Isa::avx512_bf16)) return Isa::avx512_bf16;
  return d;
}

}  // namespace

Workspace::Workspace() : impl_(std::make_unique<Impl>()) {}
Workspace::~Workspace() = default;
Workspace::Workspace(Workspace&&) noexcept = default;
Workspace& Workspace::operator=(Workspace&&) noexcept = default;
std::size_t Workspace::bytes() const { return impl_->arena.capacity(); }

ForwardStats forward(const PackedExperts& w, MatView<const bf16> x, MatView<const std::int32_t> idx,
                     MatView<const float> weights, MatView<float> y, const ForwardOptions& opt) {
  moecert::detail::Checker chk{"experts.forward"};
  contracts::experts_forward_pre(chk, w, x, idx, weights, y);
  if (chk.stop()) return {};
  const std::size_t t_count = x.rows, k = idx.cols, hidden = w.hidden(), inter = w.inter();
  std::size_t routed = 0;
  for (std::size_t t = 0; t < t_count; ++t)
    for (std::size_t j = 0; j < k; ++j) routed += idx(t, j) >= 0;
  ForwardStats stats;
  stats.isa = choose_isa(opt, routed, w.experts());
  const gemm::KernelInfo& kernel = gemm::kernel_info(stats.isa);

  // 1. Group the routed slots by expert (stable counting sort).
  Workspace temporary_ws;
  Workspace::Impl& ws = (opt.workspace ? *opt.workspace : temporary_ws).impl();
  ForwardState& st = ws.state;
  st.grouping = group_by_expert(idx, w.experts(), kernel.mr);
  const Grouping& g = st.grouping;
  contracts::experts_forward_grouping(chk, idx, g);
  stats.routed_rows = g.routed;
  stats.padded_rows = g.rows();
  const std::size_t rows = g.rows();
  const gemm::ALayout layout = kernel.a_layout;
  const std::size_t kp1 = w.experts() ? w.gate_up(0).kp() : 0, kp2 = w.experts() ? w.down(0).kp() : 0;
  st.layout = layout;
  st.lda = gemm::a_stride(layout, kp1);
  st.ldc1 = w.experts() ? w.gate_up(0).n() : 0;
  st.ldh = gemm::a_stride(layout, kp2);
  st.ldo = hidden;
  workspace::Arena& arena = ws.arena;
  arena.bind(workspace::plan_shape({w.experts(), hidden, inter, k, 0, t_count, 0}, false, 0, chk), chk);
  arena.enter(workspace::f_gather, chk);
  st.a = arena.get<bf16>("experts.a", gemm::a_size(layout, rows, kp1));
  // First element of padded row r in the packed A and h buffers (r is a
  // multiple of the kernel's MR wherever a block starts).
  auto a_row = [&](std::size_t r) { return st.a + gemm::a_offset(layout, st.lda, r, 0); };
  auto h_at = [&](std::size_t r, std::size_t col) { return st.h + gemm::a_offset(layout, st.ldh, r, col); };

  // 2. Gather each expert's token rows (padding rows and columns zero).
  oneapi::tbb::parallel_for(std::size_t{0}, w.experts(), [&](std::size_t e) {
    std::vector<std::int32_t> tokens(g.count[e]);
    for (std::size_t r = 0; r < g.count[e]; ++r) tokens[r] = g.row_slot[g.begin[e] + r] / static_cast<std::int32_t>(k);
    gemm::pack_a(layout, x, tokens.data(), g.count[e], g.begin[e + 1] - g.begin[e], kp1, a_row(g.begin[e]));
  });

  arena.enter(workspace::f_gate_up, chk);
  st.c1 = arena.get<float>("experts.c1", rows * st.ldc1);
  st.h = arena.get<bf16>("experts.h", gemm::a_size(layout, rows, kp2));
  // 3. Gate+up GEMM, then h = silu(g) * u per 32-column panel pair (16 gate
  //    columns, then the same 16 up columns), written into h in the
  //    kernel's A layout for the down GEMM. Work items: (expert, up to 512
  //    rows, 256 columns, pair-aligned). Tall items make each weight column
  //    block stream from memory once per expert, not once per row block;
  //    256 columns leave enough items for every thread.
  const std::size_t mb = round_up(512, kernel.mr);
  for_each_tile(tiles(g, st.ldc1, mb, 256), [&](const Tile& tl) {
    const std::size_t r0 = g.begin[tl.e] + tl.m0;
    gemm::gemm_block(kernel, a_row(r0), tl.m1 - tl.m0, w.gate_up(tl.e), tl.n0, tl.n1, st.ldc1, st.c1 + r0 * st.ldc1,
                     st.ldc1);
    for (std::size_t r = r0; r < r0 + (tl.m1 - tl.m0); ++r) {
      const float* c = st.c1 + r * st.ldc1;
      for (std::size_t n = tl.n0; n < tl.n1; n += 2 * gemm::kPanel) {
        const std::size_t col = n / 2;  // first intermediate index of the pair (16 in one A tile)
        if (col < inter) kernel.swiglu(c + n, c + n + gemm::kPanel, h_at(r, col), std::min(gemm::kPanel, inter - col));
      }
    }
  });
  // Zero h's K padding (columns I..kp2) and the padding rows, which the down
  // GEMM reads: a stale NaN there would reach valid outputs as 0 * NaN.
  oneapi::tbb::parallel_for(std::size_t{0}, w.experts(), [&](std::size_t e) {
    for (std::size_t r = g.begin[e]; r < g.begin[e + 1]; ++r)
      for (std::size_t col = r < g.begin[e] + g.count[e] ? inter : 0; col < kp2; ++col) *h_at(r, col) = bf16{};
  });

  // 4. Down GEMM.
  arena.enter(workspace::f_down, chk);
  st.o = arena.get<float>("experts.o", rows * st.ldo);
  for_each_tile(tiles(g, hidden, mb, 256), [&](const Tile& tl) {
    const std::size_t r0 = g.begin[tl.e] + tl.m0;
    gemm::gemm_block(kernel, h_at(r0, 0), tl.m1 - tl.m0, w.down(tl.e), tl.n0, tl.n1, hidden, st.o + r0 * st.ldo, st.ldo);
  });

  // 5. Combine in token order, slots in order j = 0..K-1, fp32 from zero.
  arena.enter(workspace::f_combine, chk);
  oneapi::tbb::parallel_for(std::size_t{0}, t_count, [&](std::size_t t) {
    float* yt = y.row(t);
    std::fill(yt, yt + hidden, 0.0f);
    for (std::size_t j = 0; j < k; ++j) {
      const std::int64_t row = g.slot_row[t * k + j];
      if (row < 0) continue;
      const float wt = weights(t, j);
      const float* o = st.o + static_cast<std::size_t>(row) * st.ldo;
      for (std::size_t m = 0; m < hidden; ++m) yt[m] += wt * o[m];
    }
  });

  arena.leave(chk);
  contracts::experts_forward_post(chk, w, x, idx, weights, y, st);
  return stats;
}

}  // namespace moecert::experts
