// ProbeSums: the probes' C side, summed by the op's epilogue (§9.1).
#include "contracts/probe_sums.hpp"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>

#include "contracts/engine.hpp"

namespace moecert::contracts {

void ProbeSums::size(std::size_t rows, std::size_t n, std::size_t item) {
  const detail::SampledTimer timer(ns_, 1);
  MOECERT_ASSERT(item % kBlock == 0 && item > 0);
  rows_ = rows, n_ = n, item_ = item, items_ = (n + item - 1) / item;
  const std::size_t size = kSlot * rows * (items_ + PackProbes::kNarrow);
  if (storage_.size() < size) storage_.resize(size);
  constexpr std::size_t kGrain = std::size_t{1} << 16;
  oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, size, kGrain),
                            [&](const oneapi::tbb::blocked_range<std::size_t>& r) {
                              std::fill(storage_.begin() + r.begin(), storage_.begin() + r.end(),
                                        NAN);
                            });
}

void ProbeSums::add(const PackProbes& p, std::size_t row0, std::size_t rows, std::size_t n0,
                    std::size_t n1, const float* c, std::size_t ldc) {
  const detail::SampledTimer timer(ns_, kAddEvery);
  MOECERT_ASSERT(n0 % kBlock == 0 && n1 > n0 && n1 - n0 <= kBlock && n1 <= n_);
  const float* r = p.dense->r.data() + n0;
  const bool first = n0 % item_ == 0;  // the item's first block starts its partial
  constexpr std::size_t kRows = 32;    // rows per run of block sums
  double sums[2 * kRows];
  for (std::size_t i0 = 0; i0 < rows; i0 += kRows) {
    const std::size_t m = std::min(kRows, rows - i0);
    const float* ci = c + i0 * ldc;
    if (n1 - n0 == kBlock)
      verify::detail::block_sums(ci, ldc, m, r, sums);
    else  // the last, partial block of C
      for (std::size_t i = 0; i < m; ++i)
        verify::detail::signed_sum_and_magnitude(ci + i * ldc, r, n1 - n0, sums[2 * i],
                                                 sums[2 * i + 1]);
    double* out = at(n0 / item_, row0 + i0);
    for (std::size_t i = 0; i < m; ++i, out += kSlot)
      if (first)
        out[0] = sums[2 * i], out[1] = sums[2 * i + 1], out[2] = 1;
      else
        out[0] += sums[2 * i], out[1] += sums[2 * i + 1], out[2] += 1;
  }
  for (std::size_t q = 0; q < p.narrow.size(); ++q) {
    const verify::Probe& nq = p.narrow[q];
    if (nq.j0 < n0 || nq.j0 >= n1) continue;  // a narrow block lies in one kBlock block
    MOECERT_ASSERT(nq.j0 + nq.width <= n1);
    double* out = at(items_ + q, row0);
    for (std::size_t i = 0; i < rows; ++i, out += kSlot)
      verify::detail::signed_sum_and_magnitude(c + i * ldc + (nq.j0 - n0), nq.r.data(), nq.width,
                                               out[0], out[1]);
  }
}

std::vector<std::pair<double, double>> ProbeSums::dense() const {
  std::vector<std::pair<double, double>> out(rows_, {0.0, 0.0});
  constexpr std::size_t kRows = 512;  // a row block's totals stay in L1
  oneapi::tbb::parallel_for(std::size_t{0}, (rows_ + kRows - 1) / kRows, [&](std::size_t blk) {
    const std::size_t r0 = blk * kRows, r1 = std::min(rows_, r0 + kRows);
    for (std::size_t s = 0; s < items_; ++s) {
      const double blocks =
          static_cast<double>((std::min(n_, (s + 1) * item_) - s * item_ + kBlock - 1) / kBlock);
      const double* in = at(s, r0);
      for (std::size_t row = r0; row < r1; ++row, in += kSlot) {
        auto& [sum, mag] = out[row];
        if (in[2] != blocks) sum = mag = NAN;  // a block missing or handed over twice (or NaN)
        sum += in[0], mag += in[1];
      }
    }
  });
  return out;
}

void RowSides::size(std::size_t rows, std::size_t probes) {
  const detail::SampledTimer timer(ns_, 1);
  probes_ = probes;
  const std::size_t n = rows * probes;
  if (storage_.size() < n) storage_.resize(n);
  const verify::RowSide unformed{NAN, NAN, NAN};
  constexpr std::size_t kGrain = std::size_t{1} << 14;
  oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, n, kGrain),
                            [&](const oneapi::tbb::blocked_range<std::size_t>& r) {
                              std::fill(storage_.begin() + r.begin(), storage_.begin() + r.end(),
                                        unformed);
                            });
}

void RowSides::form(std::size_t row, const std::vector<const verify::Probe*>& ps, const float* a,
                    std::size_t n, bool flushable) {
  const detail::SampledTimer timer(ns_);
  MOECERT_ASSERT(ps.size() == probes_);
  for (std::size_t q = 0; q < ps.size(); ++q)
    storage_[row * probes_ + q] = verify::row_side(*ps[q], 0, a, n, flushable);
}

}  // namespace moecert::contracts
