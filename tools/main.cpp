// moecert: the command-line program (info, conform, bench, plan).
#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <string_view>

#include "tools/commands.hpp"

namespace {

constexpr const char* kUsage =
    "usage: moecert COMMAND [OPTIONS]\n"
    "commands:\n"
    "  info [--json]                          CPU, ISA levels, build, contracts, versions\n"
    "  conform [--suite smoke|default|full] [--out DIR] [--isa NAME...] [--threads N] [--seed S]\n"
    "          [--guard-pages end|start]\n"
    "                                         run a conformance suite and write the report\n"
    "  bench [--case NAME...] [--json FILE] [--isa NAME] [--threads N] [--reps N] [--list]\n"
    "                                         time cases against oneDNN in the same run\n"
    "  plan --experts E --hidden H --inter I --topk K --tokens T [--rank R] [--alpha A]\n"
    "       [--router KIND] [--groups G] [--topk-group N] [--cap BYTES] [--forward-only] [--json]\n"
    "                                         print the workspace plan of a layer call\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string_view cmd = argv[1];
  try {
    if (cmd == "info") return moecert::tools::run_info(argc - 2, argv + 2);
    if (cmd == "conform") return moecert::tools::run_conform(argc - 2, argv + 2);
    if (cmd == "bench") return moecert::tools::run_bench(argc - 2, argv + 2);
    if (cmd == "plan") return moecert::tools::run_plan(argc - 2, argv + 2);
    if (cmd == "--help" || cmd == "-h" || cmd == "help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    fmt::print(stderr, "moecert: unknown command '{}'\n{}", cmd, kUsage);
    return 2;
  } catch (const std::invalid_argument& e) {
    fmt::print(stderr, "moecert {}: {}\n", cmd, e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "moecert {}: error: {}\n", cmd, e.what());
    return 3;
  }
}
