// Clauses of the workspace plan and arena (include/moecert/workspace.hpp).
#pragma once

#include "contracts/engine/engine.hpp"
#include "moecert/workspace.hpp"

namespace moecert::contracts {

void plan_pre(detail::Checker& c, const MoeConfig& cfg, std::int64_t tokens);
void plan_post(detail::Checker& c, const workspace::Plan& p, bool overflow,
               std::uint64_t memory_cap);

/// The first pair of co-live buffers of `p` (by the given offsets) that
/// share a byte, or {-1, -1}; shared by the plan and arena clauses.
detail::OverlapPair first_co_live_overlap(const workspace::Plan& p, const std::uint64_t* offsets);

}  // namespace moecert::contracts
