// experts.backward.probe and layer.backward.probe: the backward's row
// GEMMs probed inside the op, each right after its step while its buffers
// live (later steps reuse them), reported after the op.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "contracts/engine.hpp"
#include "contracts/gemm.hpp"
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
/// caller's factors.
class BackwardProbe {
 public:
  /// `lora` as the op runs with it (rank 0: none).
  BackwardProbe(const experts::PackedExperts& w, const experts::Lora& lora);
  /// After dh (fp32 rows at ldd) and dyb (r per row) are formed from the
  /// bf16 dy rows; `lora_term`: dh includes qd A_d. On the op's threads.
  void dh(const GroupingView& g, const OperandRows& dy16, const float* dh, std::size_t ldd,
          const float* dyb, bool lora_term);
  /// After the dx rows (fp32, H per row) and dgb (2r per row) are formed
  /// from dgu (bf16, dg at columns 0..I-1, du at I..2I-1).
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
  void judge(Gemm& gm, const char* name, const char* factor, const GroupingView& g, std::size_t k,
             const std::function<bool(std::size_t, float*)>& load, const float* c, std::size_t ldc,
             const float* f, std::size_t ldf);

  std::size_t rank_ = 0;
  float scale_ = 0.0f;
  std::size_t hidden_ = 0, inter_ = 0;
  Gemm dh_, dx_;
  std::atomic<std::int64_t> ns_{0};
};

}  // namespace moecert::contracts
