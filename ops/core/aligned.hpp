// Storage of packed weights and workspaces: 64-byte aligned; 2 MiB or more:
// 2 MiB aligned and advised as huge pages (memory.cpp).
#pragma once

#include <cstddef>

namespace moecert::detail {

void* allocate(std::size_t bytes);
void deallocate(void* p) noexcept;

}  // namespace moecert::detail
