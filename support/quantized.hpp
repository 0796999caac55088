// Quantized weights as a checkpoint holds them (codes and scales, owned), the
// one random filling of them, and their dequantized bf16 copy. Shared by the
// tests, the conformance cases and the fuzzers.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "contracts/gemm/formats.hpp"
#include "contracts/numeric/rounding.hpp"
#include "moecert/formats.hpp"

namespace moecert::fixture {

/// Codes and scales of one matrix, and the view of them (codes stored with
/// 3 bytes of row padding, scales with one NaN column: neither is read).
struct QuantMatrix {
  std::vector<std::uint8_t> codes;
  std::vector<float> scales;
  QuantView view;

  QuantMatrix() = default;
  QuantMatrix(const QuantMatrix& o) : codes(o.codes), scales(o.scales), view(o.view) { rebind(); }
  QuantMatrix& operator=(const QuantMatrix& o) {
    codes = o.codes, scales = o.scales, view = o.view;
    rebind();
    return *this;
  }
  void rebind() { view.codes = codes.data(), view.scales = scales.data(); }
  /// Writes code c (int4: a nibble 0..15) of element (n, k).
  void set_code(std::size_t n, std::size_t k, unsigned c) {
    out().set_code(format_info(view.format).code_bits == 4, n, k, c);
  }
  /// The matrix as an output of its layout.
  QuantOut out() { return {codes.data(), view.stride, scales.data(), view.scale_stride}; }
  /// The dequantized weights the kernels compute with, row-major.
  std::vector<bf16> dequantized() const {
    std::vector<bf16> w(view.rows * view.cols);
    for (std::size_t n = 0; n < view.rows; ++n)
      for (std::size_t k = 0; k < view.cols; ++k)
        w[n * view.cols + k] = contracts::kernel_weight(view, n, k);
    return w;
  }
};

/// C = A W^T [m x n] over quantized W's exact weights (code * scale, in
/// binary64) and the bound of a kernel that multiplies by the dequantized
/// weights wh: bounds::dot of |a||wh|, plus their deviation sum |a||wh - w|
/// (proofs/bounds.md §13), plus this binary64 sum's own rounding,
/// gamma_k(2^-53) sum |a w| (each product exact: 8 by 31 bits).
struct ExactGemm {
  std::vector<double> ref, bound;
};
inline ExactGemm exact_gemm(const std::vector<bf16>& a, std::size_t m, std::size_t k,
                            const QuantView& w, const std::vector<bf16>& wh) {
  const std::size_t n = w.rows;
  ExactGemm out{std::vector<double>(m * n), std::vector<double>(m * n)};
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double exact = 0, sa = 0, sw = 0, dev = 0;
      for (std::size_t kk = 0; kk < k; ++kk) {
        const double x = a[i * k + kk].to_float(), wx = contracts::exact_weight(w, j, kk),
                     h = wh[j * k + kk].to_float();
        exact += x * wx, sa += std::fabs(x * h), sw += std::fabs(x * wx);
        dev += std::fabs(x) * std::fabs(h - wx);
      }
      out.ref[i * n + j] = exact;
      out.bound[i * n + j] =
          bounds::dot(k, sa) + dev + bounds::gamma(static_cast<double>(k), bounds::kU64) * sw;
    }
  return out;
}

/// A random valid code of f.
inline unsigned random_code(WeightFormat f, std::mt19937_64& rng) {
  const FormatInfo& info = format_info(f);
  if (f == WeightFormat::fp8_e4m3_block128) {
    unsigned c;
    do c = static_cast<unsigned>(rng() & 255u);
    while ((c & 0x7fu) == 0x7fu);
    return c;
  }
  std::uniform_int_distribution<int> d(info.code_min, info.code_max);
  return static_cast<unsigned>(d(rng)) & (info.code_bits == 4 ? 15u : 255u);
}

/// rows x cols of format f: random valid codes, scales 2^[lo, hi) times
/// [1, 2).
inline QuantMatrix random_quantized(WeightFormat f, std::size_t rows, std::size_t cols,
                                    std::mt19937_64& rng, int lo = -20, int hi = 20) {
  QuantMatrix q;
  q.view.format = f;
  q.view.rows = rows, q.view.cols = cols;
  q.view.stride = q.view.row_bytes() + 3;
  q.codes.assign(rows * q.view.stride, 0xee);
  for (std::size_t n = 0; n < rows; ++n)
    for (std::size_t k = 0; k < cols; ++k) q.set_code(n, k, random_code(f, rng));
  q.view.scale_stride = q.view.scale_cols() + 1;
  q.scales.assign(q.view.scale_rows() * q.view.scale_stride, NAN);
  std::uniform_real_distribution<double> e(lo, hi), m(1, 2);
  for (std::size_t r = 0; r < q.view.scale_rows(); ++r)
    for (std::size_t c = 0; c < q.view.scale_cols(); ++c)
      q.scales[r * q.view.scale_stride + c] =
          static_cast<float>(std::ldexp(m(rng), static_cast<int>(std::floor(e(rng)))));
  q.rebind();
  return q;
}

}  // namespace moecert::fixture
