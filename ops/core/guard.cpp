// Guard-page allocation (moecert/memory.hpp): blocks carved from one
// reserved, inaccessible address range, each made accessible on its own
// pages, with an inaccessible page after it (mode end) or before it (start).
// Addresses are handed out once, in order, and never reused; a freed block's
// pages are replaced by fresh inaccessible ones (memory returned).
#include "ops/core/guard.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "moecert/memory.hpp"

namespace moecert {
namespace {

constexpr std::size_t kPage = 4096;
// Address space reserved for guarded blocks (no memory: PROT_NONE,
// MAP_NORESERVE): 1 TiB, at 2 pages or more a block hundreds of millions of
// blocks; less where the address space is smaller (ThreadSanitizer's is).
constexpr std::size_t kRegionSizes[] = {std::size_t{1} << 40, std::size_t{1} << 36,
                                        std::size_t{1} << 32};

// MOECERT_GUARD_PAGES when it does not parse (then the mode is off), else
// null: check_guard_pages_environment() reports it (a test mode silently
// off would pass for tested; aborting in operator new would crash the
// caller).
const char* g_bad_environment = nullptr;

std::atomic<GuardPages>& mode_ref() {
  static std::atomic<GuardPages> mode{[] {
    GuardPages m = GuardPages::off;
    const char* env = std::getenv("MOECERT_GUARD_PAGES");
    if (env && *env && !parse_guard_pages(env, m)) g_bad_environment = env, m = GuardPages::off;
    return m;
  }()};
  return mode;
}

// The reserved range; its page count per block start (the accessible pages
// of a block, indexed by the page of its first byte), in a second reserved
// range that only the pages in use occupy.
struct Region {
  std::uintptr_t base = 0;
  std::size_t bytes = 0;
  std::uint32_t* pages = nullptr;
  std::atomic<std::size_t> next{0};
};

void* reserve(std::size_t bytes, int prot) {
  return ::mmap(nullptr, bytes, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
}

Region* region() {
  static Region* r = []() -> Region* {
    static Region reg;
    for (std::size_t bytes : kRegionSizes) {
      void* base = reserve(bytes, PROT_NONE);
      if (base == MAP_FAILED) continue;
      void* meta = reserve(bytes / kPage * sizeof(std::uint32_t), PROT_READ | PROT_WRITE);
      if (meta == MAP_FAILED) {
        ::munmap(base, bytes);
        continue;
      }
      reg.base = reinterpret_cast<std::uintptr_t>(base);
      reg.bytes = bytes;
      reg.pages = static_cast<std::uint32_t*>(meta);
      return &reg;
    }
    return nullptr;
  }();
  return r;
}

std::atomic<Region*> g_region{nullptr};  // set once a block was handed out

}  // namespace

bool parse_guard_pages(const char* text, GuardPages& out) {
  if (!text) return false;
  if (!std::strcmp(text, "off"))
    out = GuardPages::off;
  else if (!std::strcmp(text, "end"))
    out = GuardPages::end;
  else if (!std::strcmp(text, "start"))
    out = GuardPages::start;
  else
    return false;
  return true;
}

void set_guard_pages(GuardPages mode) { mode_ref().store(mode, std::memory_order_relaxed); }
GuardPages guard_pages() { return mode_ref().load(std::memory_order_relaxed); }

void check_guard_pages_environment() {
  mode_ref();
  if (g_bad_environment)
    throw std::invalid_argument(std::string("MOECERT_GUARD_PAGES=") + g_bad_environment +
                                ": expected off, end or start");
}

namespace detail {

namespace {
// nullptr, and once per process a line on stderr: the caller falls back to
// ordinary storage, which a run under guard pages should know.
void* refused(const char* why) noexcept {
  static std::atomic<bool> told{false};
  if (!told.exchange(true))
    std::fprintf(stderr, "moecert: guard pages: %s; ordinary storage from here\n", why);
  return nullptr;
}
}  // namespace

void* guard_allocate(std::size_t bytes, std::size_t align) noexcept {
  const GuardPages mode = guard_pages();
  if (mode == GuardPages::off || align == 0 || align > kPage) return nullptr;
  Region* r = region();
  if (!r) return refused("no address range could be reserved");
  g_region.store(r, std::memory_order_release);
  const std::size_t size = (std::max<std::size_t>(bytes, 1) + align - 1) / align * align;
  const std::size_t pages = (size + kPage - 1) / kPage;
  const std::size_t span = (pages + 1) * kPage;  // the block's pages and one guard page
  const std::size_t at = r->next.fetch_add(span, std::memory_order_relaxed);
  if (at + span > r->bytes) return refused("the reserved address range is used up");
  // end: [pages][guard]; start: [guard][pages]. The guard stays PROT_NONE.
  const std::uintptr_t first = r->base + at + (mode == GuardPages::start ? kPage : 0);
  if (::mprotect(reinterpret_cast<void*>(first), pages * kPage, PROT_READ | PROT_WRITE) != 0)
    return refused("mprotect refused (vm.max_map_count?)");
  r->pages[(first - r->base) / kPage] = static_cast<std::uint32_t>(pages);
  return reinterpret_cast<void*>(mode == GuardPages::start ? first : first + pages * kPage - size);
}

bool guard_deallocate(void* p) noexcept {
  Region* r = g_region.load(std::memory_order_acquire);
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (!r || a < r->base || a >= r->base + r->bytes) return false;
  const std::uintptr_t first = a / kPage * kPage;
  std::uint32_t& pages = r->pages[(first - r->base) / kPage];
  // Fresh inaccessible pages in place of the block's (its memory returned).
  ::mmap(reinterpret_cast<void*>(first), std::size_t{pages} * kPage, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  pages = 0;
  return true;
}

}  // namespace detail
}  // namespace moecert
