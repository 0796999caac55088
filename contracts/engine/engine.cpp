// The contract engine: settings (build default, environment, API, scoped
// overrides), clause counters, the handler and the violation exception.
#include "contracts/engine/engine.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>

#ifndef MOECERT_DEFAULT_LEVEL
#define MOECERT_DEFAULT_LEVEL 0
#endif

namespace moecert {
namespace {

// ---- names ---------------------------------------------------------------

constexpr std::string_view kLevelNames[] = {"off", "check", "audit", "full"};
constexpr std::string_view kSemanticNames[] = {"ignore", "observe", "enforce"};
constexpr std::string_view kGroupNames[] = {"shape",  "index",   "alias",
                                            "finite", "numeric", "memory"};
constexpr std::string_view kKindNames[] = {"pre", "post", "invariant"};
constexpr std::string_view kKindWords[] = {"precondition", "postcondition", "invariant"};

template <class E, std::size_t N>
std::optional<E> parse_name(const std::string_view (&names)[N], std::string_view s) {
  for (std::size_t i = 0; i < N; ++i)
    if (names[i] == s) return static_cast<E>(i);
  return std::nullopt;
}

// ---- process-wide settings -------------------------------------------------
// Packed into one atomic word: bits 0-1 level, 2-3 semantic, 8-13 groups.

constexpr std::uint32_t pack(const ContractSettings& s) {
  return static_cast<std::uint32_t>(s.level) | (static_cast<std::uint32_t>(s.semantic) << 2) |
         (s.groups << 8);
}
constexpr ContractSettings unpack(std::uint32_t w) {
  ContractSettings s;
  s.level = static_cast<Level>(w & 3u);
  s.semantic = static_cast<Semantic>((w >> 2) & 3u);
  s.groups = (w >> 8) & ((1u << kGroupCount) - 1);
  return s;
}

constexpr Level kDefaultLevel = static_cast<Level>(MOECERT_DEFAULT_LEVEL);

std::atomic<std::uint32_t> g_settings{pack(ContractSettings{kDefaultLevel})};
std::once_flag g_env_once;

std::string join_names(const std::string_view* names, std::size_t n) {
  return fmt::format("{}", fmt::join(names, names + n, "|"));
}

}  // namespace

namespace detail {

ContractSettings parse_settings(const char* contracts, const char* groups, ContractSettings s) {
  if (contracts && *contracts) {
    const std::string_view v = contracts;
    const auto colon = v.find(':');
    const auto level = parse_level(v.substr(0, colon));
    std::optional<Semantic> sem = s.semantic;
    if (colon != std::string_view::npos) sem = parse_semantic(v.substr(colon + 1));
    if (!level || !sem)
      throw std::invalid_argument(fmt::format(
          "MOECERT_CONTRACTS={}: expected LEVEL[:SEMANTIC], LEVEL one of {}, SEMANTIC one of {}", v,
          join_names(kLevelNames, 4), join_names(kSemanticNames, 3)));
    s.level = *level;
    s.semantic = *sem;
  }
  if (groups && *groups) {
    const std::string_view whole = groups;
    std::string_view v = whole;
    std::uint32_t mask = 0;
    if (v == "all") {
      mask = (1u << kGroupCount) - 1;
    } else if (v != "none") {
      while (!v.empty()) {
        const auto comma = v.find(',');
        const auto name = v.substr(0, comma);
        const auto g = parse_group(name);
        if (!g)
          throw std::invalid_argument(
              fmt::format("MOECERT_CONTRACT_GROUPS={}: unknown group '{}', expected all, none or "
                          "a comma-separated list of {}",
                          whole, name, join_names(kGroupNames, kGroupCount)));
        mask |= 1u << static_cast<int>(*g);
        v = comma == std::string_view::npos ? std::string_view{} : v.substr(comma + 1);
      }
    }
    s.groups = mask;
  }
  return s;
}

}  // namespace detail

namespace {

// Reads MOECERT_CONTRACTS and MOECERT_CONTRACT_GROUPS once. A value that
// does not parse is refused: running with checks the user did not ask for
// is worse than stopping.
void read_environment() {
  g_settings.store(pack(detail::parse_settings(std::getenv("MOECERT_CONTRACTS"),
                                               std::getenv("MOECERT_CONTRACT_GROUPS"),
                                               unpack(g_settings.load()))));
}

ContractSettings global_settings() {
  std::call_once(g_env_once, read_environment);
  return unpack(g_settings.load());
}

thread_local const ContractSettings* t_scope = nullptr;

// ---- counters ----------------------------------------------------------------

struct Counters {
  std::mutex mu;
  std::map<std::string, ClauseCount, std::less<>> by_id;

  ClauseCount& at(std::string_view id) {  // mu held
    auto it = by_id.find(id);
    if (it == by_id.end()) it = by_id.emplace(std::string(id), ClauseCount{std::string(id)}).first;
    return it->second;
  }
};
Counters& counters() {
  static Counters c;
  return c;
}

// ---- handler -------------------------------------------------------------------

bool should_print(std::uint64_t n) {
  if (n <= 5) return true;
  while (n % 10 == 0) n /= 10;
  return n == 1;  // 10, 100, 1000, ...
}

void print_violation(const Violation& v) {
  if (v.semantic != Semantic::observe) return;
  const std::uint64_t n = violation_count(v.clause);
  if (!should_print(n)) return;
  std::string line = "moecert: " + v.one_line();
  if (n >= 5) line += fmt::format(" [{} violations of this clause so far; rate-limited]", n);
  std::fprintf(stderr, "%s\n", line.c_str());
}

std::atomic<ViolationHandler> g_handler{&print_violation};

}  // namespace

// ---- names ---------------------------------------------------------------------

std::string_view level_name(Level l) { return kLevelNames[static_cast<int>(l) & 3]; }
std::string_view semantic_name(Semantic s) { return kSemanticNames[static_cast<int>(s) % 3]; }
std::string_view group_name(Group g) { return kGroupNames[static_cast<int>(g) % kGroupCount]; }
std::string_view clause_kind_name(ClauseKind k) { return kKindNames[static_cast<int>(k) % 3]; }
std::optional<Level> parse_level(std::string_view s) { return parse_name<Level>(kLevelNames, s); }
std::optional<Semantic> parse_semantic(std::string_view s) {
  return parse_name<Semantic>(kSemanticNames, s);
}
std::optional<Group> parse_group(std::string_view s) { return parse_name<Group>(kGroupNames, s); }

// ---- violation -------------------------------------------------------------------

std::string Violation::one_line() const {
  std::string out =
      fmt::format("{}: {} {} failed", op, kKindWords[static_cast<int>(kind) % 3], clause);
  if (!location.empty()) out += " at " + location;
  out += ": ";
  out += observed.empty() ? message : observed;
  if (!expected.empty()) out += ", expected " + expected;
  return out;
}

ContractViolation::ContractViolation(Violation v) : v_(std::move(v)), what_(v_.one_line()) {}

ViolationHandler set_violation_handler(ViolationHandler h) {
  return g_handler.exchange(h ? h : &print_violation);
}
ViolationHandler default_violation_handler() { return &print_violation; }

// ---- settings ----------------------------------------------------------------------

ContractSettings contract_settings() { return global_settings(); }
void set_contract_settings(const ContractSettings& s) {
  std::call_once(g_env_once, read_environment);  // a later env read must not undo this
  g_settings.store(pack(s));
}
void set_contract_level(Level l) {
  auto s = contract_settings();
  s.level = l;
  set_contract_settings(s);
}
void set_contract_semantic(Semantic m) {
  auto s = contract_settings();
  s.semantic = m;
  set_contract_settings(s);
}
void set_contract_group(Group g, bool on) {
  auto s = contract_settings();
  const std::uint32_t bit = 1u << static_cast<int>(g);
  s.groups = on ? (s.groups | bit) : (s.groups & ~bit);
  set_contract_settings(s);
}

Level contract_level_cap() { return detail::kContractCap; }
Level contract_default_level() { return kDefaultLevel; }

ContractSettings effective_contract_settings() {
  ContractSettings s = t_scope ? *t_scope : global_settings();
  s.level = std::min(s.level, detail::kContractCap);
  return s;
}

ContractScope::ContractScope(Level level)
    : ContractScope(level, effective_contract_settings().semantic) {}
ContractScope::ContractScope(Level level, Semantic semantic) : prev_(t_scope) {
  mine_ = effective_contract_settings();
  mine_.level = level;
  mine_.semantic = semantic;
  t_scope = &mine_;
}
ContractScope::ContractScope(const ContractSettings& s) : prev_(t_scope), mine_(s) {
  t_scope = &mine_;
}
ContractScope::~ContractScope() { t_scope = prev_; }

// ---- counters ------------------------------------------------------------------------

std::vector<ClauseCount> clause_counts() {
  auto& c = counters();
  std::lock_guard lock(c.mu);
  std::vector<ClauseCount> out;
  out.reserve(c.by_id.size());
  for (const auto& [id, n] : c.by_id) out.push_back(n);
  return out;
}

std::uint64_t violation_count(std::string_view clause_id) {
  auto& c = counters();
  std::lock_guard lock(c.mu);
  auto it = c.by_id.find(clause_id);
  return it == c.by_id.end() ? 0 : it->second.violated;
}

void reset_clause_counts() {
  auto& c = counters();
  std::lock_guard lock(c.mu);
  c.by_id.clear();
}

// ---- checker -----------------------------------------------------------------------------

namespace detail {

Checker::Checker(std::string_view op) : op_(op), settings_(effective_contract_settings()) {}

bool Checker::on(const ClauseInfo& clause) {
  if (settings_.semantic == Semantic::ignore || clause.level > settings_.level ||
      !settings_.group_on(clause.group))
    return false;
  auto& c = counters();
  std::lock_guard lock(c.mu);
  ++c.at(clause.id).checked;
  return true;
}

namespace {
ObservedPreconditions& observed_record() {
  thread_local ObservedPreconditions record;
  return record;
}
}  // namespace

void Checker::fail(const ClauseInfo& clause, std::string location, std::string observed,
                   std::string expected, SourceLocation where) {
  Violation v;
  v.op = std::string(op_);
  v.clause = std::string(clause.id);
  v.kind = clause.kind;
  v.group = clause.group;
  v.level = clause.level;
  v.semantic = settings_.semantic;
  v.message = std::string(clause.text);
  v.location = std::move(location);
  v.observed = std::move(observed);
  v.expected = std::move(expected);
  v.source = where;
  {
    auto& c = counters();
    std::lock_guard lock(c.mu);
    ++c.at(clause.id).violated;
  }
  g_handler.load()(v);
  if (settings_.semantic == Semantic::enforce) throw ContractViolation(std::move(v));
  if (clause.kind == ClauseKind::pre) {
    pre_failed_ = true;
    auto& o = observed_record();
    ++o.count;
    o.last = std::move(v);
  }
}

const ObservedPreconditions& observed_preconditions() { return observed_record(); }

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

ClauseTimer::ClauseTimer(const ClauseInfo& clause) : clause_(clause), start_ns_(now_ns()) {}

ClauseTimer::~ClauseTimer() {
  add_clause_seconds(clause_, static_cast<double>(now_ns() - start_ns_) * 1e-9);
}

SampledTimer::SampledTimer(std::atomic<std::int64_t>& ns, unsigned every) : every_(every) {
  thread_local unsigned calls = 0;
  if (++calls % every == 0) ns_ = &ns, start_ns_ = now_ns();
}

namespace {
// What a clock read adds to a timed interval (the least of 64 back-to-back
// pairs, taken once): subtracted from each sample, so that a slow clock (a
// VM guest's) is not counted kEvery times as the hook's cost.
std::int64_t clock_cost_ns() {
  static const std::int64_t cost = [] {
    std::int64_t least = INT64_MAX;
    for (int i = 0; i < 64; ++i) {
      const std::int64_t t0 = now_ns();
      least = std::min(least, now_ns() - t0);
    }
    return least;
  }();
  return cost;
}
}  // namespace

SampledTimer::~SampledTimer() {
  if (!ns_) return;
  const std::int64_t elapsed = std::max<std::int64_t>(0, now_ns() - start_ns_ - clock_cost_ns());
  ns_->fetch_add(elapsed * every_, std::memory_order_relaxed);
}

void add_clause_seconds(const ClauseInfo& clause, double seconds) {
  auto& c = counters();
  std::lock_guard lock(c.mu);
  c.at(clause.id).seconds += seconds;
}

OverlapPair first_overlap(const ByteRange* ranges, int n) {
  for (int a = 0; a < n; ++a)
    for (int b = a + 1; b < n; ++b)
      if (overlaps(ranges[a], ranges[b])) return {a, b};
  return {};
}

std::string format_range(ByteRange r) { return fmt::format("[{:#x}, {:#x})", r.begin, r.end); }

void assert_fail(const char* cond, SourceLocation where) {
  std::fprintf(stderr, "moecert: internal assertion failed: %s at %s:%u (a moecert bug)\n", cond,
               where.file_name(), where.line());
  std::abort();
}

}  // namespace detail
}  // namespace moecert
