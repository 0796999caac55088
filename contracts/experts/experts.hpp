// Clauses of experts.forward (declared in include/moecert/experts.hpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <utility>
#include <vector>

#include "contracts/bounds/experts_forward.hpp"
#include "contracts/engine/engine.hpp"
#include "contracts/engine/saved.hpp"
#include "contracts/gemm/gemm.hpp"
#include "moecert/experts.hpp"

namespace moecert::contracts {

/// The probes of the experts forward carried through the op (audit): each
/// pack's probes for this call, and the gate/up GEMM's C side of them (C r
/// and sum |C| of each grouped row, by span of the op's work item) gathered
/// by the op as each 32-column block of C is finished, in cache, so that C
/// need not be kept (proofs/bounds.md §9.1). The sums live in `storage`
/// (the op's, reused across calls), NaN until written: a span whose first
/// block the op never hands over fails the probe; a later block left out
/// leaves its part out of C r.
///
/// With LoRA (rank r > 0) the gate/up GEMM is C = [x | lb] [W_gu | B_gu]^T
/// with lb = bf16(s xa), and the down GEMM o = [h | lbd] [W_d | B_d]^T with
/// lbd = bf16(s ha) (proofs/experts.md §1): each probe's weight side gains
/// B^T r from the caller's factors, and each pack gains a last probe, of
/// the first factor's product (xa = x [A_g; A_u]^T, ha = h A_d^T: its
/// weight side over the same A row, zero on lb's columns).
class ExpertsProbe {
 public:
  static constexpr std::size_t kBlock = verify::detail::kBlockColumns;  // per add(): a panel pair
  static constexpr unsigned kAddEvery = 1024;  // add() calls per timed one (SampledTimer)

  /// `lora`: the caller's factors (null or rank 0: none), read here only.
  ExpertsProbe(const experts::PackedExperts& w, ProbeStorage& storage,
               const experts::Lora* lora = nullptr);
  /// Where the op keeps c1 for a backward: add() also records each row's
  /// digest of the block into `into` (experts.backward.saved_intact);
  /// before size_rows().
  void record_digests(SavedDigests& into) { digests_ = &into; }
  /// Sizes the sums (and digests) for `rows` grouped rows; before the GEMM.
  /// `span`: the gate/up columns of one work item of the op (a multiple of
  /// kBlock), whose blocks of a row add() takes in column order, the first
  /// one first (gemm::gemm_block's loop 3).
  void size_rows(std::size_t rows, std::size_t span);
  /// Rows [row0, row0 + rows) (expert e's) of the gate/up C, columns
  /// [n, n + kBlock), row i at c + i ldc. One writer per (row, span); any
  /// thread.
  void add(std::size_t e, std::size_t row0, std::size_t rows, std::size_t n, const float* c,
           std::size_t ldc);
  /// The probes of pack [2e] (gate_up) or [2e + 1] (down): dense, narrow,
  /// and with LoRA the first factor's.
  const std::vector<const verify::Probe*>& probes(std::size_t pack) const { return all_[pack]; }
  /// The first factor's probe of `pack` (xa's or ha's), or null without LoRA.
  const verify::Probe* factor_probe(std::size_t pack) const {
    return rank_ ? all_[pack].back() : nullptr;
  }
  /// LoRA rank r (0: none) and scale s = float(alpha / r).
  std::size_t rank() const { return rank_; }
  float scale() const { return scale_; }
  /// Each grouped row's (C r, sum |C|) over the dense probe's columns, its
  /// blocks summed in column order (read column by column, on the op's
  /// threads: by row, each of a row's blocks is a line of its own).
  std::vector<std::pair<double, double>> dense_sums() const;
  /// Row's (C r, sum |C|) over narrow probe q's columns (probes()[q + 1]).
  std::pair<double, double> narrow_sums(std::size_t row, std::size_t q) const;
  /// CPU time spent in the constructor, size_rows() and add() (add()
  /// sampled), in ns: the probe's share of the op's own passes.
  std::int64_t ns() const { return ns_.load(); }

 private:
  std::atomic<std::int64_t> ns_{0};
  std::vector<PackProbes> packs_;
  std::vector<std::vector<verify::Probe>> lora_;  // per pack with LoRA: probes() in order
  std::vector<std::vector<const verify::Probe*>> all_;
  // Column `column`'s (sum, magnitude) of grouped row `row`. Stored by
  // column (the dense probe's spans, then the narrow probes), each
  // column's rows contiguous: an add() writes its rows of one column in one
  // run.
  double* at(std::size_t column, std::size_t row) const {
    return storage_.data() + 2 * (column * rows_ + row);
  }

  std::vector<double>& storage_;
  SavedDigests* digests_ = nullptr;
  std::size_t n_ = 0;      // gate_up's N (columns)
  std::size_t span_ = 0;   // columns per span (size_rows)
  std::size_t spans_ = 0;  // spans of N
  std::size_t rows_ = 0;   // grouped rows (size_rows)
  std::size_t rank_ = 0;
  float scale_ = 0.0f;
};

/// experts.pack.shape of a quantized pack's views.
void experts_pack_pre(detail::Checker& c, const std::vector<QuantView>& w_gate,
                      const std::vector<QuantView>& w_up, const std::vector<QuantView>& w_down);
void experts_forward_pre(detail::Checker& c, const experts::PackedExperts& w, MatView<const bf16> x,
                         MatView<const std::int32_t> idx, MatView<const float> weights,
                         MatView<float> y);
void experts_forward_grouping(detail::Checker& c, MatView<const std::int32_t> idx,
                              const GroupingView& g);
/// The probes of the experts forward's GEMMs under `clause` (proofs/bounds.md
/// §9): gate/up with A read from x through the grouping (so the gather is
/// checked too) and C from the sums st.probe gathered or from st.c1, down
/// with A read from h in the kernel's layout and C = o; with LoRA (`lora`
/// as the op ran with it) also xa's and ha's products. The first failing
/// row of each GEMM in grouped order.
void probe_expert_gemms(detail::Checker& c, const ClauseInfo& clause,
                        const experts::PackedExperts& w, const experts::Lora* lora,
                        MatView<const bf16> x, std::size_t topk, const ExpertRows& st);
void experts_forward_post(detail::Checker& c, const experts::PackedExperts& w,
                          MatView<const bf16> x, MatView<const std::int32_t> idx,
                          MatView<const float> weights, MatView<const float> y,
                          const ExpertRows& st);

}  // namespace moecert::contracts
