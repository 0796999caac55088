// An op's clauses applied to another implementation's tensors (`moecert
// check`, moecert_check, moecert.check): each clause of the op at level full
// under observe, so every clause reports, tie-aware, with the outputs'
// storage rounding in the bounds (contracts/engine/judging.hpp). The ops: the
// routers (contracts/judge/router.cpp) and the experts op
// (contracts/judge/experts.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "contracts/engine/judging.hpp"
#include "contracts/engine/params.hpp"
#include "moecert/contracts.hpp"

namespace moecert::contracts::judge {

/// A 2-D tensor as the judge reads it: values in fp32 (f) or indices in
/// int32 (i), row-major [rows x cols]; unit and tiny describe its storage
/// when narrower than fp32 (2^-8 and 2^-134 for bf16, 2^-11 and 2^-25 for
/// fp16; 0 otherwise).
struct Tensor {
  std::vector<float> f = {};
  std::vector<std::int32_t> i = {};
  std::size_t rows = 0, cols = 0;
  double unit = 0, tiny = 0;
};
using Tensors = std::map<std::string, Tensor>;
using contracts::Params;  // NAME=VALUE params (contracts/engine/params.hpp)

/// One clause of the op as applied: not evaluated (a failed precondition or
/// an earlier failure made it moot), passed, or failed with its violations.
struct ClauseResult {
  ClauseInfo info;
  bool evaluated = false, passed = true;
  std::vector<Violation> violations;
};

struct Verdict {
  std::string op;
  std::vector<ClauseResult> clauses;  // every clause of the op, in the registry's order
  std::vector<Tie> ties;              // (near) ties the implementation ordered its own way
  // Rows whose expert ids an index clause rejected, which the clauses that
  // read scores or weights through the ids skipped (ascending, distinct).
  std::vector<std::size_t> skipped_rows;
  // Each output judged against a model (the experts op's): its error as a
  // whole against the bounds' (ErrorSummary).
  std::vector<ErrorSummary> errors;
  bool passed() const;
};

/// The ops judged: router.{softmax_topk,sigmoid_topk,product_key}.{forward,backward},
/// experts.{forward,forward_train,backward}.
std::vector<std::string> judged_ops();

/// Judges op's outputs `out` for inputs `in` (tensor names and params:
/// docs/JUDGE.md). std::invalid_argument for an unknown op, a missing
/// tensor or a bad parameter.
Verdict judge_op(const std::string& op, const Tensors& in, const Tensors& out,
                 const Params& params);

/// The verdict as JSON (schema moecert-check/1), with `about` (e.g. the
/// files judged) as extra string fields.
std::string verdict_json(const Verdict& v, const Params& about);

}  // namespace moecert::contracts::judge
