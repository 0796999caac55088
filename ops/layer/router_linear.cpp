// The router linear's kernels (ops/layer/router_linear.hpp) and the op that
// runs them alone: layer::router_linear_forward and router_linear_backward.
#include "ops/layer/router_linear.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "contracts/engine/clauses.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/layer/router_linear.hpp"
#include "moecert/isa.hpp"
#include "moecert/layer.hpp"
#include "ops/core/task.hpp"
#include "ops/core/views.hpp"
#include "ops/gemm/row_sums.hpp"

namespace moecert::layer {

namespace linear {

// z = x W_r^T + b in fp32: each dot product as 16 partial sums and a fixed
// tree (the kernel's dot16; an fp32 sum of H + 1 terms in one fixed order,
// proofs/bounds.md §1). Tasks of 4 tokens, so that W_r streams from L2 once
// per 4 tokens rather than once per token.
void router_linear(const gemm::KernelInfo& kernel, MatView<const bf16> x, MatView<const float> wr,
                   View<const float> b, MatView<float> z) {
  constexpr std::size_t kTokens = 4;
  const std::size_t hidden = x.cols, outs = wr.rows;
  oneapi::tbb::parallel_for(
      std::size_t{0}, (x.rows + kTokens - 1) / kTokens, moecert::detail::task([&](std::size_t blk) {
        const std::size_t t0 = blk * kTokens, tn = std::min(x.rows, t0 + kTokens) - t0;
        std::vector<float> xf(kTokens * hidden);
        const float* rows[kTokens];
        for (std::size_t i = 0; i < tn; ++i) {
          rows[i] = xf.data() + i * hidden;
          for (std::size_t h = 0; h < hidden; ++h) xf[i * hidden + h] = x(t0 + i, h).to_float();
        }
        kernel.dot16(rows, tn, wr.data, wr.stride, outs, hidden, z.row(t0), z.stride);
        for (std::size_t i = 0; i < tn; ++i)
          for (std::size_t e = 0; e < outs; ++e) z(t0 + i, e) += b[e];
      }));
}

// dx += dz W_r: blocks of 8 tokens, sums over the R router outputs in order
// (into a block's own fp32 sums, then one addition per element).
void router_dx(const gemm::KernelInfo& kernel, const Dz& dz, MatView<const float> wr,
               MatView<float> dx, contracts::GradFiniteScan* judge) {
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
        if (judge) judge->written(dx.data, t0, t0 + tn, 0, H);
      }));
}

contracts::DzPlanes dz_planes(const Dz& dz) {
  if (!dz.planes) return {{dz.data, dz.T, dz.R, dz.ld()}, {}};
  const std::size_t half = dz.R / 2;
  return {{dz.data, dz.T, half, half}, {dz.data + dz.T * half, dz.T, half, half}};
}

// dW_r[e] = sum_t dz(t, e) x_t: tasks (8 router outputs of one dz plane,
// 128 columns), sums over t in order; db[e] = sum_t dz(t, e) in order.
void router_linear_grads(const gemm::KernelInfo& kernel, const Dz& dz, MatView<const bf16> x,
                         MatView<float> dwr, View<float> db) {
  const std::size_t T = dz.T, R = dz.R, H = x.cols;
  if (!dwr.empty()) {
    moecert::detail::fill_zero(dwr);  // the row sums below accumulate into it
    const std::size_t plane = dz.planes ? R / 2 : R, ld = dz.ld(), groups = (plane + 7) / 8,
                      blocks = (H + 127) / 128;
    const std::size_t planes_n = dz.planes ? 2 : 1;
    oneapi::tbb::parallel_for(
        std::size_t{0}, planes_n * groups * blocks, moecert::detail::task([&](std::size_t task) {
          const std::size_t p = task / (groups * blocks), g = task / blocks % groups,
                            b = task % blocks;
          const std::size_t e0 = g * 8, en = std::min(plane, e0 + 8) - e0, n0 = b * 128,
                            n1 = std::min(H, n0 + 128);
          const float* s0 = dz.data + p * T * plane + e0;  // plane p (planes: ld = plane)
          gemm::row_sums(
              kernel, 0, T, en, s0, ld, nullptr, true,
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

}  // namespace linear

void router_linear_forward(MatView<const bf16> x, MatView<const float> w, View<const float> b,
                           MatView<float> z, std::optional<Isa> isa) {
  const moecert::detail::FpDefaults fp;
  moecert::detail::Checker chk{"layer.router_linear.forward"};
  contracts::router_linear_forward_pre(chk, x, w, b, z);
  if (chk.stop()) return;
  linear::router_linear(gemm::kernel_info(isa.value_or(default_isa())), x, w, b, z);
  contracts::router_linear_forward_post(chk, x, w, b, z);
}

void router_linear_backward(MatView<const bf16> x, MatView<const float> w, MatView<const float> dz,
                            const RouterLinearGrads& grads, std::optional<Isa> isa) {
  const moecert::detail::FpDefaults fp;
  moecert::detail::Checker chk{"layer.router_linear.backward"};
  contracts::router_linear_backward_pre(chk, x, w, dz, grads);
  if (chk.stop()) return;
  const auto dx_before = contracts::router_linear_dx_before(chk, grads.dx);
  std::optional<contracts::RouterLinearProbe> probe;
  if (chk.will_check(clauses::layer::kRlProbe)) probe.emplace(w, grads.dx);
  const gemm::KernelInfo& kernel = gemm::kernel_info(isa.value_or(default_isa()));
  const linear::Dz d{dz.data, dz.rows, dz.cols, false, dz.stride};
  if (!grads.dx.empty()) linear::router_dx(kernel, d, w, grads.dx);
  linear::router_linear_grads(kernel, d, x, grads.router_w, grads.router_b);
  if (probe) probe->judge(x, linear::dz_planes(d), grads);
  contracts::router_linear_backward_post(chk, x, w, dz, grads, dx_before,
                                         probe ? &*probe : nullptr);
}

}  // namespace moecert::layer
