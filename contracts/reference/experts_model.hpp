// The experts op as the judge models another implementation of it: the
// exact maths in binary64 with every rounding point the declared precision
// allows marked (bounds::Precision), from plain tensors. Covers the
// implementations of proofs/experts.md §4 (LoRA fused into the base GEMM or
// added after it, the scale applied before or after B, any summation order).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "contracts/numeric/precision.hpp"
#include "moecert/formats.hpp"
#include "moecert/types.hpp"

namespace moecert::contracts {

/// The experts op's inputs as another implementation hands them over:
/// every matrix row-major fp32 (values as given). Base weights stacked by
/// expert: w_gate, w_up [E*I x H], w_down [E*H x I]; LoRA (rank r > 0) as
/// in experts::Lora: a_gate, a_up [E*r x H], b_gate, b_up [E*I x r],
/// a_down [E*r x I], b_down [E*H x r], scale alpha / r.
/// Base weights handed over quantized (w_gate, w_up, w_down in that order):
/// each matrix's codes (a byte per element, int4 a byte per two) and scales,
/// stacked by expert, and, where their shapes are the format's, the values
/// fp32(code * scale) that ExpertsTensors' w_gate, w_up, w_down view.
struct QuantizedBase {
  WeightFormat format = WeightFormat::int8_channel;
  std::array<MatView<const std::int32_t>, 3> codes;  // [E rows x row bytes], bytes 0..255
  std::array<MatView<const float>, 3> scales;        // [E scale rows x scale columns]
  std::array<std::size_t, 3> cols = {};              // elements a row
  std::array<std::vector<float>, 3> values;          // [E rows x cols]
  std::string shape_error;                           // the first misshapen tensor, or ""
};

struct ExpertsTensors {
  std::shared_ptr<const QuantizedBase> quantized = {};  // set when the base weights are
  std::size_t E = 0, H = 0, I = 0, r = 0;
  double alpha = 0;
  MatView<const float> x = {};  // [T x H]
  MatView<const std::int32_t> idx = {};
  MatView<const float> weights = {};  // [T x K]
  MatView<const float> w_gate = {}, w_up = {}, w_down = {};
  MatView<const float> a_gate = {}, b_gate = {}, a_up = {}, b_up = {}, a_down = {}, b_down = {};
};

/// y [T x H] of the model: exact value and bound of every element
/// (before the output's own storage rounding).
std::vector<bounds::Tracked> experts_model_forward(const ExpertsTensors& in,
                                                   const bounds::Precision& p);

/// The error of y along the exact y (proofs/bounds.md §12): the implementation's
/// <y_hat - y, y> = D + R with |D| <= det and R a combination of independent
/// mean-zero roundings whose coefficients' Euclidean norm is at most rnd
/// (before the output's own storage rounding); norm2 = <y, y>.
struct Projection {
  double det = 0, rnd = 0, norm2 = 0;
};
/// experts_model_forward under probable(p), and the projection.
struct ProbableForward {
  std::vector<bounds::Tracked> y;
  Projection along_y;
};
ProbableForward experts_model_forward_probable(const ExpertsTensors& in,
                                               const bounds::Precision& p);

/// dx [T x H] and dL/dw [T x K] of the model for dy [T x H] (each before
/// its storage rounding; dL/dw is 0 at -1 slots). dx_rows and dx_rows_abs:
/// per dx element, the exact sum of the slots' rows (their errors
/// propagated) and the sum of their magnitudes, for a caller that adds
/// more rows to that sum (the layer's router linear). With weight_grads,
/// the nine weight gradients in contracts::grad_shapes' order (the six
/// LoRA factors', empty without LoRA, then w_gate, w_up, w_down), each
/// stacked by expert; exactly 0 for an expert without tokens. Under the
/// probabilistic model, dx's and dL/dw's errors along their exact values
/// (proofs/bounds.md §12: a token's elements share roundings, distinct
/// tokens' do not).
struct ExpertsBackward {
  std::vector<bounds::Tracked> dx, dweights, dx_rows;
  std::vector<double> dx_rows_abs;
  std::array<std::vector<bounds::Tracked>, 9> weight_grads;
  Projection along_dx, along_dweights;
};
ExpertsBackward experts_model_backward(const ExpertsTensors& in, MatView<const float> dy,
                                       const bounds::Precision& p, bool weight_grads = false);

}  // namespace moecert::contracts
