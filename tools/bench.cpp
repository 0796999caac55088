// `moecert bench`: times cases against peers measured in the same run.
#include "bench/bench.hpp"

#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>
#include <unistd.h>

#include <fstream>
#include <regex>

#include "bench/onednn_peer.hpp"
#include "moecert/isa.hpp"
#include "tools/commands.hpp"
#include "tools/environment.hpp"

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

void print_result(const bench::Result& r) {
  if (!r.contracts.empty()) {
    std::string levels;
    for (const auto& c : r.contracts)
      levels += fmt::format("  {} {:.2f} ms ({:+.1f}%)", level_name(c.level), c.median_ms,
                            100 * c.overhead);
    fmt::print("{:<44} {:>6} off {:.2f} ms{}\n", r.name, r.isa.substr(0, 6), r.median_ms, levels);
    return;
  }
  fmt::print("{:<44} {:>6} {:>11.2f} {:>9.3f} {:>11.2f} {:>9.3f} {:>7.2f}x {:>7}  {}\n", r.name,
             r.isa.substr(0, 6), r.median_ms, r.flops / (r.median_ms * 1e9), r.peer_median_ms,
             r.flops / (r.peer_median_ms * 1e9), r.peer_median_ms / r.median_ms,
             r.paired_speedup > 0 ? fmt::format("{:.2f}x", r.paired_speedup) : "-", r.note);
}

}  // namespace

int run_bench(int argc, char** argv) {
  Args args(argc, argv, {"case", "json", "isa", "threads", "reps", "contracts"}, {"list"});
  const auto cases = bench::all_cases();
  if (args.flag("list")) {
    for (const auto& c : cases) fmt::print("{}\n", c.name);
    return 0;
  }
  bench::Options opt;
  opt.threads = static_cast<int>(args.get_int("threads", default_threads()));
  opt.reps = static_cast<int>(args.get_int("reps", 5));
  if (opt.threads < 1 || opt.reps < 1)
    throw std::invalid_argument("--threads and --reps: expected N >= 1");
  opt.contracts = contract_levels(args.all("contracts"));
  opt.isa = default_isa();
  if (auto name = args.get("isa")) {
    const auto isa = parse_isa(*name);
    if (!isa)
      throw std::invalid_argument(fmt::format(
          "--isa {}: unknown, expected scalar, avx512_bf16, amx_bf16 or amx_emu", *name));
    if (!isa_usable(*isa))
      throw std::invalid_argument(fmt::format("--isa {}: not usable on this machine", *name));
    opt.isa = *isa;
  }
  const auto patterns = args.all("case");
  oneapi::tbb::global_control limit(oneapi::tbb::global_control::max_allowed_parallelism,
                                    static_cast<std::size_t>(opt.threads));
  bench::OnednnExperts::set_threads(opt.threads);

  boost::json::array results;
  if (opt.contracts.empty())
    fmt::print("{:<44} {:>6} {:>11} {:>9} {:>11} {:>9} {:>8} {:>7}\n", "case", "isa", "median ms",
               "TFLOP/s", "peer ms", "TFLOP/s", "speedup", "paired");
  else
    fmt::print(
        "{:<44} {:>6} moecert at off, then at each level (median; overhead: median of paired "
        "ratios - 1)\n",
        "case", "isa");
  for (const auto& c : cases) {
    bool selected = patterns.empty();
    for (const auto& p : patterns) selected |= c.name.find(p) != std::string::npos;
    if (!selected) continue;
    bench::Result r;
    if (c.bytes_needed > available_bytes() * 9 / 10) {
      r.name = c.name;
      r.op = c.op;
      r.shape = c.shape;
      r.threads = opt.threads;
      r.skipped = fmt::format("needs about {:.1f} GiB, {:.1f} GiB available",
                              c.bytes_needed / 1073741824.0, available_bytes() / 1073741824.0);
      fmt::print("{:<44} skipped: {}\n", c.name, r.skipped);
    } else {
      r = c.run(opt);
      if (!opt.contracts.empty())
        r.peer.clear(), r.note = "--contracts: moecert at off and at each level; no peer run";
      print_result(r);
    }
    std::fflush(stdout);
    results.push_back(to_json(r));
  }
  if (auto path = args.get("json")) {
    auto env = to_json(environment(opt.threads, std::string(isa_name(opt.isa))));
    env["versions"].as_object()["onednn"] = bench::OnednnExperts::version();
    boost::json::object doc{
        {"schema", "moecert-bench/1"}, {"environment", env}, {"cases", results}};
    std::ofstream(*path) << boost::json::serialize(doc) << "\n";
  }
  return 0;
}

}  // namespace moecert::tools
