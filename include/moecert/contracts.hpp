// The contract engine's public face: levels, semantics, groups, the
// violation record and exception, the replaceable handler, and counters.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moecert/types.hpp"

namespace moecert {

/// How much is checked. Each level includes the ones before it.
///   off    nothing
///   check  every pre/postcondition that costs O(inputs + outputs)
///   audit  check + Freivalds/ABFT probes and sampled rows against the reference
///   full   audit + every output element against the reference
enum class Level : std::uint8_t { off = 0, check = 1, audit = 2, full = 3 };

/// What happens on a violation (as in C++26 contracts).
///   ignore   clauses are not evaluated at all
///   observe  the handler is called, the violation counted, execution continues
///   enforce  the handler is called, then ContractViolation is thrown
enum class Semantic : std::uint8_t { ignore = 0, observe = 1, enforce = 2 };

/// Clause groups; each can be switched on or off on its own.
enum class Group : std::uint8_t { shape = 0, index, alias, finite, numeric, memory };
inline constexpr int kGroupCount = 6;

enum class ClauseKind : std::uint8_t { pre = 0, post, invariant };

std::string_view level_name(Level);
std::string_view semantic_name(Semantic);
std::string_view group_name(Group);
std::string_view clause_kind_name(ClauseKind);
std::optional<Level> parse_level(std::string_view);
std::optional<Semantic> parse_semantic(std::string_view);
std::optional<Group> parse_group(std::string_view);

/// Where a violation was detected. (std::source_location is not usable with
/// clang 14 on libstdc++ 12; these builtins are, in GCC and clang alike.)
struct SourceLocation {
  const char* file = "";
  unsigned line_number = 0;
  static constexpr SourceLocation current(const char* file = __builtin_FILE(),
                                          unsigned line = __builtin_LINE()) {
    return {file, line};
  }
  constexpr const char* file_name() const { return file; }
  constexpr unsigned line() const { return line_number; }
};

/// A clause: a stable dotted id `family.op.clause`, documented next to its
/// op's declaration. The engine counts how often each clause was evaluated
/// and how often it failed.
struct ClauseInfo {
  std::string_view id;
  ClauseKind kind;
  Group group;
  Level level;            // the lowest level at which it is evaluated
  std::string_view text;  // the condition, e.g. "-1 <= idx[t,j] < n*n"
};

/// Everything known about one violation.
struct Violation {
  std::string op;      // dotted op id, e.g. "router.product_key.backward"
  std::string clause;  // clause id, e.g. "router.product_key.idx_in_range"
  ClauseKind kind = ClauseKind::pre;
  Group group = Group::shape;
  Level level = Level::check;             // the clause's level
  Semantic semantic = Semantic::enforce;  // in effect when it was found
  std::string message;                    // what is wrong, in words
  std::string location;  // e.g. "t=17 j=3"; empty when the clause is about a whole argument
  std::string observed;  // e.g. "idx=-2"
  std::string expected;  // bound or expected value, e.g. "-1 <= idx < 256"
  SourceLocation source;

  /// One line a person can act on: "op: precondition clause failed at loc:
  /// observed, expected ...".
  std::string one_line() const;
};

/// Thrown under `enforce` after the handler returns.
class ContractViolation : public std::exception {
 public:
  explicit ContractViolation(Violation v);
  const char* what() const noexcept override { return what_.c_str(); }
  const Violation& violation() const noexcept { return v_; }
  const std::string& clause() const noexcept { return v_.clause; }

 private:
  Violation v_;
  std::string what_;
};

/// Called for every violation (observe and enforce) before the engine
/// continues or throws. The default handler writes `one_line()` to stderr
/// under observe, rate-limited per clause (the first 5, then at 10, 100,
/// 1000, ... violations), and writes nothing under enforce (the exception
/// carries the message). A handler may throw its own exception.
using ViolationHandler = void (*)(const Violation&);

/// Installs `h` (nullptr restores the default); returns the previous handler.
/// Thread-safe.
ViolationHandler set_violation_handler(ViolationHandler h);
ViolationHandler default_violation_handler();

/// Process-wide settings. Initial values: the build's default (Debug:
/// audit/enforce, Release: check/enforce), overridden once at first use by the
/// environment: MOECERT_CONTRACTS=off|check|audit|full[:ignore|observe|enforce]
/// and MOECERT_CONTRACT_GROUPS=all|none|comma-separated group names.
/// The level in effect is never above the compile-time cap.
struct ContractSettings {
  Level level = Level::off;
  Semantic semantic = Semantic::enforce;
  std::uint32_t groups = (1u << kGroupCount) - 1;  // bit i = Group(i)
  constexpr bool group_on(Group g) const { return (groups >> static_cast<int>(g)) & 1u; }
};

ContractSettings contract_settings();
void set_contract_settings(const ContractSettings&);
void set_contract_level(Level);
void set_contract_semantic(Semantic);
void set_contract_group(Group, bool on);

/// The compile-time cap (CMake option MOECERT_CONTRACT_CAP): clauses above it
/// are compiled out of the library.
Level contract_level_cap();
/// The build's default level before the environment is read.
Level contract_default_level();

/// The settings in effect on this thread: the innermost ContractScope if
/// any, else the process-wide settings; the level clamped to the cap.
ContractSettings effective_contract_settings();

/// Per-call (per-thread, scoped) override of the settings:
///   { moecert::ContractScope s{moecert::Level::full}; op(...); }
/// It holds for the whole of op(...), including the op's work that oneTBB
/// runs on other threads.
class ContractScope {
 public:
  explicit ContractScope(Level level);
  ContractScope(Level level, Semantic semantic);
  explicit ContractScope(const ContractSettings& s);
  ~ContractScope();
  ContractScope(const ContractScope&) = delete;
  ContractScope& operator=(const ContractScope&) = delete;

 private:
  const ContractSettings* prev_;
  ContractSettings mine_;
};

/// Counters of one clause since start (or the last reset).
struct ClauseCount {
  std::string id;
  std::uint64_t checked = 0;   // evaluations
  std::uint64_t violated = 0;  // violations (under any semantic but ignore)
  double seconds = 0;          // wall time in the clause's evaluations (nested ones included)
};

/// Counters of every clause evaluated or violated so far, sorted by id.
std::vector<ClauseCount> clause_counts();
/// Violations of one clause so far.
std::uint64_t violation_count(std::string_view clause_id);
void reset_clause_counts();

/// Every clause the library defines (the registry; for coverage reports).
std::vector<ClauseInfo> all_clauses();

}  // namespace moecert
