// Clauses of experts.forward: shapes, routing indices, finiteness, aliasing,
// the grouping invariant, and the numeric postconditions.
#include "contracts/experts/experts.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "contracts/bounds/experts.hpp"
#include "contracts/engine/checks.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/engine/compare.hpp"
#include "contracts/engine/tbb_sync.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/gemm/gemm.hpp"
#include "contracts/probes/lora.hpp"
#include "contracts/probes/verify.hpp"

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
  // By runs of p's columns within one panel: rows i0.. of B_g or B_u.
  auto fill = [&](const verify::Probe& p, double* sum, double* mag) {
    for (std::size_t j = 0; j < p.width;) {
      const std::size_t n = p.j0 + j, panel = n / kPanel, i0 = (panel / 2) * kPanel + n % kPanel;
      const std::size_t run = std::min(p.width - j, kPanel - n % kPanel);
      const bool up = panel % 2;
      const MatView<const bf16>& b = up ? l.b_up : l.b_gate;
      if (i0 < inter)  // columns past I are padding
        verify::detail::add_signed_rows(b.row(e * inter + i0), b.stride, std::min(run, inter - i0),
                                        r, p.r.data() + j, sum + (up ? r : 0), mag + (up ? r : 0));
      j += run;
    }
  };
  std::vector<verify::Probe> out;
  for (const verify::Probe* p : base.all()) out.push_back(lora_probe::extended(*p, 2 * r, fill));
  out.push_back(lora_probe::factor_probe(
      hidden, 2 * r, 2 * r,
      [&](const std::vector<float>& signs, double* sum, double* mag) {
        verify::detail::add_signed_rows(l.a_gate.row(e * r), l.a_gate.stride, r, hidden,
                                        signs.data(), sum, mag);
        verify::detail::add_signed_rows(l.a_up.row(e * r), l.a_up.stride, r, hidden,
                                        signs.data() + r, sum, mag);
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
          verify::detail::add_signed_rows(l.b_down.row(e * hidden + q.j0), l.b_down.stride, q.width,
                                          r, q.r.data(), sum, mag);
        }));
  out.push_back(lora_probe::factor_probe(
      inter, r, r,
      [&](const std::vector<float>& signs, double* sum, double* mag) {
        verify::detail::add_signed_rows(l.a_down.row(e * r), l.a_down.stride, r, inter,
                                        signs.data(), sum, mag);
      },
      kFactorSeed + 2 * e + 1));
  return out;
}

}  // namespace

ExpertsProbe::ExpertsProbe(const experts::PackedExperts& w, ProbeStorage& storage,
                           const experts::Lora* lora)
    : packs_(2 * w.experts()),
      lora_(2 * w.experts()),
      all_(2 * w.experts()),
      storage_(storage.blocks),
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
  if (w.experts()) n_ = w.gate_up(0).n();  // 2 round_up(I, 16) columns
}

void ExpertsProbe::size_rows(std::size_t rows, std::size_t span) {
  const detail::SampledTimer timer(ns_, 1);
  MOECERT_ASSERT(span > 0 && span % kBlock == 0);
  rows_ = rows, span_ = span, spans_ = (n_ + span - 1) / span;
  const std::size_t n = 2 * rows * (spans_ + PackProbes::kNarrow);
  if (storage_.size() < n) storage_.resize(n);
  detail::fill_parallel(storage_.data(), n, double{NAN});
  if (digests_) digests_->c1.resize(rows * spans_), digests_->valid = true;
}

void ExpertsProbe::add(std::size_t e, std::size_t row0, std::size_t rows, std::size_t n,
                       const float* c, std::size_t ldc) {
  const detail::SampledTimer timer(ns_, kAddEvery);
  MOECERT_ASSERT(n % kBlock == 0 && n + kBlock <= packs_[2 * e].dense->width);
  const PackProbes& p = packs_[2 * e];
  const std::size_t s = n / span_;
  const bool later = n % span_ != 0;  // the span's first block sets, later ones add
  verify::detail::block_sums(c, ldc, rows, p.dense->r.data() + n, at(s, row0), later);
  if (digests_)
    verify::detail::row_digests(c, ldc, rows, kBlock, digests_->c1.data() + s * rows_ + row0, 1,
                                later);
  for (std::size_t q = 0; q < p.narrow.size(); ++q) {
    const verify::Probe& nq = p.narrow[q];
    if (nq.j0 < n || nq.j0 >= n + kBlock) continue;  // a narrow block lies in one 32-column block
    double* nout = at(spans_ + q, row0);
    for (std::size_t i = 0; i < rows; ++i)
      verify::detail::signed_sum_and_magnitude(c + i * ldc + (nq.j0 - n), nq.r.data(), nq.width,
                                               nout[2 * i], nout[2 * i + 1]);
  }
}

std::vector<std::pair<double, double>> ExpertsProbe::dense_sums() const {
  std::vector<std::pair<double, double>> out(rows_, {0.0, 0.0});
  constexpr std::size_t kRows = 512;  // a row block's totals stay in L1
  oneapi::tbb::parallel_for(std::size_t{0}, (rows_ + kRows - 1) / kRows, [&](std::size_t blk) {
    const std::size_t r0 = blk * kRows, r1 = std::min(rows_, r0 + kRows);
    for (std::size_t b = 0; b < spans_; ++b) {
      const double* in = at(b, r0);
      for (std::size_t r = r0; r < r1; ++r, in += 2) out[r].first += in[0], out[r].second += in[1];
    }
  });
  return out;
}

std::pair<double, double> ExpertsProbe::narrow_sums(std::size_t row, std::size_t q) const {
  const double* in = at(spans_ + q, row);
  return {in[0], in[1]};
}

void experts_pack_pre(detail::Checker& c, const std::vector<QuantView>& w_gate,
                      const std::vector<QuantView>& w_up, const std::vector<QuantView>& w_down) {
  MOECERT_CONTRACT(c, k::kPackShape) {
    const std::size_t E = w_gate.size();
    const bool counts = E >= 1 && w_up.size() == E && w_down.size() == E;
    const std::size_t I = counts ? w_gate[0].rows : 0, H = counts ? w_gate[0].cols : 0;
    const WeightFormat f = counts ? w_gate[0].format : WeightFormat::bf16;
    if (!counts || !I || !H || f == WeightFormat::bf16) {
      c.fail(k::kPackShape, "",
             fmt::format("{} gate, {} up, {} down views; gate[0] {} {}x{}", w_gate.size(),
                         w_up.size(), w_down.size(), counts ? format_name(f) : "-", I, H),
             "as many of each (>= 1), a quantized format, I, H >= 1");
      return;
    }
    for (std::size_t e = 0; e < E; ++e) {
      const std::pair<const char*, const QuantView*> views[] = {
          {"w_gate", &w_gate[e]}, {"w_up", &w_up[e]}, {"w_down", &w_down[e]}};
      for (const auto& [name, v] : views) {
        const bool down = name[2] == 'd';
        if (v->format != f || v->rows != (down ? H : I) || v->cols != (down ? I : H)) {
          c.fail(k::kPackShape, fmt::format("{}[{}]", name, e),
                 fmt::format("{} {}x{}", format_name(v->format), v->rows, v->cols),
                 fmt::format("{} {}x{}", format_name(f), down ? H : I, down ? I : H));
          return;
        }
      }
    }
  }
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
        const ByteRange r = p->storage();
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
  // With LoRA, the row goes on with bf16(s f) for the first factor's
  // product f, as the op forms the second product's A operand.
  auto append_scaled = [&](const float* f, std::size_t n, float* row) {
    return lora_probe::scaled_bf16(f, n, probe.scale(), row);
  };
  auto load_x = [&](std::size_t i, float* row) {
    const bool flushable =
        verify::load_bf16(x.row(static_cast<std::size_t>(g.row_slot[i]) / topk), hidden, row);
    return r ? append_scaled(st.xa + i * 2 * r, 2 * r, row + hidden) || flushable : flushable;
  };
  auto load_h = [&](std::size_t i, float* row) {
    const OperandRows::Runs h = st.h.row(i, inter);
    const bool flushable = verify::load_bf16(h.first, inter, h.run, h.stride, row);
    return r ? append_scaled(st.ha + i * r, r, row + inter) || flushable : flushable;
  };
  const std::vector<std::pair<double, double>> dense =
      st.probe ? probe.dense_sums() : std::vector<std::pair<double, double>>{};
  const auto gate_up = probe_rows_sums(g.rows(), hidden + 2 * r, load_x, row_probes(0),
                                       [&](std::size_t i, std::size_t q, const verify::Probe& p) {
                                         if (is_factor(i, 0, p))
                                           return lora_probe::row_sums(st.xa + i * 2 * r, p);
                                         if (!st.probe)
                                           return lora_probe::row_sums(st.c1 + i * st.ldc1, p);
                                         return q ? probe.narrow_sums(i, q - 1) : dense[i];
                                       });
  const auto down = gate_up.pass
                        ? probe_rows_sums(g.rows(), inter + r, load_h, row_probes(1),
                                          [&](std::size_t i, std::size_t, const verify::Probe& p) {
                                            return is_factor(i, 1, p)
                                                       ? lora_probe::row_sums(st.ha + i * r, p)
                                                       : lora_probe::row_sums(st.o + i * st.ldo, p);
                                          })
                        : verify::ProbeResult{};
  for (std::size_t gemm = 0; gemm < 2; ++gemm)
    if (const verify::ProbeResult& p = gemm ? down : gate_up; !p.pass) {
      const char* name =
          is_factor(p.row, gemm, *p.probe) ? (gemm ? "ha" : "xa") : (gemm ? "down" : "gate_up");
      fail_probe(c, clause, grouped_probe_location(g, p, name), p);
      return;
    }
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
