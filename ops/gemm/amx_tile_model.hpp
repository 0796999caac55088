// A software model of the AMX tile unit (palette 1: 8 tiles of at most 16
// rows x 64 bytes), bit-exact with TDPBF16PS as measured (docs/DESIGN.md, Kernels):
// per output element two FMA chains from zero over the even and the odd bf16
// pairs, every input and intermediate result that is denormal flushed to
// signed zero, round to nearest even; then C + (even + odd), each addition
// rounded and flushed. State is per thread, like the hardware's.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "moecert/types.hpp"

namespace moecert::gemm {

/// The 64-byte LDTILECFG operand.
struct alignas(64) TileConfig {
  std::uint8_t palette = 0;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

namespace amx_model {

inline float ftz(float x) { return std::fabs(x) < 0x1p-126f ? std::copysign(0.0f, x) : x; }

struct State {
  TileConfig cfg;
  alignas(64) std::uint8_t tile[8][16 * 64];
};

inline State& state() {
  thread_local State s;
  return s;
}

inline void load_config(const TileConfig& c) { state().cfg = c; }
inline void release() { state().cfg = TileConfig{}; }

inline void zero(int t) { std::memset(state().tile[t], 0, sizeof state().tile[t]); }

inline void load(int t, const void* src, std::size_t stride) {
  State& s = state();
  for (int r = 0; r < s.cfg.rows[t]; ++r)
    std::memcpy(s.tile[t] + r * 64, static_cast<const std::uint8_t*>(src) + r * stride,
                s.cfg.colsb[t]);
}

inline void store(int t, void* dst, std::size_t stride) {
  const State& s = state();
  for (int r = 0; r < s.cfg.rows[t]; ++r)
    std::memcpy(static_cast<std::uint8_t*>(dst) + r * stride, s.tile[t] + r * 64, s.cfg.colsb[t]);
}

/// TDPBF16PS tc, ta, tb.
inline void dpbf16ps(int tc, int ta, int tb) {
  State& s = state();
  const int m_rows = s.cfg.rows[tc], n_cols = s.cfg.colsb[tc] / 4, k_pairs = s.cfg.colsb[ta] / 4;
  for (int m = 0; m < m_rows; ++m) {
    const auto* a = reinterpret_cast<const bf16*>(s.tile[ta] + m * 64);
    auto* c = reinterpret_cast<float*>(s.tile[tc] + m * 64);
    for (int n = 0; n < n_cols; ++n) {
      float even = 0, odd = 0;
      for (int kk = 0; kk < k_pairs; ++kk) {
        const auto* b = reinterpret_cast<const bf16*>(s.tile[tb] + kk * 64) + 2 * n;
        even = ftz(std::fma(ftz(a[2 * kk].to_float()), ftz(b[0].to_float()), even));
        odd = ftz(std::fma(ftz(a[2 * kk + 1].to_float()), ftz(b[1].to_float()), odd));
      }
      c[n] = ftz(ftz(c[n]) + ftz(even + odd));
    }
  }
}

}  // namespace amx_model
}  // namespace moecert::gemm
