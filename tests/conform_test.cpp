// moecert conform: the report's JSON against docs/report-schema.md, a
// planted failure, skipped ISAs, and the four files.
#include <boost/json.hpp>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "moecert/isa.hpp"
#include "moecert/moecert.hpp"
#include "test_util.hpp"
#include "tools/conform/report.hpp"
#include "tools/tensor_file.hpp"

using namespace moecert;
using namespace moecert::tools;
namespace json = boost::json;

namespace {

std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// docs/report-schema.md, as checks: every key present with its type.
enum class T { str, num, num_or_null, integer, boolean, strs, object, array };

void expect_keys(const json::object& o, std::initializer_list<std::pair<const char*, T>> keys,
                 const std::string& where) {
  for (const auto& [key, type] : keys) {
    INFO(where << "." << key);
    REQUIRE(o.contains(key));
    const json::value& v = o.at(key);
    switch (type) {
      case T::str:
        CHECK(v.is_string());
        break;
      case T::num:
        CHECK(v.is_number());
        break;
      case T::num_or_null:
        CHECK((v.is_number() || v.is_null()));
        break;
      case T::integer:
        CHECK((v.is_int64() || v.is_uint64()));
        break;
      case T::boolean:
        CHECK(v.is_bool());
        break;
      case T::object:
        CHECK(v.is_object());
        break;
      case T::array:
        CHECK(v.is_array());
        break;
      case T::strs:
        REQUIRE(v.is_array());
        for (const auto& e : v.as_array()) CHECK(e.is_string());
        break;
    }
  }
}

void validate_report(const json::value& doc) {
  REQUIRE(doc.is_object());
  const auto& o = doc.as_object();
  expect_keys(o,
              {{"schema", T::str},
               {"suite", T::str},
               {"seed", T::integer},
               {"environment", T::object},
               {"summary", T::object},
               {"cases", T::array},
               {"clauses", T::array}},
              "report");
  CHECK(o.at("schema").as_string() == "moecert-conformance/1");
  const auto& env = o.at("environment").as_object();
  expect_keys(env,
              {{"cpu_model", T::str},
               {"cpu_vendor", T::str},
               {"isa_detected", T::strs},
               {"isa_usable", T::strs},
               {"isa_default", T::str},
               {"isa_used", T::str},
               {"threads", T::integer},
               {"compiler", T::str},
               {"flags", T::str},
               {"build_type", T::str},
               {"git_commit", T::str},
               {"contract_cap", T::str},
               {"contract_default", T::str},
               {"contract_level", T::str},
               {"versions", T::object}},
              "environment");
  expect_keys(env.at("versions").as_object(),
              {{"moecert", T::str}, {"fmt", T::str}, {"onetbb", T::str}, {"boost", T::str}},
              "versions");
  const auto& sum = o.at("summary").as_object();
  expect_keys(sum,
              {{"cases", T::integer},
               {"passed", T::integer},
               {"failed", T::integer},
               {"skipped", T::integer},
               {"clauses_total", T::integer},
               {"clauses_exercised", T::integer},
               {"seconds", T::num}},
              "summary");
  const auto& cases = o.at("cases").as_array();
  CHECK(sum.at("cases").to_number<std::int64_t>() == static_cast<std::int64_t>(cases.size()));
  std::int64_t passed = 0, failed = 0, skipped = 0;
  std::set<std::string> ids;
  for (const auto& c : cases) {
    expect_keys(c.as_object(),
                {{"id", T::str},
                 {"op", T::str},
                 {"variant", T::str},
                 {"isa", T::str},
                 {"shape", T::str},
                 {"data", T::str},
                 {"level", T::str},
                 {"max_abs_err", T::num_or_null},
                 {"max_rel_err", T::num_or_null},
                 {"max_bound_utilization", T::num_or_null},
                 {"worst", T::str},
                 {"deterministic", T::boolean},
                 {"verdict", T::str},
                 {"detail", T::str},
                 {"seconds", T::num},
                 {"clauses_checked", T::strs},
                 {"clauses_fired", T::strs},
                 {"utilization_histogram", T::array},
                 {"outputs", T::array}},
                "case");
    CHECK(c.at("utilization_histogram").as_array().size() == 9);
    for (const auto& out : c.at("outputs").as_array())
      expect_keys(out.as_object(),
                  {{"name", T::str},
                   {"count", T::integer},
                   {"exceeded", T::integer},
                   {"max_abs_err", T::num_or_null},
                   {"max_rel_err", T::num_or_null},
                   {"max_bound_utilization", T::num_or_null}},
                  "output");
    const std::string v(c.at("verdict").as_string());
    CHECK((v == "pass" || v == "fail" || v == "skip"));
    passed += v == "pass";
    failed += v == "fail";
    skipped += v == "skip";
    CHECK(ids.insert(std::string(c.at("id").as_string())).second);
  }
  CHECK(sum.at("passed").to_number<std::int64_t>() == passed);
  CHECK(sum.at("failed").to_number<std::int64_t>() == failed);
  CHECK(sum.at("skipped").to_number<std::int64_t>() == skipped);
  for (const auto& c : o.at("clauses").as_array()) {
    expect_keys(c.as_object(),
                {{"id", T::str},
                 {"kind", T::str},
                 {"group", T::str},
                 {"level", T::str},
                 {"checked", T::integer},
                 {"violation_tested", T::boolean}},
                "clause");
  }
  CHECK(sum.at("clauses_total").to_number<std::int64_t>() ==
        static_cast<std::int64_t>(o.at("clauses").as_array().size()));
}

RunContext context() {
  RunContext ctx;
  ctx.threads = 2;
  ctx.seed = 7;
  ctx.isas = {Isa::scalar, Isa::amx_emu, Isa::amx_bf16};
  return ctx;
}

std::vector<CaseDef> smoke_cases(const RunContext& ctx) {
  std::vector<CaseDef> defs;
  add_core_cases(defs);
  add_kernel_cases(defs, ctx.isas);
  std::erase_if(defs, [](const CaseDef& d) {
    return d.suite > Suite::smoke || d.shape.rfind("tiny", 0) != 0;
  });
  return defs;
}

}  // namespace

TEST_CASE("tools.conform: report.json validates against docs/report-schema.md",
          "[tools][conform]") {
  const auto ctx = context();
  const Report r = run_cases(smoke_cases(ctx), ctx, "smoke", "scalar,amx_emu,amx_bf16");
  const auto dir = std::filesystem::temp_directory_path() / "moecert_conform_test_schema";
  write_report(r, dir);
  validate_report(json::parse(slurp(dir / "report.json")));
  CHECK(r.failed() == 0);
  for (const char* f : {"report.md", "report.html", "junit.xml"})
    CHECK(std::filesystem::file_size(dir / f) > 0);
  const std::string junit = slurp(dir / "junit.xml");
  CHECK(junit.find("<testsuites") != std::string::npos);
  CHECK(junit.find("tests=\"" + std::to_string(r.cases.size()) + "\"") != std::string::npos);
  const std::string html = slurp(dir / "report.html");
  CHECK(html.find("<svg") != std::string::npos);
  // Self-contained: nothing loaded from elsewhere (the SVG xmlns is a name, not a fetch).
  for (const char* ref : {"src=\"http", "href=\"http", "<script src", "<link"})
    CHECK(html.find(ref) == std::string::npos);
}

TEST_CASE("build info: the commit is taken at build time and says whether the tree was dirty",
          "[tools][info]") {
  // cmake/git_commit.cmake: 12 hex digits, "-dirty" when tracked files had
  // changes, "unknown" outside a git checkout; never empty or stale-format.
  const std::string c = build_info().git_commit;
  INFO(c);
  const auto hex = [](const std::string& h) {
    return h.size() == 12 && h.find_first_not_of("0123456789abcdef") == std::string::npos;
  };
  const std::string head = c.substr(0, c.find('-')), rest = c.substr(head.size());
  CHECK((c == "unknown" ||
         (hex(head) && (rest.empty() || rest == "-dirty" || rest == "-unknown-state"))));
}

TEST_CASE("tools.conform: a planted failing case fails the run and the report names it",
          "[tools][conform]") {
  const auto ctx = context();
  auto defs = smoke_cases(ctx);
  defs.push_back(
      {"test.planted.failure", "planted", "any", "tiny", "normal", Suite::smoke, Level::off,
       [](const RunContext&) { return CaseResult::only(Verdict::fail, "planted failure"); }});
  const Report r = run_cases(defs, ctx, "smoke", "");
  CHECK(r.failed() == 1);
  const auto dir = std::filesystem::temp_directory_path() / "moecert_conform_test_planted";
  write_report(r, dir);
  const std::string id = "test.planted.failure/planted/any/tiny/normal";
  CHECK(slurp(dir / "report.md").find("- `" + id + "`: planted failure") != std::string::npos);
  CHECK(slurp(dir / "junit.xml").find("<failure message=\"planted failure\"") != std::string::npos);
  const auto doc = json::parse(slurp(dir / "report.json"));
  CHECK(doc.at("summary").at("failed").to_number<int>() == 1);
  bool named = false;
  for (const auto& c : doc.at("cases").as_array())
    named |= c.at("id").as_string() == id && c.at("verdict").as_string() == "fail";
  CHECK(named);
}

TEST_CASE("tools.conform: a case that cannot run here is a skip with its reason",
          "[tools][conform]") {
  if (isa_usable(Isa::amx_bf16)) {
    WARN("amx_bf16 is usable here: nothing to skip");
    return;
  }
  const auto ctx = context();
  const Report r = run_cases(smoke_cases(ctx), ctx, "smoke", "");
  int amx = 0;
  for (const auto& c : r.cases)
    if (c.def.isa == "amx_bf16") {
      ++amx;
      CHECK(c.result.verdict == Verdict::skip);
      CHECK(c.result.detail.find("not usable on this CPU") != std::string::npos);
    }
  CHECK(amx > 0);
  CHECK(r.skipped() == amx);
}

TEST_CASE("tools.tensor_file: F16 widened exactly, every bit pattern", "[tools]") {
  tools::Tensor t{"F16", {65536}, {}};
  for (std::uint32_t h = 0; h < 65536; ++h)
    t.bytes.push_back(static_cast<std::uint8_t>(h)),
        t.bytes.push_back(static_cast<std::uint8_t>(h >> 8));
  const auto v = tools::to_f32(t, "t");
  // Anchors: 1, -2, the largest finite, the least subnormal, the least
  // normal, infinities, a NaN.
  CHECK(v[0x3C00] == 1.0f);
  CHECK(v[0xC000] == -2.0f);
  CHECK(v[0x7BFF] == 65504.0f);
  CHECK(v[0x0001] == 0x1p-24f);
  CHECK(v[0x0400] == 0x1p-14f);
  CHECK(v[0x7C00] == INFINITY);
  CHECK(v[0xFC00] == -INFINITY);
  CHECK(std::isnan(v[0x7E00]));
  CHECK((std::signbit(v[0x8000]) && v[0x8000] == 0.0f));
  // Between them, each finite positive pattern one ulp of the previous
  // one's binade above it (2^-24 below 2^-13, then doubling with each
  // binade), and each negative one the positive's negation.
  for (std::uint32_t h = 1; h < 0x7C00; ++h) {
    const int binade = static_cast<int>((h - 1) >> 10);
    const float ulp = std::ldexp(1.0f, std::max(binade, 1) - 25);
    INFO("pattern " << h);
    REQUIRE(v[h] - v[h - 1] == ulp);
    REQUIRE(v[h | 0x8000] == -v[h]);
  }
}

TEST_CASE("tools.conform: the router linear's cases report each output's bound utilisation",
          "[tools][conform]") {
  RunContext ctx = context();
  ctx.isas = {Isa::scalar};
  std::vector<CaseDef> defs;
  add_layer_cases(defs, ctx.isas);
  std::erase_if(defs, [](const CaseDef& d) { return d.op != "layer.router_linear"; });
  REQUIRE(defs.size() == 2);  // softmax_topk (R = E) and product_key (R = 2n)
  const Report r = run_cases(defs, ctx, "smoke", "scalar");
  for (const auto& c : r.cases) {
    INFO(c.def.id());
    CHECK(c.result.verdict == Verdict::pass);
    REQUIRE(c.result.outputs.size() == 4);  // z, dx, router_w grad, router_b grad
    for (const auto& o : c.result.outputs) CHECK((o.count > 0 && o.max_utilization <= 1));
    CHECK(c.result.max_bound_utilization > 0);
  }
}
