// Code values of the quantized weight formats, and the format names.
#include "ops/gemm/formats.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "ops/core/task.hpp"

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

namespace moecert {
namespace {

// The e4m3 code nearest v (ties to even), |v| <= 448.
unsigned e4m3_code(double v) {
  const unsigned sign = std::signbit(v) ? 0x80u : 0u;
  const double a = std::fabs(v);
  if (a < 0x1p-6) {  // subnormal: m 2^-9; m = 8 is the least normal, 1.000 2^-6
    const auto m = static_cast<unsigned>(std::nearbyint(a * 0x1p9));
    return sign | m;
  }
  int e;
  (void)std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1): a = (2 f) 2^(e - 1)
  const int ex = e - 1;
  auto m = static_cast<unsigned>(std::nearbyint((std::ldexp(a, -ex) - 1) * 8));
  unsigned biased = static_cast<unsigned>(ex + 7);
  if (m == 8) m = 0, ++biased;
  if (biased > 15 || (biased == 15 && m > 6)) biased = 15, m = 6;  // 448, the largest
  return sign | (biased << 3) | m;
}

double code_max(WeightFormat f) {
  return f == WeightFormat::fp8_e4m3_block128 ? 448.0 : format_info(f).code_max;
}

}  // namespace

void quantize(WeightFormat f, MatView<const float> w, const QuantOut& out) {
  const detail::FpDefaults fp;  // round to nearest, whatever the caller set
  const FormatInfo& info = format_info(f);
  const std::size_t br = info.block_rows ? info.block_rows : w.rows,
                    bc = info.block_cols ? info.block_cols : w.cols;
  const bool nibbles = info.code_bits == 4;
  for (std::size_t r0 = 0; r0 < w.rows; r0 += br)
    for (std::size_t c0 = 0; c0 < w.cols; c0 += bc) {
      const std::size_t r1 = std::min(w.rows, r0 + br), c1 = std::min(w.cols, c0 + bc);
      double amax = 0;
      for (std::size_t n = r0; n < r1; ++n)
        for (std::size_t k = c0; k < c1; ++k) amax = std::max(amax, std::fabs(double(w(n, k))));
      const float scale = amax > 0 ? static_cast<float>(amax / code_max(f)) : 1.0f;
      out.scales[(r0 / br) * out.scale_stride + c0 / bc] = scale;
      for (std::size_t n = r0; n < r1; ++n)
        for (std::size_t k = c0; k < c1; ++k) {
          const double q = double(w(n, k)) / scale;
          unsigned code;
          if (f == WeightFormat::fp8_e4m3_block128) {
            code = e4m3_code(std::clamp(q, -448.0, 448.0));
          } else {
            const double c = std::clamp(std::nearbyint(q), -code_max(f), code_max(f));
            code = static_cast<unsigned>(static_cast<int>(c)) & (nibbles ? 15u : 255u);
          }
          out.set_code(nibbles, n, k, code);
        }
    }
}

}  // namespace moecert
