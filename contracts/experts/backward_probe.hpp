// experts.backward.probe and layer.backward.probe: the backward's row
// GEMMs probed inside the op, each right after its step while its buffers
// live (later steps reuse them), reported after the op.
#pragma once

#include <atomic>
#include <cstddef>
#include <string>
#include <vector>

#include "contracts/engine/engine.hpp"
#include "contracts/engine/saved.hpp"
#include "contracts/gemm/gemm.hpp"
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
/// caller's factors. Where the op goes on to read dh's rows (the SwiGLU
/// backward) and the dx rows (the scatter into dx), it hands each row over
/// as it reads it (RowSums), so that the probe does not read C again.
class BackwardProbe {
 public:
  /// `lora` as the op runs with it (rank 0: none); `storage` for the sums.
  BackwardProbe(const experts::PackedExperts& w, const experts::Lora& lora, ProbeStorage& storage);
  /// Before the op's first step: `rows` grouped rows.
  void size_rows(std::size_t rows);
  /// dh judged at once, after dh (fp32 rows at ldd) and dyb (r per row) are
  /// formed from the bf16 dy rows, reading both operands (the three parts
  /// below in a row); `lora_term`: dh includes qd A_d. On the op's threads.
  void dh(const GroupingView& g, const OperandRows& dy16, const float* dh, std::size_t ldd,
          const float* dyb, bool lora_term);
  /// The same in three parts, for a backward whose SwiGLU step reads dh:
  /// A's side while dy16 lives (after dh and dyb are formed), each row of dh
  /// (expert e's) as the op reads it, then the judgement (dyb still live).
  void dh_sides(const GroupingView& g, const OperandRows& dy16, const float* dyb, bool lora_term);
  void dh_row(std::size_t e, std::size_t row, const float* dh) {
    dh_rows_.form(row, dh_.base[e], dh);
  }
  void dh_judge(const GroupingView& g, const float* dyb);
  /// A dx row (expert e's, fp32, H values) as the op's scatter reads it.
  void dx_row(std::size_t e, std::size_t row, const float* dxr) {
    dx_rows_.form(row, dx_.base[e], dxr);
  }
  /// The dx rows (fp32, H per row, read here; null: handed over by
  /// dx_row()) and dgb (2r per row), formed from dgu (bf16, dg at columns
  /// 0..I-1, du at I..2I-1), judged.
  void dx(const GroupingView& g, const OperandRows& dgu, const float* dxr, const float* dgb);
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
  // Rows of dh's A (dy16, then bf16(s dyb) or zeros) and of the dx rows' A
  // (dgu, then bf16(s dgb)) as binary32; whether one is flushable.
  bool load_dh_row(const OperandRows& dy16, const float* dyb, bool lora_term, std::size_t i,
                   float* row) const;
  bool load_dx_row(const OperandRows& dgu, const float* dgb, std::size_t i, float* row) const;
  // Whether p is the first factor's probe of expert e (its last, with LoRA).
  bool is_factor(const Gemm& gm, std::size_t e, const verify::Probe& p) const {
    return rank_ && &p == gm.all[e].back();
  }
  static std::size_t probes_per_row(const Gemm& gm) {
    return gm.all.empty() ? 0 : gm.all[0].size();
  }
  // Every routed row of C (row i at c + i ldc) into `sums`, on the op's threads.
  void form_rows(const GroupingView& g, const Gemm& gm, RowSums& sums, const float* c,
                 std::size_t ldc);
  template <class Sides, class CSums>
  void judge(Gemm& gm, const char* name, const char* factor, const GroupingView& g, std::size_t k,
             Sides sides, CSums c_sums);

  std::size_t rank_ = 0;
  float scale_ = 0.0f;
  std::size_t hidden_ = 0, inter_ = 0;
  Gemm dh_, dx_;
  RowSums dh_rows_, dx_rows_;
  std::vector<verify::RowSide>& dh_sides_;  // per grouped row, one per probe of its expert
  std::atomic<std::int64_t> ns_{0};
};

}  // namespace moecert::contracts
