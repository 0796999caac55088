// Property: for every fp32 bit pattern f, bf16(f) is the bf16 nearest to f,
// ties to even (NaN: a quiet NaN keeping the sign; overflow past the last
// half-ulp: Inf), and for every bf16 pattern b, bf16(float(b)) == b (NaN:
// b with its quiet bit set).
#include <fmt/format.h>

#include <bit>
#include <cmath>

#include "fuzz/decode.hpp"

using moecert::bf16;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  moecert::fuzz::Decoder d(data, size);
  while (d.remaining() >= 4) {
    const std::uint32_t u = d.u32();
    const float f = std::bit_cast<float>(u);
    const bf16 got(f);
    if (std::isnan(f)) {
      if (!got.is_nan() || (got.bits >> 15) != (u >> 31) || !(got.bits & 0x40))
        moecert::fuzz::finding("bf16_fuzzer", fmt::format("NaN {:#010x} -> {:#06x}", u, got.bits));
    } else {
      // Nearest even by exact comparison in double.
      const auto lo = static_cast<std::uint16_t>(u >> 16);
      const bf16 a = bf16::from_bits(lo), b = bf16::from_bits(static_cast<std::uint16_t>(lo + 1));
      std::uint16_t want = lo;
      if ((u & 0xffffu) != 0) {
        const double x = std::fabs(double(f)), da = x - std::fabs(double(a.to_float()));
        const double db = (b.is_inf() ? std::ldexp(1.0, 128) : std::fabs(double(b.to_float()))) - x;
        want = da < db ? lo : db < da ? b.bits : (lo & 1) ? b.bits : lo;
      }
      if (got.bits != want)
        moecert::fuzz::finding("bf16_fuzzer",
                               fmt::format("{:a} -> {:#06x}, want {:#06x}", f, got.bits, want));
    }
    const bf16 x = bf16::from_bits(static_cast<std::uint16_t>(u & 0xffff));
    const bf16 back(x.to_float());
    if (x.is_nan() ? back.bits != (x.bits | 0x40) : back.bits != x.bits)
      moecert::fuzz::finding("bf16_fuzzer",
                             fmt::format("round trip {:#06x} -> {:#06x}", x.bits, back.bits));
  }
  return 0;
}
