// Clauses of experts.forward (declared in include/moecert/experts.hpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <utility>
#include <vector>

#include "contracts/engine.hpp"
#include "contracts/gemm.hpp"
#include "contracts/probe_sums.hpp"
#include "contracts/reference/experts.hpp"
#include "contracts/saved.hpp"
#include "moecert/experts.hpp"

namespace moecert::contracts {

/// The probes of the experts forward carried through the op (audit): each
/// pack's probes for this call; both GEMMs' C side of them (C r and sum |C|
/// of each grouped row) gathered by the op's epilogues while a block of C
/// is in cache (ProbeSums), so that neither the gate/up C nor o is read
/// again; and their A side (RowSides) formed where the op gathers x's rows
/// and pads h's, from the same buffers the judge would read
/// (proofs/bounds.md §9.1).
///
/// With LoRA (rank r > 0) the gate/up GEMM is C = [x | lb] [W_gu | B_gu]^T
/// with lb = bf16(s xa), and the down GEMM o = [h | lbd] [W_d | B_d]^T with
/// lbd = bf16(s ha) (proofs/experts.md §1): each probe's weight side gains
/// B^T r from the caller's factors, and each pack gains a last probe, of
/// the first factor's product (xa = x [A_g; A_u]^T, ha = h A_d^T: its
/// weight side over the same A row, zero on lb's columns).
class ExpertsProbe {
 public:
  /// `lora`: the caller's factors (null or rank 0: none), read here only.
  ExpertsProbe(const experts::PackedExperts& w, ProbeStorage& storage,
               const experts::Lora* lora = nullptr);
  /// Before the GEMMs: `rows` grouped rows, the gate/up and the down GEMM
  /// computed in items of `gate_up_item` and `down_item` columns.
  void size_rows(std::size_t rows, std::size_t gate_up_item, std::size_t down_item);
  /// Rows [row0, row0 + rows) (expert e's) of the gate/up C (of o),
  /// columns [n0, n1), row i at c + i ldc: ProbeSums::add.
  void gate_up(std::size_t e, std::size_t row0, std::size_t rows, std::size_t n0, std::size_t n1,
               const float* c, std::size_t ldc) {
    gate_up_.add(packs_[2 * e], row0, rows, n0, n1, c, ldc);
  }
  void down(std::size_t e, std::size_t row0, std::size_t rows, std::size_t n0, std::size_t n1,
            const float* c, std::size_t ldc) {
    down_.add(packs_[2 * e + 1], row0, rows, n0, n1, c, ldc);
  }
  /// The gate/up GEMM's A rows [x | bf16(s xa)] of grouped rows [row0,
  /// row0 + rows) (expert e's), x's row read through the grouping (so the
  /// gather is judged too), right after the op gathered them.
  void x_rows(const GroupingView& g, MatView<const bf16> x, std::size_t topk, const float* xa,
              std::size_t e, std::size_t row0, std::size_t rows);
  /// The down GEMM's A rows [h | bf16(s ha)], right after the op padded them.
  void h_rows(const OperandRows& h, std::size_t inter, const float* ha, std::size_t e,
              std::size_t row0, std::size_t rows);
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
  /// The C side of pack [2e + gemm]'s base probes (probes()[0], [1], ...).
  const ProbeSums& sums(std::size_t gemm) const { return gemm ? down_ : gate_up_; }
  /// The A side of pack [2e + gemm]'s probes (probes()), per grouped row.
  const RowSides& sides(std::size_t gemm) const { return gemm ? h_sides_ : x_sides_; }
  /// CPU time spent in the constructor, size_rows() and the hand-overs
  /// (sampled), in ns: the probe's share of the op's own passes.
  std::int64_t ns() const { return ns_.load(); }

 private:
  std::atomic<std::int64_t> ns_{0};
  std::vector<PackProbes> packs_;
  std::vector<std::vector<verify::Probe>> lora_;  // per pack with LoRA: probes() in order
  std::vector<std::vector<const verify::Probe*>> all_;
  ProbeSums gate_up_, down_;
  RowSides x_sides_, h_sides_;
  std::size_t rank_ = 0;
  float scale_ = 0.0f;
};

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
