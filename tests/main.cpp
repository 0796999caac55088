// The Catch2 main of every test program: MOECERT_TEST_THREADS=N bounds
// oneTBB to N threads for the whole run (scripts/stress.sh runs the tests
// at 1, 2, 3 and 7), else oneTBB's default.
#define CATCH_CONFIG_RUNNER
#include <oneapi/tbb/global_control.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <memory>

int main(int argc, char** argv) {
  std::unique_ptr<oneapi::tbb::global_control> limit;
  if (const char* env = std::getenv("MOECERT_TEST_THREADS"); env && std::atoi(env) > 0)
    limit = std::make_unique<oneapi::tbb::global_control>(
        oneapi::tbb::global_control::max_allowed_parallelism,
        static_cast<std::size_t>(std::atoi(env)));
  return Catch::Session().run(argc, argv);
}
