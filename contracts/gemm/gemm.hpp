// Clauses of the GEMM ops (declared in include/moecert/gemm.hpp).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "contracts/engine/checks.hpp"
#include "contracts/engine/engine.hpp"
#include "contracts/engine/saved.hpp"
#include "contracts/probes/verify.hpp"
#include "moecert/gemm.hpp"

namespace moecert::contracts {

void gemm_pack_pre(detail::Checker& c, MatView<const bf16> w, MatView<const bf16> second);
void gemm_pack_post(detail::Checker& c, MatView<const bf16> w, MatView<const bf16> second,
                    const gemm::PackedWeights& out);
void gemm_pack_transposed_post(detail::Checker& c, MatView<const bf16> wt,
                               const gemm::PackedWeights& out);
/// The gemm.pack clauses of a quantized pack (pack: W = w, or the fused pair
/// of w and second; transposed: W = [w; second]^T, second optional).
void gemm_pack_quantized_pre(detail::Checker& c, const QuantView& w, const QuantView& second,
                             bool transposed);
void gemm_pack_quantized_post(detail::Checker& c, const QuantView& w, const QuantView& second,
                              bool transposed, const gemm::PackedWeights& out);
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
/// verify::make_probe of w's columns [j0, j0 + width), all in one panel,
/// read from that panel directly.
verify::Probe panel_probe(const gemm::PackedWeights& w, std::size_t j0, std::size_t width,
                          std::uint64_t seed);

/// The C side of a grouped GEMM's base probes (each pack's dense and
/// narrow ones) per grouped row, (C r, sum |C|), summed by the op in the
/// pass that reads C's row for its next step (the SwiGLU backward, the dx
/// scatter) while the row is in cache, so that the probe does not read C
/// again. Storage reused across calls; NaN until formed: a
/// row the op never hands over fails its probes.
class RowSums {
 public:
  explicit RowSums(std::vector<std::pair<double, double>>& storage) : storage_(storage) {}
  /// Before the op's pass: `rows` grouped rows (on the op's threads).
  void size(std::size_t rows);
  /// Row `row` of C at c, whose pack's probes are p. Any thread, one per row.
  void form(std::size_t row, const PackProbes& p, const float* c);
  /// Row `row`'s sums over its pack's probe q (0: dense, 1..: narrow).
  std::pair<double, double> of(std::size_t row, std::size_t q) const {
    return storage_[row * kProbes + q];
  }

 private:
  static constexpr std::size_t kProbes = 1 + PackProbes::kNarrow;
  std::vector<std::pair<double, double>>& storage_;
};

/// An op's storage for its probes' sums, kept across calls.
struct ProbeStorage {
  std::vector<double> blocks;                          // ExpertsProbe's epilogue sums
  std::vector<std::pair<double, double>> rows, rows2;  // RowSums of two GEMMs
  std::vector<verify::RowSide> sides;                  // A's side, per row and probe
};

/// Fails `clause` at `location` with p's residual and threshold (p failed).
void fail_probe(detail::Checker& c, const ClauseInfo& clause, std::string location,
                const verify::ProbeResult& p);
/// "e=E NAME GEMM row R columns [J0, J1)": p's failing grouped row as its
/// expert's row R.
std::string grouped_probe_location(const GroupingView& g, const verify::ProbeResult& p,
                                   std::string_view gemm);

/// Rows [0, m) of C against their probes (§9) on the op's threads: the
/// first failing (row, probe) in row order, else a pass. probes(i) gives
/// the probes of row i (none: not judged); sides(i, ps, out) writes row i's
/// side of each probe ps[q] over all k entries into out[q]; c_sums(i, q, p)
/// row i's (C r, sum |C|) over probe q = p's columns.
template <class ProbesOf, class Sides, class CSums>
verify::ProbeResult probe_rows_sides(std::size_t m, std::size_t k, ProbesOf probes, Sides sides,
                                     CSums c_sums, bool c_is_bf16 = false) {
  auto judge = [&](std::size_t i, verify::ProbeResult& res) {
    const std::vector<const verify::Probe*>& ps = probes(i);
    if (ps.empty()) return;
    thread_local std::vector<verify::RowSide> side;
    side.resize(ps.size());
    sides(i, ps, side.data());
    for (std::size_t q = 0; q < ps.size(); ++q) {
      const auto [lhs, cabs] = c_sums(i, q, *ps[q]);
      res.add(i, *ps[q], verify::judge_row(*ps[q], k, side[q], lhs, cabs, c_is_bf16));
    }
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

/// probe_rows_sides' sides(i, ps, out) from A's rows read by load(i, row):
/// row i as K binary32 values, returning whether one is flushable.
template <class Load>
auto loaded_sides(std::size_t k, Load load) {
  return
      [k, load](std::size_t i, const std::vector<const verify::Probe*>& ps, verify::RowSide* out) {
        thread_local std::vector<float> row;
        row.resize(k);
        const bool flushable = load(i, row.data());
        for (std::size_t q = 0; q < ps.size(); ++q)
          out[q] = verify::row_side(*ps[q], 0, row.data(), k, flushable);
      };
}

/// The same with A's rows read here by load (loaded_sides).
template <class Load, class ProbesOf, class CSums>
verify::ProbeResult probe_rows_sums(std::size_t m, std::size_t k, Load load, ProbesOf probes,
                                    CSums c_sums, bool c_is_bf16 = false) {
  return probe_rows_sides(m, k, probes, loaded_sides(k, load), c_sums, c_is_bf16);
}

/// The same with C's rows at c_row(i).
template <class Load, class CRow, class ProbesOf>
verify::ProbeResult probe_rows(std::size_t m, std::size_t k, Load load, CRow c_row, ProbesOf probes,
                               bool c_is_bf16 = false) {
  return probe_rows_sums(
      m, k, load, probes,
      [&](std::size_t i, std::size_t, const verify::Probe& p) {
        std::pair<double, double> s;
        verify::detail::signed_sum_and_magnitude(c_row(i) + p.j0, p.r.data(), p.width, s.first,
                                                 s.second);
        return s;
      },
      c_is_bf16);
}

}  // namespace moecert::contracts
