// The live peer of the layer benchmarks: the MoE layer with LoRA as a
// straightforward eager framework runs it (PyTorch on CPU in bf16 is the
// model), op by op: every matmul a oneDNN bf16 (router: f32) matmul on
// plain row-major operands, as PyTorch's CPU bf16 matmul calls oneDNN;
// every element-wise op a separate pass over a materialised tensor, on
// OpenMP, parallel above PyTorch's grain of 32768 elements; a Python-level
// loop over the experts; the backward as autograd derives it, including its
// gradient accumulations. It is not PyTorch (which runs live from Python:
// python3 -m moecert.bench); this peer runs in the same process as the C++
// bench, on the same data and threads, in alternation with moecert.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "moecert/types.hpp"

namespace moecert::bench {

struct EagerLayerSpec {
  std::size_t experts = 0, hidden = 0, inter = 0, topk = 0, rank = 0;
  float scale = 0;  // alpha / r
  // Stacked by expert, shapes as layer::Lora and layer::Weights take them.
  const bf16 *w_gate = nullptr, *w_up = nullptr, *w_down = nullptr;
  const bf16 *a_gate = nullptr, *b_gate = nullptr, *a_up = nullptr, *b_up = nullptr,
             *a_down = nullptr, *b_down = nullptr;
  const float *router_w = nullptr, *router_b = nullptr;  // [E x H], [E]
};

/// Gradients as layer::Gradients names them (dense row-major, written
/// entirely): dx [T x H], router_w [E x H], router_b [E], the six LoRA
/// factors'.
struct EagerLayerGrads {
  float *dx = nullptr, *router_w = nullptr, *router_b = nullptr;
  float *a_gate = nullptr, *b_gate = nullptr, *a_up = nullptr, *b_up = nullptr, *a_down = nullptr,
        *b_down = nullptr;
};

/// Softmax top-k router with weights renormalised over the K selected.
class OnednnEagerLayer {
 public:
  explicit OnednnEagerLayer(const EagerLayerSpec& spec);
  ~OnednnEagerLayer();
  /// y [T x H]; keeps what the backward needs, as autograd would.
  void forward(MatView<const bf16> x, MatView<float> y);
  /// The backward of the last forward, for dy [T x H].
  void backward(MatView<const float> dy, const EagerLayerGrads& g);
  /// The expert part alone, on the caller's routing (no -1 slots): y from
  /// x, idx, w; the backward's dx, LoRA gradients and dL/dw [T x K] (g's
  /// router entries unused).
  void forward_experts(MatView<const bf16> x, MatView<const std::int32_t> idx,
                       MatView<const float> w, MatView<float> y);
  void backward_experts(MatView<const float> dy, const EagerLayerGrads& g, float* dweights);
  /// The oneDNN implementations its matmul primitives use, with counts.
  std::string matmul_impls() const;

 private:
  void run_experts(MatView<const bf16> x, MatView<float> y);
  void backward_router(const EagerLayerGrads& g);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moecert::bench
