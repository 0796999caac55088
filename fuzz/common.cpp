// Shared by every harness: how a finding is reported.
#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "fuzz/decode.hpp"

namespace moecert::fuzz {

namespace {
// MOECERT_FUZZ_THREADS=N caps oneTBB's threads per process (campaigns that
// run one fuzzing process per core want 1).
const auto thread_cap = [] {
  const char* env = std::getenv("MOECERT_FUZZ_THREADS");
  const long n = env ? std::strtol(env, nullptr, 10) : 0;
  return n > 0 ? std::make_unique<oneapi::tbb::global_control>(
                     oneapi::tbb::global_control::max_allowed_parallelism,
                     static_cast<std::size_t>(n))
               : nullptr;
}();
}  // namespace

void finding(const char* harness, const std::string& what) {
  std::fprintf(stderr, "moecert fuzz finding in %s: %s\n", harness, what.c_str());
  std::abort();
}

void expect_same_bits(const char* harness, const Outcome& hw, const Outcome& emu) {
  if (hw.clause != emu.clause)
    finding(harness, fmt::format("amx_bf16 and amx_emu disagree: violated '{}' / '{}'", hw.clause,
                                 emu.clause));
  if (hw.out.size() != emu.out.size())
    finding(harness, fmt::format("amx_bf16 and amx_emu outputs of {} / {} values", hw.out.size(),
                                 emu.out.size()));
  for (std::size_t i = 0; i < hw.out.size(); ++i) {
    std::uint32_t a, b;
    std::memcpy(&a, &hw.out[i], 4);
    std::memcpy(&b, &emu.out[i], 4);
    if (a != b &&
        !(std::isnan(hw.out[i]) && std::isnan(emu.out[i])))  // a NaN's payload is not modelled
      finding(harness,
              fmt::format("amx_bf16 and amx_emu differ at output {}: {:#010x} ({}) / {:#010x} ({})",
                          i, a, hw.out[i], b, emu.out[i]));
  }
}

}  // namespace moecert::fuzz
