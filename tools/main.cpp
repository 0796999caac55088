// moecert: the command-line program (info, conform, bench, plan, check).
#include <fmt/format.h>

#include <exception>
#include <string>

#include "moecert/memory.hpp"
#include "tools/commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"moecert: contract-checked Mixture-of-Experts operators for CPUs", "moecert"};
  app.require_subcommand(1);
  moecert::tools::Command run;
  moecert::tools::add_info(app, run);
  moecert::tools::add_conform(app, run);
  moecert::tools::add_bench(app, run);
  moecert::tools::add_plan(app, run);
  moecert::tools::add_check(app, run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help: 0; a usage error: 2, as for a bad value below
  }
  const std::string cmd = app.get_subcommands().front()->get_name();
  try {
    moecert::check_guard_pages_environment();
    return run();
  } catch (const std::invalid_argument& e) {
    fmt::print(stderr, "moecert {}: {}\n", cmd, e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "moecert {}: error: {}\n", cmd, e.what());
    return 3;
  }
}
