// Property, for the `moecert` program's command line (tools/main.cpp's
// subcommands and options, CLI11) on fuzzed arguments, a mix of the real
// option names and values and raw strings: parsing accepts or refuses with a
// CLI11 error; a parsed `plan`, `info` or `check` runs and returns an exit
// status, throws std::invalid_argument (main's exit 2) or a ContractViolation
// naming the clause (a config the contracts refuse) — no crash, no other
// exception. (`conform` and `bench` are parsed, not run: they time.)
#include <fmt/format.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz/decode.hpp"
#include "moecert/contracts.hpp"
#include "tools/commands.hpp"

using namespace moecert;

namespace {

constexpr const char* kName = "cli_fuzzer";

const char* const kWords[] = {"plan",
                              "info",
                              "check",
                              "conform",
                              "bench",
                              "--experts",
                              "--hidden",
                              "--inter",
                              "--topk",
                              "--tokens",
                              "--rank",
                              "--alpha",
                              "--router",
                              "--groups",
                              "--topk-group",
                              "--cap",
                              "--json",
                              "--forward-only",
                              "--inputs",
                              "--outputs",
                              "--param",
                              "--precision",
                              "--out",
                              "--suite",
                              "--seed",
                              "--threads",
                              "--isa",
                              "--reps",
                              "--contracts",
                              "--clause-times",
                              "--case",
                              "--list",
                              "--help",
                              "softmax_topk",
                              "sigmoid_topk",
                              "product_key",
                              "8",
                              "64",
                              "0",
                              "-1",
                              "4294967296",
                              "9223372036854775808",
                              "1e300",
                              "nan",
                              "fp32",
                              "bf16",
                              "mixed",
                              "smoke",
                              "/dev/null",
                              "/nonexistent",
                              "router.softmax_topk.forward",
                              "renormalize=false",
                              "=",
                              ""};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  std::vector<std::string> args{"moecert"};
  for (std::size_t n = d.range(0, 14); n > 0; --n) {
    if ((d.u8() & 3) == 0) {  // a raw string now and then
      std::string s;
      for (std::size_t len = d.range(0, 12); len > 0; --len) s.push_back(static_cast<char>(d.u8()));
      args.push_back(s);
    } else {
      args.emplace_back(kWords[d.u8() % (sizeof kWords / sizeof kWords[0])]);
    }
  }
  CLI::App app{"moecert", "moecert"};
  app.require_subcommand(1);
  tools::Command run;
  tools::add_info(app, run);
  tools::add_conform(app, run);
  tools::add_bench(app, run);
  tools::add_plan(app, run);
  tools::add_check(app, run);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::Error&) {
    return 0;  // a usage error (or --help): main's exit 2 (or 0)
  }
  const std::string cmd = app.get_subcommands().front()->get_name();
  if (cmd == "conform" || cmd == "bench" || !run) return 0;
  std::FILE* out = std::freopen("/dev/null", "w", stdout);  // the reports go nowhere
  (void)out;
  try {
    const int status = run();
    if (status < 0 || status > 3) fuzz::finding(kName, fmt::format("{} exited {}", cmd, status));
  } catch (const std::invalid_argument&) {
    // main's exit 2: a bad value or file
  } catch (const ContractViolation&) {
    // main's exit 3 naming the clause: a config or plan the contracts refuse
  } catch (const std::exception& e) {
    fuzz::finding(kName, fmt::format("{}: {} escaped the command", cmd, e.what()));
  }
  return 0;
}
