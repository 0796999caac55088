// Decoding of quantized weight codes (moecert/formats.hpp): the values the
// quantized packs and the GEMM loops multiply by.
#pragma once

#include "moecert/formats.hpp"
#include "moecert/types.hpp"

namespace moecert::gemm {

/// The value of a code as stored (int4: the nibble, 0..15), exact in fp32
/// and in bf16: int8 two's complement, int4 two's complement of 4 bits,
/// e4m3 sign, 4 exponent bits (bias 7; 0 subnormal), 3 mantissa bits.
float code_value(WeightFormat f, unsigned code);

/// The weight the kernels compute with: bf16(fp32(code value * scale)), the
/// fp32 product rounded to nearest even, then rounded to bf16.
inline bf16 dequantize(WeightFormat f, unsigned code, float scale) {
  return bf16(code_value(f, code) * scale);
}

}  // namespace moecert::gemm
