// The peer of the expert forward: oneDNN's bf16 matmul looping over the
// experts (gather, gate+up matmul, SwiGLU, down matmul, combine), its
// element-wise loops on OpenMP like oneDNN itself.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecert/types.hpp"

namespace moecert::bench {

class OnednnExperts {
 public:
  /// Weights as moecert takes them (w_gate, w_up [E*I x H], w_down [E*H x I]);
  /// routing fixed at construction (one matmul primitive per expert and
  /// shape, created and weights reordered here, outside the timing).
  OnednnExperts(std::size_t e, std::size_t h, std::size_t i, const std::vector<bf16>& w_gate,
                const std::vector<bf16>& w_up, const std::vector<bf16>& w_down,
                MatView<const std::int32_t> idx);
  ~OnednnExperts();
  void forward(MatView<const bf16> x, MatView<const float> weights, MatView<float> y);
  static std::string version();
  static void set_threads(int n);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// One bf16 matmul C[M x N] fp32 = A [M x K] W^T with W [N x K].
class OnednnMatmul {
 public:
  OnednnMatmul(std::size_t m, std::size_t n, std::size_t k, const std::vector<bf16>& w);
  ~OnednnMatmul();
  void run(const bf16* a, float* c);
  std::string impl_name() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moecert::bench
