// Writes a conformance report as report.json, report.md, report.html and junit.xml.
#include "tools/conform/report.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>

namespace moecert::tools {

std::string escape_xml(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

namespace {

std::string escape_md(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '|')
      out += "\\|";
    else if (c == '\n')
      out += ' ';
    else
      out += c;
  }
  return out;
}

// The outputs of the cases that compare each one: error and utilisation
// per output (y, dx, each gradient, M_A, M_G).
std::string per_output_md(const Report& r) {
  std::string s =
      "\n## Outputs\n\n| case | output | elements | beyond bound | max abs err | max "
      "rel err | max bound util |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |\n";
  bool any = false;
  for (const auto& c : r.cases)
    for (const auto& o : c.result.outputs) {
      any = true;
      s += fmt::format("| `{}` | {} | {} | {} | {:.3g} | {:.3g} | {:.3g} |\n", c.def.id(), o.name,
                       o.count, o.exceeded, o.max_abs_err, o.max_rel_err, o.max_utilization);
    }
  return any ? s : "";
}

// Per op and ISA: cases, failures and the worst bound utilisation.
struct Cell {
  int cases = 0, failed = 0, skipped = 0;
  double worst = 0;
};
std::map<std::string, std::map<std::string, Cell>> matrix(const Report& r) {
  std::map<std::string, std::map<std::string, Cell>> m;
  for (const auto& c : r.cases) {
    Cell& cell = m[c.def.op][c.def.isa];
    ++cell.cases;
    cell.failed += c.result.verdict == Verdict::fail;
    cell.skipped += c.result.verdict == Verdict::skip;
    if (std::isfinite(c.result.max_bound_utilization))
      cell.worst = std::max(cell.worst, c.result.max_bound_utilization);
    else
      cell.worst = INFINITY;
  }
  return m;
}

std::string matrix_html(const Report& r) {
  const auto m = matrix(r);
  std::vector<std::string> isas;
  for (const auto& [op, row] : m)
    for (const auto& [isa, cell] : row)
      if (std::find(isas.begin(), isas.end(), isa) == isas.end()) isas.push_back(isa);
  std::sort(isas.begin(), isas.end());
  std::string s = "<table><tr><th>op</th>";
  for (const auto& isa : isas) s += "<th>" + escape_xml(isa) + "</th>";
  s += "</tr>";
  for (const auto& [op, row] : m) {
    s += "<tr><td>" + escape_xml(op) + "</td>";
    for (const auto& isa : isas) {
      const auto it = row.find(isa);
      if (it == row.end()) {
        s += "<td></td>";
        continue;
      }
      const Cell& c = it->second;
      const char* cls = c.failed ? "fail" : c.skipped == c.cases ? "skip" : "pass";
      s +=
          fmt::format(R"(<td class="{}">{} case{}{}{}{}</td>)", cls, c.cases,
                      c.cases == 1 ? "" : "s", c.failed ? fmt::format(", {} failed", c.failed) : "",
                      c.skipped ? fmt::format(", {} skipped", c.skipped) : "",
                      c.worst > 0 ? fmt::format("; util {:.3g}", c.worst) : "");
    }
    s += "</tr>";
  }
  return s + "</table>";
}

std::string per_output_html(const Report& r) {
  std::string s =
      "<table><tr><th>case</th><th>output</th><th>elements</th><th>beyond bound</th><th>max abs "
      "err</th><th>max rel err</th><th>max bound util</th></tr>";
  bool any = false;
  for (const auto& c : r.cases)
    for (const auto& o : c.result.outputs) {
      any = true;
      s += fmt::format(
          R"(<tr><td>{}</td><td>{}</td><td>{}</td><td class="{}">{}</td><td>{:.3g}</td><td>{:.3g}</td><td>{:.3g}</td></tr>)",
          escape_xml(c.def.id()), escape_xml(o.name), o.count, o.exceeded ? "fail" : "pass",
          o.exceeded, o.max_abs_err, o.max_rel_err, o.max_utilization);
    }
  return any ? s + "</table>" : "<p>No case in this run compares its outputs one by one.</p>";
}

std::string md(const Report& r) {
  std::string s;
  s += fmt::format("# moecert conformance report ({} suite)\n\n", r.suite);
  s += fmt::format(
      "**{}**: {} cases, {} passed, {} failed, {} skipped; clauses exercised {} of {}; {:.1f} "
      "s\n\n",
      r.failed() ? "FAIL" : "PASS", r.cases.size(), r.passed(), r.failed(), r.skipped(),
      r.clauses_exercised(), r.clauses.size(), r.seconds);
  s += "## Environment\n\n| | |\n| --- | --- |\n";
  const auto& e = r.env;
  s += fmt::format(
      "| CPU | {} ({}) |\n| ISA detected | {} |\n| ISA usable | {} |\n| ISA used | {} |\n",
      e.cpu_model, e.cpu_vendor, fmt::join(e.isa_detected, ", "), fmt::join(e.isa_usable, ", "),
      e.isa_used);
  s += fmt::format(
      "| threads | {} |\n| compiler | {} |\n| flags | `{}` |\n| build | {} |\n| commit | {} |\n",
      e.threads, e.compiler, e.flags, e.build_type, e.git_commit);
  s += fmt::format(
      "| contracts | cap {}, default {} |\n| versions | moecert {}, fmt {}, oneTBB {}, Boost {} "
      "|\n",
      e.contract_cap, e.contract_default, e.moecert_version, e.fmt_version, e.tbb_version,
      e.boost_version);
  s += fmt::format("| seed | {} |\n\n", r.seed);
  if (r.failed()) {
    s += "## Failures\n\n";
    for (const auto& c : r.cases)
      if (c.result.verdict == Verdict::fail)
        s += fmt::format("- `{}`: {}\n", c.def.id(), escape_md(c.result.detail));
    s += "\n";
  }
  s += "## Cases\n\n| verdict | op | variant | isa | shape | data | level | max abs err | max rel "
       "err | max bound util | deterministic | detail |\n";
  s += "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | --- | --- |\n";
  for (const auto& c : r.cases) {
    const auto& d = c.def;
    const auto& x = c.result;
    s +=
        fmt::format("| {} | `{}` | {} | {} | {} | {} | {} | {:.3g} | {:.3g} | {:.3g} | {} | {} |\n",
                    verdict_name(x.verdict), d.op, d.variant, d.isa, d.shape, d.data,
                    level_name(d.level), x.max_abs_err, x.max_rel_err, x.max_bound_utilization,
                    x.deterministic ? "yes" : "NO", escape_md(x.detail));
  }
  s += per_output_md(r);
  s += "\n## Clause coverage\n\n| clause | kind | group | level | checked | violation tested |\n| "
       "--- | --- | --- | --- | ---: | --- |\n";
  for (const auto& c : r.clauses)
    s += fmt::format("| `{}` | {} | {} | {} | {} | {} |\n", c.info.id,
                     clause_kind_name(c.info.kind), group_name(c.info.group),
                     level_name(c.info.level), c.checked, c.violation_tested ? "yes" : "no");
  return s;
}

// One horizontal bar per case: its maximal bound utilisation (1 = at the bound).
std::string utilization_svg(const Report& r) {
  std::vector<const CaseRecord*> rows;
  for (const auto& c : r.cases)
    if (c.result.max_bound_utilization > 0) rows.push_back(&c);
  if (rows.empty()) return "<p>No case in this run compares against a bound yet.</p>";
  const int h = 16, label = 640, width = 300;
  std::string s = fmt::format(R"(<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}">)",
                              label + width + 80, h * static_cast<int>(rows.size()) + 20);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const double u = rows[i]->result.max_bound_utilization;
    const int y = static_cast<int>(i) * h;
    const double w = std::min(u, 1.2) / 1.2 * width;
    s += fmt::format(R"(<text x="0" y="{}" font-size="10">{}</text>)", y + 12,
                     escape_xml(rows[i]->def.id()));
    s += fmt::format(R"(<rect x="{}" y="{}" width="{:.1f}" height="{}" fill="{}"/>)", label, y + 3,
                     w, h - 6, u <= 1 ? "#4a8" : "#c44");
    s += fmt::format(R"(<text x="{:.1f}" y="{}" font-size="11">{:.3g}</text>)", label + w + 4,
                     y + 13, u);
  }
  const double one = label + width / 1.2;
  s += fmt::format(
      R"(<line x1="{0:.1f}" y1="0" x2="{0:.1f}" y2="{1}" stroke="#000" stroke-dasharray="3"/>)",
      one, h * static_cast<int>(rows.size()));
  return s + "</svg>";
}

// Per (op, isa): how many compared elements fell in each utilisation decade.
std::string histogram_svgs(const Report& r) {
  std::map<std::string, compare::UtilizationHistogram> groups;
  for (const auto& c : r.cases) groups[c.def.op + " on " + c.def.isa].merge(c.result.histogram);
  static const char* kLabels[] = {"<1e-6", "1e-6", "1e-5",  "1e-4", "1e-3",
                                  "1e-2",  "1e-1", "0.1-1", ">1"};
  std::string s;
  for (const auto& [name, h] : groups) {
    std::uint64_t total = 0, top = 1;
    for (auto n : h.count) total += n, top = std::max(top, n);
    if (total == 0) continue;
    const int bw = 52, height = 90;
    s += fmt::format(
        R"(<figure style="display:inline-block;margin:6px"><svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}">)",
        bw * compare::UtilizationHistogram::kBins, height + 30);
    for (int i = 0; i < compare::UtilizationHistogram::kBins; ++i) {
      const double frac = std::log1p(double(h.count[i])) / std::log1p(double(top));  // log scale
      const int bh = static_cast<int>(frac * height);
      s += fmt::format(
          R"(<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}: {}</title></rect>)",
          i * bw + 4, height - bh, bw - 8, bh,
          i == compare::UtilizationHistogram::kBins - 1 ? "#c44" : "#48a", kLabels[i], h.count[i]);
      s += fmt::format(R"(<text x="{}" y="{}" font-size="10">{}</text>)", i * bw + 4, height + 12,
                       kLabels[i]);
      s += fmt::format(R"(<text x="{}" y="{}" font-size="9">{}</text>)", i * bw + 4, height + 24,
                       h.count[i]);
    }
    s += fmt::format("</svg><figcaption>{} ({} elements)</figcaption></figure>", escape_xml(name),
                     total);
  }
  return s.empty() ? "<p>No element comparisons in this run.</p>" : s;
}

std::string html(const Report& r) {
  std::string s =
      R"(<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>moecert conformance</title>
<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:2px 6px}.pass{color:#173}.fail{color:#b00;font-weight:bold}.skip{color:#777}</style>
</head><body>)";
  s += fmt::format("<h1>moecert conformance report ({} suite)</h1>", escape_xml(r.suite));
  s += fmt::format(
      R"(<p class="{}">{}: {} cases, {} passed, {} failed, {} skipped; clauses exercised {} of {}</p>)",
      r.failed() ? "fail" : "pass", r.failed() ? "FAIL" : "PASS", r.cases.size(), r.passed(),
      r.failed(), r.skipped(), r.clauses_exercised(), r.clauses.size());
  s += fmt::format(
      "<p>{} &middot; ISA used {} &middot; {} threads &middot; {} {} &middot; commit {}</p>",
      escape_xml(r.env.cpu_model), escape_xml(r.env.isa_used), r.env.threads,
      escape_xml(r.env.compiler), escape_xml(r.env.build_type), escape_xml(r.env.git_commit));
  s += "<h2>Ops by ISA: cases, failures, worst bound utilisation</h2>" + matrix_html(r);
  s += "<h2>Bound utilisation (worst element per case)</h2>" + utilization_svg(r);
  s += "<h2>Error histograms: elements by |err| / bound, per op and ISA (log-scaled bars)</h2>" +
       histogram_svgs(r);
  s += "<h2>Cases</h2><table><tr><th>verdict</th><th>case</th><th>level</th><th>max abs "
       "err</th><th>max bound util</th><th>deterministic</th><th>detail</th></tr>";
  for (const auto& c : r.cases) {
    const auto v = verdict_name(c.result.verdict);
    s += fmt::format(
        R"(<tr><td class="{0}">{0}</td><td>{1}</td><td>{2}</td><td>{3:.3g}</td><td>{4:.3g}</td><td>{5}</td><td>{6}</td></tr>)",
        v, escape_xml(c.def.id()), level_name(c.def.level), c.result.max_abs_err,
        c.result.max_bound_utilization, c.result.deterministic ? "yes" : "NO",
        escape_xml(c.result.detail));
  }
  s += "</table><h2>Outputs: error and bound utilisation of each</h2>" + per_output_html(r);
  s += "<h2>Clauses</h2><table><tr><th>clause</th><th>kind</th><th>group</th><th>checked</"
       "th><th>violation tested</th></tr>";
  for (const auto& c : r.clauses)
    s += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", c.info.id,
                     clause_kind_name(c.info.kind), group_name(c.info.group), c.checked,
                     c.violation_tested ? "yes" : "no");
  return s + "</table></body></html>\n";
}

std::string junit(const Report& r) {
  std::string s = R"(<?xml version="1.0" encoding="UTF-8"?>)"
                  "\n";
  s += fmt::format(
      R"(<testsuites name="moecert" tests="{}" failures="{}" skipped="{}" time="{:.3f}">)",
      r.cases.size(), r.failed(), r.skipped(), r.seconds);
  s += fmt::format(
      R"(<testsuite name="moecert.conform.{}" tests="{}" failures="{}" skipped="{}" time="{:.3f}">)",
      escape_xml(r.suite), r.cases.size(), r.failed(), r.skipped(), r.seconds);
  for (const auto& c : r.cases) {
    s += fmt::format(R"(<testcase classname="{}" name="{}" time="{:.3f}">)", escape_xml(c.def.op),
                     escape_xml(c.def.id()), c.seconds);
    if (c.result.verdict == Verdict::fail)
      s += fmt::format(R"(<failure message="{}"/>)", escape_xml(c.result.detail));
    else if (c.result.verdict == Verdict::skip)
      s += fmt::format(R"(<skipped message="{}"/>)", escape_xml(c.result.detail));
    s += "</testcase>";
  }
  return s + "</testsuite></testsuites>\n";
}

}  // namespace

std::string_view verdict_name(Verdict v) {
  switch (v) {
    case Verdict::pass:
      return "pass";
    case Verdict::fail:
      return "fail";
    case Verdict::skip:
      return "skip";
  }
  return "?";
}

int Report::passed() const {
  return static_cast<int>(std::count_if(cases.begin(), cases.end(),
                                        [](auto& c) { return c.result.verdict == Verdict::pass; }));
}
int Report::failed() const {
  return static_cast<int>(std::count_if(cases.begin(), cases.end(),
                                        [](auto& c) { return c.result.verdict == Verdict::fail; }));
}
int Report::skipped() const {
  return static_cast<int>(std::count_if(cases.begin(), cases.end(),
                                        [](auto& c) { return c.result.verdict == Verdict::skip; }));
}
int Report::clauses_exercised() const {
  return static_cast<int>(
      std::count_if(clauses.begin(), clauses.end(), [](auto& c) { return c.checked > 0; }));
}

namespace {

boost::json::array outputs_json(const CaseResult& x) {
  namespace json = boost::json;
  auto finite = [](double v) -> json::value {
    return std::isfinite(v) ? json::value(v) : json::value(nullptr);
  };
  json::array out;
  for (const auto& o : x.outputs)
    out.push_back(json::object{{"name", o.name},
                               {"count", o.count},
                               {"exceeded", o.exceeded},
                               {"max_abs_err", finite(o.max_abs_err)},
                               {"max_rel_err", finite(o.max_rel_err)},
                               {"max_bound_utilization", finite(o.max_utilization)}});
  return out;
}

}  // namespace

boost::json::object to_json(const Report& r) {
  namespace json = boost::json;
  json::array cases;
  for (const auto& c : r.cases) {
    const auto& x = c.result;
    auto finite = [](double v) -> json::value {
      return std::isfinite(v) ? json::value(v) : json::value(nullptr);
    };
    cases.push_back(json::object{
        {"id", c.def.id()},
        {"op", c.def.op},
        {"variant", c.def.variant},
        {"isa", c.def.isa},
        {"shape", c.def.shape},
        {"data", c.def.data},
        {"level", level_name(c.def.level)},
        {"max_abs_err", finite(x.max_abs_err)},
        {"max_rel_err", finite(x.max_rel_err)},
        {"max_bound_utilization", finite(x.max_bound_utilization)},
        {"worst", x.worst},
        {"deterministic", x.deterministic},
        {"digest", x.digest},
        {"verdict", verdict_name(x.verdict)},
        {"detail", x.detail},
        {"seconds", c.seconds},
        {"clauses_checked", json::array(c.clauses_checked.begin(), c.clauses_checked.end())},
        {"clauses_fired", json::array(x.clauses_fired.begin(), x.clauses_fired.end())},
        {"utilization_histogram",
         json::array(std::begin(x.histogram.count), std::end(x.histogram.count))},
        {"outputs", outputs_json(x)}});
  }
  json::array clauses;
  for (const auto& c : r.clauses)
    clauses.push_back(json::object{{"id", c.info.id},
                                   {"kind", clause_kind_name(c.info.kind)},
                                   {"group", group_name(c.info.group)},
                                   {"level", level_name(c.info.level)},
                                   {"checked", c.checked},
                                   {"violation_tested", c.violation_tested}});
  return {{"schema", "moecert-conformance/1"},
          {"suite", r.suite},
          {"seed", r.seed},
          {"environment", to_json(r.env)},
          {"summary",
           {{"cases", r.cases.size()},
            {"passed", r.passed()},
            {"failed", r.failed()},
            {"skipped", r.skipped()},
            {"clauses_total", r.clauses.size()},
            {"clauses_exercised", r.clauses_exercised()},
            {"seconds", r.seconds}}},
          {"cases", cases},
          {"clauses", clauses}};
}

void write_file(const std::filesystem::path& p, const std::string& text) {
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  if (ec) throw std::invalid_argument(fmt::format("cannot write {}: {}", p.string(), ec.message()));
  errno = 0;
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
  f.close();  // a full disk shows here, when the buffer is written
  if (!f)
    throw std::invalid_argument(fmt::format("cannot write {}: {}", p.string(),
                                            errno ? std::strerror(errno) : "write failed"));
}

void write_report(const Report& r, const std::filesystem::path& dir) {
  write_file(dir / "report.json", boost::json::serialize(to_json(r)) + "\n");
  write_file(dir / "report.md", md(r));
  write_file(dir / "report.html", html(r));
  write_file(dir / "junit.xml", junit(r));
}

}  // namespace moecert::tools
