// bf16: conversion both ways, over every bit pattern and every tie.
#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "moecert/types.hpp"
#include "test_util.hpp"

using moecert::bf16;

namespace {
float from_bits32(std::uint32_t u) { return std::bit_cast<float>(u); }
}  // namespace

TEST_CASE("core.bf16: every bit pattern converts to float and back", "[core][bf16]") {
  int nan_count = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const bf16 x = bf16::from_bits(static_cast<std::uint16_t>(b));
    const float f = x.to_float();
    REQUIRE(std::bit_cast<std::uint32_t>(f) == b << 16);  // exact widening
    const bf16 y = bf16::from_float(f);
    if (x.is_nan()) {
      ++nan_count;
      REQUIRE(std::isnan(f));
      REQUIRE(y.is_nan());
      REQUIRE(y.bits == (x.bits | 0x0040u));  // quietened, sign and payload kept
    } else {
      REQUIRE(y.bits == x.bits);
    }
  }
  CHECK(nan_count == 2 * 127);  // exponent all ones, 127 nonzero mantissas, two signs
}

TEST_CASE("core.bf16: halfway cases round to nearest even", "[core][bf16]") {
  for (std::uint32_t b = 0; b < 0x7f80u; ++b) {  // every finite non-negative bf16
    for (std::uint32_t sign : {0u, 0x80000000u}) {
      const std::uint32_t base = sign | (b << 16);
      const std::uint16_t even = (b & 1u) ? static_cast<std::uint16_t>((base >> 16) + 1)
                                          : static_cast<std::uint16_t>(base >> 16);
      REQUIRE(bf16::from_float(from_bits32(base | 0x8000u)).bits == even);
      REQUIRE(bf16::from_float(from_bits32(base | 0x7fffu)).bits == (base >> 16));  // below half
      REQUIRE(bf16::from_float(from_bits32(base | 0x8001u)).bits == (base >> 16) + 1);  // above
    }
  }
  CHECK(bf16(1.00390625f).bits == 0x3f80);  // 1 + 2^-8: tie, down to even 1.0
  CHECK(bf16(1.01171875f).bits == 0x3f82);  // 1 + 3*2^-8: tie, up to even
}

TEST_CASE("core.bf16: NaN stays NaN, quiet, sign kept", "[core][bf16]") {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  CHECK(bf16(qnan).is_nan());
  CHECK(bf16(-qnan).is_nan());
  CHECK((bf16(-qnan).bits & 0x8000u) != 0);
  // A NaN whose payload lies only in the 16 bits that are dropped must not
  // become Inf.
  const float low_payload = from_bits32(0x7f800001u);
  REQUIRE(std::isnan(low_payload));
  CHECK(bf16(low_payload).is_nan());
  CHECK(bf16(low_payload).bits == 0x7fc0u);
  CHECK(bf16(from_bits32(0xff800001u)).bits == 0xffc0u);
}

TEST_CASE("core.bf16: Inf stays Inf and overflow rounds to Inf", "[core][bf16]") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(bf16(inf).bits == 0x7f80u);
  CHECK(bf16(-inf).bits == 0xff80u);
  const float max_bf16 = bf16::from_bits(0x7f7fu).to_float();
  CHECK(bf16(max_bf16).bits == 0x7f7fu);
  CHECK(bf16(std::numeric_limits<float>::max()).bits == 0x7f80u);  // above max + half ulp
  CHECK(bf16(from_bits32(0x7f7f7fffu)).bits == 0x7f7fu);           // just below the tie
  CHECK(bf16(from_bits32(0x7f7f8000u)).bits == 0x7f80u);           // tie, odd: to Inf
  CHECK(bf16(-std::numeric_limits<float>::max()).bits == 0xff80u);
}

TEST_CASE("core.bf16: denormals convert exactly, no flushing", "[core][bf16]") {
  for (std::uint16_t m = 1; m < 0x80; ++m) {
    const bf16 d = bf16::from_bits(m);
    REQUIRE(std::fpclassify(d.to_float()) == FP_SUBNORMAL);
    REQUIRE(bf16(d.to_float()).bits == m);
  }
  CHECK(bf16(std::numeric_limits<float>::denorm_min()).bits == 0);         // rounds to +0
  CHECK(bf16(-std::numeric_limits<float>::denorm_min()).bits == 0x8000u);  // to -0
  CHECK(bf16(from_bits32(0x00008000u)).bits == 0);        // tie between 0 and the least denormal
  CHECK(bf16(from_bits32(0x00018000u)).bits == 0x0002u);  // tie, odd: up
}

TEST_CASE("core.bf16: random floats match an exact nearest-even reference", "[core][bf16]") {
  std::mt19937 rng(7);
  for (int i = 0; i < 2000000; ++i) {
    const std::uint32_t u = rng();
    const float f = from_bits32(u);
    if (!std::isfinite(f)) continue;
    const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);
    const double x = std::fabs(double(f));
    const double a = std::fabs(double(bf16::from_bits(lo).to_float()));
    const bf16 next = bf16::from_bits(static_cast<std::uint16_t>(lo + 1));
    const double b = next.is_inf() ? std::ldexp(1.0, 128) : std::fabs(double(next.to_float()));
    const std::uint16_t want = (x - a < b - x)   ? lo
                               : (b - x < x - a) ? next.bits
                                                 : ((lo & 1) ? next.bits : lo);
    REQUIRE(bf16(f).bits == want);
  }
}

TEST_CASE("core.bf16: conversion is constexpr", "[core][bf16]") {
  static_assert(bf16(1.0f).bits == 0x3f80);
  static_assert(bf16(-2.0f).bits == 0xc000);
  static_assert(bf16::from_bits(0x3f80).to_float() == 1.0f);
  SUCCEED();
}
