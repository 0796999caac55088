// The layer's router linear: z = x W_r^T + b and its backward, shared by the
// layer (forward.cpp, backward.cpp) and the op that runs it alone
// (layer::router_linear_forward/backward).
#pragma once

#include <cstddef>

#include "moecert/types.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::contracts {
class GradFiniteScan;
struct DzPlanes;
}  // namespace moecert::contracts

namespace moecert::layer::linear {

/// dz as [T x R] rows (row stride ld, 0: R), or for product_key as two
/// planes dsx [T x n], dsy [T x n] (the router's backward wants them disjoint).
struct Dz {
  const float* data;
  std::size_t T, R;
  bool planes;
  std::size_t stride = 0;
  std::size_t ld() const { return planes ? R / 2 : (stride ? stride : R); }
  float at(std::size_t t, std::size_t e) const {
    const std::size_t half = R / 2;
    if (!planes) return data[t * ld() + e];
    return e < half ? data[t * half + e] : data[T * half + t * half + e - half];
  }
};

/// dz as the contracts read it (the same memory).
contracts::DzPlanes dz_planes(const Dz& dz);

/// z = x W_r^T + b in fp32 (each element one fixed-order sum of H + 1 terms).
void router_linear(const gemm::KernelInfo& kernel, MatView<const bf16> x, MatView<const float> wr,
                   View<const float> b, MatView<float> z);

/// dx += dz W_r (each element a sum over the R outputs in order, then one
/// addition); each block of rows written goes to `judge` (grad_finite) when
/// not null.
void router_dx(const gemm::KernelInfo& kernel, const Dz& dz, MatView<const float> wr,
               MatView<float> dx, contracts::GradFiniteScan* judge = nullptr);

/// dW_r = dz^T x and db = the column sums of dz (sums over t in order), each
/// written where given.
void router_linear_grads(const gemm::KernelInfo& kernel, const Dz& dz, MatView<const bf16> x,
                         MatView<float> dwr, View<float> db);

}  // namespace moecert::layer::linear
