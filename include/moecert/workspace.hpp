// The workspace plan: every scratch and saved buffer of a layer call, with
// its size, its 64-byte aligned offset and its live steps, placed so that
// co-live buffers never share a byte (proved for every config in the
// limits: proofs/workspace.md). `moecert plan` prints it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moecert/config.hpp"
#include "moecert/formats.hpp"

namespace moecert::workspace {

struct Buffer {
  std::string name;          // e.g. "experts.c1"
  std::uint64_t offset = 0;  // bytes from the plan's start, a multiple of 64
  std::uint64_t bytes = 0;   // requested size
  int first = 0, last = 0;   // live steps, inclusive (step_name)
};

struct Plan {
  std::int64_t tokens = 0;
  bool training = true;
  std::vector<Buffer> buffers;            // in placement order
  std::uint64_t total_bytes = 0;          // the arena: every buffer, guard zones included
  std::uint64_t packed_weight_bytes = 0;  // packed weight copies, besides the arena
  std::uint64_t peak_live_bytes = 0;      // the largest sum of co-live buffer sizes (a lower bound)
  const Buffer* find(std::string_view name) const;
};

struct PlanOptions {
  bool training = true;                      // forward and backward; false: the forward only
  std::uint64_t memory_cap = 0;              // largest total_bytes allowed; 0: no cap
  WeightFormat format = WeightFormat::bf16;  // the base weights' (packed_weight_bytes)
};

/// Name of a step of the layer ("forward.gate_up", "backward.dx", ...).
std::string_view step_name(int step);
int step_count();

/// Plans a layer call of `tokens` tokens for `cfg` (validated first: the
/// core.config clauses). Nothing is allocated.
///
/// Clauses (contracts/workspace/workspace.cpp; proofs/workspace.md):
///   workspace.plan.tokens_range pre   shape   0 <= tokens <= cfg.max_tokens
///   workspace.plan.overflow     pre   memory  no size or offset overflows 64 bits (reachable only
///                                             past the config limits, under observe)
///   workspace.plan.memory_cap   pre   memory  total_bytes <= options.memory_cap (when set)
///   workspace.plan.disjoint     invariant memory  co-live buffers disjoint, every buffer inside
///                                             the total, offsets 64-byte aligned
/// The arena the ops bind a plan to (ops/workspace/arena.hpp) adds, per call:
///   workspace.arena.disjoint    invariant alias   co-live buffers, at the offsets the arena uses,
///                                               share no byte (names both buffers)
///   workspace.arena.guard       invariant memory  the 64-byte guard zone after every live buffer is
///                                               intact at each step (names the buffer and step);
///                                               with it on, fresh buffers are filled with NaN
///                                               (0x7fc07fc0) when their interval starts: every
///                                               word at full and of a buffer up to 64 KiB,
///                                               else one 64-byte line per 4 KiB (check) or
///                                               512 B (audit), the line rotating per call
///                                               (proofs/workspace.md, "Poison")
/// Example:
///   auto p = moecert::workspace::plan(cfg, 4096, {.memory_cap = 16ull << 30});
Plan plan(const MoeConfig& cfg, std::int64_t tokens, const PlanOptions& options = {});

}  // namespace moecert::workspace
