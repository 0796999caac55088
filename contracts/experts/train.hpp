// Clauses of experts.forward_train and experts.backward
// (include/moecert/experts.hpp), and the clause bodies the layer shares
// with them (it runs the same op around its router).
#pragma once

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "contracts/engine/engine.hpp"
#include "contracts/engine/saved.hpp"
#include "contracts/numeric/tracked.hpp"
#include "contracts/reference/layer.hpp"
#include "moecert/experts.hpp"

namespace moecert::contracts {

void experts_train_forward_pre(detail::Checker& c, const experts::PackedExperts& w,
                               const experts::Lora& lora, MatView<const bf16> x,
                               MatView<const std::int32_t> idx, MatView<const float> weights,
                               MatView<float> y);
void experts_train_forward_post(detail::Checker& c, const experts::PackedExperts& w,
                                const experts::Lora& lora, MatView<const bf16> x,
                                MatView<const float> y, const TrainSaved& s);
void experts_backward_pre(detail::Checker& c, const experts::PackedExperts& w,
                          const experts::Lora& lora, MatView<const bf16> x, MatView<const float> dy,
                          const TrainSaved& s, const experts::Gradients& g);
class GradFiniteScan;
class BackwardProbe;
/// grads_judge: grad_finite as judged in the op's passes (null: judged
/// here, in a pass of its own).
void experts_backward_post(detail::Checker& c, const experts::PackedExperts& w,
                           const experts::Lora& lora, MatView<const bf16> x,
                           MatView<const float> dy, const TrainSaved& s,
                           const experts::Gradients& g, GradFiniteScan* grads_judge,
                           const BackwardProbe* probe = nullptr);

// ---- shared with the layer -------------------------------------------------

// Clause bodies: each fails `clause` at its first offender; the caller
// guards it with MOECERT_CONTRACT(c, clause) (so a cap compiles it out).

/// -1 <= idx < E, and -1 only at the tail of a row.
void routing_in_range(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx,
                      std::size_t experts);
/// No expert twice in a row.
void routing_unique(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx);
/// Every weight finite, and 0 at -1 slots.
void routing_weights(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx,
                     MatView<const float> weights);

/// The six LoRA views with the shapes they must have for E, H, I, r.
struct Named {
  const char* name;
  std::size_t rows, cols;
};
std::array<Named, 6> lora_shapes(std::size_t E, std::size_t H, std::size_t I, std::size_t r);
std::array<MatView<const bf16>, 6> lora_views(const experts::Lora& l);
/// The first LoRA view not of its shape, as "lora.a_gate 3x4, expected 4x4"; "" if none.
std::string lora_shape_error(const experts::Lora& l, std::size_t E, std::size_t H, std::size_t I);
/// s = float(alpha / r) finite and in [2^-60, 2^60] (r > 0).
void lora_scale(detail::Checker& c, const ClauseInfo& clause, std::size_t rank, double alpha);
/// The packed LoRA factors' rank padding is zero.
void lora_padding(detail::Checker& c, const ClauseInfo& clause,
                  std::span<const PackedFactor> factors);

/// lora_finite (every LoRA element finite) and lora_range (0 or
/// 2^-60 <= |a| <= 2^60), judged while the factors are packed: expert(e)
/// scans expert e's rows of the six factors on the thread that packs them
/// (the pack has just read them) and keeps each factor's first offender of
/// each; report() fails `finite` at the first factor's non-finite element,
/// else `range` (when `range_on`) at the first factor's out-of-range one,
/// and adds the time spent in expert() to the clauses'.
class LoraFiniteScan {
 public:
  LoraFiniteScan(const experts::Lora& l, std::size_t experts, bool range_on);
  void expert(std::size_t e);  // thread-safe
  void report(detail::Checker& c, const ClauseInfo& finite, const ClauseInfo& range);

 private:
  bool fail_first(detail::Checker& c, const ClauseInfo& clause,
                  const std::array<std::atomic<std::size_t>, 6>& first, std::string_view expected);
  const experts::Lora& lora_;
  std::size_t experts_;
  bool range_on_;
  // i * cols + j of each factor's first offender; SIZE_MAX: none
  std::array<std::atomic<std::size_t>, 6> first_finite_, first_range_;
  std::atomic<std::int64_t> ns_{0};
};

/// lora_padding judged while the packs are made: expert() reads one
/// expert's packs on the thread that just wrote them (still in its cache)
/// and keeps the first offender (lowest expert, then factor); report()
/// fails `clause` there as lora_padding does, and adds the time spent in
/// expert() to the clause's.
class LoraPaddingScan {
 public:
  void expert(std::span<const PackedFactor, 8> factors);  // thread-safe
  void report(detail::Checker& c, const ClauseInfo& clause);

 private:
  std::mutex mu_;
  std::optional<PackedFactor> first_;
  std::atomic<std::int64_t> ns_{0};
};

/// The exact values of a Tracked reference.
std::vector<double> exact(const std::vector<bounds::Tracked>& ref);
/// The rounding audit of an output against its exact reference values
/// (compare::rounding_audit, proofs/bounds.md §11); false when it failed.
bool rounding_unbiased(detail::Checker& c, const ClauseInfo& clause, std::string_view name,
                       std::span<const float> got, std::span<const double> ref);

/// The weight gradients of the expert path (LoRA's six, then the base
/// weights' three) with the shapes they must have.
constexpr std::size_t kWeightGrads = 9;
std::array<Named, kWeightGrads> grad_shapes(std::size_t E, std::size_t H, std::size_t I,
                                            std::size_t r);
std::array<MatView<float>, kWeightGrads> weight_grads(const experts::Gradients& g);

/// The saved state the backward reads is finite (idx in range) at the
/// elements it reads, for experts of intermediate size I (logits: the
/// layer's router logits [T x R], or null; c1's rows only `with_c1`);
/// false when `clause` failed.
bool train_saved_finite(detail::Checker& c, const ClauseInfo& clause, const TrainSaved& s,
                        std::size_t I, const float* logits, std::size_t R, bool with_c1 = true);
/// saved_finite judged inside the backward's own passes (the saved rows are
/// its largest read; proofs/experts.md §7). begin(), after the first step's
/// poison and before any work: the routing copy and the router logits,
/// O(T (K + R)); at audit and above every saved row as well, c1 but where
/// c1_by_row() (a fresh buffer placed on saved rows shows its poison there
/// before its first write; at check that is workspace.arena.disjoint's to
/// catch). dweights(sum): a
/// grouped row's binary64 dL/dw sum over h's and ha's row is not finite
/// when one of their elements is not. row(q): c1's gate and up runs and the
/// xa, ha rows (and h's where no dL/dw is formed) on the thread that just
/// read them for the SwiGLU backward. report(), before the backward writes
/// an output: after a mark, train_saved_finite names the first offender
/// (none: dh itself was not finite, for grad_finite to name); once.
class SavedFiniteScan {
 public:
  SavedFiniteScan(detail::Checker& c, const ClauseInfo& clause, const TrainSaved& s, std::size_t I,
                  const float* logits, std::size_t R);
  void begin();
  /// The caller forms dL/dw: h's rows are judged through dweights().
  void h_through_dweights() { h_judged_ = true; }
  /// saved_intact holds c1 to the forward's bits (audit): begin()'s scan of
  /// every saved row leaves c1 to row(). Before begin().
  void c1_by_row() { c1_intact_ = true; }
  void dweights(double sum) {  // thread-safe
    if (!std::isfinite(sum)) marked_.store(true, std::memory_order_relaxed);
  }
  void row(std::size_t q);  // thread-safe
  void report();

 private:
  detail::Checker& c_;
  const ClauseInfo& clause_;
  TrainSaved s_;
  std::size_t inter_, router_out_;
  const float* logits_;
  bool h_judged_ = false, reported_ = false, c1_intact_ = false;
  std::atomic<bool> marked_{false};
  std::atomic<std::int64_t> ns_{0};
};

/// saved_intact (audit): c1, the saved gate/up output that the SwiGLU
/// backward reads, holds the bits the forward wrote. The audited training
/// forward recorded the digest of each block of each grouped row as its
/// epilogue finished it (ExpertRows::c1_digests, SavedDigests,
/// verify::detail::row_digests); row(q) forms row q's digest again on the
/// thread that has just read the row (in its cache) and keeps the first row
/// that differs; report() fails `clause` there, before the backward writes
/// an output. Any change of one element of a row is caught
/// (proofs/experts.md §7). Made only where the forward recorded digests.
class SavedIntactScan {
 public:
  SavedIntactScan(detail::Checker& c, const ClauseInfo& clause, const ExpertRows& rows);
  void row(std::size_t q);  // thread-safe
  void report();

 private:
  std::uint32_t recorded(std::size_t q) const;  // row q's digest as the forward recorded it

  detail::Checker& c_;
  const ClauseInfo& clause_;
  ExpertRows rows_;
  std::size_t parts_;                         // digests recorded per row
  std::atomic<std::size_t> first_{SIZE_MAX};  // grouped row
  std::atomic<std::int64_t> ns_{0};
};

/// grad_finite judged where the backward writes: written(m, ...) checks a
/// block of output m on the thread that just wrote it (in its cache) and
/// keeps the output's first offender; reopen(m) forgets what was handed
/// over (m is written again). report() fails `clause` at the first
/// offender of the first output in order; an output not handed over in
/// full (elements counted) is scanned in a pass of its own.
class GradFiniteScan {
 public:
  struct Output {
    std::string name;
    MatView<const float> m;
  };
  explicit GradFiniteScan(std::vector<Output> outputs);
  /// Rows [r0, r1) x columns [c0, c1) of the output at m.data (thread-safe;
  /// not an output: ignored).
  void written(const float* m, std::size_t r0, std::size_t r1, std::size_t c0, std::size_t c1);
  /// The blocks of one output that one task writes, each judged as it is
  /// finished (in cache; e.g. a GEMM's block_done), their count handed over
  /// once when the Task ends: one atomic addition per task, not per block.
  class Task {
   public:
    Task(GradFiniteScan* scan, const float* m);  // null scan, or m not an output: nothing
    ~Task();
    Task(const Task&) = delete;
    Task& operator=(const Task&) = delete;
    void add(std::size_t r0, std::size_t r1, std::size_t c0, std::size_t c1);

   private:
    GradFiniteScan* scan_ = nullptr;
    std::size_t out_ = 0, handed_ = 0;
  };
  void reopen(const float* m);
  void report(detail::Checker& c, const ClauseInfo& clause);

 private:
  struct State {
    std::atomic<std::size_t> handed{0}, first{SIZE_MAX};  // first: i * cols + j
  };
  std::vector<Output> outs_;
  std::unique_ptr<State[]> state_;
  std::atomic<std::int64_t> ns_{0};
};

/// experts.backward's outputs in grad_finite's order: dx, dweights, m_a,
/// m_g, then the weight gradients.
std::vector<GradFiniteScan::Output> experts_grad_outputs(const experts::Gradients& g, std::size_t E,
                                                         std::size_t H, std::size_t I,
                                                         std::size_t r);

/// An idle expert's weight gradients are exactly 0, and M_A, M_G are 0
/// wherever token t is not routed to e.
void empty_expert_zero(detail::Checker& c, const ClauseInfo& clause, const TrainSaved& s,
                       const experts::Gradients& g);
/// dL/dw exactly 0 at -1 slots.
void dweights_masked(detail::Checker& c, const ClauseInfo& clause, const TrainSaved& s,
                     MatView<const float> dw);

/// The elements of m, row by row.
std::vector<float> values(MatView<const float> m);
/// Compares got (rows x cols, row-major) with the bounded reference (times
/// kReferenceSlack); fails `clause` at the worst element, citing `proof`.
bool within(detail::Checker& c, const ClauseInfo& clause, std::string_view name, std::size_t cols,
            const std::vector<float>& got, const std::vector<bounds::Tracked>& ref,
            std::string_view proof);

/// The experts op's inputs as reference data of scalar S (idx and weights
/// from the saved state: the kernel's copies), dy [T x H] optional.
template <class S>
ref::LayerData<S> experts_data(const experts::PackedExperts& w, const experts::Lora& lora,
                               MatView<const bf16> x, std::optional<MatView<const float>> dy,
                               const TrainSaved& s);

}  // namespace moecert::contracts
