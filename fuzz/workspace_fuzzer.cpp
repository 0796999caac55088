// Property: workspace::plan, given a config whose fields are in or out of
// the limits, a token count and a memory cap, either raises exactly a
// precondition violation (a config clause, tokens_range, overflow,
// memory_cap) or returns a plan whose co-live buffers are disjoint, inside
// the total and aligned (checked here by brute force). Small plans are then
// bound to an arena and run step by step, every live buffer written in
// full: no guard fires; then one byte past a live buffer's end is written
// and the guard clause must name that buffer.
#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "fuzz/decode.hpp"
#include "moecert/workspace.hpp"
#include "ops/workspace/arena.hpp"
#include "ops/workspace/planner.hpp"

using namespace moecert;

namespace {

std::int64_t field(fuzz::Decoder& d, std::int64_t lo, std::int64_t hi) {
  switch (d.u8() & 15) {
    case 0:
      return static_cast<std::int64_t>(d.u32()) << (d.u8() & 31);  // far out of range
    case 1:
      return -static_cast<std::int64_t>(d.u8());
    default:
      return lo + static_cast<std::int64_t>(d.u32() % static_cast<std::uint64_t>(hi - lo + 1));
  }
}

bool config_valid(const MoeConfig& c) {
  return c.experts >= 1 && c.experts <= kMaxExperts && c.hidden >= 1 && c.hidden <= kMaxDim &&
         c.inter >= 1 && c.inter <= kMaxDim && c.topk >= 1 &&
         c.topk <= std::min(c.experts, kMaxTopk) && c.lora_rank >= 0 && c.lora_rank <= kMaxRank &&
         c.max_tokens >= 1 && c.max_tokens <= kMaxTokens;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  const bool small = d.flag();
  MoeConfig c;
  c.experts = field(d, 1, small ? 16 : 1024);
  c.hidden = field(d, 1, small ? 96 : 65536);
  c.inter = field(d, 1, small ? 96 : 65536);
  c.topk = field(d, 1, small ? 4 : 64);
  c.lora_rank = field(d, 0, small ? 8 : 256);
  c.lora_alpha = 16.0;
  c.max_tokens = field(d, 1, small ? 64 : (1 << 20));
  const std::int64_t tokens = field(d, 0, std::max<std::int64_t>(c.max_tokens, 0));
  const std::uint64_t cap = d.flag() ? 0 : static_cast<std::uint64_t>(d.u32()) << (d.u8() % 24);
  const bool training = d.flag();
  const bool valid = config_valid(c) && tokens >= 0 && tokens <= c.max_tokens;
  workspace::Plan p;
  try {
    ContractScope s{Level::check, Semantic::enforce};
    p = workspace::plan(c, tokens, {.training = training, .memory_cap = cap});
    if (!valid) fuzz::finding("workspace_fuzzer", "plan accepted an invalid config or token count");
  } catch (const ContractViolation& v) {
    const bool cap_hit = v.clause() == "workspace.plan.memory_cap";
    if ((valid && !cap_hit) || v.violation().kind != ClauseKind::pre)
      fuzz::finding("workspace_fuzzer", std::string("plan: ") + v.what());
    return 0;
  }
  if (cap && p.total_bytes > cap) fuzz::finding("workspace_fuzzer", "plan over the cap accepted");
  for (std::size_t i = 0; i < p.buffers.size(); ++i) {
    const auto& a = p.buffers[i];
    if (a.offset % 64 || a.offset + a.bytes > p.total_bytes)
      fuzz::finding("workspace_fuzzer", fmt::format("{} misaligned or outside the total", a.name));
    for (std::size_t j = i + 1; j < p.buffers.size(); ++j) {
      const auto& b = p.buffers[j];
      if (a.bytes && b.bytes && a.first <= b.last && b.first <= a.last &&
          a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes)
        fuzz::finding("workspace_fuzzer",
                      fmt::format("{} and {} co-live and overlapping", a.name, b.name));
    }
  }
  if (p.total_bytes > (1u << 22)) return 0;
  // Run the arena through every step, writing each live buffer in full.
  ContractScope s{Level::check, Semantic::enforce};
  workspace::Arena arena;
  detail::Checker chk{"fuzz.arena"};
  const int stray_step = static_cast<int>(d.range(0, workspace::step_count() - 1));
  try {
    arena.bind(p, chk);
    for (int step = 0; step < workspace::step_count(); ++step) {
      arena.enter(step, chk);
      for (const auto& b : p.buffers)
        if (b.first <= step && step <= b.last && b.bytes)
          std::memset(arena.get<std::byte>(b.name, b.bytes), step, b.bytes);
      if (step == stray_step) {
        for (const auto& b : p.buffers)
          if (b.first <= step && step <= b.last && b.bytes) {
            // One byte past the buffer's 64-byte rounding: its guard.
            arena.get<std::byte>(b.name, b.bytes)[(b.bytes + 63) / 64 * 64] = std::byte{0};
            try {
              step + 1 < workspace::step_count() ? arena.enter(step + 1, chk) : arena.leave(chk);
            } catch (const ContractViolation& v) {
              if (v.clause() != "workspace.arena.guard" ||
                  v.violation().location.find("after " + b.name) != 0)
                fuzz::finding("workspace_fuzzer",
                              std::string("stray write reported as: ") + v.what());
              return 0;
            }
            fuzz::finding("workspace_fuzzer",
                          fmt::format("a write into {}'s guard went unnoticed", b.name));
          }
      }
    }
    arena.leave(chk);
  } catch (const ContractViolation& v) {
    fuzz::finding("workspace_fuzzer", std::string("arena on a valid plan: ") + v.what());
  }
  return 0;
}
