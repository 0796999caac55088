// The environment an op computes in, on every thread it runs on.
//
// Floating point: round to nearest even, denormals kept (no FTZ, no DAZ),
// exceptions masked — the arithmetic the bounds of proofs/ assume, and the
// one the AMX and AVX-512 BF16 products do not consult (they flush by
// themselves). A caller's thread, or the oneTBB arena (which hands its
// workers the settings of the thread that first used it), may run with
// flush-to-zero, denormals-are-zero or another rounding (-ffast-math
// start-up code, ML frameworks' own threads); the ops' fp32 and binary64
// code must not see them, or its results would depend on the caller.
//
// Contracts: a ContractScope is per thread, so each task carries the
// settings in effect where the op was called.
#pragma once

#include <utility>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "contracts/engine/engine.hpp"
#include "contracts/engine/tbb_sync.hpp"

namespace moecert::detail {

/// MXCSR's control bits set to the default (0x1F80: every exception masked,
/// round to nearest, no FTZ, no DAZ) for the guard's lifetime, then the
/// caller's control bits restored; status flags raised meanwhile stay
/// raised. Touches MXCSR only where it differs.
class FpDefaults {
 public:
#if defined(__SSE__)
  FpDefaults() : saved_(_mm_getcsr()) {
    if ((saved_ & ~kFlags) != kDefault) _mm_setcsr(kDefault | (saved_ & kFlags));
  }
  ~FpDefaults() {
    if ((saved_ & ~kFlags) != kDefault) _mm_setcsr((saved_ & ~kFlags) | (_mm_getcsr() & kFlags));
  }
#else
  FpDefaults() = default;
#endif
  FpDefaults(const FpDefaults&) = delete;
  FpDefaults& operator=(const FpDefaults&) = delete;

 private:
#if defined(__SSE__)
  static constexpr unsigned kDefault = 0x1F80, kFlags = 0x3F;
  unsigned saved_;
#endif
};

/// `f` made to run, on whatever thread oneTBB gives it, under the
/// library's floating-point environment and the contract settings in effect
/// where this is called (and ordered for ThreadSanitizer: tbb_sync.hpp).
/// Every parallel body of an op goes through it.
template <class F>
auto task(F f) {
  return TbbBody([s = effective_contract_settings(), f = std::move(f)](auto&&... args) {
    const ContractScope contracts{s};
    const FpDefaults fp;
    return f(std::forward<decltype(args)>(args)...);
  });
}

}  // namespace moecert::detail
