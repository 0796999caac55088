// Clauses of experts.forward: shapes, routing indices, finiteness, aliasing,
// the grouping invariant, and the numeric postconditions.
#include "contracts/experts.hpp"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "contracts/bounds/experts.hpp"
#include "contracts/checks.hpp"
#include "contracts/clauses.hpp"
#include "contracts/compare.hpp"
#include "contracts/experts_train.hpp"
#include "contracts/gemm.hpp"
#include "contracts/lora_probes.hpp"
#include "contracts/tbb_sync.hpp"
#include "contracts/verify.hpp"

namespace moecert::contracts {

namespace k = clauses::experts;

namespace {

constexpr std::uint64_t kFactorSeed = 0x5eed1a;

// Expert e's gate/up probes with LoRA: B_gu's column n is [B_g row i | 0]
// or [0 | B_u row i] as n lies in a gate or an up panel (16-column panels
// alternate, ExpertRows::c1), zero for padding columns (i >= I); then the
// probe of xa = x [A_g; A_u]^T.
std::vector<verify::Probe> gate_up_lora(const PackProbes& base, const experts::Lora& l,
                                        std::size_t e, std::size_t hidden, std::size_t inter) {
  constexpr std::size_t kPanel = gemm::PackedWeights::kPanel;
  const std::size_t r = l.rank;
  auto fill = [&](const verify::Probe& p, double* sum, double* mag) {
    for (std::size_t j = 0; j < p.width; ++j) {
      const std::size_t n = p.j0 + j, panel = n / kPanel, i = (panel / 2) * kPanel + n % kPanel;
      if (i >= inter) continue;  // padding
      const bool up = panel % 2;
      lora_probe::short_add(up ? l.b_up.row(e * inter + i) : l.b_gate.row(e * inter + i), r, p.r[j],
                            sum + (up ? r : 0), mag + (up ? r : 0));
    }
  };
  std::vector<verify::Probe> out;
  for (const verify::Probe* p : base.all()) out.push_back(lora_probe::extended(*p, 2 * r, fill));
  out.push_back(lora_probe::factor_probe(
      hidden, 2 * r, 2 * r,
      [&](const std::vector<float>& signs, double* sum, double* mag) {
        for (std::size_t j = 0; j < 2 * r; ++j)
          verify::detail::add_signed(j < r ? l.a_gate.row(e * r + j) : l.a_up.row(e * r + j - r),
                                     hidden, signs[j], sum, mag);
      },
      kFactorSeed + 2 * e));
  return out;
}

// Expert e's down probes with LoRA: B_d's rows as the extra weight side,
// then the probe of ha = h A_d^T.
std::vector<verify::Probe> down_lora(const PackProbes& base, const experts::Lora& l, std::size_t e,
                                     std::size_t hidden, std::size_t inter) {
  const std::size_t r = l.rank;
  std::vector<verify::Probe> out;
  for (const verify::Probe* p : base.all())
    out.push_back(
        lora_probe::extended(*p, r, [&](const verify::Probe& q, double* sum, double* mag) {
          for (std::size_t j = 0; j < q.width; ++j)
            lora_probe::short_add(l.b_down.row(e * hidden + q.j0 + j), r, q.r[j], sum, mag);
        }));
  out.push_back(lora_probe::factor_probe(
      inter, r, r,
      [&](const std::vector<float>& signs, double* sum, double* mag) {
        for (std::size_t j = 0; j < r; ++j)
          verify::detail::add_signed(l.a_down.row(e * r + j), inter, signs[j], sum, mag);
      },
      kFactorSeed + 2 * e + 1));
  return out;
}

// The gate/up GEMM's A row i: x's row of the slot's token, then with LoRA
// bf16(s xa_i), as the op forms the second product's A operand; whether a
// value is flushable.
bool load_x_row(const GroupingView& g, MatView<const bf16> x, std::size_t topk, const float* xa,
                std::size_t r, float s, std::size_t i, float* row) {
  const bool flushable =
      verify::load_bf16(x.row(static_cast<std::size_t>(g.row_slot[i]) / topk), x.cols, row);
  return r ? lora_probe::scaled_bf16(xa + i * 2 * r, 2 * r, s, row + x.cols) || flushable
           : flushable;
}

// The down GEMM's A row i: h's row, then with LoRA bf16(s ha_i).
bool load_h_row(const OperandRows& h, std::size_t inter, const float* ha, std::size_t r, float s,
                std::size_t i, float* row) {
  const OperandRows::Runs hr = h.row(i, inter);
  const bool flushable = verify::load_bf16(hr.first, inter, hr.run, hr.stride, row);
  return r ? lora_probe::scaled_bf16(ha + i * r, r, s, row + inter) || flushable : flushable;
}

}  // namespace

ExpertsProbe::ExpertsProbe(const experts::PackedExperts& w, ProbeStorage& storage,
                           const experts::Lora* lora)
    : packs_(2 * w.experts()),
      lora_(2 * w.experts()),
      all_(2 * w.experts()),
      gate_up_(storage.c_first, ns_),
      down_(storage.c_second, ns_),
      x_sides_(storage.a_first, ns_),
      h_sides_(storage.a_second, ns_),
      rank_(lora ? lora->rank : 0),
      scale_(rank_ ? static_cast<float>(lora->alpha / static_cast<double>(rank_)) : 0.0f) {
  const detail::SampledTimer timer(ns_, 1);
  oneapi::tbb::parallel_for(std::size_t{0}, packs_.size(), [&](std::size_t i) {
    const std::size_t e = i / 2;
    packs_[i] = pack_probes(i % 2 ? w.down(e) : w.gate_up(e));
    if (!rank_) {
      all_[i] = packs_[i].all();
      return;
    }
    lora_[i] = i % 2 ? down_lora(packs_[i], *lora, e, w.hidden(), w.inter())
                     : gate_up_lora(packs_[i], *lora, e, w.hidden(), w.inter());
    for (const verify::Probe& p : lora_[i]) all_[i].push_back(&p);
  });
}

void ExpertsProbe::size_rows(std::size_t rows, std::size_t gate_up_item, std::size_t down_item) {
  const std::size_t n1 = packs_.empty() ? 0 : packs_[0].dense->r.size();
  const std::size_t n2 = packs_.empty() ? 0 : packs_[1].dense->r.size();
  gate_up_.size(rows, n1, gate_up_item);
  down_.size(rows, n2, down_item);
  x_sides_.size(rows, all_.empty() ? 0 : all_[0].size());
  h_sides_.size(rows, all_.empty() ? 0 : all_[1].size());
}

void ExpertsProbe::x_rows(const GroupingView& g, MatView<const bf16> x, std::size_t topk,
                          const float* xa, std::size_t e, std::size_t row0, std::size_t rows) {
  const std::size_t k = x.cols + 2 * rank_;
  thread_local std::vector<float> row;
  row.resize(k);
  for (std::size_t i = row0; i < row0 + rows; ++i)
    x_sides_.form(i, all_[2 * e], row.data(), k,
                  load_x_row(g, x, topk, xa, rank_, scale_, i, row.data()));
}

void ExpertsProbe::h_rows(const OperandRows& h, std::size_t inter, const float* ha, std::size_t e,
                          std::size_t row0, std::size_t rows) {
  const std::size_t k = inter + rank_;
  thread_local std::vector<float> row;
  row.resize(k);
  for (std::size_t i = row0; i < row0 + rows; ++i)
    h_sides_.form(i, all_[2 * e + 1], row.data(), k,
                  load_h_row(h, inter, ha, rank_, scale_, i, row.data()));
}

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
  std::vector<const gemm::PackedWeights*> packs;
  for (std::size_t e = 0; e < e_count; ++e)
    packs.push_back(&w.gate_up(e)), packs.push_back(&w.down(e));
  gemm_checksums(c, packs, [](std::size_t i) {
    return fmt::format("{} e={}", i % 2 ? "down" : "gate_up", i / 2);
  });
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

void probe_expert_gemms(detail::Checker& c, const ClauseInfo& clause,
                        const experts::PackedExperts& w, const experts::Lora* lora,
                        MatView<const bf16> x, std::size_t topk, const ExpertRows& st) {
  const GroupingView& g = st.grouping;
  MOECERT_ASSERT(st.c1 != nullptr || st.probe != nullptr);
  // The op's probes, or (c1 kept) this call's, formed here.
  ProbeStorage no_sums;
  std::optional<ExpertsProbe> own;
  const ExpertsProbe& probe = st.probe ? *st.probe : own.emplace(w, no_sums, lora);
  if (st.probe)  // its share of the op's passes (own's is inside this clause's time)
    detail::add_clause_seconds(clause, static_cast<double>(probe.ns()) * 1e-9);
  const std::size_t r = probe.rank(), hidden = w.hidden(), inter = w.inter();
  MOECERT_ASSERT(r == st.rank);
  static const std::vector<const verify::Probe*> none;
  auto row_probes = [&](std::size_t gemm) {
    return [&, gemm](std::size_t i) -> const std::vector<const verify::Probe*>& {
      return g.routed_row(i) ? probe.probes(2 * g.expert_of(i) + gemm) : none;
    };
  };
  auto is_factor = [&](std::size_t i, std::size_t gemm, const verify::Probe& p) {
    return &p == probe.factor_probe(2 * g.expert_of(i) + gemm);
  };
  auto load_x = [&](std::size_t i, float* row) {
    return load_x_row(g, x, topk, st.xa, r, probe.scale(), i, row);
  };
  auto load_h = [&](std::size_t i, float* row) {
    return load_h_row(st.h, inter, st.ha, r, probe.scale(), i, row);
  };
  // A's side of the op's probes as the op formed them.
  auto formed = [&](std::size_t gemm) {
    return [&, gemm](std::size_t i, const std::vector<const verify::Probe*>& ps,
                     verify::RowSide* out) {
      for (std::size_t q = 0; q < ps.size(); ++q) out[q] = probe.sides(gemm).side(i, q);
    };
  };
  auto fail = [&](const verify::ProbeResult& p, std::size_t gemm) {
    const char* name =
        is_factor(p.row, gemm, *p.probe) ? (gemm ? "ha" : "xa") : (gemm ? "down" : "gate_up");
    fail_probe(c, clause, grouped_probe_location(g, p, name), p);
  };
  // From the op's sums and sides (st.probe), else from x, c1, h and o.
  auto c_side = [&](std::size_t gemm, const std::vector<std::pair<double, double>>& dense,
                    const float* f, std::size_t ldf, const float* c, std::size_t ldc) {
    return [&, gemm, f, ldf, c, ldc](std::size_t i, std::size_t q, const verify::Probe& p) {
      if (is_factor(i, gemm, p)) return lora_probe::row_sums(f + i * ldf, p);
      return st.probe ? probe.sums(gemm).of(dense, i, q) : lora_probe::row_sums(c + i * ldc, p);
    };
  };
  auto judge = [&](std::size_t gemm, std::size_t k, auto load, const auto& c_sums) {
    return st.probe ? probe_rows_sides(g.rows(), k, row_probes(gemm), formed(gemm), c_sums)
                    : probe_rows_sums(g.rows(), k, load, row_probes(gemm), c_sums);
  };
  const auto dense_gu = st.probe ? probe.sums(0).dense() : std::vector<std::pair<double, double>>{};
  const auto gate_up =
      judge(0, hidden + 2 * r, load_x, c_side(0, dense_gu, st.xa, 2 * r, st.c1, st.ldc1));
  if (!gate_up.pass) return fail(gate_up, 0);
  const auto dense_d = st.probe ? probe.sums(1).dense() : std::vector<std::pair<double, double>>{};
  const auto down = judge(1, inter + r, load_h, c_side(1, dense_d, st.ha, r, st.o, st.ldo));
  if (!down.pass) fail(down, 1);
}

void experts_forward_post(detail::Checker& c, const experts::PackedExperts& w,
                          MatView<const bf16> x, MatView<const std::int32_t> idx,
                          MatView<const float> weights, MatView<const float> y,
                          const ExpertRows& st) {
  MOECERT_CONTRACT(c, k::kYFinite) { detail::scan_finite(c, k::kYFinite, "y", y); }
  // x and W in range, no overflow; Freivalds probes of both GEMMs of every
  // expert (each pack's dense probe and this call's narrow blocks), never
  // failing within bounds::dot; proofs/bounds.md §9.
  MOECERT_CONTRACT(c, k::kProbe) { probe_expert_gemms(c, k::kProbe, w, nullptr, x, idx.cols, st); }
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
