// Storage for packed weights and workspaces: 64-byte aligned; blocks of
// 2 MiB or more aligned to 2 MiB and advised as transparent huge pages
// (Linux "madvise" mode, the default on Debian and Ubuntu), before anything
// touches them. A GEMM streaming 1 GB of packed weights then walks a page
// table entry per 2 MiB instead of per 4 KiB. The advice is a hint: where
// the kernel refuses it the memory is the same, in small pages. Under
// guard pages (moecert/memory.hpp), 64-byte aligned against the guard.
#include "moecert/memory.hpp"

#include <algorithm>
#include <cstdlib>
#include <new>

#include "moecert/gemm.hpp"
#include "moecert/types.hpp"
#include "ops/core/aligned.hpp"
#include "ops/core/guard.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace moecert::detail {

void* allocate(std::size_t bytes) {
  check_guard_pages_environment();
  if (guard_pages() != GuardPages::off)
    if (void* p = guard_allocate(bytes, 64)) return p;
  constexpr std::size_t kHuge = std::size_t{2} << 20;
  const std::size_t align = bytes >= kHuge ? kHuge : 64;
  const std::size_t size =
      (std::max<std::size_t>(bytes, 1) + align - 1) / align * align;  // aligned_alloc: a multiple
  void* p = std::aligned_alloc(align, size);
  if (!p) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (align == kHuge) (void)::madvise(p, size, MADV_HUGEPAGE);
#endif
  return p;
}

void deallocate(void* p) noexcept {
  if (!guard_deallocate(p)) std::free(p);
}

void AlignedFree::operator()(bf16* p) const { deallocate(p); }

}  // namespace moecert::detail
