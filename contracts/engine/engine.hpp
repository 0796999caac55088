// Internal interface ops use to evaluate clauses at their API boundary.
//
//   detail::Checker c{"router.product_key.backward"};
//   MOECERT_CONTRACT(c, clauses::kIdxInRange) {
//     for (...) if (bad) c.fail(clauses::kIdxInRange, loc, observed, expected);
//   }
//   if (c.stop()) return;  // a precondition failed under `observe`
//
// A clause whose level is above the compile-time cap is a discarded
// `if constexpr` branch: its body is not compiled into the library.
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "moecert/contracts.hpp"

#ifndef MOECERT_CONTRACT_CAP_LEVEL
#define MOECERT_CONTRACT_CAP_LEVEL 3
#endif

namespace moecert::detail {

inline constexpr Level kContractCap = static_cast<Level>(MOECERT_CONTRACT_CAP_LEVEL);
static_assert(MOECERT_CONTRACT_CAP_LEVEL >= 0 && MOECERT_CONTRACT_CAP_LEVEL <= 3);

constexpr bool cap_allows(Level clause_level) { return clause_level <= kContractCap; }

/// One op call's view of the contract engine.
class Checker {
 public:
  explicit Checker(std::string_view op);

  /// True when `clause` is to be evaluated now (level, group, semantic);
  /// counts the evaluation.
  bool on(const ClauseInfo& clause);
  /// Whether on(clause) would be true, without counting: for work an op
  /// does inside its passes for a clause judged after it (e.g. a probe).
  bool will_check(const ClauseInfo& clause) const {
    return settings_.semantic != Semantic::ignore && clause.level <= settings_.level &&
           settings_.group_on(clause.group);
  }

  /// Reports a failure of `clause`: counts it, calls the handler, then
  /// throws ContractViolation under enforce. Under observe it returns, and
  /// a failed precondition makes stop() true.
  void fail(const ClauseInfo& clause, std::string location, std::string observed,
            std::string expected, SourceLocation where = ::moecert::SourceLocation::current());

  /// True after a precondition failed under observe: the op must return
  /// without writing any output.
  bool stop() const { return pre_failed_; }

  /// The level in effect for this call (already clamped to the cap).
  Level level() const { return settings_.level; }
  std::string_view op() const { return op_; }

 private:
  std::string_view op_;
  ContractSettings settings_;
  bool pre_failed_ = false;
};

/// The settings MOECERT_CONTRACTS (LEVEL[:SEMANTIC]) and
/// MOECERT_CONTRACT_GROUPS (all, none or a comma-separated list of groups)
/// give on top of `base` (a null or empty value changes nothing);
/// std::invalid_argument naming the variable and the values it takes for
/// anything else.
ContractSettings parse_settings(const char* contracts, const char* groups, ContractSettings base);

/// The preconditions that failed under observe on this thread: how many,
/// and the last one (the C ABI tells its caller that an op wrote nothing).
struct ObservedPreconditions {
  std::uint64_t count = 0;
  Violation last;
};
const ObservedPreconditions& observed_preconditions();

/// Adds the wall time from its construction to its destruction to
/// `clause`'s ClauseCount::seconds (the cost of one evaluation, for
/// `moecert bench --contracts ... --clause-times`).
class ClauseTimer {
 public:
  explicit ClauseTimer(const ClauseInfo& clause);
  ~ClauseTimer();
  ClauseTimer(const ClauseTimer&) = delete;
  ClauseTimer& operator=(const ClauseTimer&) = delete;

 private:
  const ClauseInfo& clause_;
  std::int64_t start_ns_;
};

/// Adds `seconds` to `clause`'s ClauseCount::seconds (work a clause did
/// outside its MOECERT_CONTRACT block, e.g. inside the op's passes).
void add_clause_seconds(const ClauseInfo& clause, double seconds);

/// The steady clock in nanoseconds (clause timing).
std::int64_t now_ns();

/// Times one in `every` of the scopes it guards on each thread and adds
/// `every` times the elapsed nanoseconds to `ns`: an estimate of what a hook
/// that runs thousands of times inside an op's passes costs, without a
/// clock read per call (up to a microsecond in a VM guest). A hook called
/// per row and column block (millions of calls) takes a longer period.
class SampledTimer {
 public:
  static constexpr unsigned kEvery = 32;
  explicit SampledTimer(std::atomic<std::int64_t>& ns, unsigned every = kEvery);
  ~SampledTimer();
  SampledTimer(const SampledTimer&) = delete;
  SampledTimer& operator=(const SampledTimer&) = delete;

 private:
  std::atomic<std::int64_t>* ns_ = nullptr;
  std::int64_t start_ns_ = 0;
  unsigned every_ = kEvery;
};

/// The first (lowest-index) pair of byte ranges that overlap among `n`
/// ranges, or {-1, -1}. Quadratic in n; n is the argument count of one op.
struct OverlapPair {
  int a = -1;
  int b = -1;
  explicit operator bool() const { return a >= 0; }
};
OverlapPair first_overlap(const ByteRange* ranges, int n);

/// "[0x..., 0x...)", for alias messages.
std::string format_range(ByteRange r);

}  // namespace moecert::detail

/// Evaluates the following block when `clause` is compiled in (cap) and on
/// (runtime settings), timed into the clause's counters. `clause` must be a
/// constant expression.
#define MOECERT_CONTRACT(checker, clause)                      \
  if constexpr (::moecert::detail::cap_allows((clause).level)) \
    if ((checker).on(clause))                                  \
      if (::moecert::detail::ClauseTimer moecert_clause_timer_{clause}; true)

/// A broken internal invariant: a moecert bug, not bad input. Always on.
#define MOECERT_ASSERT(cond)     \
  ((cond) ? static_cast<void>(0) \
          : ::moecert::detail::assert_fail(#cond, ::moecert::SourceLocation::current()))

namespace moecert::detail {
[[noreturn]] void assert_fail(const char* cond, SourceLocation where);
}
