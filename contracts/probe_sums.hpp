// The C side of a grouped GEMM's probes, summed by the op's epilogue while
// each block of C is in cache (proofs/bounds.md §9.1).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "contracts/gemm.hpp"
#include "contracts/verify.hpp"

namespace moecert::contracts {

/// Per grouped row of C (N columns, computed in work items of `item`
/// columns by gemm_block): (C r, sum |C|) over the dense probe's columns,
/// one partial per item, and over each narrow probe's columns, handed over
/// block by block from the op's epilogue, so that the probe never reads C
/// again. A row's partial for an item is its blocks' sums added in binary64
/// in column order (gemm_block finishes a row's blocks of an item in column
/// order, on one thread); the partials are added in item order. The sums
/// live in `storage` (the op's, reused across calls), NaN until written,
/// with a count of the blocks each partial took: a block the op never hands
/// over, or hands over again after a later one of its item, leaves the
/// row's sums NaN and fails the probe.
class ProbeSums {
 public:
  static constexpr std::size_t kBlock = verify::detail::kBlockColumns;  // gemm's NR
  static constexpr unsigned kAddEvery = 1024;  // add() calls per timed one (SampledTimer)

  /// `ns`: the owner's time counter (add() sampled, size() in full).
  ProbeSums(std::vector<double>& storage, std::atomic<std::int64_t>& ns)
      : storage_(storage), ns_(ns) {}
  /// Before the GEMM: `rows` grouped rows of C with `n` columns, in items of
  /// `item` columns (a multiple of kBlock); the storage NaN on the op's
  /// threads.
  void size(std::size_t rows, std::size_t n, std::size_t item);
  /// Rows [row0, row0 + rows) of C, columns [n0, n1) (n0 a multiple of
  /// kBlock, n1 - n0 <= kBlock), row i at c + i ldc; `p`: the probes of the
  /// rows' pack. Any thread; one per (row, item).
  void add(const PackProbes& p, std::size_t row0, std::size_t rows, std::size_t n0, std::size_t n1,
           const float* c, std::size_t ldc);
  /// Each row's (C r, sum |C|) over the dense probe's columns (NaN where a
  /// block is missing), on the op's threads.
  std::vector<std::pair<double, double>> dense() const;
  /// Row's (C r, sum |C|) over narrow probe q's columns.
  std::pair<double, double> narrow(std::size_t row, std::size_t q) const {
    const double* s = at(items_ + q, row);
    return {s[0], s[1]};
  }
  /// (C r, sum |C|) of row i for probe q of its pack (0: dense, from d =
  /// dense(); q > 0: narrow q - 1).
  std::pair<double, double> of(const std::vector<std::pair<double, double>>& d, std::size_t i,
                               std::size_t q) const {
    return q ? narrow(i, q - 1) : d[i];
  }

 private:
  static constexpr std::size_t kSlot = 3;  // sum, magnitude, blocks taken
  // Slot `slot`'s entry of grouped row `row`: the dense probe's items, then
  // the narrow probes; each slot's rows contiguous (an add() writes one run).
  double* at(std::size_t slot, std::size_t row) const {
    return storage_.data() + kSlot * (slot * rows_ + row);
  }

  std::vector<double>& storage_;
  std::atomic<std::int64_t>& ns_;
  std::size_t rows_ = 0, n_ = 0, item_ = 0, items_ = 0;
};

/// Each grouped row's side of its probes (verify::RowSide), formed where the
/// op forms or reads the row (its A operand in cache) and kept for the
/// judge, so that the probe need not read A again. NaN until formed: a row
/// the op never hands over fails its probes.
class RowSides {
 public:
  RowSides(std::vector<verify::RowSide>& storage, std::atomic<std::int64_t>& ns)
      : storage_(storage), ns_(ns) {}
  /// Before the op's pass: `rows` grouped rows of `probes` probes each.
  void size(std::size_t rows, std::size_t probes);
  /// Row `row`'s sides of ps over their weight entries [0, n) from its n
  /// values `a` (binary32; `flushable`: whether one is). Any thread, one per
  /// row.
  void form(std::size_t row, const std::vector<const verify::Probe*>& ps, const float* a,
            std::size_t n, bool flushable);
  /// Row `row`'s side of its probe q.
  const verify::RowSide& side(std::size_t row, std::size_t q) const {
    return storage_[row * probes_ + q];
  }

 private:
  std::vector<verify::RowSide>& storage_;
  std::atomic<std::int64_t>& ns_;
  std::size_t probes_ = 0;
};

/// An op's storage for the sums of its two probed GEMMs (C's side, A's
/// side), kept across calls.
struct ProbeStorage {
  std::vector<double> c_first, c_second;
  std::vector<verify::RowSide> a_first, a_second;
};

}  // namespace moecert::contracts
