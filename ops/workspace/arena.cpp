// Arena: allocation, guards, poison.
#include "ops/workspace/arena.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#include "contracts/engine/clauses.hpp"
#include "contracts/workspace/workspace.hpp"
#include "moecert/gemm.hpp"
#include "ops/core/aligned.hpp"
#include "ops/gemm/stream.hpp"
#include "ops/workspace/planner.hpp"

namespace moecert::workspace {

namespace k = clauses::workspace;

void Arena::Free::operator()(std::byte* p) const { moecert::detail::deallocate(p); }

void Arena::bind(const Plan& p, detail::Checker& c) {
  const std::size_t need = kGuard + p.total_bytes;
  if (need > capacity_) {
    block_.reset(static_cast<std::byte*>(moecert::detail::allocate(need)));
    capacity_ = need;
  }
  plan_ = p;
  current_ = -1;
  ++binds_;
  offsets_.clear();
  for (const auto& b : plan_.buffers) offsets_.push_back(b.offset);
  for (const auto& [a, b] : test_aliases_) apply_alias(a, b);
  std::memset(block_.get(), kGuardByte, kGuard);
  MOECERT_CONTRACT(c, k::kArenaDisjoint) {
    if (auto o = contracts::first_co_live_overlap(plan_, offsets_.data()))
      c.fail(k::kArenaDisjoint,
             fmt::format("{} and {}", plan_.buffers[o.a].name, plan_.buffers[o.b].name),
             fmt::format("[{}, {}) and [{}, {}) both live", offsets_[o.a],
                         offsets_[o.a] + plan_.buffers[o.a].bytes, offsets_[o.b],
                         offsets_[o.b] + plan_.buffers[o.b].bytes),
             "disjoint");
  }
}

void* Arena::raw(std::string_view name, std::size_t bytes) {
  for (std::size_t i = 0; i < plan_.buffers.size(); ++i)
    if (plan_.buffers[i].name == name) {
      MOECERT_ASSERT(bytes <= plan_.buffers[i].bytes);
      return block_.get() + kGuard + offsets_[i];
    }
  MOECERT_ASSERT(false && "buffer not in the plan");
  return nullptr;
}

// A buffer's guard zone belongs to it only while it is live: other buffers
// may use those bytes at other steps. So guards are written when a buffer's
// interval starts and checked at every later step of it and at its end.
void Arena::check_guards(detail::Checker& c, std::string_view when) {
  if (current_ < 0) return;
  MOECERT_CONTRACT(c, k::kArenaGuard) {
    auto intact = [](const std::byte* g) {
      for (std::size_t i = 0; i < kGuard; ++i)
        if (g[i] != std::byte{kGuardByte}) return false;
      return true;
    };
    if (!intact(block_.get()))
      c.fail(k::kArenaGuard, fmt::format("before the first buffer, at {}", when), "damaged",
             "intact");
    const std::byte* base = block_.get() + kGuard;
    for (std::size_t i = 0; i < plan_.buffers.size(); ++i) {
      const auto& b = plan_.buffers[i];
      if (b.first > current_ || b.last < current_) continue;
      if (!intact(base + offsets_[i] + round_up(b.bytes, kAlign))) {
        c.fail(k::kArenaGuard, fmt::format("after {}, at {}", b.name, when), "damaged", "intact");
        return;
      }
    }
  }
}

namespace {

// One buffer's poison: n words at w, every word (`stride` 1) or the
// 64-byte lines starting at words phase, phase + stride, ...
struct PoisonFill {
  std::uint32_t* w;
  std::uint64_t n, stride, phase;
};

// Writes every fill on the op's threads in one pass, in 1 MiB blocks over
// all of them (a block starts at a multiple of the stride). Sparse lines
// are streamed past the caches: a line written without being read costs
// half the memory traffic, and the op writes it again before any read.
void poison(const std::vector<PoisonFill>& fills) {
  constexpr std::uint64_t kBlock = std::uint64_t{1} << 18;    // words
  std::vector<std::pair<std::size_t, std::uint64_t>> blocks;  // (fill, first word)
  for (std::size_t f = 0; f < fills.size(); ++f)
    for (std::uint64_t b = 0; b < fills[f].n; b += kBlock) blocks.emplace_back(f, b);
  oneapi::tbb::parallel_for(std::size_t{0}, blocks.size(), [&](std::size_t i) {
    const PoisonFill& p = fills[blocks[i].first];
    const std::uint64_t b = blocks[i].second, end = std::min(p.n, b + kBlock);
    if (p.stride == 1)
      std::fill(p.w + b, p.w + end, kPoison);
    else if (b + p.phase < end)
      gemm::stream_lines(p.w + b + p.phase, (end - b - p.phase + p.stride - 1) / p.stride, p.stride,
                         kPoison);
  });
}

}  // namespace

void Arena::enter(int step, detail::Checker& c) {
  check_guards(c, step_name(step));
  const int previous = step > current_ ? current_ : step - 1;
  current_ = step;
  std::byte* base = block_.get() + kGuard;
  auto fresh = [&](const Buffer& b) { return b.first > previous && b.first <= step; };
  for (std::size_t i = 0; i < plan_.buffers.size(); ++i)
    if (fresh(plan_.buffers[i]))
      std::memset(base + offsets_[i] + round_up(plan_.buffers[i].bytes, kAlign), kGuardByte,
                  kGuard);
  // Poison (proofs/workspace.md, "Poison"): every word at full and of a
  // buffer up to kSparseAbove bytes; else one word per stride (check:
  // kSparseStride, audit: kAuditStride), in the line the call count selects.
  MOECERT_CONTRACT(c, k::kArenaGuard) {
    const bool dense = c.level() >= Level::full;
    const std::uint64_t stride = c.level() >= Level::audit ? kAuditStride : kSparseStride;
    const std::uint64_t line = (binds_ - 1) % (stride / kAlign);
    std::vector<PoisonFill> fills;
    for (std::size_t i = 0; i < plan_.buffers.size(); ++i) {
      if (!fresh(plan_.buffers[i])) continue;
      const std::uint64_t size = round_up(plan_.buffers[i].bytes, kAlign);
      auto* words = reinterpret_cast<std::uint32_t*>(base + offsets_[i]);
      if (dense || size <= kSparseAbove)
        fills.push_back({words, size / 4, 1, 0});
      else
        fills.push_back({words, size / 4, stride / 4, line * kAlign / 4});
    }
    poison(fills);
  }
}

void Arena::leave(detail::Checker& c) { check_guards(c, "end"); }

void Arena::alias_for_testing(std::string_view a, std::string_view b) {
  test_aliases_.emplace_back(std::string(a), std::string(b));
}

void Arena::apply_alias(std::string_view a, std::string_view b) {
  std::size_t ia = plan_.buffers.size(), ib = ia;
  for (std::size_t i = 0; i < plan_.buffers.size(); ++i) {
    if (plan_.buffers[i].name == a) ia = i;
    if (plan_.buffers[i].name == b) ib = i;
  }
  MOECERT_ASSERT(ia < plan_.buffers.size() && ib < plan_.buffers.size());
  MOECERT_ASSERT(plan_.buffers[ib].bytes <= plan_.buffers[ia].bytes);
  offsets_[ib] = offsets_[ia];
}

}  // namespace moecert::workspace
