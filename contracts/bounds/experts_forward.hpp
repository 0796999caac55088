// The experts op's forward reference: y in binary64 from the packed weights
// and the caller's routing, with every element's bound of the kernel's error
// (contracts/bounds/experts.hpp, proofs/experts.md).
#pragma once

#include <cstdint>
#include <vector>

#include "moecert/experts.hpp"

namespace moecert::contracts {

/// Reference and bound of every y element (the full-level comparison, also
/// used by tests and the conformance suite).
struct ExpertsReference {
  std::vector<double> y, bound;  // [T x H]
};
ExpertsReference experts_forward_reference(const experts::PackedExperts& w, MatView<const bf16> x,
                                           MatView<const std::int32_t> idx,
                                           MatView<const float> weights);

}  // namespace moecert::contracts
