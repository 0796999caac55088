// `moecert conform`: runs a suite of cases, then writes the report.
#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <set>

#include "moecert/moecert.hpp"
#include "tools/commands.hpp"
#include "tools/conform/report.hpp"

namespace moecert::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct ConformArgs {
  std::string suite = "default", out = "build/report";
  std::vector<std::string> isas;
  int threads = default_threads();
  std::uint64_t seed = 20261122;
  std::optional<std::string> guard_pages;
};

Suite parse_suite(const std::string& s) {
  if (s == "smoke") return Suite::smoke;
  if (s == "full") return Suite::full;
  return Suite::def;  // the option admits smoke, default and full
}

std::map<std::string, std::uint64_t> checked_counts() {
  std::map<std::string, std::uint64_t> m;
  for (const auto& c : clause_counts()) m[c.id] = c.checked;
  return m;
}

// Progress on stderr: a bar redrawn in place on a terminal, lines otherwise.
class Progress {
 public:
  explicit Progress(std::size_t total) : total_(total), tty_(isatty(STDERR_FILENO)) {}
  void step(std::size_t i, const CaseRecord& c) {
    if (tty_) {
      const int width = 30, done = static_cast<int>(width * (i + 1) / total_);
      fmt::print(stderr, "\r[{:=<{}}{: <{}}] {}/{} {:<60.60}", "", done, "", width - done, i + 1,
                 total_, c.def.id());
      if (i + 1 == total_) fmt::print(stderr, "\n");
    } else {
      fmt::print(stderr, "conform: [{}/{}] {} {} ({:.2f} s)\n", i + 1, total_,
                 verdict_name(c.result.verdict), c.def.id(), c.seconds);
    }
  }

 private:
  std::size_t total_;
  bool tty_;
};

CaseRecord run_case(const CaseDef& def, const RunContext& ctx) {
  CaseRecord rec{def, {}, {}, 0};
  const auto before = checked_counts();
  const auto t0 = Clock::now();
  try {
    ContractScope scope{def.level, Semantic::enforce};
    rec.result = def.run(ctx);
  } catch (const ContractViolation& v) {
    rec.result.verdict = Verdict::fail;
    rec.result.detail = fmt::format("unexpected violation: {}", v.what());
  } catch (const std::exception& e) {
    rec.result.verdict = Verdict::fail;
    rec.result.detail = fmt::format("exception: {}", e.what());
  }
  rec.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  for (const auto& [id, n] : checked_counts()) {
    auto it = before.find(id);
    if (n > (it == before.end() ? 0 : it->second)) rec.clauses_checked.push_back(id);
  }
  return rec;
}

}  // namespace

Report run_cases(const std::vector<CaseDef>& defs, const RunContext& ctx,
                 const std::string& suite_name, const std::string& isa_used) {
  Report report;
  report.env = environment(ctx.threads, isa_used);
  report.suite = suite_name;
  report.seed = ctx.seed;
  reset_clause_counts();
  Progress progress(defs.size());
  const auto t0 = Clock::now();
  for (std::size_t i = 0; i < defs.size(); ++i) {
    report.cases.push_back(run_case(defs[i], ctx));
    progress.step(i, report.cases.back());
  }
  report.seconds = std::chrono::duration<double>(Clock::now() - t0).count();

  std::set<std::string> fired;
  for (const auto& c : report.cases)
    fired.insert(c.result.clauses_fired.begin(), c.result.clauses_fired.end());
  const auto counts = checked_counts();
  for (const auto& info : all_clauses()) {
    auto it = counts.find(std::string(info.id));
    report.clauses.push_back(
        {info, it == counts.end() ? 0 : it->second, fired.count(std::string(info.id)) > 0});
  }
  return report;
}

namespace {

int run_conform(const ConformArgs& a) {
  const std::string& suite_name = a.suite;
  const Suite suite = parse_suite(suite_name);
  const std::string& out = a.out;
  const int threads = a.threads;
  if (const auto& guard = a.guard_pages) {  // from here on: the cases' inputs, outputs and scratch
    GuardPages mode;
    parse_guard_pages(guard->c_str(), mode);  // one of the names the option admits
    set_guard_pages(mode);
  }

  RunContext ctx;
  ctx.threads = threads;
  ctx.seed = a.seed;
  std::string isa_used;
  for (const auto& name : a.isas) {
    const auto isa = parse_isa(name);
    if (!isa)
      throw std::invalid_argument(
          fmt::format("--isa {}: unknown, expected {}", name, isa_name_list()));
    ctx.isas.push_back(*isa);  // kept even if unusable here: its cases are reported as skip
    isa_used += (isa_used.empty() ? "" : ",") + name;
  }
  // Every ISA by default: those this CPU cannot run are reported as skip.
  if (ctx.isas.empty()) ctx.isas.assign(std::begin(kAllIsas), std::end(kAllIsas));

  oneapi::tbb::global_control limit(oneapi::tbb::global_control::max_allowed_parallelism,
                                    static_cast<std::size_t>(threads));
  std::vector<CaseDef> defs;
  add_core_cases(defs);
  add_router_cases(defs);
  add_kernel_cases(defs, ctx.isas);
  add_experts_train_cases(defs, ctx.isas);
  add_format_cases(defs, ctx.isas);
  add_layer_cases(defs, ctx.isas);
  std::erase_if(defs, [&](const CaseDef& d) { return d.suite > suite; });

  const Report report = run_cases(defs, ctx, suite_name, isa_used);
  write_report(report, out);
  fmt::print(
      "conform: {} suite: {} cases, {} passed, {} failed, {} skipped; clauses exercised {}/{}; "
      "report in {}\n",
      suite_name, report.cases.size(), report.passed(), report.failed(), report.skipped(),
      report.clauses_exercised(), report.clauses.size(), out);
  for (const auto& c : report.cases)
    if (c.result.verdict == Verdict::fail)
      fmt::print("conform: FAIL {}: {}\n", c.def.id(), c.result.detail);
  return report.failed() ? 1 : 0;
}

}  // namespace

void add_conform(CLI::App& app, Command& run) {
  auto* sub = app.add_subcommand("conform", "run a conformance suite and write the report");
  auto a = std::make_shared<ConformArgs>();
  sub->add_option("--suite", a->suite, "which cases")
      ->check(CLI::IsMember({"smoke", "default", "full"}))
      ->capture_default_str();
  sub->add_option("--out", a->out, "report folder (report.json, .md, .html, junit.xml)")
      ->capture_default_str();
  sub->add_option("--isa", a->isas, isa_name_list() + " (default: all; unusable ones skip)");
  sub->add_option("--threads", a->threads, "oneTBB threads")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--seed", a->seed, "data seed")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub->add_option("--guard-pages", a->guard_pages,
                  "inaccessible pages after (end) or before (start) every case allocation")
      ->check(CLI::IsMember({"off", "end", "start"}));
  sub->callback([a, &run] { run = [a] { return run_conform(*a); }; });
}

}  // namespace moecert::tools
