// Clauses of experts.forward: shapes, routing indices, finiteness, aliasing,
// the grouping invariant, and the numeric postconditions.
#include "contracts/experts.hpp"

#include <oneapi/tbb/parallel_for.h>

#include "contracts/bounds/experts.hpp"
#include "contracts/checks.hpp"
#include "contracts/clauses.hpp"
#include "contracts/compare.hpp"
#include "contracts/experts_train.hpp"
#include "contracts/gemm.hpp"
#include "contracts/tbb_sync.hpp"
#include "contracts/verify.hpp"

namespace moecert::contracts {

namespace k = clauses::experts;

void experts_forward_pre(detail::Checker& c, const experts::PackedExperts& w, MatView<const bf16> x,
                         MatView<const std::int32_t> idx, MatView<const float> weights,
                         MatView<float> y) {
  const std::size_t t = x.rows, kk = idx.cols, e_count = w.experts();
  MOECERT_CONTRACT(c, k::kShape) {
    if (x.cols != w.hidden() || idx.rows != t || weights.rows != t || weights.cols != kk ||
        y.rows != t || y.cols != w.hidden() || x.stride < x.cols || y.stride < y.cols ||
        idx.stride < kk || weights.stride < kk)
      c.fail(k::kShape, "",
             fmt::format("x {}x{}, idx {}x{}, weights {}x{}, y {}x{}", x.rows, x.cols, idx.rows,
                         idx.cols, weights.rows, weights.cols, y.rows, y.cols),
             fmt::format("x Tx{0}, idx and weights TxK, y Tx{0}", w.hidden()));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kIdxInRange) { routing_in_range(c, k::kIdxInRange, idx, e_count); }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kIdxUnique) { routing_unique(c, k::kIdxUnique, idx); }
  MOECERT_CONTRACT(c, k::kWeightFinite) { routing_weights(c, k::kWeightFinite, idx, weights); }
  MOECERT_CONTRACT(c, k::kXFinite) { detail::scan_finite(c, k::kXFinite, "x", x); }
  MOECERT_CONTRACT(c, k::kXRange) { detail::scan_bf16_range(c, k::kXRange, "x", x); }
  MOECERT_CONTRACT(c, k::kNoAlias) {
    const ByteRange yr = y.bytes();
    const std::pair<const char*, ByteRange> inputs[] = {
        {"x", x.bytes()}, {"idx", idx.bytes()}, {"weights", weights.bytes()}};
    for (const auto& [name, r] : inputs)
      if (overlaps(yr, r))
        c.fail(k::kNoAlias, "",
               fmt::format("y {} overlaps {} {}", detail::format_range(yr), name,
                           detail::format_range(r)),
               "disjoint");
    for (std::size_t e = 0; e < e_count; ++e)
      for (const auto* p : {&w.gate_up(e), &w.down(e)}) {
        const ByteRange r{reinterpret_cast<std::uintptr_t>(p->data()),
                          reinterpret_cast<std::uintptr_t>(p->data() + p->size())};
        if (overlaps(yr, r))
          c.fail(k::kNoAlias, fmt::format("e={}", e),
                 fmt::format("y {} overlaps packed weights {}", detail::format_range(yr),
                             detail::format_range(r)),
                 "disjoint");
      }
  }
  for (std::size_t e = 0; e < e_count; ++e) {
    gemm_checksum(c, w.gate_up(e), fmt::format("gate_up e={}", e));
    gemm_checksum(c, w.down(e), fmt::format("down e={}", e));
  }
}

void experts_forward_grouping(detail::Checker& c, MatView<const std::int32_t> idx,
                              const GroupingView& g) {
  MOECERT_CONTRACT(c, k::kPermutation) {
    // Every valid slot maps to a row of its own expert's group that maps back
    // to it; the histogram sums to the number of valid slots.
    std::size_t valid = 0, sum = 0;
    for (std::size_t e = 0; e < g.experts; ++e) sum += g.count[e];
    for (std::size_t s = 0; s < idx.rows * idx.cols; ++s) {
      const std::int32_t e = idx(s / idx.cols, s % idx.cols);
      const std::int64_t row = g.slot_row[s];
      if (e < 0) {
        if (row != -1)
          c.fail(k::kPermutation, fmt::format("slot {}", s), fmt::format("row={}", row),
                 "-1 for an empty slot");
        continue;
      }
      ++valid;
      const auto ue = static_cast<std::size_t>(e);
      if (row < static_cast<std::int64_t>(g.begin[ue]) ||
          row >= static_cast<std::int64_t>(g.begin[ue] + g.count[ue]) ||
          g.row_slot[static_cast<std::size_t>(row)] != static_cast<std::int32_t>(s)) {
        c.fail(k::kPermutation, fmt::format("slot {}", s),
               fmt::format("row={} (expert {})", row, e),
               fmt::format("a row in [{}, {}) mapping back to the slot", g.begin[ue],
                           g.begin[ue] + g.count[ue]));
        return;
      }
    }
    if (valid != sum || valid != g.routed)
      c.fail(k::kPermutation, "", fmt::format("histogram sum {} routed {}", sum, g.routed),
             fmt::format("{} valid slots", valid));
  }
}

void experts_forward_post(detail::Checker& c, const experts::PackedExperts& w,
                          MatView<const bf16> x, MatView<const std::int32_t> idx,
                          MatView<const float> weights, MatView<const float> y,
                          const ExpertRows& st) {
  MOECERT_CONTRACT(c, k::kYFinite) { detail::scan_finite(c, k::kYFinite, "y", y); }
  // x and W in range, no overflow; Freivalds probes of both GEMMs of every
  // expert, never failing within bounds::dot; proofs/bounds.md §9.
  MOECERT_CONTRACT(c, k::kProbe) {
    const auto& g = st.grouping;
    for (std::size_t e = 0; e < g.experts; ++e) {
      if (g.count[e] == 0) continue;
      const std::size_t r0 = g.begin[e], m = g.count[e];
      const auto& gu = w.gate_up(e);
      const auto& dn = w.down(e);
      // Gate+up: A read from x through the grouping (so the gather is
      // checked too); down: A read from h in the kernel's layout.
      const auto p1 = verify::probe_gemm_nt(
          m, w.hidden(),
          [&](std::size_t i, std::size_t kk) {
            return x(static_cast<std::size_t>(g.row_slot[r0 + i]) / idx.cols, kk);
          },
          gu.n(), [&](std::size_t j, std::size_t kk) { return gu.at(j, kk); },
          MatView<const float>(st.c1 + r0 * st.ldc1, m, gu.n(), st.ldc1));
      const auto p2 = verify::probe_gemm_nt(
          m, w.inter(), [&](std::size_t i, std::size_t kk) { return st.h.at(r0 + i, kk); },
          w.hidden(), [&](std::size_t j, std::size_t kk) { return dn.at(j, kk); },
          MatView<const float>(st.o + r0 * st.ldo, m, w.hidden(), st.ldo));
      for (const auto* p : {&p1, &p2})
        if (!p->pass) {
          c.fail(k::kProbe,
                 fmt::format("e={} {} GEMM row {} column block {}", e,
                             p == &p1 ? "gate_up" : "down", p->row, p->block),
                 fmt::format("residual {:.6g}", p->residual),
                 fmt::format("<= {:.6g} (proofs/bounds.md §9)", p->threshold));
          return;
        }
    }
  }
  // x, W and the weights exact; every y within the chained expert bound
  // (bounds::expert_row, bounds::combine); proofs/bounds.md §10.
  MOECERT_CONTRACT(c, k::kWithinBound) {
    const auto ref = experts_forward_reference(w, x, idx, weights);
    std::vector<float> got(y.rows * y.cols);
    for (std::size_t t = 0; t < y.rows; ++t)
      for (std::size_t m = 0; m < y.cols; ++m) got[t * y.cols + m] = y(t, m);
    const auto cmp = compare::bounded(got, ref.y, ref.bound);
    if (!cmp.pass())
      c.fail(k::kWithinBound, fmt::format("t={} h={}", cmp.worst / y.cols, cmp.worst % y.cols),
             fmt::format("y={:.9g} ref={:.17g} (utilisation {:.3g})", cmp.worst_got, cmp.worst_ref,
                         cmp.max_utilization),
             fmt::format("|y - ref| <= {:.6g} (proofs/bounds.md §10)", cmp.worst_bound));
  }
}

}  // namespace moecert::contracts
