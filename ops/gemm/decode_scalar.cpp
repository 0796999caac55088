// Quantized weight panels decoded into bf16, portable: element by element,
// formats.hpp's dequantize. Every other decoder is compared with it.
#include "ops/gemm/formats.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {

void decode_scalar(const DecodeArgs& a) {
  const bool nibbles = format_info(a.format).code_bits == 4;
  for (std::size_t p = a.p0; p < a.p1; ++p) {
    const std::size_t e0 = p * a.kp * kPanel;
    bf16* d = a.dst + (p - a.p0) * a.kp * kPanel;
    // Element q of the panel: k pair q / 32, column (q / 2) % 16, k = 2 (q / 32) + q % 2.
    for (std::size_t q = 0; q < a.kp * kPanel; ++q) {
      const std::size_t e = e0 + q, n = p * kPanel + (q / 2) % kPanel, k = 2 * (q / 32) + q % 2;
      const unsigned code =
          nibbles ? (e % 2 ? a.codes[e / 2] >> 4 : a.codes[e / 2] & 15u) : a.codes[e];
      const float scale = a.transposed ? a.scales[a.srow[k] * a.sstride + n / a.sblock]
                                       : a.scales[a.srow[n] * a.sstride + k / a.sblock];
      d[q] = dequantize(a.format, code, scale);
    }
  }
}

}  // namespace moecert::gemm
