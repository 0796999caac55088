// Decoding fuzzer input into shapes, values and indices from raw bits: bf16
// and fp32 patterns include NaN, Inf and denormals on purpose (libFuzzer's
// FuzzedDataProvider float helper never yields them), indices include -1,
// out-of-range and duplicate values. An exhausted input yields zeros.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "moecert/types.hpp"

namespace moecert::fuzz {

class Decoder {
 public:
  Decoder(const std::uint8_t* data, std::size_t size) : p_(data), n_(size) {}

  std::uint8_t u8() { return n_ ? (--n_, *p_++) : 0; }
  std::uint16_t u16() { return static_cast<std::uint16_t>(u8() | (u8() << 8)); }
  std::uint32_t u32() { return u16() | (static_cast<std::uint32_t>(u16()) << 16); }
  /// In [lo, hi].
  std::size_t range(std::size_t lo, std::size_t hi) { return lo + u16() % (hi - lo + 1); }
  bool flag() { return u8() & 1; }

  /// A bf16: usually a moderate value (most inputs should be valid), one in
  /// eight a raw bit pattern (NaN, Inf, denormals, extremes).
  bf16 value_bf16() {
    const std::uint8_t sel = u8();
    if ((sel & 7) == 0) return bf16::from_bits(u16());
    return bf16(static_cast<float>(static_cast<std::int16_t>(u16())) / 4096.0f);
  }
  /// An fp32 likewise: moderate, or one in eight a raw pattern.
  float value_f32() {
    const std::uint8_t sel = u8();
    if ((sel & 7) == 0) {
      const std::uint32_t bits = u32();
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    return static_cast<float>(static_cast<std::int16_t>(u16())) / 2048.0f;
  }
  /// An expert index: usually valid, sometimes -1, -2, e or e + 1000.
  std::int32_t index(std::size_t e) {
    const std::uint8_t sel = u8();
    switch (sel & 15) {
      case 0:
        return -1;
      case 1:
        return -2;
      case 2:
        return static_cast<std::int32_t>(e);
      case 3:
        return static_cast<std::int32_t>(e + 1000);
      default:
        return static_cast<std::int32_t>(u16() % (e ? e : 1));
    }
  }
  std::size_t remaining() const { return n_; }

 private:
  const std::uint8_t* p_;
  std::size_t n_;
};

/// Aborts naming what broke: a finding. (libFuzzer records the input.)
[[noreturn]] void finding(const char* harness, const std::string& what);

/// One kernel's outcome on an input: the clause it violated (empty: none)
/// and its output. The AMX hardware and its tile model (amx_emu) must agree
/// on both, bit for bit (docs/DESIGN.md, Kernels).
struct Outcome {
  std::string clause;
  std::vector<float> out;
};

/// A finding where `hw` (amx_bf16) and `emu` (amx_emu) differ: in the clause
/// they violated, or in the first output whose bits differ (two NaNs agree:
/// the model does not follow a NaN's payload).
void expect_same_bits(const char* harness, const Outcome& hw, const Outcome& emu);

}  // namespace moecert::fuzz
