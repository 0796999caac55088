// The whole public API of moecert.
#pragma once

#include "moecert/config.hpp"
#include "moecert/contracts.hpp"
#include "moecert/experts.hpp"
#include "moecert/gemm.hpp"
#include "moecert/isa.hpp"
#include "moecert/layer.hpp"
#include "moecert/memory.hpp"
#include "moecert/router.hpp"
#include "moecert/types.hpp"
#include "moecert/workspace.hpp"

namespace moecert {

/// How this library was built, for `moecert info` and report fingerprints.
struct BuildInfo {
  std::string version;     // moecert's, e.g. "0.1.0"
  std::string build_type;  // CMAKE_BUILD_TYPE
  std::string compiler;    // id and version
  std::string flags;       // CMAKE_CXX_FLAGS + the build type's flags
  std::string git_commit;  // at build time, "-dirty" if tracked files had changes; or "unknown"
  Level contract_cap = Level::full;
  Level contract_default = Level::off;
  std::string fmt_version;
  std::string tbb_version;  // runtime version of the loaded oneTBB
  std::string boost_version;
};

const BuildInfo& build_info();

}  // namespace moecert
