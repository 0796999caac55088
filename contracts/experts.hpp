// Clauses of experts.forward (declared in include/moecert/experts.hpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <utility>
#include <vector>

#include "contracts/engine.hpp"
#include "contracts/gemm.hpp"
#include "contracts/reference/experts.hpp"
#include "contracts/saved.hpp"
#include "moecert/experts.hpp"

namespace moecert::contracts {

/// experts.forward.probe carried through the op (audit): each pack's
/// probes for this call, and the gate/up GEMM's C side of them (C r and
/// sum |C| of each grouped row, by 32-column block) gathered by the op's
/// epilogue while a block of C is in cache, so that C need not be kept
/// (proofs/bounds.md §9.1). The sums live in `storage` (the op's, reused
/// across calls), NaN until written: a block the op never hands over fails
/// the probe.
class ExpertsProbe {
 public:
  static constexpr std::size_t kBlock = verify::detail::kBlockColumns;  // per add(): a panel pair
  static constexpr unsigned kAddEvery = 1024;  // add() calls per timed one (SampledTimer)

  ExpertsProbe(const experts::PackedExperts& w, std::vector<double>& storage);
  /// Sizes the sums for `rows` grouped rows; before the GEMM.
  void size_rows(std::size_t rows);
  /// Rows [row0, row0 + rows) (expert e's) of the gate/up C, columns
  /// [n, n + kBlock), row i at c + i ldc. One writer per (row, n); any
  /// thread.
  void add(std::size_t e, std::size_t row0, std::size_t rows, std::size_t n, const float* c,
           std::size_t ldc);
  /// The probes of pack [2e] (gate_up) or [2e + 1] (down): dense, narrow.
  const std::vector<const verify::Probe*>& probes(std::size_t pack) const { return all_[pack]; }
  /// Each grouped row's (C r, sum |C|) over the dense probe's columns, its
  /// blocks summed in column order (read column by column, on the op's
  /// threads: by row, each of a row's blocks is a line of its own).
  std::vector<std::pair<double, double>> dense_sums() const;
  /// Row's (C r, sum |C|) over narrow probe q's columns (probes()[q + 1]).
  std::pair<double, double> narrow_sums(std::size_t row, std::size_t q) const;
  /// CPU time spent in the constructor, size_rows() and add() (add()
  /// sampled), in ns: the probe's share of the op's own passes.
  std::int64_t ns() const { return ns_.load(); }

 private:
  std::atomic<std::int64_t> ns_{0};
  std::vector<PackProbes> packs_;
  std::vector<std::vector<const verify::Probe*>> all_;
  // Column `column`'s (sum, magnitude) of grouped row `row`. Stored by
  // column (the dense probe's blocks, then the narrow probes), each
  // column's rows contiguous: an add() writes its rows of one column in one
  // run, and the rows the epilogue hands over one by one share lines.
  double* at(std::size_t column, std::size_t row) const {
    return storage_.data() + 2 * (column * rows_ + row);
  }

  std::vector<double>& storage_;
  std::size_t blocks_ = 0;  // kBlock-column blocks of gate_up's N
  std::size_t rows_ = 0;    // grouped rows (size_rows)
};

void experts_forward_pre(detail::Checker& c, const experts::PackedExperts& w, MatView<const bf16> x,
                         MatView<const std::int32_t> idx, MatView<const float> weights,
                         MatView<float> y);
void experts_forward_grouping(detail::Checker& c, MatView<const std::int32_t> idx,
                              const GroupingView& g);
void experts_forward_post(detail::Checker& c, const experts::PackedExperts& w,
                          MatView<const bf16> x, MatView<const std::int32_t> idx,
                          MatView<const float> weights, MatView<const float> y,
                          const ExpertRows& st);

}  // namespace moecert::contracts
