// The arena a plan is bound to: one 64-byte aligned allocation, guard zones
// after every buffer (and one before the first), and, under contracts,
// fresh buffers filled with a NaN pattern when their live interval starts,
// so a read before a write shows up in the reader's finite clause.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "contracts/engine/engine.hpp"
#include "moecert/workspace.hpp"

namespace moecert::workspace {

/// A layer call's dimensions, for plan_shape.
struct Shape {
  std::uint64_t experts, hidden, inter, topk, rank, tokens, router_out;
};
/// The plan of `s` without config validation (the ops' own entry; their
/// preconditions checked the shapes), with the plan clauses on `c`.
Plan plan_shape(const Shape& s, bool training, std::uint64_t memory_cap, detail::Checker& c,
                WeightFormat format = WeightFormat::bf16);

/// Poison: 0x7fc07fc0 is a quiet NaN as fp32, two NaNs as bf16, and an
/// out-of-range expert id as int32.
inline constexpr std::uint32_t kPoison = 0x7fc07fc0u;
/// At `check` (`audit`), a fresh buffer larger than kSparseAbove bytes is
/// poisoned in one 64-byte line per kSparseStride (kAuditStride) bytes, line
/// (binds - 1) mod (stride / 64) of each stride, streamed past the caches;
/// at `full` every word is (proofs/workspace.md, "Poison").
inline constexpr std::uint64_t kSparseAbove = 64 * 1024, kSparseStride = 4096, kAuditStride = 512;
inline constexpr std::uint8_t kGuardByte = 0xa5;

class Arena {
 public:
  /// Binds `p` (allocating when the held block is smaller than its total),
  /// writes every guard zone and checks workspace.arena.disjoint.
  void bind(const Plan& p, detail::Checker& c);

  /// Buffer `name` of the bound plan as `count` elements of T (a moecert
  /// bug, MOECERT_ASSERT, if the plan sized it smaller).
  template <class T>
  T* get(std::string_view name, std::size_t count) {
    return static_cast<T*>(raw(name, count * sizeof(T)));
  }
  template <class T>
  const T* get(std::string_view name, std::size_t count) const {
    return static_cast<const T*>(const_cast<Arena*>(this)->raw(name, count * sizeof(T)));
  }
  /// The bytes the arena holds (for alias clauses).
  ByteRange bytes() const {
    const auto b = reinterpret_cast<std::uintptr_t>(block_.get());
    return {b, b + capacity_};
  }

  /// Starts `step`: checks the guard zones of the buffers live in the
  /// previous step (workspace.arena.guard, naming the buffer and the step),
  /// then writes the guards of the buffers whose live interval starts here
  /// (or since the previous step) and, under contracts (memory group on),
  /// poisons them: every word at full, sparsely at check and audit (above).
  /// Steps go in increasing order; a step at or before the previous one
  /// starts a new pass from there (a second backward after one forward),
  /// whose buffers are fresh again.
  void enter(int step, detail::Checker& c);

  /// Checks the guards of the last step's buffers at the end of a call; a
  /// later call may enter the following steps (the layer's backward).
  void leave(detail::Checker& c);

  const Plan& plan() const { return plan_; }
  std::size_t capacity() const { return capacity_; }

  /// Test hook (failure mode 3): from the next bind on, buffer `b` shares
  /// `a`'s memory (b no larger than a).
  void alias_for_testing(std::string_view a, std::string_view b);

 private:
  void* raw(std::string_view name, std::size_t bytes);
  void check_guards(detail::Checker& c, std::string_view when);
  void apply_alias(std::string_view a, std::string_view b);
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte[], Free> block_;
  std::size_t capacity_ = 0;
  Plan plan_;
  int current_ = -1;                    // the step entered last; -1 before the first
  std::uint64_t binds_ = 0;             // binds so far: the sparse poison's line
  std::vector<std::uint64_t> offsets_;  // the plan's, unless a test hook moved one
  std::vector<std::pair<std::string, std::string>> test_aliases_;
};

}  // namespace moecert::workspace
