// Clauses of workspace.plan and workspace.arena.
#include "contracts/workspace/workspace.hpp"

#include "contracts/engine/clauses.hpp"
#include "moecert/workspace.hpp"

namespace moecert::contracts {

namespace k = clauses::workspace;

// The alignment every plan offset keeps (include/moecert/workspace.hpp), as
// the judge states it, not taken from the planner it judges.
constexpr std::uint64_t kPlanAlign = 64;

void plan_pre(detail::Checker& c, const MoeConfig& cfg, std::int64_t tokens) {
  MOECERT_CONTRACT(c, k::kTokensRange) {
    if (tokens < 0 || tokens > cfg.max_tokens)
      c.fail(k::kTokensRange, "", fmt::format("tokens={}", tokens),
             fmt::format("0 <= tokens <= {}", cfg.max_tokens));
  }
}

detail::OverlapPair first_co_live_overlap(const workspace::Plan& p, const std::uint64_t* offsets) {
  const auto& b = p.buffers;
  for (std::size_t i = 0; i < b.size(); ++i)
    for (std::size_t j = i + 1; j < b.size(); ++j) {
      if (b[i].bytes == 0 || b[j].bytes == 0) continue;
      const bool co_live = b[i].first <= b[j].last && b[j].first <= b[i].last;
      const bool overlap =
          offsets[i] < offsets[j] + b[j].bytes && offsets[j] < offsets[i] + b[i].bytes;
      if (co_live && overlap) return {static_cast<int>(i), static_cast<int>(j)};
    }
  return {};
}

void plan_post(detail::Checker& c, const workspace::Plan& p, bool overflow,
               std::uint64_t memory_cap) {
  MOECERT_CONTRACT(c, k::kOverflow) {
    if (overflow)
      c.fail(k::kOverflow, fmt::format("tokens={}", p.tokens), "a size overflows 64 bits",
             "< 2^64");
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kMemoryCap) {
    if (memory_cap != 0 && p.total_bytes > memory_cap)
      c.fail(k::kMemoryCap, fmt::format("tokens={}", p.tokens),
             fmt::format("total_bytes={}", p.total_bytes), fmt::format("<= {}", memory_cap));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kDisjoint) {
    std::vector<std::uint64_t> offsets;
    for (const auto& b : p.buffers) {
      offsets.push_back(b.offset);
      if (b.offset % kPlanAlign != 0 || b.offset + b.bytes > p.total_bytes) {
        c.fail(k::kDisjoint, b.name, fmt::format("[{}, {})", b.offset, b.offset + b.bytes),
               fmt::format("64-byte aligned, inside [0, {})", p.total_bytes));
        return;
      }
    }
    if (auto o = first_co_live_overlap(p, offsets.data()))
      c.fail(k::kDisjoint, fmt::format("{} and {}", p.buffers[o.a].name, p.buffers[o.b].name),
             "co-live and overlapping", "disjoint");
  }
}

}  // namespace moecert::contracts
