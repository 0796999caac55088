// experts.backward.probe and layer.backward.probe: the backward's row
// GEMMs probed inside the op, each right after its step while its buffers
// live (later steps reuse them), reported after the op.
#pragma once

#include <atomic>
#include <cstddef>
#include <string>
#include <vector>

#include "contracts/engine.hpp"
#include "contracts/gemm.hpp"
#include "contracts/probe_sums.hpp"
#include "contracts/saved.hpp"
#include "moecert/experts.hpp"

namespace moecert::contracts {

/// The probes of the experts backward's two row GEMMs and their LoRA
/// products (proofs/bounds.md §9.3), per grouped row:
///   dh  = dy16 W_d (+ qd A_d on the expert path, qd = bf16(s dyb)),
///         against down_t's probes, and dyb = dy16 B_d;
///   dxr = [dg du] [W_g; W_u] (+ qgu [A_g; A_u], qgu = bf16(s dgb)),
///         against gate_up_t's probes, and dgb = [dg du] blockdiag(B_g, B_u).
/// The base packs' dense probes are kept with the packs (§9.1), their
/// narrow ones rotate; the LoRA parts are formed per call from the
/// caller's factors. dh and the dx rows reach the probe block by block from
/// the op's epilogues (ProbeSums), dy16's and dgu's rows as the op forms
/// them (RowSides): no operand is read again but the LoRA columns.
class BackwardProbe {
 public:
  /// `lora` as the op runs with it (rank 0: none); `storage` for the sums
  /// (the op's, reused across calls).
  BackwardProbe(const experts::PackedExperts& w, const experts::Lora& lora, ProbeStorage& storage);
  /// Before the dy rows are formed, the dh GEMM's last pass (the one whose
  /// epilogue hands dh over) computed in items of `item` columns.
  void size_dh(std::size_t rows, std::size_t item);
  /// Grouped rows [row0, row0 + rows) of expert e of dy16, right after the
  /// op formed them: their side of dh's probes over dy16's H columns.
  void dy_rows(const OperandRows& dy16, std::size_t e, std::size_t row0, std::size_t rows);
  /// A finished block of dh: rows [row0, row0 + rows) of expert e, columns
  /// [n0, n1), row i at c + i ldc (ProbeSums::add).
  void dh_block(std::size_t e, std::size_t row0, std::size_t rows, std::size_t n0, std::size_t n1,
                const float* c, std::size_t ldc) {
    dh_sums_.add(dh_.base[e], row0, rows, n0, n1, c, ldc);
  }
  /// The same for the dx rows' GEMM: before dgu is formed; each of its rows
  /// (expert e's) right after the op formed it, over dgu's 2I columns.
  void size_dx(std::size_t rows, std::size_t item);
  void dgu_row(const OperandRows& dgu, std::size_t e, std::size_t row);
  void dx_block(std::size_t e, std::size_t row0, std::size_t rows, std::size_t n0, std::size_t n1,
                const float* c, std::size_t ldc) {
    dx_sums_.add(dx_.base[e], row0, rows, n0, n1, c, ldc);
  }
  /// After dh (handed over block by block) and dyb (r per row) are formed;
  /// `lora_term`: dh includes qd A_d. On the op's threads.
  void dh(const GroupingView& g, const float* dyb, bool lora_term);
  /// After the dx rows (handed over) and dgb (2r per row) are formed from
  /// dgu (bf16, dg at columns 0..I-1, du at I..2I-1).
  void dx(const GroupingView& g, const float* dgb);
  /// Fails `clause` at the first failing row of the first failing GEMM.
  void report(detail::Checker& c, const ClauseInfo& clause) const;

 private:
  struct Gemm {
    std::vector<PackProbes> base;                    // per expert: the pack's probes
    std::vector<std::vector<verify::Probe>> probes;  // per expert with LoRA: base's extended,
                                                     // the factor's last
    std::vector<std::vector<const verify::Probe*>> all;
    verify::ProbeResult result;
    std::string failure;  // the location of result's failure
  };
  void judge(Gemm& gm, const ProbeSums& sums, const RowSides& sides, const char* name,
             const char* factor, const GroupingView& g, std::size_t k, const float* f,
             std::size_t ldf, bool lora_term);

  std::atomic<std::int64_t> ns_{0};
  std::size_t rank_ = 0;
  float scale_ = 0.0f;
  std::size_t hidden_ = 0, inter_ = 0;
  Gemm dh_, dx_;
  ProbeSums dh_sums_, dx_sums_;
  RowSides dh_sides_, dx_sides_;  // over dy16's and dgu's columns (the LoRA ones in judge())
};

}  // namespace moecert::contracts
