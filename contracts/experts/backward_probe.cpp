// The experts backward's row GEMMs against their probes, judged inside the
// op while their operands live (proofs/bounds.md §9.3).
#include "contracts/experts/backward_probe.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>

#include "contracts/probes/lora.hpp"

namespace moecert::contracts {

namespace {

constexpr std::uint64_t kDybSeed = 0x5eedd1, kDgbSeed = 0x5eedd2;

}  // namespace

BackwardProbe::BackwardProbe(const experts::PackedExperts& w, const experts::Lora& l,
                             ProbeStorage& storage)
    : rank_(l.rank),
      scale_(rank_ ? static_cast<float>(l.alpha / static_cast<double>(rank_)) : 0.0f),
      hidden_(w.hidden()),
      inter_(w.inter()),
      dh_rows_(storage.rows),
      dx_rows_(storage.rows2),
      dh_sides_(storage.sides) {
  const detail::SampledTimer timer(ns_, 1);
  const std::size_t E = w.experts(), H = hidden_, I = inter_, r = rank_;
  for (Gemm* gm : {&dh_, &dx_}) gm->base.resize(E), gm->probes.resize(E), gm->all.resize(E);
  oneapi::tbb::parallel_for(std::size_t{0}, 2 * E, [&](std::size_t task) {
    const std::size_t e = task / 2;
    const bool dx = task % 2;
    Gemm& gm = dx ? dx_ : dh_;
    const PackProbes& base = gm.base[e] = pack_probes(dx ? w.gate_up_t(e) : w.down_t(e));
    std::vector<verify::Probe>& out = gm.probes[e];
    if (!r) {
      gm.all[e] = base.all();
      return;
    }
    if (!dx) {
      // dh: A_d^T's column i is A_d's column i (the rows of A_d over the
      // probe's columns); dyb = dy16 B_d: F's row q is B_d's column q.
      for (const verify::Probe* p : base.all())
        out.push_back(
            lora_probe::extended(*p, r, [&](const verify::Probe& q, double* sum, double* mag) {
              lora_probe::fill_by_rows(
                  q, r, 0, [&](std::size_t k) { return l.a_down.row(e * r + k); }, sum, mag);
            }));
      out.push_back(lora_probe::factor_probe(
          H, r, r,
          [&](const std::vector<float>& signs, double* sum, double* mag) {
            verify::detail::signed_row_sums(l.b_down.row(e * H), l.b_down.stride, H, r,
                                            signs.data(), sum, mag);
          },
          kDybSeed + e));
    } else {
      // dx rows: [A_g; A_u]^T's column m is A_g's, then A_u's column m;
      // dgb = [dg du] blockdiag(B_g, B_u): F's row q < r is B_g's column q
      // over dg's columns, row r + q B_u's over du's.
      for (const verify::Probe* p : base.all())
        out.push_back(
            lora_probe::extended(*p, 2 * r, [&](const verify::Probe& q, double* sum, double* mag) {
              lora_probe::fill_by_rows(
                  q, r, 0, [&](std::size_t k) { return l.a_gate.row(e * r + k); }, sum, mag);
              lora_probe::fill_by_rows(
                  q, r, r, [&](std::size_t k) { return l.a_up.row(e * r + k); }, sum, mag);
            }));
      out.push_back(lora_probe::factor_probe(
          2 * I, 2 * r, 2 * r,
          [&](const std::vector<float>& signs, double* sum, double* mag) {
            verify::detail::signed_row_sums(l.b_gate.row(e * I), l.b_gate.stride, I, r,
                                            signs.data(), sum, mag);
            verify::detail::signed_row_sums(l.b_up.row(e * I), l.b_up.stride, I, r,
                                            signs.data() + r, sum + I, mag + I);
          },
          kDgbSeed + e));
    }
    for (const verify::Probe& p : out) gm.all[e].push_back(&p);
  });
}

void BackwardProbe::size_rows(std::size_t rows) {
  const detail::SampledTimer timer(ns_, 1);
  dh_rows_.size(rows);
  dx_rows_.size(rows);
}

bool BackwardProbe::load_dh_row(const OperandRows& dy16, const float* dyb, bool lora_term,
                                std::size_t i, float* row) const {
  const std::size_t H = hidden_, r = rank_;
  const OperandRows::Runs d = dy16.row(i, H);
  const bool flushable = verify::load_bf16(d.first, H, d.run, d.stride, row);
  if (!lora_term) {  // dh without qd A_d: qd's columns weigh nothing
    std::fill(row + H, row + H + r, 0.0f);
    return flushable;
  }
  return lora_probe::scaled_bf16(dyb + i * r, r, scale_, row + H) || flushable;
}

bool BackwardProbe::load_dx_row(const OperandRows& dgu, const float* dgb, std::size_t i,
                                float* row) const {
  const std::size_t k = 2 * inter_, r2 = 2 * rank_;
  const OperandRows::Runs d = dgu.row(i, k);
  const bool flushable = verify::load_bf16(d.first, k, d.run, d.stride, row);
  return r2 ? lora_probe::scaled_bf16(dgb + i * r2, r2, scale_, row + k) || flushable : flushable;
}

// Every routed row against its expert's probes, from A's side sides(i, ps,
// out) and C's c_sums(i, q, p); the first failure kept with its location.
template <class Sides, class CSums>
void BackwardProbe::judge(Gemm& gm, const char* name, const char* factor, const GroupingView& g,
                          std::size_t k, Sides sides, CSums c_sums) {
  const detail::SampledTimer timer(ns_, 1);
  static const std::vector<const verify::Probe*> none;
  gm.result = probe_rows_sides(
      g.rows(), k,
      [&](std::size_t i) -> const std::vector<const verify::Probe*>& {
        return g.routed_row(i) ? gm.all[g.expert_of(i)] : none;
      },
      sides, c_sums);
  if (!gm.result.pass)
    gm.failure = grouped_probe_location(
        g, gm.result, is_factor(gm, g.expert_of(gm.result.row), *gm.result.probe) ? factor : name);
}

void BackwardProbe::form_rows(const GroupingView& g, const Gemm& gm, RowSums& sums, const float* c,
                              std::size_t ldc) {
  const detail::SampledTimer timer(ns_, 1);
  oneapi::tbb::parallel_for(std::size_t{0}, g.rows(), [&](std::size_t i) {
    if (g.routed_row(i)) sums.form(i, gm.base[g.expert_of(i)], c + i * ldc);
  });
}

void BackwardProbe::dh(const GroupingView& g, const OperandRows& dy16, const float* dh,
                       std::size_t ldd, const float* dyb, bool lora_term) {
  dh_sides(g, dy16, dyb, lora_term);
  form_rows(g, dh_, dh_rows_, dh, ldd);
  dh_judge(g, dyb);
}

void BackwardProbe::dh_sides(const GroupingView& g, const OperandRows& dy16, const float* dyb,
                             bool lora_term) {
  const detail::SampledTimer timer(ns_, 1);
  const std::size_t k = hidden_ + rank_, n = probes_per_row(dh_);
  if (dh_sides_.size() < g.rows() * n) dh_sides_.resize(g.rows() * n);
  auto sides = loaded_sides(
      k, [&](std::size_t i, float* row) { return load_dh_row(dy16, dyb, lora_term, i, row); });
  oneapi::tbb::parallel_for(std::size_t{0}, g.rows(), [&](std::size_t i) {
    if (g.routed_row(i)) sides(i, dh_.all[g.expert_of(i)], dh_sides_.data() + i * n);
  });
}

void BackwardProbe::dh_judge(const GroupingView& g, const float* dyb) {
  const std::size_t n = probes_per_row(dh_);
  judge(
      dh_, "dh", "dyb", g, hidden_ + rank_,
      [&](std::size_t i, const std::vector<const verify::Probe*>& ps, verify::RowSide* out) {
        std::copy(dh_sides_.begin() + i * n, dh_sides_.begin() + i * n + ps.size(), out);
      },
      [&](std::size_t i, std::size_t q, const verify::Probe& p) {
        return is_factor(dh_, g.expert_of(i), p) ? lora_probe::row_sums(dyb + i * rank_, p)
                                                 : dh_rows_.of(i, q);
      });
}

void BackwardProbe::dx(const GroupingView& g, const OperandRows& dgu, const float* dxr,
                       const float* dgb) {
  if (dxr) form_rows(g, dx_, dx_rows_, dxr, hidden_);
  const std::size_t k = 2 * inter_ + 2 * rank_;
  judge(dx_, "dx", "dgb", g, k,
        loaded_sides(k, [&](std::size_t i, float* row) { return load_dx_row(dgu, dgb, i, row); }),
        [&](std::size_t i, std::size_t q, const verify::Probe& p) {
          return is_factor(dx_, g.expert_of(i), p) ? lora_probe::row_sums(dgb + i * 2 * rank_, p)
                                                   : dx_rows_.of(i, q);
        });
}

void BackwardProbe::report(detail::Checker& c, const ClauseInfo& clause) const {
  detail::add_clause_seconds(clause, static_cast<double>(ns_.load()) * 1e-9);
  for (const Gemm* gm : {&dh_, &dx_})
    if (!gm->result.pass) {
      fail_probe(c, clause, gm->failure, gm->result);
      return;
    }
}

}  // namespace moecert::contracts
