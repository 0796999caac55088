// Clauses of the GEMM ops (declared in include/moecert/gemm.hpp).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "contracts/checks.hpp"
#include "contracts/engine.hpp"
#include "contracts/verify.hpp"
#include "moecert/gemm.hpp"

namespace moecert::contracts {

void gemm_pack_pre(detail::Checker& c, MatView<const bf16> w, MatView<const bf16> second);
void gemm_pack_post(detail::Checker& c, MatView<const bf16> w, MatView<const bf16> second,
                    const gemm::PackedWeights& out);
void gemm_pack_transposed_post(detail::Checker& c, MatView<const bf16> wt,
                               const gemm::PackedWeights& out);
void gemm_matmul_pre(detail::Checker& c, MatView<const bf16> a, const gemm::PackedWeights& w,
                     MatView<float> out);
void gemm_matmul_post(detail::Checker& c, MatView<const bf16> a, const gemm::PackedWeights& w,
                      MatView<const float> out);
/// gemm.pack.checksum for an op that reads `w`: at audit the next part in
/// w's rotation, at full every part.
void gemm_checksum(detail::Checker& c, const gemm::PackedWeights& w, std::string_view name);
/// The same for packs[0..n), verified on the op's threads; a failure names
/// name(i) of the first failing pack.
void gemm_checksums(detail::Checker& c, const std::vector<const gemm::PackedWeights*>& packs,
                    const std::function<std::string(std::size_t)>& name);

/// The probes of C = A W^T for one audited call (proofs/bounds.md §9.1):
/// the dense probe over every column of W, formed on the pack's first
/// audited call and kept with it, and kNarrow blocks of kNarrowWidth
/// columns in rotation (call c of this pack probes blocks cP .. cP + P - 1
/// modulo the block count, P = kNarrow: each block within
/// ceil(N / (P width)) calls).
struct PackProbes {
  static constexpr std::size_t kNarrow = 1, kNarrowWidth = 4;
  std::shared_ptr<const verify::Probe> dense;
  std::vector<verify::Probe> narrow;
  std::vector<const verify::Probe*> all() const;
};
PackProbes pack_probes(const gemm::PackedWeights& w);

/// Rows [0, m) of C against their probes (§9) on the op's threads: the
/// first failing (row, probe) in row order, else a pass. load(i, row) writes
/// A's row i as K binary32 values and returns whether one is flushable;
/// c_row(i) is C's row i; probes(i) the probes of row i (none: not judged).
template <class Load, class CRow, class ProbesOf>
verify::ProbeResult probe_rows(std::size_t m, std::size_t k, Load load, CRow c_row, ProbesOf probes,
                               bool c_is_bf16 = false) {
  auto judge = [&](std::size_t i, verify::ProbeResult& res) {
    const std::vector<const verify::Probe*>& ps = probes(i);
    if (ps.empty()) return;
    thread_local std::vector<float> row;
    row.resize(k);
    const bool flushable = load(i, row.data());
    for (const verify::Probe* p : ps)
      res.add(i, *p, verify::probe_row(*p, row.data(), k, flushable, c_row(i), c_is_bf16));
  };
  const std::size_t i = detail::first_failing(m, 6 * k, [&](std::size_t i) {
    verify::ProbeResult r;
    judge(i, r);
    return r.pass;
  });
  verify::ProbeResult res;
  if (i < m) judge(i, res);
  return res;
}

}  // namespace moecert::contracts
