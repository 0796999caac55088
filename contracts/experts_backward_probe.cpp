// The experts backward's row GEMMs against their probes, judged inside the
// op right after each step (proofs/bounds.md §9.3).
#include "contracts/experts_backward_probe.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>

#include "contracts/lora_probes.hpp"

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
      dh_sums_(storage.c_first, ns_),
      dx_sums_(storage.c_second, ns_),
      dh_sides_(storage.a_first, ns_),
      dx_sides_(storage.a_second, ns_) {
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
            for (std::size_t m = 0; m < H; ++m)
              lora_probe::short_sums(l.b_down.row(e * H + m), signs.data(), r, sum[m], mag[m]);
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
            for (std::size_t i = 0; i < I; ++i) {
              lora_probe::short_sums(l.b_gate.row(e * I + i), signs.data(), r, sum[i], mag[i]);
              lora_probe::short_sums(l.b_up.row(e * I + i), signs.data() + r, r, sum[I + i],
                                     mag[I + i]);
            }
          },
          kDgbSeed + e));
    }
    for (const verify::Probe& p : out) gm.all[e].push_back(&p);
  });
}

void BackwardProbe::size_dh(std::size_t rows, std::size_t item) {
  dh_sums_.size(rows, inter_, item);
  dh_sides_.size(rows, dh_.all.empty() ? 0 : dh_.all[0].size());
}

void BackwardProbe::size_dx(std::size_t rows, std::size_t item) {
  dx_sums_.size(rows, hidden_, item);
  dx_sides_.size(rows, dx_.all.empty() ? 0 : dx_.all[0].size());
}

void BackwardProbe::dy_rows(const OperandRows& dy16, std::size_t e, std::size_t row0,
                            std::size_t rows) {
  thread_local std::vector<float> a;
  a.resize(hidden_);
  for (std::size_t i = row0; i < row0 + rows; ++i) {
    const OperandRows::Runs d = dy16.row(i, hidden_);
    dh_sides_.form(i, dh_.all[e], a.data(), hidden_,
                   verify::load_bf16(d.first, hidden_, d.run, d.stride, a.data()));
  }
}

void BackwardProbe::dgu_row(const OperandRows& dgu, std::size_t e, std::size_t row) {
  const std::size_t k = 2 * inter_;
  thread_local std::vector<float> a;
  a.resize(k);
  const OperandRows::Runs d = dgu.row(row, k);
  dx_sides_.form(row, dx_.all[e], a.data(), k,
                 verify::load_bf16(d.first, k, d.run, d.stride, a.data()));
}

// Each routed row against its expert's probes: A's side as the op formed
// its rows over the first k columns, plus the ldf LoRA columns bf16(s f)
// from the first factor's product f (lora_term; without it they are zero
// and add nothing); C's side from the epilogue's sums, the factor's own
// probe's from f.
void BackwardProbe::judge(Gemm& gm, const ProbeSums& sums, const RowSides& sides, const char* name,
                          const char* factor, const GroupingView& g, std::size_t k, const float* f,
                          std::size_t ldf, bool lora_term) {
  const detail::SampledTimer timer(ns_, 1);
  static const std::vector<const verify::Probe*> none;
  auto is_factor = [&](std::size_t i, const verify::Probe& p) {
    return rank_ && &p == gm.all[g.expert_of(i)].back();
  };
  auto row_sides = [&](std::size_t i, const std::vector<const verify::Probe*>& ps,
                       verify::RowSide* out) {
    thread_local std::vector<float> lora;
    lora.resize(ldf);
    const bool flushable =
        lora_term && lora_probe::scaled_bf16(f + i * ldf, ldf, scale_, lora.data());
    for (std::size_t q = 0; q < ps.size(); ++q) {
      out[q] = sides.side(i, q);
      if (lora_term) out[q] += verify::row_side(*ps[q], k, lora.data(), ldf, flushable);
    }
  };
  const std::vector<std::pair<double, double>> dense = sums.dense();
  gm.result = probe_rows_sides(
      g.rows(), k + ldf,
      [&](std::size_t i) -> const std::vector<const verify::Probe*>& {
        return g.routed_row(i) ? gm.all[g.expert_of(i)] : none;
      },
      row_sides,
      [&](std::size_t i, std::size_t q, const verify::Probe& p) {
        return is_factor(i, p) ? lora_probe::row_sums(f + i * ldf, p) : sums.of(dense, i, q);
      });
  if (!gm.result.pass)
    gm.failure = grouped_probe_location(g, gm.result,
                                        is_factor(gm.result.row, *gm.result.probe) ? factor : name);
}

void BackwardProbe::dh(const GroupingView& g, const float* dyb, bool lora_term) {
  judge(dh_, dh_sums_, dh_sides_, "dh", "dyb", g, hidden_, dyb, rank_, lora_term);
}

void BackwardProbe::dx(const GroupingView& g, const float* dgb) {
  judge(dx_, dx_sums_, dx_sides_, "dx", "dgb", g, 2 * inter_, dgb, 2 * rank_, rank_ > 0);
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
