// Build facts, and library versions. The commit is taken at build time
// (cmake/git_commit.cmake), marked -dirty when tracked files had changes.
#include <fmt/format.h>
#include <oneapi/tbb/version.h>

#include <boost/version.hpp>

#include "moecert/moecert.hpp"

#ifndef MOECERT_VERSION
#define MOECERT_VERSION "unknown"
#endif
#ifndef MOECERT_BUILD_TYPE
#define MOECERT_BUILD_TYPE "unknown"
#endif
#ifndef MOECERT_CXX_FLAGS
#define MOECERT_CXX_FLAGS ""
#endif
#if __has_include("git_commit.inc")
#include "git_commit.inc"
#endif
#ifndef MOECERT_GIT_COMMIT
#define MOECERT_GIT_COMMIT "unknown"
#endif

namespace moecert {

const BuildInfo& build_info() {
  static const BuildInfo info = [] {
    BuildInfo b;
    b.version = MOECERT_VERSION;
    b.build_type = MOECERT_BUILD_TYPE;
#if defined(__clang__)
    b.compiler =
        fmt::format("clang {}.{}.{}", __clang_major__, __clang_minor__, __clang_patchlevel__);
#elif defined(__GNUC__)
    b.compiler = fmt::format("g++ {}.{}.{}", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__);
#else
    b.compiler = "unknown";
#endif
    b.flags = MOECERT_CXX_FLAGS;
    b.git_commit = MOECERT_GIT_COMMIT;
    b.contract_cap = contract_level_cap();
    b.contract_default = contract_default_level();
    b.fmt_version =
        fmt::format("{}.{}.{}", FMT_VERSION / 10000, FMT_VERSION / 100 % 100, FMT_VERSION % 100);
    b.tbb_version = TBB_runtime_version();
    b.boost_version = fmt::format("{}.{}.{}", BOOST_VERSION / 100000, BOOST_VERSION / 100 % 1000,
                                  BOOST_VERSION % 100);
    return b;
  }();
  return info;
}

}  // namespace moecert
