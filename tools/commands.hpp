// The moecert subcommands; each takes the arguments after its name.
#pragma once

#include "tools/cli.hpp"

namespace moecert::tools {

int run_info(int argc, char** argv);
int run_conform(int argc, char** argv);
int run_bench(int argc, char** argv);
int run_plan(int argc, char** argv);

}  // namespace moecert::tools
