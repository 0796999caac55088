// The GEMM bound (proofs/bounds.md §1, §2): one element of C = A B^T from
// bf16 A and B, accumulated in fp32 in any order and any summation tree.
#pragma once

#include <cstddef>

#include "contracts/numeric/rounding.hpp"

namespace moecert::bounds {

/// |c_hat - c| for an element over k products with sum |a_i b_i| =
/// sum_abs (flushed: the part from denormal inputs, Lemma 1'), stored in
/// fp32, or rounded to bf16 when bf16_out (§2, given the exact |c|).
constexpr double gemm_element(std::size_t k, double sum_abs, double flushed, double exact_abs,
                              bool bf16_out) {
  const double e = dot(k, sum_abs, flushed);
  return bf16_out ? bf16_store(exact_abs, e) : e;
}

}  // namespace moecert::bounds
