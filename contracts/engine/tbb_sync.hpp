// oneTBB's ordering told to ThreadSanitizer: a parallel body starts after
// the parallel_for that runs it was called, and parallel_for returns after
// every body ended. The uninstrumented libtbb establishes both with atomics
// ThreadSanitizer does not see, so without this every read a task makes of
// its caller's data (and the caller's next write to it) is reported as a
// race. The edges are those an instrumented oneTBB would show: the call
// before every body, every body before the return, and a copy of a body
// (made where a range is split) before the thread that runs it; bodies of
// one parallel_for are otherwise unordered, so a race between two tasks is
// still found. Empty outside -fsanitize=thread.
#pragma once

#include <utility>

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace moecert::detail {

#if defined(__SANITIZE_THREAD__)
inline char tbb_spawn_key, tbb_copy_key, tbb_join_key;
// The caller, before parallel_for; a copy of a body, once made (oneTBB
// hands it to the thread that runs it).
inline void tbb_spawn() { __tsan_release(&tbb_spawn_key); }
inline void tbb_copied() { __tsan_release(&tbb_copy_key); }
// A body (or a copy being made), first.
inline void tbb_begin() {
  __tsan_acquire(&tbb_spawn_key);
  __tsan_acquire(&tbb_copy_key);
}
inline void tbb_end() { __tsan_release(&tbb_join_key); }   // a body, last
inline void tbb_join() { __tsan_acquire(&tbb_join_key); }  // the caller, after parallel_for
#else
inline void tbb_spawn() {}
inline void tbb_copied() {}
inline void tbb_begin() {}
inline void tbb_end() {}
inline void tbb_join() {}
#endif

/// `f` as a parallel body with the orderings above; the object the caller
/// constructs marks the join when it is destroyed (after parallel_for has
/// returned), copies oneTBB makes of it do not.
template <class F>
class TbbBody {
  struct Begin {  // a copy: ordered before any member is copied
    Begin() = default;
    Begin(const Begin&) { tbb_begin(); }
  };
  struct End {
    ~End() { tbb_end(); }
  };

 public:
  explicit TbbBody(F f) : f_(std::move(f)) { tbb_spawn(); }  // every member written
  TbbBody(const TbbBody& o) : begin_(o.begin_), f_(o.f_), original_(false) { tbb_copied(); }
  TbbBody& operator=(const TbbBody&) = delete;
  ~TbbBody() {
    if (original_) tbb_join();
  }

  template <class... A>
  decltype(auto) operator()(A&&... a) const {
    tbb_begin();
    const End end;
    return f_(std::forward<A>(a)...);
  }

 private:
  Begin begin_;
  F f_;
  bool original_ = true;
};

}  // namespace moecert::detail
