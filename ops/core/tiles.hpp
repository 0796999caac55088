// Work items of the grouped GEMMs: rows of one group (an expert's tokens) by
// a block of columns; the items of one pass share no output element, so they
// run in parallel in any order and give the same bits.
#pragma once

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "ops/core/task.hpp"

namespace moecert::detail {

/// Rows [m0, m1) of group e, columns [n0, n1).
struct Tile {
  std::size_t e, m0, m1, n0, n1;
};

/// Every group's rows (rows[e] of group e) by n columns, in blocks of up to
/// mb rows and nb columns; groups in order, then row blocks, then columns.
inline std::vector<Tile> tiles(const std::vector<std::size_t>& rows, std::size_t n, std::size_t mb,
                               std::size_t nb) {
  std::vector<Tile> out;
  for (std::size_t e = 0; e < rows.size(); ++e)
    for (std::size_t m0 = 0; m0 < rows[e]; m0 += mb)
      for (std::size_t n0 = 0; n0 < n; n0 += nb)
        out.push_back({e, m0, std::min(rows[e], m0 + mb), n0, std::min(n, n0 + nb)});
  return out;
}

/// f(tile) for every tile, in parallel on the caller's oneTBB arena, each task
/// in the caller's floating-point and contract settings (task.hpp).
template <class F>
void for_each_tile(const std::vector<Tile>& ts, F f) {
  oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, ts.size(), 1),
                            task([&](const oneapi::tbb::blocked_range<std::size_t>& r) {
                              for (std::size_t i = r.begin(); i < r.end(); ++i) f(ts[i]);
                            }));
}

}  // namespace moecert::detail
