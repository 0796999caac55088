// Small operations on views shared by the ops.
#pragma once

#include <algorithm>

#include "moecert/types.hpp"

namespace moecert::detail {

/// Every element of m set to 0 (rows at m's stride).
inline void fill_zero(MatView<float> m) {
  for (std::size_t i = 0; i < m.rows; ++i) std::fill(m.row(i), m.row(i) + m.cols, 0.0f);
}

}  // namespace moecert::detail
