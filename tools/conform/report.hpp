// The conformance report: one model, four files (JSON, Markdown, HTML, JUnit).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "tools/conform/case.hpp"
#include "tools/conform/environment.hpp"

namespace moecert::tools {

struct ClauseCoverage {
  ClauseInfo info;
  std::uint64_t checked = 0;
  bool violation_tested = false;
};

struct Report {
  Environment env;
  std::string suite;
  std::uint64_t seed = 0;
  std::vector<CaseRecord> cases;
  std::vector<ClauseCoverage> clauses;
  double seconds = 0;

  int passed() const;
  int failed() const;
  int skipped() const;
  int clauses_exercised() const;  // checked at least once
};

std::string_view verdict_name(Verdict v);

/// Runs every case in order (progress on stderr) and assembles the report,
/// clause coverage included.
Report run_cases(const std::vector<CaseDef>& defs, const RunContext& ctx,
                 const std::string& suite_name, const std::string& isa_used);

/// Schema moecert-conformance/1 (docs/report-schema.md).
boost::json::object to_json(const Report& r);
void write_report(const Report& r, const std::filesystem::path& dir);

/// s with &, <, >, " and ' as XML entities (for junit.xml and report.html).
std::string escape_xml(std::string_view s);

}  // namespace moecert::tools
