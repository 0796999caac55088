// Shared by every harness: how a finding is reported.
#include <cstdio>
#include <cstdlib>
#include <string>

#include <memory>

#include <oneapi/tbb/global_control.h>

#include "fuzz/decode.hpp"

namespace moecert::fuzz {

namespace {
// MOECERT_FUZZ_THREADS=N caps oneTBB's threads per process (campaigns that
// run one fuzzing process per core want 1).
const auto thread_cap = [] {
  const char* env = std::getenv("MOECERT_FUZZ_THREADS");
  const long n = env ? std::strtol(env, nullptr, 10) : 0;
  return n > 0 ? std::make_unique<oneapi::tbb::global_control>(oneapi::tbb::global_control::max_allowed_parallelism,
                                                               static_cast<std::size_t>(n))
               : nullptr;
}();
}  // namespace

void finding(const char* harness, const std::string& what) {
  std::fprintf(stderr, "moecert fuzz finding in %s: %s\n", harness, what.c_str());
  std::abort();
}

}  // namespace moecert::fuzz
