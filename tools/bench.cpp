// `moecert bench`: times cases against peers measured in the same run.
#include "bench/bench.hpp"

#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>
#include <unistd.h>

#include <fstream>
#include <optional>
#include <regex>
#include <string>
#include <utility>

#include "bench/onednn_peer.hpp"
#include "moecert/isa.hpp"
#include "tools/commands.hpp"
#include "tools/conform/environment.hpp"

namespace moecert::tools {
namespace {

std::size_t available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  std::size_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

// {id: ms per call}, costliest first.
boost::json::object clause_times(const std::vector<bench::ClauseTime>& clauses) {
  boost::json::object o;
  for (const auto& c : clauses) o[c.id] = c.ms_per_call;
  return o;
}

boost::json::object to_json(const bench::Result& r) {
  const double speedup = r.median_ms > 0 ? r.peer_median_ms / r.median_ms : 0;
  boost::json::object o{
      {"name", r.name},
      {"op", r.op},
      {"shape",
       {{"E", r.shape.e},
        {"H", r.shape.h},
        {"I", r.shape.i},
        {"K", r.shape.k},
        {"r", r.shape.r},
        {"T", r.shape.t}}},
      {"isa", r.isa},
      {"threads", r.threads},
      {"median_ms", r.median_ms},
      {"tflops", r.median_ms > 0 ? r.flops / (r.median_ms * 1e9) : 0.0},
      {"peer", r.peer},
      {"peer_median_ms", r.peer_median_ms},
      {"peer_tflops", r.peer_median_ms > 0 ? r.flops / (r.peer_median_ms * 1e9) : 0.0},
      {"speedup_vs_peer", speedup},
      {"runs_ms", boost::json::array(r.ms.begin(), r.ms.end())},
      {"peer_runs_ms", boost::json::array(r.peer_ms.begin(), r.peer_ms.end())},
      {"note", r.note}};
  if (r.paired_speedup > 0)
    o["paired_speedup"] = r.paired_speedup;  // a live peer, run in alternation
  if (r.recorded_peer_ms > 0)
    o["recorded_peer"] = {{"name", r.recorded_peer},
                          {"median_ms", r.recorded_peer_ms},
                          {"speedup", r.median_ms > 0 ? r.recorded_peer_ms / r.median_ms : 0.0}};
  if (!r.skipped.empty()) o["skipped"] = r.skipped;
  if (!r.contracts.empty()) {
    boost::json::array levels;
    for (const auto& c : r.contracts)
      levels.push_back({{"level", level_name(c.level)},
                        {"median_ms", c.median_ms},
                        {"overhead", c.overhead},
                        {"clause_ms_per_call", clause_times(c.clauses)},
                        {"runs_ms", boost::json::array(c.ms.begin(), c.ms.end())}});
    o["contracts"] = std::move(levels);  // median_ms and runs_ms above: moecert at off
  }
  return o;
}

// --contracts LEVEL...: check, audit or full (each timed against off).
std::vector<Level> contract_levels(const std::vector<std::string>& names) {
  std::vector<Level> out;
  for (const auto& n : names) {
    const auto level = parse_level(n);
    if (!level || *level == Level::off)
      throw std::invalid_argument(fmt::format("--contracts {}: expected check, audit or full", n));
    out.push_back(*level);
  }
  return out;
}

// Under a contract line, each level's costliest clauses (ms per op call).
void print_clause_times(const bench::ContractRuns& c, std::size_t top) {
  std::string line;
  for (std::size_t i = 0; i < std::min(top, c.clauses.size()); ++i)
    line += fmt::format("{}{} {:.3f}", i ? ", " : "", c.clauses[i].id, c.clauses[i].ms_per_call);
  fmt::print("    {} clauses, ms per call: {}\n", level_name(c.level), line);
}

void print_result(const bench::Result& r, std::size_t clause_times) {
  if (!r.contracts.empty()) {
    std::string levels;
    for (const auto& c : r.contracts)
      levels += fmt::format("  {} {:.2f} ms ({:+.1f}%)", level_name(c.level), c.median_ms,
                            100 * c.overhead);
    fmt::print("{:<44} {:>6} off {:.2f} ms{}\n", r.name, r.isa.substr(0, 6), r.median_ms, levels);
    for (const auto& c : r.contracts)
      if (clause_times) print_clause_times(c, clause_times);
    return;
  }
  fmt::print("{:<44} {:>6} {:>11.2f} {:>9.3f} {:>11.2f} {:>9.3f} {:>7.2f}x {:>7}  {}\n", r.name,
             r.isa.substr(0, 6), r.median_ms, r.flops / (r.median_ms * 1e9), r.peer_median_ms,
             r.flops / (r.peer_median_ms * 1e9), r.peer_median_ms / r.median_ms,
             r.paired_speedup > 0 ? fmt::format("{:.2f}x", r.paired_speedup) : "-", r.note);
}

struct BenchArgs {
  std::vector<std::string> cases, contracts;
  std::optional<std::string> json, isa;
  int threads = default_threads(), reps = 5;
  std::size_t clause_times = 0;
  bool list = false;
};

bench::Options options(const BenchArgs& a) {
  bench::Options opt;
  opt.threads = a.threads;
  opt.reps = a.reps;
  opt.contracts = contract_levels(a.contracts);
  opt.isa = default_isa();
  if (a.isa) {
    const auto isa = parse_isa(*a.isa);
    if (!isa)
      throw std::invalid_argument(
          fmt::format("--isa {}: unknown, expected {}", *a.isa, isa_name_list()));
    if (!isa_usable(*isa))
      throw std::invalid_argument(fmt::format("--isa {}: not usable on this machine", *a.isa));
    opt.isa = *isa;
  }
  return opt;
}

void print_header(const bench::Options& opt) {
  if (opt.contracts.empty())
    fmt::print("{:<44} {:>6} {:>11} {:>9} {:>11} {:>9} {:>8} {:>7}\n", "case", "isa", "median ms",
               "TFLOP/s", "peer ms", "TFLOP/s", "speedup", "paired");
  else
    fmt::print(
        "{:<44} {:>6} moecert at off, then at each level (median; overhead: median of paired "
        "ratios - 1)\n",
        "case", "isa");
}

// A case not run, with the reason printed and kept in its JSON record.
bench::Result skipped_case(const bench::Case& c, const bench::Options& opt, std::string reason) {
  bench::Result r;
  r.name = c.name;
  r.op = c.op;
  r.shape = c.shape;
  r.threads = opt.threads;
  r.skipped = std::move(reason);
  fmt::print("{:<44} skipped: {}\n", c.name, r.skipped);
  std::fflush(stdout);
  return r;
}

bench::Result run_case(const bench::Case& c, const bench::Options& opt, std::size_t clause_times) {
  if (c.bytes_needed > available_bytes() * 9 / 10)
    return skipped_case(
        c, opt,
        fmt::format("needs about {:.1f} GiB, {:.1f} GiB available", c.bytes_needed / 1073741824.0,
                    available_bytes() / 1073741824.0));
  bench::Result r;
  try {
    r = c.run(opt);
  } catch (const bench::PeerUnavailable& e) {
    return skipped_case(c, opt, fmt::format("peer: {}", e.what()));
  }
  if (!opt.contracts.empty())
    r.peer.clear(), r.note = "--contracts: moecert at off and at each level; no peer run";
  print_result(r, clause_times);
  std::fflush(stdout);
  return r;
}

int run_bench(const BenchArgs& a) {
  const auto cases = bench::all_cases();
  if (a.list) {
    for (const auto& c : cases) fmt::print("{}\n", c.name);
    return 0;
  }
  const bench::Options opt = options(a);
  oneapi::tbb::global_control limit(oneapi::tbb::global_control::max_allowed_parallelism,
                                    static_cast<std::size_t>(opt.threads));
  bench::OnednnExperts::set_threads(opt.threads);

  boost::json::array results;
  print_header(opt);
  for (const auto& c : cases) {
    bool selected = a.cases.empty();
    for (const auto& p : a.cases) selected |= c.name.find(p) != std::string::npos;
    if (selected) results.push_back(to_json(run_case(c, opt, a.clause_times)));
  }
  if (const auto& path = a.json) {
    auto env = to_json(environment(opt.threads, std::string(isa_name(opt.isa))));
    env["versions"].as_object()["onednn"] = bench::OnednnExperts::version();
    boost::json::object doc{
        {"schema", "moecert-bench/1"}, {"environment", env}, {"cases", results}};
    write_file(*path, boost::json::serialize(doc) + "\n");
  }
  return 0;
}

}  // namespace

void add_bench(CLI::App& app, Command& run) {
  auto* sub = app.add_subcommand("bench", "time cases against peers measured in the same run");
  auto a = std::make_shared<BenchArgs>();
  sub->add_option("--case", a->cases, "cases whose name contains one of these (default: all)");
  sub->add_option("--json", a->json, "also write the results (schema moecert-bench/1) here");
  sub->add_option("--isa", a->isa, isa_name_list() + " (default: best)");
  sub->add_option("--threads", a->threads, "oneTBB threads")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--reps", a->reps, "timed repetitions per case and side")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--contracts", a->contracts,
                  "check, audit or full: time moecert at off and at each level, alternating");
  sub->add_option("--clause-times", a->clause_times,
                  "with --contracts: print each level's N costliest clauses (ms per op call)")
      ->check(CLI::NonNegativeNumber);
  sub->add_flag("--list", a->list, "print the case names and stop");
  sub->callback([a, &run] { run = [a] { return run_bench(*a); }; });
}

}  // namespace moecert::tools
