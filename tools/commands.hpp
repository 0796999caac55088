// The moecert subcommands. Each `add_*` registers its subcommand, options and
// help with the program's CLI11 app; when that subcommand is parsed, its
// callback stores in `run` the command itself, which returns the exit status.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace moecert::tools {

using Command = std::function<int()>;

void add_info(CLI::App& app, Command& run);
void add_conform(CLI::App& app, Command& run);
void add_bench(CLI::App& app, Command& run);
void add_plan(CLI::App& app, Command& run);
void add_check(CLI::App& app, Command& run);

}  // namespace moecert::tools
