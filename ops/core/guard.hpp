// Allocation against a guard page (include/moecert/memory.hpp's modes), for
// the library's buffers (memory.cpp) and the replacement operator new.
#pragma once

#include <cstddef>

namespace moecert::detail {

/// `bytes` at `align` (a power of two up to 4096) against a guard page in
/// the current mode (which must not be off); nullptr if the guarded region
/// is exhausted or the system refuses (the caller falls back).
void* guard_allocate(std::size_t bytes, std::size_t align) noexcept;
/// Frees p if guard_allocate made it and returns true; false otherwise.
bool guard_deallocate(void* p) noexcept;

}  // namespace moecert::detail
