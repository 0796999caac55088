// Code values of the quantized weight formats, and the format names.
#include "ops/gemm/formats.hpp"

#include <array>
#include <cmath>
#include <string>

namespace moecert {

std::optional<WeightFormat> parse_format(std::string_view name) {
  for (const FormatInfo& f : kFormatTable)
    if (f.name == name) return f.format;
  return std::nullopt;
}

std::string format_name_list() {
  std::string s;
  for (std::size_t i = 0; i < kFormatCount; ++i) {
    if (i > 0) s.append(i + 1 == kFormatCount ? " or " : ", ");
    s.append(kFormatTable[i].name);
  }
  return s;
}

namespace gemm {
namespace {

// e4m3 (OCP e4m3fn) value of each byte; the NaN codes (S.1111.111) read as
// NaN (refused at pack time by gemm.pack.q_code).
const std::array<float, 256> kE4m3 = [] {
  std::array<float, 256> t{};
  for (unsigned c = 0; c < 256; ++c) {
    const unsigned e = (c >> 3) & 15u, m = c & 7u;
    const float mag =
        (c & 0x7fu) == 0x7fu ? NAN
        : e == 0             ? std::ldexp(static_cast<float>(m), -9)
                 : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, static_cast<int>(e) - 7);
    t[c] = c & 0x80u ? -mag : mag;
  }
  return t;
}();

}  // namespace

float code_value(WeightFormat f, unsigned code) {
  switch (f) {
    case WeightFormat::int8_channel:
      return static_cast<float>(static_cast<std::int8_t>(code));
    case WeightFormat::int4_group:
      return static_cast<float>(code >= 8 ? static_cast<int>(code) - 16 : static_cast<int>(code));
    case WeightFormat::fp8_e4m3_block128:
      return kE4m3[code & 255u];
    case WeightFormat::bf16:
      break;
  }
  return NAN;
}

}  // namespace gemm
}  // namespace moecert
