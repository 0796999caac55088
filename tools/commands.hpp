// The moecert subcommands. Each `add_*` registers its subcommand, options and
// help with the program's CLI11 app; when that subcommand is parsed, its
// callback stores in `run` the command itself, which returns the exit status.
#pragma once

#include <CLI/CLI.hpp>
#include <filesystem>
#include <functional>
#include <string>

namespace moecert::tools {

using Command = std::function<int()>;

void add_info(CLI::App& app, Command& run);
void add_conform(CLI::App& app, Command& run);
void add_bench(CLI::App& app, Command& run);
void add_plan(CLI::App& app, Command& run);
void add_check(CLI::App& app, Command& run);

/// Writes `text` to `path` (replacing it), creating its folder; a folder or
/// file that cannot be written (read-only, full, a directory in the way) is
/// std::invalid_argument naming the path and the system's reason (exit 2).
void write_file(const std::filesystem::path& path, const std::string& text);

}  // namespace moecert::tools
