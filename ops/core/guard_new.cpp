// Replacement global operator new and delete for the programs that check
// moecert (tests, fuzz replay, the moecert tool): under guard pages
// (moecert/memory.hpp) every heap block, the caller's inputs and outputs
// and the ops' per-task temporaries included, touches a guard page;
// otherwise malloc. Linked into executables only, never into the library.
#include <algorithm>
#include <cstdlib>
#include <new>

#include "moecert/memory.hpp"
#include "ops/core/guard.hpp"

namespace {

void* allocate(std::size_t n, std::size_t align) {
  if (moecert::guard_pages() != moecert::GuardPages::off)
    if (void* p = moecert::detail::guard_allocate(n, align)) return p;
  const std::size_t size = (std::max<std::size_t>(n, 1) + align - 1) / align * align;
  void* p = align <= __STDCPP_DEFAULT_NEW_ALIGNMENT__ ? std::malloc(size)
                                                      : std::aligned_alloc(align, size);
  if (!p) throw std::bad_alloc();
  return p;
}

void release(void* p) noexcept {
  if (p && !moecert::detail::guard_deallocate(p)) std::free(p);
}

constexpr std::size_t kDefault = __STDCPP_DEFAULT_NEW_ALIGNMENT__;

}  // namespace

void* operator new(std::size_t n) { return allocate(n, kDefault); }
void* operator new[](std::size_t n) { return allocate(n, kDefault); }
void* operator new(std::size_t n, std::align_val_t a) {
  return allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return allocate(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept try {
  return allocate(n, kDefault);
} catch (...) {
  return nullptr;
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept try {
  return allocate(n, kDefault);
} catch (...) {
  return nullptr;
}
void operator delete(void* p) noexcept { release(p); }
void operator delete[](void* p) noexcept { release(p); }
void operator delete(void* p, std::size_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t) noexcept { release(p); }
void operator delete(void* p, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { release(p); }
