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

BackwardProbe::BackwardProbe(const experts::PackedExperts& w, const experts::Lora& l)
    : rank_(l.rank),
      scale_(rank_ ? static_cast<float>(l.alpha / static_cast<double>(rank_)) : 0.0f),
      hidden_(w.hidden()),
      inter_(w.inter()) {
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

void BackwardProbe::judge(Gemm& gm, const char* name, const char* factor, const GroupingView& g,
                          std::size_t k, const std::function<bool(std::size_t, float*)>& load,
                          const float* c, std::size_t ldc, const float* f, std::size_t ldf) {
  const detail::SampledTimer timer(ns_, 1);
  static const std::vector<const verify::Probe*> none;
  auto is_factor = [&](std::size_t i, const verify::Probe& p) {
    return rank_ && &p == gm.all[g.expert_of(i)].back();
  };
  gm.result = probe_rows_sums(
      g.rows(), k, load,
      [&](std::size_t i) -> const std::vector<const verify::Probe*>& {
        return g.routed_row(i) ? gm.all[g.expert_of(i)] : none;
      },
      [&](std::size_t i, std::size_t, const verify::Probe& p) {
        return is_factor(i, p) ? lora_probe::row_sums(f + i * ldf, p)
                               : lora_probe::row_sums(c + i * ldc, p);
      });
  if (!gm.result.pass)
    gm.failure = grouped_probe_location(g, gm.result,
                                        is_factor(gm.result.row, *gm.result.probe) ? factor : name);
}

void BackwardProbe::dh(const GroupingView& g, const OperandRows& dy16, const float* dh,
                       std::size_t ldd, const float* dyb, bool lora_term) {
  const std::size_t H = hidden_, r = rank_;
  judge(
      dh_, "dh", "dyb", g, H + r,
      [&](std::size_t i, float* row) {
        const OperandRows::Runs d = dy16.row(i, H);
        const bool flushable = verify::load_bf16(d.first, H, d.run, d.stride, row);
        if (!lora_term) {  // dh without qd A_d: qd's columns weigh nothing
          std::fill(row + H, row + H + r, 0.0f);
          return flushable;
        }
        return lora_probe::scaled_bf16(dyb + i * r, r, scale_, row + H) || flushable;
      },
      dh, ldd, dyb, r);
}

void BackwardProbe::dx(const GroupingView& g, const OperandRows& dgu, const float* dxr,
                       const float* dgb) {
  const std::size_t k = 2 * inter_, r2 = 2 * rank_;
  judge(
      dx_, "dx", "dgb", g, k + r2,
      [&](std::size_t i, float* row) {
        const OperandRows::Runs d = dgu.row(i, k);
        const bool flushable = verify::load_bf16(d.first, k, d.run, d.stride, row);
        return r2 ? lora_probe::scaled_bf16(dgb + i * r2, r2, scale_, row + k) || flushable
                  : flushable;
      },
      dxr, hidden_, dgb, r2);
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
