// exp(x) in binary32 as the vector epilogues compute it, written once for
// scalar code with the same operations in the same order (so the scalar and
// AVX-512 epilogues agree bit for bit):
//   n = rint(x log2 e), r = (x - n ln2_hi) - n ln2_lo (two FMAs),
//   p = degree-7 Taylor polynomial of e^r by Horner with FMAs, result p 2^n.
// |r| <= 0.3466 makes the truncation error below 0.1 ulp; measured maximum
// error 1 ulp over the normal range (tests/gemm_test.cpp), within
// bounds::kExpUlps = 2. Overflow gives +Inf, deep underflow +0.
#pragma once

#include <cmath>

namespace moecert::gemm::exp_poly {

inline constexpr float kLog2e = 0x1.715476p+0f;
inline constexpr float kLn2Hi = 0x1.62e400p-1f;  // ln 2, high bits (n * kLn2Hi exact for |n| < 2^9)
inline constexpr float kLn2Lo = 0x1.7f7d1cp-20f;  // ln 2 - kLn2Hi
inline constexpr float kMax = 88.7228f;           // beyond: +Inf
inline constexpr float kMin = -103.9721f;         // below: +0
inline constexpr float kC[8] = {
    1.0f,           1.0f,           0x1p-1f,         0x1.555556p-3f,
    0x1.555556p-5f, 0x1.111112p-7f, 0x1.6c16c2p-10f, 0x1.a01a02p-13f};  // 1/k!

inline float exp(float x) {
  if (!(x < kMax)) return x != x ? x : INFINITY;
  if (x < kMin) return 0.0f;
  const float n = std::rint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kC[7];
  for (int i = 6; i >= 0; --i) p = std::fma(p, r, kC[i]);
  return std::ldexp(p, static_cast<int>(n));
}

/// h = silu(g) * u rounded to bf16 bits, the fp32 sequence of
/// proofs/bounds.md §5: s = 1 / (1 + exp(-g)), then (g * s) * u.
inline float swiglu(float g, float u) {
  const float s = 1.0f / (1.0f + exp(-g));
  return (g * s) * u;
}

/// The SwiGLU backward of one element, the fp32 sequence of proofs/layer.md
/// §2: dhv = w dh; s = 1 / (1 + exp(-g)); silu = g s;
/// dsilu = s (1 + g (1 - s)); dg = (dhv u) dsilu, du = dhv silu (before the
/// rounding to bf16).
inline void swiglu_backward(float g, float u, float dh, float w, float& dg, float& du) {
  const float dhv = w * dh;
  const float s = 1.0f / (1.0f + exp(-g));
  const float silu = g * s;
  const float dsilu = s * (1.0f + g * (1.0f - s));
  dg = (dhv * u) * dsilu;
  du = dhv * silu;
}

}  // namespace moecert::gemm::exp_poly
