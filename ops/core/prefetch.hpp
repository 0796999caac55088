// Software prefetch of whole rows, for loops that read rows scattered by
// the routing (a token's expert rows, an expert's token rows): each row
// lies on its own pages, which the hardware prefetchers do not cross, so
// the next row is requested while the current one is summed or copied.
#pragma once

#include <cstddef>

namespace moecert::detail {

/// Every 64-byte line of [p, p + bytes) into the caches (a hint: no fault, no effect on results).
inline void prefetch_lines(const void* p, std::size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (std::size_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

}  // namespace moecert::detail
