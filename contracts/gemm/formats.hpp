// The judge's own dequantization of quantized weights (moecert/formats.hpp),
// written from the formats' definitions, apart from the kernels' decoding.
#pragma once

#include <cstddef>

#include "moecert/formats.hpp"
#include "moecert/types.hpp"

namespace moecert::contracts {

/// The value of code `c` of format f (int4: the nibble): exact in binary64.
double code_value(WeightFormat f, unsigned c);
/// Whether c is a valid code of f (gemm.pack.q_code).
bool code_valid(WeightFormat f, unsigned c);
/// w[n][k] = code * scale exactly (binary64: at most 8 significant bits
/// times 24).
double exact_weight(const QuantView& w, std::size_t n, std::size_t k);
/// What the kernels compute with: the exact weight rounded to fp32, then to
/// bf16, each to nearest even.
inline bf16 kernel_weight(const QuantView& w, std::size_t n, std::size_t k) {
  return bf16(static_cast<float>(exact_weight(w, n, k)));
}

}  // namespace moecert::contracts
