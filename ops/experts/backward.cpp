// Experts backward on a training forward's state: dy rows -> dh (and
// dL/dw = <dy, o>), then the expert path dh -> dg, du -> dx rows -> dx, the
// LoRA and base-weight gradients and the per-token statistics. Every output
// element has one writer and a fixed summation order: the same bits for any
// thread count.
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "ops/core/task.hpp"
#include "ops/core/views.hpp"
#include "ops/experts/train.hpp"
#include "ops/gemm/loops.hpp"
#include "ops/gemm/row_sums.hpp"
#include "ops/workspace/planner.hpp"

namespace moecert::experts {

using gemm::round_up;

namespace {

// The shapes and layouts every step reads.
struct Ctx {
  const PackedExperts& pe;
  TrainState& s;
  const Grouping& gr;
  const gemm::KernelInfo& kernel;
  gemm::ALayout layout;
  // A packed row in the kernel's layout is contiguous over 32 columns
  // (tiles) or all of it (rows: 0); the gradient sums read it in such runs.
  std::size_t chunk;
  std::size_t T, H, I, E, K, r, rows, mb;
  float sc;
  BackwardJudges judges;

  Ctx(const PackedExperts& w, TrainState& st, const BackwardJudges& j)
      : pe(w),
        s(st),
        gr(st.st.grouping),
        kernel(gemm::kernel_info(st.isa)),
        layout(st.st.layout),
        chunk(layout == gemm::ALayout::tiles ? gemm::kKStep : 0),
        T(st.tokens),
        H(w.hidden()),
        I(w.inter()),
        E(w.experts()),
        K(st.topk),
        r(st.st.rank),
        rows(gr.rows()),
        mb(round_up(512, kernel.mr)),
        sc(st.st.scale),
        judges(j) {}
  // Token and routing weight of a grouped row.
  std::size_t token_of(std::size_t row) const {
    return static_cast<std::size_t>(gr.row_slot[row]) / K;
  }
  float weight_of(std::size_t row) const {
    return s.weights[static_cast<std::size_t>(gr.row_slot[row])];
  }
  // Expert of a routed grouped row.
  std::size_t expert_of(std::size_t row) const {
    return static_cast<std::size_t>(s.idx[static_cast<std::size_t>(gr.row_slot[row])]);
  }
  // Row stride of dh (fp32, depth I padded to the K step).
  std::size_t ldd() const { return round_up(I, gemm::kKStep); }
  // The dg, du rows (bf16, A layout of depth 2I): dg at columns 0..I-1, du at I..2I-1.
  std::size_t kp2i() const { return round_up(2 * I, gemm::kKStep); }
  std::size_t ldg() const { return gemm::a_stride(layout, kp2i()); }
};

// Per expert e, its gradient rows out[e * r + k][n] = scale * sum over the
// expert's rows q of s[q][k] * v_q[n] ([r x N] blocks: A factors), or, with
// `transposed`, out[e * N + n][k] ([N x r] blocks: B factors). s: r values
// per grouped row at stride lds; row_scale: a factor of v per grouped row,
// or null. Several outputs share one pass over the rows v_q: output p takes
// s's values p r .. p r + r - 1 (an empty view: not wanted). Tasks (expert,
// 128 columns), one writer per element; each written block goes to `judge`
// (grad_finite) when not null.
template <class RowAt>
void expert_sums(const gemm::KernelInfo& kernel, contracts::GradFiniteScan* judge,
                 const Grouping& gr, std::size_t r, std::size_t n_cols, bool transposed,
                 const float* s, std::size_t lds, const float* row_scale, bool v_bf16, RowAt row_at,
                 std::size_t chunk, std::size_t shift, float scale,
                 std::initializer_list<MatView<float>> outs) {
  if (std::all_of(outs.begin(), outs.end(), [](const MatView<float>& o) { return o.empty(); }))
    return;
  constexpr std::size_t kCols = 128;
  const std::size_t blocks = (n_cols + kCols - 1) / kCols, rs = r * outs.size();
  oneapi::tbb::parallel_for(
      std::size_t{0}, gr.experts * blocks, moecert::detail::task([&](std::size_t task) {
        const std::size_t e = task / blocks, n0 = task % blocks * kCols,
                          n1 = std::min(n_cols, n0 + kCols);
        std::vector<float> acc(rs * (n1 - n0), 0.0f);
        gemm::row_sums(kernel, gr.begin[e], gr.count[e], rs, s + gr.begin[e] * lds, lds,
                       row_scale ? row_scale + gr.begin[e] : nullptr, v_bf16, row_at, chunk, shift,
                       n0, n1, acc.data(), n1 - n0);
        const float* a = acc.data();
        for (const MatView<float>& out : outs) {
          if (!out.empty()) {
            for (std::size_t k = 0; k < r; ++k)
              for (std::size_t j = n0; j < n1; ++j) {
                const float v = scale * a[k * (n1 - n0) + (j - n0)];
                if (transposed)
                  out(e * n_cols + j, k) = v;
                else
                  out(e * r + k, j) = v;
              }
            if (judge && transposed)
              judge->written(out.data, e * n_cols + n0, e * n_cols + n1, 0, r);
            else if (judge)
              judge->written(out.data, e * r, e * r + r, n0, n1);
          }
          a += r * (n1 - n0);
        }
      }));
}

// dL/dw of each grouped row: <dh', h> + <dyb, lb_d> in binary64, the row's
// terms in order (every product exact), rounded once, into dw at the row's
// slot. Eight rows at a time, an accumulator each: one row's additions form
// a chain of dependent double adds, and a row alone left the core waiting.
void dweights_rows(const Ctx& c, const float* dh, const float* dyb, MatView<float> dw) {
  constexpr std::size_t kRows = 8;
  const std::size_t ldd = c.ldd();
  const ForwardState& st = c.s.st;
  oneapi::tbb::parallel_for(
      std::size_t{0}, (c.rows + kRows - 1) / kRows, moecert::detail::task([&](std::size_t blk) {
        const std::size_t q0 = blk * kRows;
        const float* dq[kRows];
        const bf16* hq[kRows];  // h's row q, element i at hq + a_offset(0, i)
        for (std::size_t l = 0; l < kRows; ++l) {
          const std::size_t q =
              std::min(q0 + l, c.rows - 1);  // past the last row: that row again, not stored
          dq[l] = dh + q * ldd;
          hq[l] = st.h + gemm::a_offset(st.layout, st.ldh, q, 0);
        }
        double acc[kRows] = {};
        for (std::size_t i0 = 0; i0 < c.I;
             i0 += gemm::kKStep) {  // one contiguous 32-element piece of each h row
          const std::size_t at = gemm::a_offset(st.layout, st.ldh, 0, i0),
                            n = std::min(gemm::kKStep, c.I - i0);
          for (std::size_t i = 0; i < n; ++i)
            for (std::size_t l = 0; l < kRows; ++l)
              acc[l] += double(dq[l][i0 + i]) * double(hq[l][at + i].to_float());
        }
        for (std::size_t l = 0; l < kRows && q0 + l < c.rows; ++l) {
          const std::size_t q = q0 + l;
          if (c.gr.row_slot[q] < 0) continue;
          for (std::size_t k = 0; k < c.r; ++k)
            acc[l] +=
                double(dyb[q * c.r + k]) *
                double(
                    bf16(c.sc * st.ha[q * c.r + k]).to_float());  // lb_d, as the forward rounded it
          if (c.judges.saved) c.judges.saved->dweights(acc[l]);
          const auto slot = static_cast<std::size_t>(c.gr.row_slot[q]);
          dw(slot / c.K, slot % c.K) = static_cast<float>(acc[l]);
        }
      }));
}

}  // namespace

bool wants_expert_path(const Gradients& g) {
  for (const auto& v : {g.dx, g.a_gate, g.b_gate, g.a_up, g.b_up, g.a_down, g.b_down, g.w_gate,
                        g.w_up, g.w_down, g.m_a, g.m_g})
    if (!v.empty()) return true;
  return false;
}

DyRows backward_dh(const PackedExperts& w, TrainState& s, MatView<const float> dy, bool expert_path,
                   MatView<float> dw, const BackwardJudges& judges, detail::Checker& chk) {
  const Ctx c(w, s, judges);
  workspace::Arena& arena = s.arena;
  const bool need_dh = expert_path || !dw.empty();
  DyRows d;
  if (judges.probe) judges.probe->size_rows(c.rows);
  // 1. dy rows in bf16, in the kernel's A layout (step b_gather; the
  //    caller entered it).
  const std::size_t kph = round_up(c.H, gemm::kKStep), lddy = gemm::a_stride(c.layout, kph);
  bf16* dyr = arena.get<bf16>("bwd.dy", gemm::a_size(c.layout, c.rows, kph));
  auto dy_row = [&](std::size_t row) { return dyr + gemm::a_offset(c.layout, lddy, row, 0); };
  if (need_dh)
    oneapi::tbb::parallel_for(std::size_t{0}, c.E, moecert::detail::task([&](std::size_t e) {
                                std::vector<std::int32_t> tokens(c.gr.count[e]);
                                for (std::size_t q = 0; q < c.gr.count[e]; ++q)
                                  tokens[q] =
                                      static_cast<std::int32_t>(c.token_of(c.gr.begin[e] + q));
                                gemm::pack_a_f32(c.kernel, dy.data, dy.stride, tokens.data(),
                                                 c.gr.count[e], c.gr.begin[e + 1] - c.gr.begin[e],
                                                 c.H, kph, 1.0f, dy_row(c.gr.begin[e]));
                              }));

  // 2. dh' = dy W_d, dyb = dy B_d; dw = <dh', h> + <dyb, lb_d>; then the
  //    expert path's dh = dh' + bf16(s dyb) A_d.
  arena.enter(workspace::b_dh, chk);
  const std::size_t ldd = c.ldd();
  d.dh = arena.get<float>("bwd.dh", c.rows * ldd);
  d.dyb = c.r ? arena.get<float>("lora.dyb", c.rows * c.r) : nullptr;
  const std::size_t kr2 = round_up(c.r, gemm::kKStep);
  if (need_dh) {
    for_each_tile(tiles(c.gr.count, c.I, c.mb, gemm::item_cols(kph)), [&](const Tile& tl) {
      const std::size_t r0 = c.gr.begin[tl.e] + tl.m0;
      gemm::gemm_block(c.kernel, dy_row(r0), tl.m1 - tl.m0, w.down_t(tl.e), tl.n0, tl.n1, c.I,
                       d.dh + r0 * ldd, ldd);
    });
    if (c.r)
      for_each_tile(tiles(c.gr.count, c.r, c.mb, 256), [&](const Tile& tl) {
        const std::size_t r0 = c.gr.begin[tl.e] + tl.m0;
        gemm::gemm_block(c.kernel, dy_row(r0), tl.m1 - tl.m0, s.lora.experts[tl.e].b_d_t, tl.n0,
                         tl.n1, c.r, d.dyb + r0 * c.r, c.r);
      });
  }
  if (!dw.empty()) {
    detail::fill_zero(dw);
    if (judges.saved) judges.saved->h_through_dweights();
    dweights_rows(c, d.dh, d.dyb, dw);
  }
  if (expert_path && c.r) {
    bf16* qd = arena.get<bf16>("lora.qd", gemm::a_size(c.layout, c.rows, kr2));
    const std::size_t ldq = gemm::a_stride(c.layout, kr2);
    oneapi::tbb::parallel_for(std::size_t{0}, c.E, moecert::detail::task([&](std::size_t e) {
                                gemm::pack_a_f32(
                                    c.kernel, d.dyb + c.gr.begin[e] * c.r, c.r, nullptr,
                                    c.gr.count[e], c.gr.begin[e + 1] - c.gr.begin[e], c.r, kr2,
                                    c.sc, qd + gemm::a_offset(c.layout, ldq, c.gr.begin[e], 0));
                              }));
    for_each_tile(tiles(c.gr.count, c.I, c.mb, 256), [&](const Tile& tl) {
      const std::size_t r0 = c.gr.begin[tl.e] + tl.m0;
      gemm::gemm_block(c.kernel, qd + gemm::a_offset(c.layout, ldq, r0, 0), tl.m1 - tl.m0,
                       s.lora.experts[tl.e].a_d_t, tl.n0, tl.n1, c.I, d.dh + r0 * ldd, ldd,
                       {.accumulate = true});
    });
  }
  // At audit: with the expert path the SwiGLU backward hands dh's rows to
  // the probe, which takes A's side now, while the dy rows live.
  if (judges.probe && need_dh) {
    const contracts::OperandRows dy16 = operand_rows(dyr, lddy, c.layout);
    if (expert_path)
      judges.probe->dh_sides(grouping_view(c.gr), dy16, d.dyb, c.r > 0);
    else
      judges.probe->dh(grouping_view(c.gr), dy16, d.dh, ldd, d.dyb, false);
  }
  return d;
}

namespace {

// Step b_swiglu: dg, du (bf16, A layout of depth 2I) from dh, the saved
// gate/up outputs and the routing weight; with LoRA, dgb = [dg du]
// blockdiag(B_g, B_u). Runs of at most 16 intermediates: one c1 panel (16
// gate columns, the same 16 up columns after them) whose dg and du each
// stay inside one 32-column piece of a dgu row (contiguous in either A
// layout).
void swiglu_backward(const Ctx& c, const float* dh, bf16* dgu, float* dgb) {
  const ForwardState& st = c.s.st;
  const std::size_t ldd = c.ldd(), kp2i = c.kp2i(), ldg = c.ldg();
  const std::size_t piece = c.chunk ? c.chunk : kp2i;
  auto at = [&](std::size_t row, std::size_t col) {
    return dgu + gemm::a_offset(c.layout, ldg, row, col);
  };
  oneapi::tbb::parallel_for(
      std::size_t{0}, c.rows, moecert::detail::task([&](std::size_t row) {
        const bool valid = c.gr.row_slot[row] >= 0;
        for (std::size_t i = valid ? 2 * c.I : 0; i < kp2i; ++i) *at(row, i) = bf16{};
        if (!valid) return;
        const float wt = c.weight_of(row);
        const float* c1 = st.c1 + row * st.ldc1;
        for (std::size_t i = 0; i < c.I;) {
          const std::size_t n =
              std::min({gemm::kPanel - i % gemm::kPanel, piece - (c.I + i) % piece, c.I - i});
          const std::size_t col =
              2 * gemm::kPanel * (i / gemm::kPanel) + i % gemm::kPanel;  // gate; up 16 further
          c.kernel.swiglu_backward(c1 + col, c1 + col + gemm::kPanel, dh + row * ldd + i, wt,
                                   at(row, i), at(row, c.I + i), n);
          i += n;
        }
        if (c.judges.saved) c.judges.saved->row(row);  // c1's row, still in cache
        if (c.judges.intact) c.judges.intact->row(row);
        if (c.judges.probe) c.judges.probe->dh_row(c.expert_of(row), row, dh + row * ldd);
      }));
  if (c.r)
    for_each_tile(tiles(c.gr.count, 2 * c.r, c.mb, 256), [&](const Tile& tl) {
      const std::size_t r0 = c.gr.begin[tl.e] + tl.m0;
      gemm::gemm_block(c.kernel, at(r0, 0), tl.m1 - tl.m0, c.s.lora.experts[tl.e].b_gu_t, tl.n0,
                       tl.n1, 2 * c.r, dgb + r0 * 2 * c.r, 2 * c.r);
    });
}

// dB_d[e] = s sum_rows (w dy) ha^T [H x r]; dA_d[e] = s sum_rows (w dyb) h^T [r x I].
void lora_down_grads(const Ctx& c, MatView<const float> dy, const float* dyb, const Gradients& g) {
  const ForwardState& st = c.s.st;
  std::vector<float> wts(c.rows), wdyb(c.rows * c.r);  // w per grouped row; w dyb
  for (std::size_t q = 0; q < c.rows; ++q) {
    wts[q] = c.gr.row_slot[q] >= 0 ? c.weight_of(q) : 0.0f;
    for (std::size_t k = 0; k < c.r; ++k) wdyb[q * c.r + k] = wts[q] * dyb[q * c.r + k];
  }
  expert_sums(
      c.kernel, c.judges.grads, c.gr, c.r, c.H, true, st.ha, c.r, wts.data(), false,
      [&](std::size_t q, std::size_t m) -> const void* { return dy.row(c.token_of(q)) + m; }, 0, 0,
      c.sc, {g.b_down});
  expert_sums(c.kernel, c.judges.grads, c.gr, c.r, c.I, false, wdyb.data(), c.r, nullptr, true,
              [&](std::size_t q, std::size_t i) -> const void* {
                return &st.h[gemm::a_offset(c.layout, st.ldh, q, i)];
              },
              c.chunk, 0, c.sc, {g.a_down});
}

// Step b_dx: dx rows = [dg du] [W_g; W_u] (+ LoRA: bf16(s dgb) [A_g; A_u]).
void dx_rows(const Ctx& c, const bf16* dgu, const float* dgb, float* dxr) {
  workspace::Arena& arena = c.s.arena;
  const std::size_t kr1 = round_up(2 * c.r, gemm::kKStep), ldg = c.ldg();
  bf16* qgu = c.r ? arena.get<bf16>("lora.qgu", gemm::a_size(c.layout, c.rows, kr1)) : nullptr;
  const std::size_t ldq = gemm::a_stride(c.layout, kr1);
  if (c.r)
    oneapi::tbb::parallel_for(std::size_t{0}, c.E, moecert::detail::task([&](std::size_t e) {
                                gemm::pack_a_f32(
                                    c.kernel, dgb + c.gr.begin[e] * 2 * c.r, 2 * c.r, nullptr,
                                    c.gr.count[e], c.gr.begin[e + 1] - c.gr.begin[e], 2 * c.r, kr1,
                                    c.sc, qgu + gemm::a_offset(c.layout, ldq, c.gr.begin[e], 0));
                              }));
  // Items of 128 columns (gemm::item_cols, K = 2I): with 256, B (1.4 MiB
  // at I = 1408) would not stay in L2 under the AMX loops' row blocks.
  const std::size_t nb_dx = gemm::item_cols(c.kp2i());
  for_each_tile(tiles(c.gr.count, c.H, c.mb, nb_dx), [&](const Tile& tl) {
    const std::size_t r0 = c.gr.begin[tl.e] + tl.m0;
    gemm::BlockOptions bo;  // the LoRA product into the same blocks
    if (c.r)
      bo.a2 = qgu + gemm::a_offset(c.layout, ldq, r0, 0), bo.w2 = &c.s.lora.experts[tl.e].a_gu_t;
    gemm::gemm_block(c.kernel, dgu + gemm::a_offset(c.layout, ldg, r0, 0), tl.m1 - tl.m0,
                     c.pe.gate_up_t(tl.e), tl.n0, tl.n1, c.H, dxr + r0 * c.H, c.H, bo);
  });
}

// dx_t = sum_j dx rows of t's slots, in slot order from 0 (fp32).
void scatter_dx(const Ctx& c, const float* dxr, MatView<float> dx) {
  oneapi::tbb::parallel_for(std::size_t{0}, c.T, moecert::detail::task([&](std::size_t t) {
                              float* o = dx.row(t);
                              std::fill(o, o + c.H, 0.0f);
                              for (std::size_t j = 0; j < c.K; ++j) {
                                const std::int64_t row = c.gr.slot_row[t * c.K + j];
                                if (row < 0) continue;
                                const float* src = dxr + static_cast<std::size_t>(row) * c.H;
                                for (std::size_t m = 0; m < c.H; ++m) o[m] += src[m];
                                if (c.judges.probe)  // the row in cache, to the probe
                                  c.judges.probe->dx_row(c.expert_of(static_cast<std::size_t>(row)),
                                                         static_cast<std::size_t>(row), src);
                              }
                              if (c.judges.grads)
                                c.judges.grads->written(dx.data, t, t + 1, 0, c.H);
                            }));
}

// dB_g[e] = s sum_rows dg xa_g^T, dA_g[e] = s sum_rows dgb_g x^T; up likewise.
void lora_gate_up_grads(const Ctx& c, MatView<const bf16> x, const bf16* dgu, const float* dgb,
                        const Gradients& g) {
  const ForwardState& st = c.s.st;
  const std::size_t ldg = c.ldg();
  auto x_at = [&](std::size_t q, std::size_t m) -> const void* { return x.row(c.token_of(q)) + m; };
  for (std::size_t part = 0; part < 2; ++part)  // gate, up
    expert_sums(c.kernel, c.judges.grads, c.gr, c.r, c.I, true, st.xa + part * c.r, 2 * c.r,
                nullptr, true,
                [&](std::size_t q, std::size_t i) -> const void* {
                  return dgu + gemm::a_offset(c.layout, ldg, q, part * c.I + i);
                },
                c.chunk, part* c.I, c.sc, {part ? g.b_up : g.b_gate});
  // Both A factors in one pass over the x rows (dgb: r gate values, then r up).
  expert_sums(c.kernel, c.judges.grads, c.gr, c.r, c.H, false, dgb, 2 * c.r, nullptr, true, x_at, 0,
              0, c.sc, {g.a_gate, g.a_up});
}

// Base weights: per expert, GEMMs over its rows (K = the row count,
// zero-padded): dW_g[e] = dg^T X, dW_u[e] = du^T X ([I x H]),
// dW_d[e] = bf16(w dy)^T Hr ([H x I]; Hr: the saved h rows). The left
// factor, transposed, is the A operand; the right one, transposed, is
// packed like weights. Tasks (expert, matrix); one writer per element.
// Each finished block goes to grad_finite's judge while in cache.
void base_grads(const Ctx& c, MatView<const bf16> x, MatView<const float> dy, const bf16* dgu,
                const Gradients& g) {
  const ForwardState& st = c.s.st;
  const std::size_t ldg = c.ldg();
  oneapi::tbb::parallel_for(
      std::size_t{0}, 3 * c.E, moecert::detail::task([&](std::size_t task) {
        const std::size_t e = task / 3, which = task % 3, q0 = c.gr.begin[e], m = c.gr.count[e];
        const MatView<float> out = which == 0 ? g.w_gate : which == 1 ? g.w_up : g.w_down;
        if (out.empty()) return;
        const std::size_t M = which < 2 ? c.I : c.H, N = which < 2 ? c.H : c.I;
        contracts::GradFiniteScan::Task judged(c.judges.grads, out.data);
        if (m == 0) {  // an idle expert: exactly 0
          for (std::size_t i = 0; i < M; ++i)
            std::fill(out.row(e * M + i), out.row(e * M + i) + N, 0.0f);
          judged.add(e * M, e * M + M, 0, N);
          return;
        }
        std::vector<bf16> left(M * m), right(N * m);  // [M x m], [N x m]
        for (std::size_t q = 0; q < m; ++q) {
          const std::size_t row = q0 + q;
          const bf16* xt = x.row(c.token_of(row));
          if (which < 2) {
            for (std::size_t i = 0; i < c.I; ++i)
              left[i * m + q] = dgu[gemm::a_offset(c.layout, ldg, row, which * c.I + i)];
            for (std::size_t h = 0; h < c.H; ++h) right[h * m + q] = xt[h];
          } else {
            const float wt = c.weight_of(row), *d = dy.row(c.token_of(row));
            for (std::size_t h = 0; h < c.H; ++h) left[h * m + q] = bf16(wt * d[h]);
            for (std::size_t i = 0; i < c.I; ++i) right[i * m + q] = st.h_at(row, i);
          }
        }
        const auto wpk =
            gemm::PackedWeights::pack_operand(MatView<const bf16>(right.data(), N, m), {}, {});
        const std::size_t mp = round_up(std::max<std::size_t>(M, 1), c.kernel.mr);
        std::vector<bf16> ap(gemm::a_size(c.layout, mp, wpk.kp()));
        gemm::pack_a(c.layout, MatView<const bf16>(left.data(), M, m), nullptr, M, mp, wpk.kp(),
                     ap.data());
        const auto judge = [&](std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1) {
          judged.add(e * M + i0, e * M + i1, j0, j1);
        };
        gemm::BlockOptions opt;
        if (c.judges.grads) opt.block_done = judge;
        gemm::gemm_block(c.kernel, ap.data(), M, wpk, 0, wpk.np(), N, out.row(e * M), out.stride,
                         opt);
      }));
}

// Per-token statistics (docs/DESIGN.md, proofs/layer.md §5): M_A[t,e] =
// sqrt(|x_t|^2 + |h|^2), M_G[t,e] from the rank-1 norms of each trainable
// matrix's per-token gradient, in binary64; 0 where t is not routed to e.
void token_stats(const Ctx& c, MatView<const bf16> x, MatView<const float> dy, const bf16* dgu,
                 const float* dgb, const float* dyb, const Gradients& g) {
  const ForwardState& st = c.s.st;
  const std::size_t ldg = c.ldg(), r = c.r;
  if (!g.m_a.empty()) detail::fill_zero(g.m_a);
  if (!g.m_g.empty()) detail::fill_zero(g.m_g);
  oneapi::tbb::parallel_for(
      std::size_t{0}, c.rows, moecert::detail::task([&](std::size_t row) {
        if (c.gr.row_slot[row] < 0) return;
        const std::size_t t = c.token_of(row),
                          e = static_cast<std::size_t>(c.s.idx[c.gr.row_slot[row]]);
        auto sq = [](double v) { return v * v; };
        auto dg_at = [&](std::size_t i) {
          return dgu[gemm::a_offset(c.layout, ldg, row, i)].to_float();
        };
        double x2 = 0, dy2 = 0, h2 = 0, dg2 = 0, du2 = 0;
        for (std::size_t m = 0; m < c.H; ++m) x2 += sq(x(t, m).to_float()), dy2 += sq(dy(t, m));
        for (std::size_t i = 0; i < c.I; ++i)
          h2 += sq(st.h_at(row, i).to_float()), dg2 += sq(dg_at(i)), du2 += sq(dg_at(c.I + i));
        const double wt = c.weight_of(row), w2 = wt * wt;
        double g2;
        if (r) {
          double bg2 = 0, bu2 = 0, xg2 = 0, xu2 = 0, yb2 = 0, ha2 = 0;
          for (std::size_t k = 0; k < r; ++k) {
            bg2 += sq(dgb[row * 2 * r + k]), bu2 += sq(dgb[row * 2 * r + r + k]);
            xg2 += sq(st.xa[row * 2 * r + k]), xu2 += sq(st.xa[row * 2 * r + r + k]);
            yb2 += sq(dyb[row * r + k]), ha2 += sq(st.ha[row * r + k]);
          }
          g2 = double(c.sc) * c.sc *
               (bg2 * x2 + dg2 * xg2 + bu2 * x2 + du2 * xu2 + w2 * yb2 * h2 + w2 * dy2 * ha2);
        } else {
          g2 = dg2 * x2 + du2 * x2 + w2 * dy2 * h2;
        }
        if (!g.m_a.empty()) g.m_a(t, e) = static_cast<float>(std::sqrt(x2 + h2));
        if (!g.m_g.empty()) g.m_g(t, e) = static_cast<float>(std::sqrt(g2));
      }));
}

}  // namespace

void backward_expert(const PackedExperts& w, TrainState& s, MatView<const bf16> x,
                     MatView<const float> dy, const DyRows& d, const Gradients& g, bool expert_path,
                     const BackwardJudges& judges, detail::Checker& chk) {
  const Ctx c(w, s, judges);
  workspace::Arena& arena = s.arena;
  const std::size_t kp2i = c.kp2i();
  // 3. dg, du; LoRA down gradients.
  arena.enter(workspace::b_swiglu, chk);
  bf16* dgu = arena.get<bf16>("bwd.dgu", gemm::a_size(c.layout, c.rows, kp2i));
  float* dgb = c.r ? arena.get<float>("lora.dgb", c.rows * 2 * c.r) : nullptr;
  if (expert_path) swiglu_backward(c, d.dh, dgu, dgb);
  if (judges.probe && expert_path) judges.probe->dh_judge(grouping_view(c.gr), d.dyb);
  if (judges.saved) {  // before the first output is written
    judges.saved->report();
    if (chk.stop()) return;
  }
  if (judges.intact) {
    judges.intact->report();
    if (chk.stop()) return;
  }
  if (expert_path && c.r) lora_down_grads(c, dy, d.dyb, g);
  // 4. dx rows.
  arena.enter(workspace::b_dx, chk);
  float* dxr = arena.get<float>("bwd.dx_rows", c.rows * c.H);
  // At audit the dx rows are judged once the scatter has handed them over,
  // or here when dx is not wanted.
  const bool scattered = expert_path && !g.dx.empty();
  if (expert_path) {
    dx_rows(c, dgu, dgb, dxr);
    if (judges.probe && !scattered)
      judges.probe->dx(grouping_view(c.gr), operand_rows(dgu, c.ldg(), c.layout), dxr, dgb);
  }
  // 5. dx, LoRA gate/up gradients, base-weight gradients, statistics.
  arena.enter(workspace::b_scatter, chk);
  if (!g.dx.empty()) {
    if (expert_path)
      scatter_dx(c, dxr, g.dx);
    else
      detail::fill_zero(g.dx);
  }
  if (judges.probe && scattered)
    judges.probe->dx(grouping_view(c.gr), operand_rows(dgu, c.ldg(), c.layout), nullptr, dgb);
  if (c.r && expert_path) {
    lora_gate_up_grads(c, x, dgu, dgb, g);
  } else {
    for (const auto& v : {g.a_gate, g.b_gate, g.a_up, g.b_up, g.a_down, g.b_down})
      if (!v.empty()) detail::fill_zero(v);
  }
  if (expert_path) {
    base_grads(c, x, dy, dgu, g);
  } else {
    for (const auto& v : {g.w_gate, g.w_up, g.w_down})
      if (!v.empty()) detail::fill_zero(v);
  }
  if (!g.m_a.empty() || !g.m_g.empty()) {
    if (expert_path)
      token_stats(c, x, dy, dgu, dgb, d.dyb, g);
    else
      for (const auto& v : {g.m_a, g.m_g})
        if (!v.empty()) detail::fill_zero(v);
  }
}

}  // namespace moecert::experts
