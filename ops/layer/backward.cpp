// MoE layer backward: the expert path (dy rows -> dh -> dg, du -> dx rows,
// LoRA gradients) and the router path (dw = <dy, o>, router backward,
// router linear backward), on the forward's arena. Every output element has
// one writer and a fixed summation order: the same bits for any thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <vector>

#include <oneapi/tbb/parallel_for.h>

#include "contracts/layer.hpp"
#include "moecert/router.hpp"
#include "ops/core/task.hpp"
#include "ops/gemm/loops.hpp"
#include "ops/layer/state.hpp"
#include "ops/workspace/planner.hpp"

namespace moecert::layer {

using gemm::round_up;

namespace {

void zero(MatView<float> m) {
  for (std::size_t i = 0; i < m.rows; ++i) std::fill(m.row(i), m.row(i) + m.cols, 0.0f);
}

// Sums over the rows q of [q0, q0 + m) in order, through the kernel's
// rank_sums: acc[k][j] (k < r, j < n1 - n0) = sum_q s[q][k] * v_q[n0 + j],
// v_q given as a pointer to the element at a column (row_at(q, col)).
// Rows in the kernel's `tiles` layout are contiguous only within 32
// columns (chunk = 32, column col sitting at col + shift of the row); plain
// rows throughout (chunk = 0).
//
// The rows go in blocks of kRows, all columns per block: the kernel walks
// the rows once per 32 columns, and over a block's rows those pieces stay
// in L1 and its pages in the TLB (all T rows at once, 4 KiB apart, missed
// the TLB on every row: the router-linear gradient at T = 4096 took 21x the
// time of T = 1024 here). acc holds the sums between blocks: fp32 stores
// and reloads, the same bits.
template <class RowAt>
void row_sums(const gemm::KernelInfo& kernel, std::size_t q0, std::size_t m, std::size_t r, const float* s,
              std::size_t lds, const float* vscale, bool v_bf16, RowAt row_at, std::size_t chunk, std::size_t shift,
              std::size_t n0, std::size_t n1, float* acc, std::size_t ldacc) {
  constexpr std::size_t kRows = 64;
  const void* ptr[kRows];
  for (std::size_t b0 = 0; b0 < m; b0 += kRows) {
    const std::size_t bm = std::min(kRows, m - b0);
    for (std::size_t j = n0; j < n1;) {
      const std::size_t len = chunk ? std::min(n1 - j, chunk - (j + shift) % chunk) : n1 - j;
      for (std::size_t q = 0; q < bm; ++q) ptr[q] = row_at(q0 + b0 + q, j);
      gemm::RankSumArgs a;
      a.m = bm, a.r = r, a.n = len, a.v = ptr, a.v_bf16 = v_bf16, a.vscale = vscale ? vscale + b0 : nullptr;
      a.s = s + b0 * lds, a.lds = lds, a.acc = acc + (j - n0), a.ldacc = ldacc;
      kernel.rank_sums(a);
      j += len;
    }
  }
}

// Per expert e, its gradient rows out[e * r + k][n] = scale * sum over the
// expert's rows q of s[q][k] * v_q[n] ([r x N] blocks: A factors), or, with
// `transposed`, out[e * N + n][k] ([N x r] blocks: B factors). s: r values
// per grouped row at stride lds; row_scale: a factor of v per grouped row,
// or null. Several outputs share one pass over the rows v_q: output p takes
// s's values p r .. p r + r - 1 (an empty view: not wanted). Tasks (expert,
// 128 columns), one writer per element.
template <class RowAt>
void expert_sums(const gemm::KernelInfo& kernel, const experts::Grouping& gr, std::size_t r, std::size_t n_cols,
                 bool transposed, const float* s, std::size_t lds, const float* row_scale, bool v_bf16, RowAt row_at,
                 std::size_t chunk, std::size_t shift, float scale, std::initializer_list<MatView<float>> outs) {
  if (std::all_of(outs.begin(), outs.end(), [](const MatView<float>& o) { return o.empty(); })) return;
  constexpr std::size_t kCols = 128;
  const std::size_t blocks = (n_cols + kCols - 1) / kCols, rs = r * outs.size();
  oneapi::tbb::parallel_for(std::size_t{0}, gr.experts * blocks, moecert::detail::task([&](std::size_t task) {
    const std::size_t e = task / blocks, n0 = task % blocks * kCols, n1 = std::min(n_cols, n0 + kCols);
    std::vector<float> acc(rs * (n1 - n0), 0.0f);
#ifdef MOECERT_MUTANT_EMPTY_EXPERT_GRAD_UNINIT
    if (!gr.count[e]) return;  // mutant (docs/MUTANTS.md): idle experts' gradients left unwritten
#endif
    row_sums(kernel, gr.begin[e], gr.count[e], rs, s + gr.begin[e] * lds, lds, row_scale ? row_scale + gr.begin[e] : nullptr,
             v_bf16, row_at, chunk, shift, n0, n1, acc.data(), n1 - n0);
    const float* a = acc.data();
    for (const MatView<float>& out : outs) {
      if (!out.empty())
        for (std::size_t k = 0; k < r; ++k)
          for (std::size_t j = n0; j < n1; ++j) {
            const float v = scale * a[k * (n1 - n0) + (j - n0)];
            if (transposed) out(e * n_cols + j, k) = v;
            else out(e * r + k, j) = v;
          }
      a += r * (n1 - n0);
    }
  }));
}

}  // namespace

void backward(const MoeConfig& cfg, const Weights& w, MatView<const bf16> x, MatView<const float> dy, Saved& saved,
              const Gradients& grads, const BackwardOptions& opt) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  detail::Checker chk{"layer.backward"};
  contracts::layer_backward_pre(chk, cfg, w, x, dy, saved, grads);
  if (chk.stop()) return;
  Saved::Impl& s = saved.impl();
  experts::ForwardState& st = s.st;
  const experts::Grouping& gr = st.grouping;
  const experts::PackedExperts& pe = *w.experts;
  const gemm::KernelInfo& kernel = gemm::kernel_info(s.isa);
  const gemm::ALayout layout = st.layout;
  // A packed row in the kernel's layout is contiguous over 32 columns
  // (tiles) or all of it (rows: 0); the gradient sums read it in such runs.
  const std::size_t chunk = layout == gemm::ALayout::tiles ? gemm::kKStep : 0;
  const std::size_t T = x.rows, H = pe.hidden(), I = pe.inter(), E = pe.experts(), K = static_cast<std::size_t>(cfg.topk);
  const std::size_t r = st.rank, R = static_cast<std::size_t>(workspace::router_outputs(cfg)), rows = gr.rows();
  const float sc = st.scale;
  const std::size_t mb = round_up(512, kernel.mr);
  workspace::Arena& arena = s.arena;
  const bool need_dh = opt.expert_path || opt.router_path;

  // Rows of expert e's tokens (token index per grouped row).
  auto token_of = [&](std::size_t row) { return static_cast<std::size_t>(gr.row_slot[row]) / K; };
  auto weight_of = [&](std::size_t row) { return s.weights[static_cast<std::size_t>(gr.row_slot[row])]; };

  // 1. dy rows in bf16, in the kernel's A layout.
  arena.enter(workspace::b_gather, chk);
  contracts::layer_backward_saved(chk, cfg, x, saved);
  if (chk.stop()) return;
  const std::size_t kph = round_up(H, gemm::kKStep), lddy = gemm::a_stride(layout, kph);
  bf16* dyr = arena.get<bf16>("bwd.dy", gemm::a_size(layout, rows, kph));
  auto dy_row = [&](std::size_t row) { return dyr + gemm::a_offset(layout, lddy, row, 0); };
  if (need_dh)
    oneapi::tbb::parallel_for(std::size_t{0}, E, moecert::detail::task([&](std::size_t e) {
      std::vector<std::int32_t> tokens(gr.count[e]);
      for (std::size_t q = 0; q < gr.count[e]; ++q) tokens[q] = static_cast<std::int32_t>(token_of(gr.begin[e] + q));
      gemm::pack_a_f32(kernel, dy.data, dy.stride, tokens.data(), gr.count[e], gr.begin[e + 1] - gr.begin[e], H, kph, 1.0f,
                       dy_row(gr.begin[e]));
    }));

  // 2. dh' = dy W_d (+ LoRA), dyb = dy B_d; router path: dw = <dy W_d, h> + <dyb, lb_d>.
  arena.enter(workspace::b_dh, chk);
  const std::size_t ldd = round_up(I, gemm::kKStep);
  float* dh = arena.get<float>("bwd.dh", rows * ldd);
  float* dyb = r ? arena.get<float>("lora.dyb", rows * r) : nullptr;
  float* dw = arena.get<float>("router.dw", T * K);
  const std::size_t kr1 = round_up(2 * r, gemm::kKStep), kr2 = round_up(r, gemm::kKStep);
  if (need_dh) {
    for_each_tile(experts::tiles(gr, I, mb, gemm::item_cols(kph)), [&](const experts::Tile& tl) {
      const std::size_t r0 = gr.begin[tl.e] + tl.m0;
      gemm::gemm_block(kernel, dy_row(r0), tl.m1 - tl.m0, pe.down_t(tl.e), tl.n0, tl.n1, I, dh + r0 * ldd, ldd);
    });
    if (r)
      for_each_tile(experts::tiles(gr, r, mb, 256), [&](const experts::Tile& tl) {
        const std::size_t r0 = gr.begin[tl.e] + tl.m0;
        gemm::gemm_block(kernel, dy_row(r0), tl.m1 - tl.m0, s.lora.experts[tl.e].b_d_t, tl.n0, tl.n1, r, dyb + r0 * r, r);
      });
  }
  std::fill(dw, dw + T * K, 0.0f);
  if (opt.router_path) {
    // dL/dw of each grouped row: <dh, h> + <dyb, lb_d> in binary64, the
    // row's terms in order (every product exact), rounded once. Eight rows
    // at a time, an accumulator each: one row's additions form a chain of
    // dependent double adds, and a row alone left the core waiting on them.
    constexpr std::size_t kRows = 8;
    oneapi::tbb::parallel_for(std::size_t{0}, (rows + kRows - 1) / kRows, moecert::detail::task([&](std::size_t blk) {
      const std::size_t q0 = blk * kRows;
      const float* dq[kRows];
      const bf16* hq[kRows];  // h's row q, element i at hq + a_offset(0, i)
      for (std::size_t l = 0; l < kRows; ++l) {
        const std::size_t q = std::min(q0 + l, rows - 1);  // past the last row: that row again, not stored
        dq[l] = dh + q * ldd;
        hq[l] = st.h + gemm::a_offset(st.layout, st.ldh, q, 0);
      }
      double acc[kRows] = {};
      for (std::size_t i0 = 0; i0 < I; i0 += gemm::kKStep) {  // one contiguous 32-element piece of each h row
        const std::size_t at = gemm::a_offset(st.layout, st.ldh, 0, i0), n = std::min(gemm::kKStep, I - i0);
        for (std::size_t i = 0; i < n; ++i)
          for (std::size_t l = 0; l < kRows; ++l) acc[l] += double(dq[l][i0 + i]) * double(hq[l][at + i].to_float());
      }
      for (std::size_t l = 0; l < kRows && q0 + l < rows; ++l) {
        const std::size_t q = q0 + l;
        if (gr.row_slot[q] < 0) continue;
        for (std::size_t k = 0; k < r; ++k)
          acc[l] += double(dyb[q * r + k]) * double(bf16(sc * st.ha[q * r + k]).to_float());  // lb_d, as the forward rounded it
#ifdef MOECERT_MUTANT_DW_WRONG_SLOT
        const auto slot = static_cast<std::size_t>(gr.row_slot[q]);  // mutant (docs/MUTANTS.md): dL/dw lands on the next slot
        dw[slot / K * K + (slot % K + 1) % K] = static_cast<float>(acc[l]);
#else
        dw[static_cast<std::size_t>(gr.row_slot[q])] = static_cast<float>(acc[l]);
#endif
      }
    }));
  }
  if (opt.expert_path && r) {
    bf16* qd = arena.get<bf16>("lora.qd", gemm::a_size(layout, rows, kr2));
    const std::size_t ldq = gemm::a_stride(layout, kr2);
    oneapi::tbb::parallel_for(std::size_t{0}, E, moecert::detail::task([&](std::size_t e) {
      gemm::pack_a_f32(kernel, dyb + gr.begin[e] * r, r, nullptr, gr.count[e], gr.begin[e + 1] - gr.begin[e], r, kr2, sc,
                       qd + gemm::a_offset(layout, ldq, gr.begin[e], 0));
    }));
    for_each_tile(experts::tiles(gr, I, mb, 256), [&](const experts::Tile& tl) {
      const std::size_t r0 = gr.begin[tl.e] + tl.m0;
      gemm::gemm_block(kernel, qd + gemm::a_offset(layout, ldq, r0, 0), tl.m1 - tl.m0, s.lora.experts[tl.e].a_d_t, tl.n0,
                       tl.n1, I, dh + r0 * ldd, ldd, {.accumulate = true});
    });
  }

  // 3. Router path: the router's backward from dw, into dz [T x R].
  arena.enter(workspace::b_router, chk);
  float* dz = arena.get<float>("router.dz", T * R);
  const MatView<const float> z(s.logits, T, R, R);
  // dz as [T x R] rows; for product_key as two planes dsx [T x n], dsy [T x n]
  // (the router's backward wants them disjoint).
  const bool planes = cfg.router == RouterKind::product_key;
  const std::size_t half = R / 2;
  auto dz_at = [&](std::size_t t, std::size_t e) {
    return planes ? (e < half ? dz[t * half + e] : dz[T * half + t * half + e - half]) : dz[t * R + e];
  };
  const MatView<float> dzv(dz, T, R, R);
  if (opt.router_path) {
    const MatView<const std::int32_t> idx = saved.idx();
    const MatView<const float> g(dw, T, K, K);
    switch (cfg.router) {
      case RouterKind::softmax_topk: router::softmax_topk_backward(z, idx, g, dzv, cfg.renormalize); break;
      case RouterKind::sigmoid_topk:
        router::sigmoid_topk_backward(z, idx, g,
                                      {static_cast<std::size_t>(cfg.groups), static_cast<std::size_t>(cfg.topk_group),
                                       static_cast<float>(cfg.scaling)},
                                      dzv);
        break;
      case RouterKind::product_key:
        router::product_key_backward(MatView<const float>(z.data, T, half, R), MatView<const float>(z.data + half, T, half, R),
                                     idx, g, router::KeyWeights::softmax, MatView<float>(dz, T, half, half),
                                     MatView<float>(dz + T * half, T, half, half));
        break;
    }
  } else {
    zero(dzv);
  }

  // 4. dg, du (bf16, A layout of depth 2I); LoRA: dgb = [dg du] blockdiag(B_g, B_u)
  //    and the down factors' gradients.
  arena.enter(workspace::b_swiglu, chk);
  const std::size_t kp2i = round_up(2 * I, gemm::kKStep), ldg = gemm::a_stride(layout, kp2i);
  bf16* dgu = arena.get<bf16>("bwd.dgu", gemm::a_size(layout, rows, kp2i));
  auto dgu_at = [&](std::size_t row, std::size_t col) -> bf16& { return dgu[gemm::a_offset(layout, ldg, row, col)]; };
  float* dgb = r ? arena.get<float>("lora.dgb", rows * 2 * r) : nullptr;
  if (opt.expert_path) {
    // Runs of at most 16 intermediates: one c1 panel (16 gate columns, the
    // same 16 up columns after them) whose dg and du each stay inside one
    // 32-column piece of a dgu row (contiguous in either A layout).
    const std::size_t piece = chunk ? chunk : kp2i;
    oneapi::tbb::parallel_for(std::size_t{0}, rows, moecert::detail::task([&](std::size_t row) {
      const bool valid = gr.row_slot[row] >= 0;
      for (std::size_t i = valid ? 2 * I : 0; i < kp2i; ++i) dgu_at(row, i) = bf16{};
      if (!valid) return;
      const float wt = weight_of(row);
      const float* c = st.c1 + row * st.ldc1;
      for (std::size_t i = 0; i < I;) {
        const std::size_t n = std::min({gemm::kPanel - i % gemm::kPanel, piece - (I + i) % piece, I - i});
        const std::size_t at = 2 * gemm::kPanel * (i / gemm::kPanel) + i % gemm::kPanel;  // gate; up 16 further
        kernel.swiglu_backward(c + at, c + at + gemm::kPanel, dh + row * ldd + i, wt, &dgu_at(row, i), &dgu_at(row, I + i), n);
        i += n;
      }
    }));
    if (r)
      for_each_tile(experts::tiles(gr, 2 * r, mb, 256), [&](const experts::Tile& tl) {
        const std::size_t r0 = gr.begin[tl.e] + tl.m0;
        gemm::gemm_block(kernel, &dgu_at(r0, 0), tl.m1 - tl.m0, s.lora.experts[tl.e].b_gu_t, tl.n0, tl.n1, 2 * r,
                         dgb + r0 * 2 * r, 2 * r);
      });
    if (r) {
      // dB_d[e] = s sum_rows (w dy) ha^T [H x r]; dA_d[e] = s sum_rows (w dyb) h^T [r x I].
      std::vector<float> wts(rows), wdyb(rows * r);  // w per grouped row; w dyb
      for (std::size_t q = 0; q < rows; ++q) {
        wts[q] = gr.row_slot[q] >= 0 ? weight_of(q) : 0.0f;
        for (std::size_t k = 0; k < r; ++k) wdyb[q * r + k] = wts[q] * dyb[q * r + k];
      }
      expert_sums(
          kernel, gr, r, H, true, st.ha, r, wts.data(), false,
          [&](std::size_t q, std::size_t m) -> const void* { return dy.row(token_of(q)) + m; }, 0, 0, sc, {grads.b_down});
      expert_sums(
          kernel, gr, r, I, false, wdyb.data(), r, nullptr, true,
          [&](std::size_t q, std::size_t i) -> const void* { return &st.h[gemm::a_offset(layout, st.ldh, q, i)]; }, chunk,
          0, sc, {grads.a_down});
    }
  }

  // 5. dx rows = [dg du] [W_g; W_u] (+ LoRA: bf16(s dgb) [A_g; A_u]).
  arena.enter(workspace::b_dx, chk);
  float* dxr = arena.get<float>("bwd.dx_rows", rows * H);
  if (opt.expert_path) {
    bf16* qgu = r ? arena.get<bf16>("lora.qgu", gemm::a_size(layout, rows, kr1)) : nullptr;
    const std::size_t ldq = gemm::a_stride(layout, kr1);
    if (r)
      oneapi::tbb::parallel_for(std::size_t{0}, E, moecert::detail::task([&](std::size_t e) {
        gemm::pack_a_f32(kernel, dgb + gr.begin[e] * 2 * r, 2 * r, nullptr, gr.count[e], gr.begin[e + 1] - gr.begin[e], 2 * r,
                         kr1, sc, qgu + gemm::a_offset(layout, ldq, gr.begin[e], 0));
      }));
    // Items of 128 columns (gemm::item_cols, K = 2I): with 256, B (1.4 MiB
    // at I = 1408) would not stay in L2 under the AMX loops' row blocks.
    const std::size_t nb_dx = gemm::item_cols(round_up(2 * I, gemm::kKStep));
    for_each_tile(experts::tiles(gr, H, mb, nb_dx), [&](const experts::Tile& tl) {
      const std::size_t r0 = gr.begin[tl.e] + tl.m0;
      gemm::BlockOptions bo;  // the LoRA product into the same blocks
#ifdef MOECERT_MUTANT_DX_MISSING_LORA
      (void)qgu;  // mutant (docs/MUTANTS.md): dx misses the LoRA term
#else
      if (r) bo.a2 = qgu + gemm::a_offset(layout, ldq, r0, 0), bo.w2 = &s.lora.experts[tl.e].a_gu_t;
#endif
      gemm::gemm_block(kernel, &dgu_at(r0, 0), tl.m1 - tl.m0, pe.gate_up_t(tl.e), tl.n0, tl.n1, H, dxr + r0 * H, H, bo);
    });
  }

  // 6. dx = sum_j dx rows (slot order) + dz W_r; LoRA gate/up gradients;
  //    router linear gradients; per-token statistics.
  arena.enter(workspace::b_scatter, chk);
  if (!grads.dx.empty()) {
    // Blocks of 8 tokens: their expert rows summed in slot order, then the
    // router part dz W_r (sums over the R router outputs in order).
    constexpr std::size_t kTb = 8;
    oneapi::tbb::parallel_for(std::size_t{0}, (T + kTb - 1) / kTb, moecert::detail::task([&](std::size_t blk) {
      const std::size_t t0 = blk * kTb, tn = std::min(T, t0 + kTb) - t0;
      for (std::size_t t = t0; t < t0 + tn; ++t) {
        float* o = grads.dx.row(t);
        std::fill(o, o + H, 0.0f);
        if (opt.expert_path)
          for (std::size_t j = 0; j < K; ++j) {
            const std::int64_t row = gr.slot_row[t * K + j];
            if (row < 0) continue;
            const float* src = dxr + static_cast<std::size_t>(row) * H;
            for (std::size_t m = 0; m < H; ++m) o[m] += src[m];
          }
      }
      if (!opt.router_path) return;
      std::vector<float> sz(R * tn), acc(tn * H, 0.0f);  // sz[e][k] = dz(t0 + k, e)
      for (std::size_t e = 0; e < R; ++e)
        for (std::size_t k = 0; k < tn; ++k) sz[e * tn + k] = dz_at(t0 + k, e);
      row_sums(
          kernel, 0, R, tn, sz.data(), tn, nullptr, false,
          [&](std::size_t e, std::size_t m) -> const void* { return w.router_w.row(e) + m; }, 0, 0, 0, H, acc.data(), H);
      for (std::size_t k = 0; k < tn; ++k) {
        float* o = grads.dx.row(t0 + k);
        for (std::size_t m = 0; m < H; ++m) o[m] += acc[k * H + m];
      }
    }));
  }
  if (r && opt.expert_path) {
    // dB_g[e] = s sum_rows dg xa_g^T, dA_g[e] = s sum_rows dgb_g x^T; up likewise.
    auto x_at = [&](std::size_t q, std::size_t m) -> const void* { return x.row(token_of(q)) + m; };
    for (std::size_t part = 0; part < 2; ++part)  // gate, up
      expert_sums(
          kernel, gr, r, I, true, st.xa + part * r, 2 * r, nullptr, true,
          [&](std::size_t q, std::size_t i) -> const void* { return &dgu_at(q, part * I + i); }, chunk, part * I, sc,
          {part ? grads.b_up : grads.b_gate});
    // Both A factors in one pass over the x rows (dgb: r gate values, then r up).
    expert_sums(kernel, gr, r, H, false, dgb, 2 * r, nullptr, true, x_at, 0, 0, sc, {grads.a_gate, grads.a_up});
  } else {
    for (const auto& g : {grads.a_gate, grads.b_gate, grads.a_up, grads.b_up, grads.a_down, grads.b_down})
      if (!g.empty()) zero(g);
  }
  const bool base = !grads.w_gate.empty() || !grads.w_up.empty() || !grads.w_down.empty();
  if (base && opt.expert_path) {
    // Base weights (optional): per expert, GEMMs over its rows (K = the row
    // count, zero-padded): dW_g[e] = dg^T X, dW_u[e] = du^T X ([I x H]),
    // dW_d[e] = bf16(w dy)^T Hr ([H x I]; Hr: the saved h rows). The left
    // factor, transposed, is the A operand; the right one, transposed, is
    // packed like weights. Tasks (expert, matrix); one writer per element.
    oneapi::tbb::parallel_for(std::size_t{0}, 3 * E, moecert::detail::task([&](std::size_t task) {
      const std::size_t e = task / 3, which = task % 3, q0 = gr.begin[e], m = gr.count[e];
      const MatView<float> out = which == 0 ? grads.w_gate : which == 1 ? grads.w_up : grads.w_down;
      if (out.empty()) return;
      const std::size_t M = which < 2 ? I : H, N = which < 2 ? H : I;
      if (m == 0) {  // an idle expert: exactly 0
        for (std::size_t i = 0; i < M; ++i) std::fill(out.row(e * M + i), out.row(e * M + i) + N, 0.0f);
        return;
      }
      std::vector<bf16> left(M * m), right(N * m);  // [M x m], [N x m]
      for (std::size_t q = 0; q < m; ++q) {
        const std::size_t row = q0 + q;
        const bf16* xt = x.row(token_of(row));
        if (which < 2) {
          for (std::size_t i = 0; i < I; ++i) left[i * m + q] = dgu_at(row, which * I + i);
          for (std::size_t h = 0; h < H; ++h) right[h * m + q] = xt[h];
        } else {
          const float wt = weight_of(row), *d = dy.row(token_of(row));
#ifdef MOECERT_MUTANT_BASE_DOWN_GRAD_UNWEIGHTED
          for (std::size_t h = 0; h < H; ++h) left[h * m + q] = bf16((void(wt), d[h]));  // mutant (docs/MUTANTS.md): routing weight left out
#else
          for (std::size_t h = 0; h < H; ++h) left[h * m + q] = bf16(wt * d[h]);
#endif
          for (std::size_t i = 0; i < I; ++i) right[i * m + q] = st.h_at(row, i);
        }
      }
      const auto wpk = gemm::PackedWeights::pack_operand(MatView<const bf16>(right.data(), N, m), {}, {});
      const std::size_t mp = round_up(std::max<std::size_t>(M, 1), kernel.mr);
      std::vector<bf16> ap(gemm::a_size(layout, mp, wpk.kp()));
      gemm::pack_a(layout, MatView<const bf16>(left.data(), M, m), nullptr, M, mp, wpk.kp(), ap.data());
      gemm::gemm_block(kernel, ap.data(), M, wpk, 0, wpk.np(), N, out.row(e * M), out.stride);
    }));
  } else {
    for (const auto& g : {grads.w_gate, grads.w_up, grads.w_down})
      if (!g.empty()) zero(g);
  }
  if (!grads.router_w.empty()) {
    // dW_r[e] = sum_t dz(t, e) x_t: tasks (8 router outputs of one dz
    // plane, 128 columns), sums over t in order.
    zero(grads.router_w);
    if (opt.router_path) {
      const std::size_t plane = planes ? half : R, groups = (plane + 7) / 8, blocks = (H + 127) / 128;
      const std::size_t planes_n = planes ? 2 : 1;
      oneapi::tbb::parallel_for(std::size_t{0}, planes_n * groups * blocks, moecert::detail::task([&](std::size_t task) {
        const std::size_t p = task / (groups * blocks), g = task / blocks % groups, b = task % blocks;
        const std::size_t e0 = g * 8, en = std::min(plane, e0 + 8) - e0, n0 = b * 128, n1 = std::min(H, n0 + 128);
        const float* s0 = dz + p * T * plane + e0;
        row_sums(
            kernel, 0, T, en, s0, plane, nullptr, true, [&](std::size_t t, std::size_t m) -> const void* { return x.row(t) + m; },
            0, 0, n0, n1, grads.router_w.row(p * plane + e0) + n0, grads.router_w.stride);
      }));
    }
  }
  if (!grads.router_b.empty())
    for (std::size_t e = 0; e < R; ++e) {
      float b = 0;
      if (opt.router_path)
        for (std::size_t t = 0; t < T; ++t) b += dz_at(t, e);
      grads.router_b[e] = b;
    }
  if (!grads.m_a.empty() || !grads.m_g.empty()) {
    if (!grads.m_a.empty()) zero(grads.m_a);
    if (!grads.m_g.empty()) zero(grads.m_g);
    if (opt.expert_path)
      oneapi::tbb::parallel_for(std::size_t{0}, rows, moecert::detail::task([&](std::size_t row) {
        if (gr.row_slot[row] < 0) return;
        const std::size_t t = token_of(row), e = static_cast<std::size_t>(s.idx[gr.row_slot[row]]);
        auto sq = [](double v) { return v * v; };
        double x2 = 0, dy2 = 0, h2 = 0, dg2 = 0, du2 = 0;
        for (std::size_t m = 0; m < H; ++m) x2 += sq(x(t, m).to_float()), dy2 += sq(dy(t, m));
        for (std::size_t i = 0; i < I; ++i)
          h2 += sq(st.h_at(row, i).to_float()), dg2 += sq(dgu_at(row, i).to_float()), du2 += sq(dgu_at(row, I + i).to_float());
        const double wt = weight_of(row), w2 = wt * wt;
        double g2;
        if (r) {
          double bg2 = 0, bu2 = 0, xg2 = 0, xu2 = 0, yb2 = 0, ha2 = 0;
          for (std::size_t k = 0; k < r; ++k) {
            bg2 += sq(dgb[row * 2 * r + k]), bu2 += sq(dgb[row * 2 * r + r + k]);
            xg2 += sq(st.xa[row * 2 * r + k]), xu2 += sq(st.xa[row * 2 * r + r + k]);
            yb2 += sq(dyb[row * r + k]), ha2 += sq(st.ha[row * r + k]);
          }
          g2 = double(sc) * sc * (bg2 * x2 + dg2 * xg2 + bu2 * x2 + du2 * xu2 + w2 * yb2 * h2 + w2 * dy2 * ha2);
        } else {
          g2 = dg2 * x2 + du2 * x2 + w2 * dy2 * h2;
        }
        if (!grads.m_a.empty()) grads.m_a(t, e) = static_cast<float>(std::sqrt(x2 + h2));
        if (!grads.m_g.empty()) grads.m_g(t, e) = static_cast<float>(std::sqrt(g2));
      }));
  }
  arena.leave(chk);
  contracts::layer_backward_post(chk, cfg, w, x, dy, saved, grads, opt);
}

}  // namespace moecert::layer
