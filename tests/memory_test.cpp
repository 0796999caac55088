// Guard pages (moecert/memory.hpp): an access one byte past a buffer's end
// (mode end) or before its start (mode start) faults at once, in moecert's
// own storage and, in the programs that link the guard operator new, in
// every heap block; a freed block faults too. Each access runs in a child
// process, which must die of SIGSEGV.
#include "moecert/memory.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <functional>
#include <vector>

#include "moecert/gemm.hpp"
#include "ops/core/aligned.hpp"
#include "test_util.hpp"

using namespace moecert;

namespace {

// The signal that ended a child running fn (0: it exited normally; under
// ThreadSanitizer, its exit status when it reported an error and exited).
int dies_of(GuardPages mode, const std::function<void()>& fn) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::signal(SIGSEGV, SIG_DFL);  // neither Catch2's handler nor a sanitizer's: die of it
    set_guard_pages(mode);
    fn();
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status);
}

volatile unsigned char sink;

}  // namespace

TEST_CASE(
    "memory: guard pages fault one byte past the end or before the start of moecert's storage",
    "[memory]") {
  for (std::size_t bytes : {std::size_t{64}, std::size_t{6144}, std::size_t{4096},
                            std::size_t{100000}, std::size_t{3}}) {
    INFO("bytes=" << bytes);
    const auto end = static_cast<std::ptrdiff_t>((bytes + 63) / 64 *
                                                 64);  // the end at moecert's 64-byte alignment
    auto at = [bytes](std::ptrdiff_t i) {
      return [bytes, i] {
        auto* p = static_cast<unsigned char*>(detail::allocate(bytes));
        std::memset(p, 1, bytes);  // all of it is usable
        sink = p[i];
      };
    };
    CHECK(dies_of(GuardPages::end, at(0)) == 0);
    CHECK(dies_of(GuardPages::end, at(static_cast<std::ptrdiff_t>(bytes) - 1)) == 0);
    CHECK(dies_of(GuardPages::end, at(end)) == SIGSEGV);
    CHECK(dies_of(GuardPages::start, at(-1)) == SIGSEGV);
    CHECK(dies_of(GuardPages::start, at(static_cast<std::ptrdiff_t>(bytes) - 1)) == 0);
    CHECK(dies_of(GuardPages::off, at(end - 1)) == 0);
  }
}

TEST_CASE("memory: a freed guarded block faults, and a block is freed as it was allocated",
          "[memory]") {
  const int use_after_free = dies_of(GuardPages::end, [] {
    auto* p = static_cast<unsigned char*>(detail::allocate(256));
    detail::deallocate(p);
    sink = p[0];
  });
#if defined(__SANITIZE_THREAD__)
  CHECK(use_after_free !=
        0);  // ThreadSanitizer reports the read (and ends the child) before it faults
#else
  CHECK(use_after_free == SIGSEGV);
#endif
  // Allocated in one mode, freed in another.
  CHECK(dies_of(GuardPages::end, [] {
          void* p = detail::allocate(128);
          set_guard_pages(GuardPages::off);
          detail::deallocate(p);
          void* q = detail::allocate(128);
          set_guard_pages(GuardPages::start);
          detail::deallocate(q);
        }) == 0);
}

#ifdef MOECERT_GUARD_NEW
TEST_CASE("memory: under guard pages every heap block of a checking program is guarded",
          "[memory]") {
  // std::vector's storage (the caller's tensors in tests, the ops' per-task
  // temporaries): 40 bf16, 80 bytes, a multiple of new's 16-byte alignment.
  CHECK(dies_of(GuardPages::end, [] {
          std::vector<bf16> v(40);
          sink = static_cast<unsigned char>(v.data()[40].bits);
        }) == SIGSEGV);
  CHECK(dies_of(GuardPages::start, [] {
          std::vector<float> v(3);
          sink = static_cast<unsigned char>(v.data()[-1]);
        }) == SIGSEGV);
  CHECK(dies_of(GuardPages::end, [] {
          std::vector<float> v(20);
          sink = static_cast<unsigned char>(v.data()[19]);
        }) == 0);
}
#endif

TEST_CASE("memory: parse_guard_pages takes off, end and start only", "[memory]") {
  GuardPages m = GuardPages::off;
  CHECK(parse_guard_pages("end", m));
  CHECK(m == GuardPages::end);
  CHECK(parse_guard_pages("start", m));
  CHECK(m == GuardPages::start);
  CHECK(parse_guard_pages("off", m));
  CHECK(m == GuardPages::off);
  CHECK_FALSE(parse_guard_pages("ends", m));
  CHECK_FALSE(parse_guard_pages(nullptr, m));
}
