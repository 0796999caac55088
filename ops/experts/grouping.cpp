// Counting sort of routed slots by expert.
#include "ops/experts/grouping.hpp"

namespace moecert::experts {

Grouping group_by_expert(MatView<const std::int32_t> idx, std::size_t experts, std::size_t mr) {
  Grouping g;
  g.experts = experts;
  g.mr = mr;
  g.count.assign(experts, 0);
  for (std::size_t t = 0; t < idx.rows; ++t)
    for (std::size_t j = 0; j < idx.cols; ++j)
      if (idx(t, j) >= 0) ++g.count[static_cast<std::size_t>(idx(t, j))];
  g.begin.assign(experts + 1, 0);
  for (std::size_t e = 0; e < experts; ++e) {
    g.begin[e + 1] = g.begin[e] + (g.count[e] + mr - 1) / mr * mr;
    g.routed += g.count[e];
  }
  g.row_slot.assign(g.rows(), -1);
  g.slot_row.assign(idx.rows * idx.cols, -1);
  std::vector<std::size_t> next(g.begin.begin(), g.begin.end() - 1);
  for (std::size_t t = 0; t < idx.rows; ++t)
    for (std::size_t j = 0; j < idx.cols; ++j) {
      const std::int32_t e = idx(t, j);
      if (e < 0) continue;
      const std::size_t row = next[static_cast<std::size_t>(e)]++;
      const std::size_t slot = t * idx.cols + j;
      g.row_slot[row] = static_cast<std::int32_t>(slot);
      g.slot_row[slot] = static_cast<std::int64_t>(row);
    }
  return g;
}

}  // namespace moecert::experts
