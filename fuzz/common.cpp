// Shared by every harness: how a finding is reported.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz/decode.hpp"

namespace moecert::fuzz {

void finding(const char* harness, const std::string& what) {
  std::fprintf(stderr, "moecert fuzz finding in %s: %s\n", harness, what.c_str());
  std::abort();
}

}  // namespace moecert::fuzz
