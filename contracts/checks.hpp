// Reusable clause bodies: element scans that report the first offender.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <string>

#include "contracts/engine.hpp"
#include "moecert/types.hpp"

namespace moecert::detail {

/// bf16 value usable by the GEMM bounds: 0, or 2^-60 <= |x| <= 2^60 (so no
/// product of two such values underflows or overflows; proofs/bounds.md §0).
constexpr bool bf16_in_range(bf16 x) {
  const unsigned e = (x.bits >> 7) & 0xffu;
  return (x.bits & 0x7fffu) == 0 || (e >= 127 - 60 && e <= 127 + 60);
}

/// Fails `clause` at the first element of `m` for which ok(value) is false,
/// naming it `name[i, j]`. Returns whether all passed.
template <class T, class Pred>
bool scan(Checker& c, const ClauseInfo& clause, std::string_view name, MatView<const T> m, Pred ok,
          std::string_view expected) {
  for (std::size_t i = 0; i < m.rows; ++i)
    for (std::size_t j = 0; j < m.cols; ++j)
      if (!ok(m(i, j))) {
        c.fail(clause, fmt::format("{}[{}, {}]", name, i, j),
               fmt::format("{}={}", name, static_cast<double>(static_cast<float>(m(i, j)))),
               std::string(expected));
        return false;
      }
  return true;
}

template <class T>
bool scan_finite(Checker& c, const ClauseInfo& clause, std::string_view name, MatView<const T> m) {
  return scan(
      c, clause, name, m, [](T v) { return std::isfinite(static_cast<float>(v)); }, "finite");
}

inline bool scan_bf16_range(Checker& c, const ClauseInfo& clause, std::string_view name,
                            MatView<const bf16> m) {
  return scan(c, clause, name, m, bf16_in_range, "0 or 2^-60 <= |x| <= 2^60");
}

}  // namespace moecert::detail
