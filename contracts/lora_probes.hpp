// The weight sides of probes over a product with a LoRA term: a base
// probe extended over the second product's columns, and the probe of a
// first factor's product (proofs/bounds.md §9.2).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "contracts/verify.hpp"

namespace moecert::contracts::lora_probe {

/// Column n of a second product's weight: `rank` values from p on, at
/// `stride`, at the extension's entries q0 .. q0 + rank - 1 (p null: a
/// zero column).
struct FactorColumn {
  const bf16* p = nullptr;
  std::size_t q0 = 0, stride = 1;
};

/// A column: up to two runs (e.g. A_g's part and A_u's).
using FactorColumns = std::array<FactorColumn, 2>;

/// p over K + k2 columns of A: its weight side over the k2 columns after
/// A's K, sum_j r_j b_jq and sum_j |b_jq| with b's column j0 + j in the
/// runs column_of(j0 + j) (FactorColumns), formed in binary64 and stored in binary32 as
/// verify::make_probe forms a probe (§9.1).
template <class ColumnOf>
verify::Probe extended(const verify::Probe& p, std::size_t k2, std::size_t rank,
                       ColumnOf column_of) {
  const std::size_t k = p.br.size();
  verify::Probe out{p.j0, p.width, p.r, std::vector<float>(k + k2), std::vector<float>(k + k2)};
  std::copy(p.br.begin(), p.br.end(), out.br.begin());
  std::copy(p.babs.begin(), p.babs.end(), out.babs.begin());
  std::vector<double> br(k2), babs(k2);
  for (std::size_t j = 0; j < p.width; ++j) {
    const double sign = p.r[j];
    for (const FactorColumn& col : column_of(p.j0 + j)) {
      if (!col.p) continue;
      for (std::size_t q = 0; q < rank; ++q) {
        const double v = col.p[q * col.stride].to_float();
        br[col.q0 + q] += sign * v;
        babs[col.q0 + q] += std::fabs(v);
      }
    }
  }
  for (std::size_t q = 0; q < k2; ++q)
    out.br[k + q] = static_cast<float>(br[q]), out.babs[k + q] = static_cast<float>(babs[q]);
  return out;
}

/// The probe of a first factor's product C = A F^T (F [width x k] via
/// f(j, kk), read for each j in kk order) over an A row of k + k2 columns:
/// zero weight on the last k2.
template <class FAt>
verify::Probe factor_probe(std::size_t k, std::size_t k2, std::size_t width, FAt f,
                           std::uint64_t seed) {
  verify::Probe p{0, width, verify::probe_signs(width, seed), std::vector<float>(k + k2),
                  std::vector<float>(k + k2)};
  std::vector<double> br(k), babs(k);
  for (std::size_t j = 0; j < width; ++j) {
    const double sign = p.r[j];
    for (std::size_t kk = 0; kk < k; ++kk) {
      const double v = f(j, kk).to_float();
      br[kk] += sign * v;
      babs[kk] += std::fabs(v);
    }
  }
  for (std::size_t kk = 0; kk < k; ++kk)
    p.br[kk] = static_cast<float>(br[kk]), p.babs[kk] = static_cast<float>(babs[kk]);
  return p;
}

/// Row i's (C r, sum |C|) over p's columns, C's row i at c.
inline std::pair<double, double> row_sums(const float* c, const verify::Probe& p) {
  std::pair<double, double> s;
  verify::detail::signed_sum_and_magnitude(c + p.j0, p.r.data(), p.width, s.first, s.second);
  return s;
}

/// row[q] = bf16(s f[q]) as binary32 for q < n, the second product's A
/// operand as the op forms it from the first's fp32 output; whether one is
/// flushable.
inline bool scaled_bf16(const float* f, std::size_t n, float s, float* row) {
  bool flushable = false;
  for (std::size_t q = 0; q < n; ++q) {
    row[q] = bf16(s * f[q]).to_float();
    flushable |= bounds::flushable(row[q]);
  }
  return flushable;
}

}  // namespace moecert::contracts::lora_probe
