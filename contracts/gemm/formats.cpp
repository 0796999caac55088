// The judge's dequantization of the weight formats.
#include "contracts/gemm/formats.hpp"

#include <cmath>
#include <cstdint>

namespace moecert::contracts {

double code_value(WeightFormat f, unsigned c) {
  if (f == WeightFormat::int8_channel) return static_cast<std::int8_t>(c & 255u);
  if (f == WeightFormat::int4_group) return (c & 15u) >= 8 ? double(c & 15u) - 16 : double(c & 15u);
  if (f == WeightFormat::fp8_e4m3_block128) {  // S.EEEE.MMM, bias 7, e = 0 subnormal
    const unsigned e = (c >> 3) & 15u, m = c & 7u;
    if ((c & 0x7fu) == 0x7fu) return NAN;
    const double mag = e ? std::ldexp(8.0 + m, static_cast<int>(e) - 10) : std::ldexp(m, -9);
    return (c & 0x80u) ? -mag : mag;
  }
  return NAN;
}

bool code_valid(WeightFormat f, unsigned c) {
  const FormatInfo& info = format_info(f);
  if (info.code_min < info.code_max) {
    const double v = code_value(f, c);
    return v >= info.code_min && v <= info.code_max;
  }
  return !std::isnan(code_value(f, c));
}

double exact_weight(const QuantView& w, std::size_t n, std::size_t k) {
  return code_value(w.format, w.code(n, k)) * static_cast<double>(w.scale(n, k));
}

}  // namespace moecert::contracts
