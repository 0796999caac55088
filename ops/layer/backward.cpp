// MoE layer backward: the experts op's backward (ops/experts/backward.cpp)
// with the router path around it: dL/dw from the experts, the router's
// backward into dz, then the router linear's gradients and its share of dx.
// Every output element has one writer and a fixed summation order: the same
// bits for any thread count.
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <vector>

#include "contracts/experts_train.hpp"
#include "contracts/layer.hpp"
#include "moecert/router.hpp"
#include "ops/core/task.hpp"
#include "ops/core/views.hpp"
#include "ops/gemm/row_sums.hpp"
#include "ops/layer/state.hpp"
#include "ops/workspace/planner.hpp"

namespace moecert::layer {

namespace {

// dz as [T x R] rows; for product_key as two planes dsx [T x n], dsy [T x n]
// (the router's backward wants them disjoint).
struct Dz {
  float* data;
  std::size_t T, R;
  bool planes;
  float at(std::size_t t, std::size_t e) const {
    const std::size_t half = R / 2;
    return planes ? (e < half ? data[t * half + e] : data[T * half + t * half + e - half])
                  : data[t * R + e];
  }
};

// The router's backward from g = dL/dw into dz.
void router_backward(const MoeConfig& cfg, MatView<const float> z, MatView<const std::int32_t> idx,
                     MatView<const float> g, const Dz& dz) {
  const std::size_t T = dz.T, R = dz.R, half = R / 2;
  switch (cfg.router) {
    case RouterKind::softmax_topk:
      router::softmax_topk_backward(z, idx, g, MatView<float>(dz.data, T, R, R), cfg.renormalize);
      break;
    case RouterKind::sigmoid_topk:
      router::sigmoid_topk_backward(
          z, idx, g,
          {static_cast<std::size_t>(cfg.groups), static_cast<std::size_t>(cfg.topk_group),
           static_cast<float>(cfg.scaling)},
          MatView<float>(dz.data, T, R, R));
      break;
    case RouterKind::product_key:
      router::product_key_backward(
          MatView<const float>(z.data, T, half, R), MatView<const float>(z.data + half, T, half, R),
          idx, g, router::KeyWeights::softmax, MatView<float>(dz.data, T, half, half),
          MatView<float>(dz.data + T * half, T, half, half));
      break;
  }
}

// dx += dz W_r: blocks of 8 tokens, sums over the R router outputs in order
// (into a block's own fp32 sums, then one addition per element).
void router_dx(const gemm::KernelInfo& kernel, const Dz& dz, MatView<const float> wr,
               MatView<float> dx) {
  constexpr std::size_t kTb = 8;
  const std::size_t T = dz.T, R = dz.R, H = dx.cols;
  oneapi::tbb::parallel_for(
      std::size_t{0}, (T + kTb - 1) / kTb, moecert::detail::task([&](std::size_t blk) {
        const std::size_t t0 = blk * kTb, tn = std::min(T, t0 + kTb) - t0;
        std::vector<float> sz(R * tn), acc(tn * H, 0.0f);  // sz[e][k] = dz(t0 + k, e)
        for (std::size_t e = 0; e < R; ++e)
          for (std::size_t k = 0; k < tn; ++k) sz[e * tn + k] = dz.at(t0 + k, e);
        gemm::row_sums(
            kernel, 0, R, tn, sz.data(), tn, nullptr, false,
            [&](std::size_t e, std::size_t m) -> const void* { return wr.row(e) + m; }, 0, 0, 0, H,
            acc.data(), H);
        for (std::size_t k = 0; k < tn; ++k) {
          float* o = dx.row(t0 + k);
          for (std::size_t m = 0; m < H; ++m) o[m] += acc[k * H + m];
        }
      }));
}

// dW_r[e] = sum_t dz(t, e) x_t: tasks (8 router outputs of one dz plane,
// 128 columns), sums over t in order; db[e] = sum_t dz(t, e) in order.
void router_linear_grads(const gemm::KernelInfo& kernel, const Dz& dz, MatView<const bf16> x,
                         MatView<float> dwr, View<float> db) {
  const std::size_t T = dz.T, R = dz.R, H = x.cols;
  if (!dwr.empty()) {
    const std::size_t plane = dz.planes ? R / 2 : R, groups = (plane + 7) / 8,
                      blocks = (H + 127) / 128;
    const std::size_t planes_n = dz.planes ? 2 : 1;
    oneapi::tbb::parallel_for(
        std::size_t{0}, planes_n * groups * blocks, moecert::detail::task([&](std::size_t task) {
          const std::size_t p = task / (groups * blocks), g = task / blocks % groups,
                            b = task % blocks;
          const std::size_t e0 = g * 8, en = std::min(plane, e0 + 8) - e0, n0 = b * 128,
                            n1 = std::min(H, n0 + 128);
          const float* s0 = dz.data + p * T * plane + e0;
          gemm::row_sums(
              kernel, 0, T, en, s0, plane, nullptr, true,
              [&](std::size_t t, std::size_t m) -> const void* { return x.row(t) + m; }, 0, 0, n0,
              n1, dwr.row(p * plane + e0) + n0, dwr.stride);
        }));
  }
  if (!db.empty())
    for (std::size_t e = 0; e < R; ++e) {
      float b = 0;
      for (std::size_t t = 0; t < T; ++t) b += dz.at(t, e);
      db[e] = b;
    }
}

}  // namespace

void backward(const MoeConfig& cfg, const Weights& w, MatView<const bf16> x,
              MatView<const float> dy, Saved& saved, const Gradients& grads,
              const BackwardOptions& opt) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  detail::Checker chk{"layer.backward"};
  contracts::layer_backward_pre(chk, cfg, w, x, dy, saved, grads);
  if (chk.stop()) return;
  Saved::Impl& s = saved.impl();
  const std::size_t T = x.rows, K = static_cast<std::size_t>(cfg.topk);
  const std::size_t R = static_cast<std::size_t>(workspace::router_outputs(cfg));
  const gemm::KernelInfo& kernel = gemm::kernel_info(s.isa);
  workspace::Arena& arena = s.arena;

  // 1. The experts op's first part: dy rows, dh; router path: dL/dw.
  arena.enter(workspace::b_gather, chk);
  contracts::layer_backward_saved(chk, cfg, x, saved);
  if (chk.stop()) return;
  const MatView<float> dw(arena.get<float>("router.dw", T * K), T, K, K);
  const auto d = experts::backward_dh(*w.experts, s, dy, opt.expert_path,
                                      opt.router_path ? dw : MatView<float>{}, chk);
  if (!opt.router_path) detail::fill_zero(dw);

  // 2. Router path: the router's backward from dL/dw, into dz.
  arena.enter(workspace::b_router, chk);
  const Dz dz{arena.get<float>("router.dz", T * R), T, R, cfg.router == RouterKind::product_key};
  if (opt.router_path)
    router_backward(cfg, MatView<const float>(s.logits, T, R, R), saved.idx(), dw, dz);
  else
    std::fill(dz.data, dz.data + T * R, 0.0f);

  // 3. The experts op's expert path: dx (its part), LoRA and base-weight
  //    gradients, statistics.
  experts::backward_expert(*w.experts, s, x, dy, d, expert_gradients(grads), opt.expert_path, chk);

  // 4. Router path: dx += dz W_r, the router linear's gradients.
  if (!grads.dx.empty() && opt.router_path) router_dx(kernel, dz, w.router_w, grads.dx);
  if (!grads.router_w.empty()) detail::fill_zero(grads.router_w);
  if (!grads.router_b.empty())
    std::fill(grads.router_b.data, grads.router_b.data + grads.router_b.size, 0.0f);
  if (opt.router_path) router_linear_grads(kernel, dz, x, grads.router_w, grads.router_b);
  arena.leave(chk);
  contracts::layer_backward_post(chk, cfg, w, x, dy, saved, grads, opt);
}

}  // namespace moecert::layer
