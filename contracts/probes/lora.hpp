// The weight sides of probes over a product with a LoRA term: a base
// probe extended over the second product's columns, and the probe of a
// first factor's product (proofs/bounds.md §9.2).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "contracts/probes/verify.hpp"

namespace moecert::contracts::lora_probe {

/// p over K + k2 columns of A: its weight side over the k2 columns after
/// A's K, sum_j r_j b_jq and sum_j |b_jq| (j over p's columns), formed by
/// fill(p, sum, mag) into k2 binary64 entries from zero and stored in
/// binary32 as verify::make_probe stores a probe (§9.1).
template <class Fill>
verify::Probe extended(const verify::Probe& p, std::size_t k2, Fill fill) {
  const std::size_t k = p.br.size();
  verify::Probe out{p.j0, p.width, p.r, std::vector<float>(k + k2), std::vector<float>(k + k2)};
  std::copy(p.br.begin(), p.br.end(), out.br.begin());
  std::copy(p.babs.begin(), p.babs.end(), out.babs.begin());
  std::vector<double> br(k2), babs(k2);
  fill(p, br.data(), babs.data());
  for (std::size_t q = 0; q < k2; ++q)
    out.br[k + q] = static_cast<float>(br[q]), out.babs[k + q] = static_cast<float>(babs[q]);
  return out;
}

/// The probe of a first factor's product C = A F^T (F: `width` rows of k
/// values) over an A row of k + k2 columns, zero weight on the last k2:
/// signs r from `seed`, fill(r, sum, mag) forms sum_j r_j F_j and
/// sum_j |F_j| into k binary64 entries from zero.
template <class Fill>
verify::Probe factor_probe(std::size_t k, std::size_t k2, std::size_t width, Fill fill,
                           std::uint64_t seed) {
  verify::Probe p{0, width, verify::probe_signs(width, seed), std::vector<float>(k + k2),
                  std::vector<float>(k + k2)};
  std::vector<double> br(k), babs(k);
  fill(p.r, br.data(), babs.data());
  for (std::size_t kk = 0; kk < k; ++kk)
    p.br[kk] = static_cast<float>(br[kk]), p.babs[kk] = static_cast<float>(babs[kk]);
  return p;
}

/// Weight entries [q0, q0 + n) from n rows over p's columns: row q's
/// column j at rows(q)[j] (a second factor stored by rows of columns,
/// e.g. A_d for dh's extension).
template <class Rows>
void fill_by_rows(const verify::Probe& p, std::size_t n, std::size_t q0, Rows rows, double* sum,
                  double* mag) {
  for (std::size_t q = 0; q < n; ++q)
    verify::detail::signed_sums(rows(q) + p.j0, p.r.data(), p.width, sum[q0 + q], mag[q0 + q]);
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
