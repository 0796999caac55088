// A conformance case and its result: what `moecert conform` runs and reports.
#pragma once

#include <oneapi/tbb/global_control.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "contracts/engine/compare.hpp"
#include "contracts/numeric/tracked.hpp"
#include "moecert/contracts.hpp"
#include "moecert/types.hpp"

namespace moecert::tools {

enum class Suite : std::uint8_t { smoke = 0, def = 1, full = 2 };
enum class Verdict : std::uint8_t { pass, fail, skip };

struct RunContext {
  int threads = 1;
  std::uint64_t seed = 0;
  std::vector<Isa> isas;  // the ISAs this run covers (--isa, else every usable one)
};

/// One output of a case against its bounded reference: elements compared,
/// beyond their bound, and the worst errors and utilisation.
struct OutputError {
  std::string name;
  std::size_t count = 0, exceeded = 0;
  double max_abs_err = 0, max_rel_err = 0, max_utilization = 0;
};

struct CaseResult {
  Verdict verdict = Verdict::pass;
  std::string detail;  // why it failed or was skipped; a short note otherwise
  double max_abs_err = 0;
  double max_rel_err = 0;
  double max_bound_utilization = 0;  // |err| / bound, <= 1 passes
  std::string worst;                 // the worst element's location and values
  bool deterministic = true;         // re-run with another thread count, bitwise equal
  std::string digest;  // FNV-1a 64 of the outputs' bits, hex (compares runs, builds, machines)
  std::vector<std::string> clauses_fired;   // clause ids whose violation the case provoked
  compare::UtilizationHistogram histogram;  // of every compared element
  std::vector<OutputError> outputs;         // per output, where the case compares each

  /// A result that is only a verdict and its reason (a skip).
  static CaseResult only(Verdict v, std::string why) {
    CaseResult r;
    r.verdict = v;
    r.detail = std::move(why);
    return r;
  }
  /// Fails this result with the reason, keeping what was measured.
  void fail(std::string why) {
    verdict = Verdict::fail;
    detail = std::move(why);
  }
};

struct CaseDef {
  std::string op;              // dotted op id
  std::string variant;         // e.g. "roundtrip"
  std::string isa;             // ISA name, or "any"
  std::string shape;           // shape class and sizes
  std::string data;            // data class
  Suite suite = Suite::smoke;  // the smallest suite that runs it
  Level level = Level::full;   // the contract level it runs at
  std::function<CaseResult(const RunContext&)> run;

  std::string id() const { return op + "/" + variant + "/" + isa + "/" + shape + "/" + data; }
};

struct CaseRecord {
  CaseDef def;
  CaseResult result;
  std::vector<std::string> clauses_checked;  // clause ids evaluated during the case
  double seconds = 0;
};

/// Every case of the engine's self-checks (bf16, config, contracts, ISA).
void add_core_cases(std::vector<CaseDef>& out);
/// Router cases (ISA-independent): softmax and product-key, forward and backward.
void add_router_cases(std::vector<CaseDef>& out);
/// GEMM and expert forward cases for each of `isas` (unusable ones: skip).
void add_kernel_cases(std::vector<CaseDef>& out, const std::vector<Isa>& isas);

/// The experts op with the caller's routing (forward_train + backward) per
/// ISA and routing class (-1 slots, one expert, idle experts).
void add_experts_train_cases(std::vector<CaseDef>& out, const std::vector<Isa>& isas);
/// tools/conform/cases_formats.cpp: the GEMM over quantized packs of each
/// weight format.
void add_format_cases(std::vector<CaseDef>& out, const std::vector<Isa>& isas);

/// Layer cases (forward + backward, two training steps) and the workspace plan.
void add_layer_cases(std::vector<CaseDef>& out, const std::vector<Isa>& isas);

/// Runs f with `threads` threads at most.
template <class F>
auto with_threads(int threads, F f) {
  oneapi::tbb::global_control gc(oneapi::tbb::global_control::max_allowed_parallelism,
                                 static_cast<std::size_t>(threads));
  return f();
}
/// Whether a and b hold the same bits (tools/conform/cases_kernels.cpp).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b);
/// Why a case of `isa` skips on this CPU.
std::string skip_reason(Isa isa);
/// r with b's maxima, worst element and histogram; failed when an element
/// is beyond its bound.
CaseResult fill_from(const compare::Bounded& b, CaseResult r);

/// FNV-1a 64 of the bytes of `v`, 16 hex digits.
std::string digest_of(const std::vector<float>& v);

/// Fails the case with `detail` unless `ok`; returns ok.
bool expect(CaseResult& r, bool ok, const std::string& detail);

/// Compares output `name` with its bounded reference (values and bounds,
/// the reference's own rounding covered by bounds::kReferenceSlack): a row
/// of r.outputs, folded into the case's maxima and histogram; fails the case
/// when an element is beyond its bound, and, with `audit`, when its errors
/// lean toward or away from zero (compare::rounding_audit, proofs/bounds.md
/// §11: for outputs linear in the rounding errors, on random data).
void compare_output(CaseResult& r, std::string name, const std::vector<float>& got,
                    const std::vector<bounds::Tracked>& ref, bool audit = false);

}  // namespace moecert::tools
