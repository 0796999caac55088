// The experts op's judge pieces the layer's judge composes
// (contracts/judge/experts.cpp, contracts/judge/layer.cpp).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "contracts/experts/train.hpp"
#include "contracts/judge/tensors.hpp"
#include "contracts/numeric/precision.hpp"
#include "contracts/reference/experts_model.hpp"

namespace moecert::contracts::judge {

/// The declared arithmetic (param `precision`: fp32, mixed or bf16).
bounds::Precision precision_of(const Params& p);

/// x and the experts' weights by name, LoRA (a_*, b_* and param alpha)
/// when given and `lora_allowed`; idx and weights are left to the caller.
/// E = rows(w_gate) / I, r = rows(a_gate) / E. With param format (a
/// quantized one of moecert/formats.hpp), the base weights as read_quantized
/// takes them.
ExpertsTensors experts_tensors(const Tensors& in, const Params& p, bool lora_allowed);

/// Param format: the quantized weight format declared, none for bf16 or
/// absent; std::invalid_argument for an unknown name.
std::optional<WeightFormat> format_of(const Params& p);

/// The base weights given quantized: `w_gate.codes`, `w_up.codes`,
/// `w_down.codes` (index tensors of bytes 0..255 or int8 codes as signed
/// values -128..127, each expert's rows
/// stacked: [E I x row bytes], [E H x row bytes]) and `<name>.scales` (fp32
/// [E scale rows x scale columns]); E = rows(w_down.codes) / H, I =
/// rows(w_gate.codes) / E. Where their shapes are the format's, t's
/// w_gate, w_up, w_down view fp32(code * scale) (contracts/gemm/formats.hpp);
/// otherwise t.quantized->shape_error names the first misshapen tensor.
void read_quantized(const Tensors& in, WeightFormat f, ExpertsTensors& t);

/// The clause families the format param adds (gemm.pack.q_code, q_scale).
std::vector<std::string> quantized_families(const Params& p);

/// The first of idx, weights, y (named `y_name`), the weights and the LoRA
/// factors whose shape is not the one E, H, I, r, T, K imply, or "".
std::string experts_shape_error(const ExpertsTensors& t, const char* y_name,
                                MatView<const float> y);

/// Every value finite and 0 or within [2^-60, 2^60] (the bounds' range).
bool finite_in_range(detail::Checker& c, const ClauseInfo& clause, const char* name,
                     MatView<const float> m);

/// The base weights by gemm.pack.w_finite and w_range (quantized: first
/// their codes and scales by gemm.pack.q_code and q_scale).
void base_weight_clauses(detail::Checker& c, const ExpertsTensors& t);
/// m finite by `finite`, then in the bounds' range by `range` (each where
/// its level is on); false when one failed.
bool finite_then_range(detail::Checker& c, const ClauseInfo& finite, const ClauseInfo& range,
                       const char* name, MatView<const float> m);

/// Every finite element of m in the bounds' range (0 or 2^-60 <= |v| <=
/// 2^60); false when one is not.
bool scan_range(detail::Checker& c, const ClauseInfo& clause, const char* name,
                MatView<const float> m);

/// Every LoRA factor finite and in range; false when one failed.
bool lora_in_range(detail::Checker& c, const ClauseInfo& finite, const ClauseInfo& range,
                   const ExpertsTensors& t);

/// The base weights' clauses; with LoRA, its factors by `lora_finite` and
/// `lora_range` and its scale by `scale`.
template <const ClauseInfo& lora_finite, const ClauseInfo& lora_range, const ClauseInfo& scale>
void weight_clauses(detail::Checker& c, const ExpertsTensors& t) {
  base_weight_clauses(c, t);
  if (t.r == 0) return;
  lora_in_range(c, lora_finite, lora_range, t);
  MOECERT_CONTRACT(c, scale) { lora_scale(c, scale, t.r, t.alpha); }
}

/// Output `name`'s error as a whole against the model `ref` and, where
/// formed, the probabilistic model, for the verdict (ErrorSummary; nothing
/// where no list is kept).
void summarize_error(const char* name, MatView<const float> m,
                     const std::vector<bounds::Tracked>& ref,
                     const std::vector<bounds::Tracked>* probable = nullptr);

/// An output against the model: |v - ref| <= its bound, widened by the
/// output's storage; false when it failed.
bool within_model(detail::Checker& c, const ClauseInfo& clause, const char* name,
                  MatView<const float> m, const std::vector<bounds::Tracked>& ref,
                  const bounds::Precision& p, const char* proof);

/// <m - ref, ref> within the projection's bound at kProjectionLambda
/// (proofs/bounds.md §12), ref the probabilistic model's values, the
/// output's storage rounding added at its worst case or as a random term,
/// whichever is smaller; the relative error along ref in the message.
bool within_projection(detail::Checker& c, const ClauseInfo& clause, const char* name,
                       MatView<const float> m, const std::vector<bounds::Tracked>& ref,
                       const Projection& along, const bounds::Precision& p);

/// Param audit (true): the rounding audit and the probabilistic clauses;
/// their model (independent errors) needs data where no single rounding
/// dominates many outputs.
bool audit_asked(const Params& p);

/// The weight gradients among the outputs (`a_gate_grad`, `b_gate_grad`,
/// `a_up_grad`, `b_up_grad`, `a_down_grad`, `b_down_grad`, `w_gate_grad`,
/// `w_up_grad`, `w_down_grad`: grad_shapes' order); a null view where one
/// is not given.
using WeightGrads = std::array<MatView<const float>, kWeightGrads>;
WeightGrads weight_grad_outputs(const Tensors& out);
bool any_weight_grad(const WeightGrads& g);

/// The first weight gradient given whose shape is not its weight's, or "".
std::string weight_grads_shape_error(const ExpertsTensors& t, const WeightGrads& g);

/// Every weight gradient given finite; false when one failed.
bool weight_grads_finite(detail::Checker& c, const ClauseInfo& clause, const WeightGrads& g);
/// An expert without tokens has every weight gradient given exactly 0.
void weight_grads_idle_zero(detail::Checker& c, const ClauseInfo& clause, const ExpertsTensors& t,
                            const WeightGrads& g);
/// Every weight gradient given within the model's bound; false when one failed.
bool weight_grads_within(detail::Checker& c, const ClauseInfo& clause, const WeightGrads& g,
                         const ExpertsBackward& model, const bounds::Precision& p,
                         const char* proof);
/// Every weight gradient given without a sign bias against the model's exact
/// values, audited on one element per row and column of each of the E
/// experts (proofs/bounds.md §11); false when one failed.
bool weight_grads_unbiased(detail::Checker& c, const ClauseInfo& clause, const WeightGrads& g,
                           const ExpertsBackward& model, std::size_t E);

}  // namespace moecert::contracts::judge
