// The contract engine: semantics, levels, groups, scopes, handler, counters,
// and the agreement of the clause registry with the docs and the tests.
#include <oneapi/tbb/parallel_for.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "contracts/engine/checks.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/engine/engine.hpp"
#include "moecert/config.hpp"
#include "test_util.hpp"

using namespace moecert;

namespace {

// A miniature op with clauses of every level, to exercise the engine alone.
namespace k {
constexpr ClauseInfo kNoAlias =
    clauses::pre("test.scale.out_no_alias", Group::alias, "out shares no byte with in");
constexpr ClauseInfo kFiniteIn =
    clauses::pre("test.scale.finite_in", Group::finite, "in is finite");
constexpr ClauseInfo kAudit =
    clauses::post("test.scale.audit_probe", Group::numeric, "audit probe", Level::audit);
constexpr ClauseInfo kFull =
    clauses::post("test.scale.full_compare", Group::numeric, "full compare", Level::full);
}  // namespace k

int g_audit_runs = 0, g_full_runs = 0;

// out[i] = s * in[i], with its preconditions checked before any write.
void scale(View<const float> in, View<float> out, float s) {
  detail::Checker c{"test.scale"};
  MOECERT_CONTRACT(c, k::kNoAlias) {
    if (overlaps(in.bytes(), out.bytes()))
      c.fail(k::kNoAlias, "",
             fmt::format("out {} overlaps in {}", detail::format_range(out.bytes()),
                         detail::format_range(in.bytes())),
             "disjoint");
  }
  MOECERT_CONTRACT(c, k::kFiniteIn) {
    for (std::size_t i = 0; i < in.size; ++i)
      if (!std::isfinite(in[i]))
        c.fail(k::kFiniteIn, fmt::format("i={}", i), fmt::format("in={}", in[i]), "finite");
  }
  if (c.stop()) return;
  for (std::size_t i = 0; i < in.size; ++i) out[i] = s * in[i];
  MOECERT_CONTRACT(c, k::kAudit) { ++g_audit_runs; }
  MOECERT_CONTRACT(c, k::kFull) { ++g_full_runs; }
}

std::uint64_t checked(std::string_view id) {
  for (const auto& c : clause_counts())
    if (c.id == id) return c.checked;
  return 0;
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Captures what is written to stderr while alive.
class StderrCapture {
 public:
  StderrCapture() {
    std::fflush(stderr);
    file_ = std::tmpfile();
    saved_ = dup(fileno(stderr));
    dup2(fileno(file_), fileno(stderr));
  }
  std::string finish() {
    std::fflush(stderr);
    dup2(saved_, fileno(stderr));
    close(saved_);
    std::rewind(file_);
    std::string out;
    for (int ch; (ch = std::fgetc(file_)) != EOF;) out += static_cast<char>(ch);
    std::fclose(file_);
    return out;
  }

 private:
  std::FILE* file_;
  int saved_;
};

}  // namespace

TEST_CASE("core.contracts: enforce throws and leaves the caller's output untouched",
          "[core][contracts]") {
  std::vector<float> in = {1, 2, NAN, 4};
  std::vector<float> out = {7, 7, 7, 7};
  auto v = test::expect_violation(
      [&] {
        scale({in.data(), 4}, {out.data(), 4}, 2);
      },
      "test.scale.finite_in");
  CHECK(out == std::vector<float>{7, 7, 7, 7});
  CHECK(v.location == "i=2");
  CHECK(v.observed == "in=nan");
  CHECK(v.one_line() ==
        "test.scale: precondition test.scale.finite_in failed at i=2: in=nan, expected finite");
}

TEST_CASE("core.contracts: alias clause fires on overlapping buffers", "[core][contracts][alias]") {
  std::vector<float> buf = {1, 2, 3, 4, 5};
  const std::vector<float> before = buf;
  auto v = test::expect_violation(
      [&] {
        scale({buf.data(), 3}, {buf.data() + 2, 3}, 2);
      },
      "test.scale.out_no_alias");
  CHECK(buf == before);
  CHECK(v.observed.find("overlaps") != std::string::npos);
  ContractScope scope{Level::check, Semantic::enforce};
  CHECK_NOTHROW(scale({buf.data(), 2}, {buf.data() + 2, 2}, 2));  // adjacent, disjoint
}

TEST_CASE("core.contracts: observe calls the handler, counts and continues without writing",
          "[core][contracts]") {
  static std::atomic<int> calls;
  calls = 0;
  auto prev = set_violation_handler([](const Violation& v) {
    CHECK(v.semantic == Semantic::observe);
    ++calls;
  });
  std::vector<float> in = {NAN, 1}, out = {5, 5};
  const auto before = violation_count("test.scale.finite_in");
  {
    ContractScope scope{Level::check, Semantic::observe};
    CHECK_NOTHROW(scale({in.data(), 2}, {out.data(), 2}, 3));
    CHECK_NOTHROW(scale({in.data(), 2}, {out.data(), 2}, 3));
  }
  set_violation_handler(prev);
  CHECK(calls == 2);
  CHECK(violation_count("test.scale.finite_in") == before + 2);
  CHECK(out == std::vector<float>{5, 5});  // the op stopped before writing
}

TEST_CASE("core.contracts: observe messages are rate-limited per clause", "[core][contracts]") {
  std::vector<float> in = {NAN}, out = {0};
  reset_clause_counts();
  StderrCapture cap;
  {
    ContractScope scope{Level::check, Semantic::observe};
    for (int i = 0; i < 150; ++i) scale({in.data(), 1}, {out.data(), 1}, 1);
  }
  const std::string err = cap.finish();
  int lines = 0;
  for (char ch : err) lines += ch == '\n';
  CHECK(lines == 7);  // violations 1-5, 10 and 100
  CHECK(err.find("[100 violations of this clause so far; rate-limited]") != std::string::npos);
  CHECK(violation_count("test.scale.finite_in") == 150);
}

TEST_CASE("core.contracts: ignore evaluates no clause", "[core][contracts]") {
  std::vector<float> in = {NAN}, out = {0};
  reset_clause_counts();
  ContractScope scope{Level::full, Semantic::ignore};
  CHECK_NOTHROW(scale({in.data(), 1}, {out.data(), 1}, 1));
  CHECK(clause_counts().empty());
}

TEST_CASE("core.contracts: the level gates clauses", "[core][contracts]") {
  std::vector<float> in = {1}, out = {0};
  g_audit_runs = g_full_runs = 0;
  reset_clause_counts();
  {
    ContractScope s{Level::off};
    scale({in.data(), 1}, {out.data(), 1}, 1);
  }
  CHECK(checked("test.scale.finite_in") == 0);
  {
    ContractScope s{Level::check};
    scale({in.data(), 1}, {out.data(), 1}, 1);
  }
  CHECK(checked("test.scale.finite_in") == 1);
  CHECK(g_audit_runs == 0);
  {
    ContractScope s{Level::audit};
    scale({in.data(), 1}, {out.data(), 1}, 1);
  }
  CHECK(g_audit_runs == 1);
  CHECK(g_full_runs == 0);
  {
    ContractScope s{Level::full};
    scale({in.data(), 1}, {out.data(), 1}, 1);
  }
  CHECK(g_audit_runs == 2);
  CHECK(g_full_runs == 1);
}

TEST_CASE("core.contracts: groups switch on and off", "[core][contracts]") {
  std::vector<float> in = {NAN}, out = {0};
  ContractSettings s{Level::full, Semantic::enforce};
  s.groups &= ~(1u << static_cast<int>(Group::finite));
  {
    ContractScope scope{s};
    CHECK_NOTHROW(scale({in.data(), 1}, {out.data(), 1}, 1));
  }
  const ContractSettings saved = contract_settings();
  set_contract_settings({Level::check, Semantic::enforce});
  set_contract_group(Group::finite, false);
  CHECK_FALSE(contract_settings().group_on(Group::finite));
  CHECK(contract_settings().group_on(Group::alias));
  CHECK_NOTHROW(scale({in.data(), 1}, {out.data(), 1}, 1));
  set_contract_group(Group::finite, true);
  CHECK_THROWS_AS(scale({in.data(), 1}, {out.data(), 1}, 1), ContractViolation);
  set_contract_settings(saved);
}

TEST_CASE("core.contracts: scopes nest and are per thread", "[core][contracts]") {
  const ContractSettings saved = contract_settings();
  set_contract_level(Level::off);
  CHECK(effective_contract_settings().level == Level::off);
  {
    ContractScope outer{Level::check};
    CHECK(effective_contract_settings().level == Level::check);
    {
      ContractScope inner{Level::full, Semantic::observe};
      CHECK(effective_contract_settings().level == Level::full);
      CHECK(effective_contract_settings().semantic == Semantic::observe);
      Level other = Level::full;
      std::thread([&] { other = effective_contract_settings().level; }).join();
      CHECK(other == Level::off);  // another thread sees the process setting
    }
    CHECK(effective_contract_settings().level == Level::check);
    CHECK(effective_contract_settings().semantic == saved.semantic);
  }
  CHECK(effective_contract_settings().level == Level::off);
  set_contract_settings(saved);
}

TEST_CASE("core.contracts: the handler is replaceable and returns the previous one",
          "[core][contracts]") {
  auto h1 = [](const Violation&) {};
  auto h2 = [](const Violation&) {};
  auto original = set_violation_handler(h1);
  CHECK(original == default_violation_handler());
  CHECK(set_violation_handler(h2) == +h1);
  CHECK(set_violation_handler(nullptr) == +h2);
  CHECK(set_violation_handler(original) == default_violation_handler());
}

TEST_CASE("core.contracts: a throwing handler replaces the exception", "[core][contracts]") {
  struct Mine {};
  auto prev = set_violation_handler([](const Violation&) { throw Mine{}; });
  std::vector<float> in = {NAN}, out = {0};
  ContractScope scope{Level::check, Semantic::enforce};
  CHECK_THROWS_AS(scale({in.data(), 1}, {out.data(), 1}, 1), Mine);
  set_violation_handler(prev);
}

TEST_CASE("core.contracts: counters are exact under concurrent observe", "[core][contracts]") {
  auto prev = set_violation_handler([](const Violation&) {});
  reset_clause_counts();
  oneapi::tbb::parallel_for(0, 4000, [](int) {
    float in = NAN, out = 0;
    ContractScope scope{Level::check, Semantic::observe};
    scale({&in, 1}, {&out, 1}, 1);
  });
  set_violation_handler(prev);
  CHECK(violation_count("test.scale.finite_in") == 4000);
  CHECK(checked("test.scale.out_no_alias") == 4000);
}

TEST_CASE("core.contracts: first_overlap names the first aliasing pair",
          "[core][contracts][alias]") {
  const ByteRange r[] = {{0, 8}, {8, 16}, {20, 30}, {12, 21}};
  auto p = detail::first_overlap(r, 4);
  REQUIRE(p);
  CHECK(p.a == 1);
  CHECK(p.b == 3);
  const ByteRange disjoint[] = {{0, 8}, {8, 16}, {16, 16}, {16, 17}};
  CHECK_FALSE(detail::first_overlap(disjoint, 4));
}

TEST_CASE("core.contracts: names parse and print", "[core][contracts]") {
  for (Level l : {Level::off, Level::check, Level::audit, Level::full})
    CHECK(parse_level(level_name(l)) == l);
  for (Semantic s : {Semantic::ignore, Semantic::observe, Semantic::enforce})
    CHECK(parse_semantic(semantic_name(s)) == s);
  for (int g = 0; g < kGroupCount; ++g)
    CHECK(parse_group(group_name(static_cast<Group>(g))) == static_cast<Group>(g));
  CHECK_FALSE(parse_level("audits"));
  CHECK_FALSE(parse_group(""));
}

TEST_CASE("core.contracts: the build default is audit in Debug, check in Release",
          "[core][contracts]") {
#ifdef NDEBUG
  CHECK(contract_default_level() == Level::check);
#else
  CHECK(contract_default_level() == Level::audit);
#endif
  CHECK(contract_level_cap() == Level::full);
  // The level in effect never exceeds the cap.
  ContractScope scope{Level::full};
  CHECK(effective_contract_settings().level <= contract_level_cap());
}

TEST_CASE("core.contracts: every clause is documented next to its op and tested",
          "[core][contracts]") {
  namespace fs = std::filesystem;
  const fs::path root = MOECERT_SOURCE_DIR;
  std::string headers, tests;
  for (const auto& e : fs::directory_iterator(root / "include" / "moecert"))
    headers += read_file(e.path());
  for (const auto& e : fs::directory_iterator(root / "tests"))
    if (e.path().extension() == ".cpp" && e.path().filename() != "contracts_test.cpp")
      tests += read_file(e.path());
  const auto all = all_clauses();
  REQUIRE(all.size() >= 12);
  std::set<std::string_view> ids;
  for (const auto& c : all) {
    INFO(c.id);
    CHECK(ids.insert(c.id).second);                         // unique
    CHECK(std::count(c.id.begin(), c.id.end(), '.') == 2);  // family.op.clause
    // The documentation table: "///   <id>  <kind>  <group>  <condition>".
    const auto at = headers.find("///   " + std::string(c.id) + " ");
    REQUIRE(at != std::string::npos);
    const std::string line = headers.substr(at, headers.find('\n', at) - at);
    CHECK(line.find(std::string(" ") + std::string(clause_kind_name(c.kind)) + " ") !=
          std::string::npos);
    CHECK(line.find(std::string(" ") + std::string(group_name(c.group)) + " ") !=
          std::string::npos);
    // At least one test names it.
    CHECK(tests.find("\"" + std::string(c.id) + "\"") != std::string::npos);
  }
}

TEST_CASE("core.contracts: rows_finite finds +-inf and NaN anywhere in a strided block",
          "[core][contracts]") {
  // Blocks of several widths (whole 16-lane groups, a remainder, both) in a
  // wider matrix; each non-finite value at each position, and the largest
  // finite magnitudes and denormals, which are finite.
  const std::size_t ld = 67, rows = 5;
  const float bad[] = {std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN(),
                       -std::numeric_limits<float>::quiet_NaN(), std::bit_cast<float>(0x7f800001u)};
  const float good[] = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                        std::numeric_limits<float>::denorm_min(), -0.0f};
  for (const std::size_t cols :
       {std::size_t{1}, std::size_t{16}, std::size_t{23}, std::size_t{48}}) {
    std::vector<float> m(rows * ld, 1.5f);
    const std::size_t c0 = 3;  // the block starts inside the row
    REQUIRE(detail::rows_finite(m.data() + c0, ld, rows, cols));
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < cols; ++j) {
        float& at = m[i * ld + c0 + j];
        for (const float v : good) {
          at = v;
          CHECK(detail::rows_finite(m.data() + c0, ld, rows, cols));
        }
        for (const float v : bad) {
          at = v;
          CHECK_FALSE(detail::rows_finite(m.data() + c0, ld, rows, cols));
        }
        at = 1.5f;
      }
    m[c0 - 1] = m[c0 + cols] = m[rows * ld - 1] = bad[2];  // outside the block: not read
    CHECK(detail::rows_finite(m.data() + c0, ld, rows, cols));
  }
}
