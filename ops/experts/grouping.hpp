// Grouping of routed (token, slot) pairs by expert: a stable counting sort,
// each expert's rows padded to the kernel's MR. Shared by the forward, its
// contracts and (later) the backward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "moecert/types.hpp"

namespace moecert::experts {

struct Grouping {
  std::size_t experts = 0, mr = 1;
  std::vector<std::size_t> count;      // routed rows per expert
  std::vector<std::size_t> begin;      // first padded row of each expert (E + 1 entries)
  std::vector<std::int32_t> row_slot;  // padded row -> slot t*K+j, or -1 for padding
  std::vector<std::int64_t> slot_row;  // slot t*K+j -> padded row, or -1 for an empty slot
  std::size_t routed = 0;
  std::size_t rows() const { return begin.back(); }
};

/// Groups the valid slots of idx (assumed valid: the caller checked its
/// preconditions) by expert, in token order within each expert.
Grouping group_by_expert(MatView<const std::int32_t> idx, std::size_t experts, std::size_t mr);

}  // namespace moecert::experts
