// Packing of quantized weights (moecert/formats.hpp) into the panel order of
// the bf16 layout, and their decoding into bf16 panels for the kernels.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "contracts/gemm/gemm.hpp"
#include "moecert/gemm.hpp"
#include "ops/core/aligned.hpp"
#include "ops/core/task.hpp"
#include "ops/gemm/formats.hpp"
#include "ops/gemm/loops.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {
namespace {

// The packed element index of W[n][k] (the bf16 layout's, ukernel.hpp).
std::size_t element(std::size_t kp, std::size_t n, std::size_t k) {
  return (n / kPanel) * kp * kPanel + (k / 2) * 2 * kPanel + (n % kPanel) * 2 + (k % 2);
}

// Writes code c of element e: a byte each, or (int4) a nibble, e even low.
void put_code(std::uint8_t* codes, bool nibbles, std::size_t e, unsigned c) {
  if (!nibbles) {
    codes[e] = static_cast<std::uint8_t>(c);
  } else {
    std::uint8_t& b = codes[e / 2];
    b = static_cast<std::uint8_t>(e % 2 ? (b & 0x0fu) | (c << 4) : (b & 0xf0u) | (c & 0x0fu));
  }
}

unsigned get_code(const std::uint8_t* codes, bool nibbles, std::size_t e) {
  return nibbles ? (e % 2 ? codes[e / 2] >> 4 : codes[e / 2] & 0x0fu) : codes[e];
}

// The block width of a scale along a dimension (0 in the table: all of it).
std::size_t block(std::size_t b) { return b ? b : std::numeric_limits<std::size_t>::max(); }

}  // namespace

PackedWeights PackedWeights::pack(const QuantView& w, const QuantView& second) {
  const moecert::detail::FpDefaults fp;
  detail::Checker c{"gemm.pack"};
  contracts::gemm_pack_quantized_pre(c, w, second, false);
  if (c.stop()) return {};
  const bool pair = second.codes != nullptr;
  const FormatInfo& f = format_info(w.format);
  PackedWeights out = shaped(w.rows, w.cols, pair);
  const bool nibbles = f.code_bits == 4;
  auto* codes = out.quantized_storage(w, second, out.kp_);  // scale columns over kp
  const std::size_t wrows = w.scale_rows();
  // Each packed column: its source row, its codes, its table row.
  out.srow_.assign(out.np_, 0);
  const std::size_t br = block(f.block_rows);
  for (std::size_t n = 0; n < out.np_; ++n) {
    const std::size_t p = n / kPanel;
    const bool from_second = pair && p % 2 == 1;
    const std::size_t row = pair ? (p / 2) * kPanel + n % kPanel : n;
    const QuantView& src = from_second ? second : w;
    if (row >= src.rows) continue;
    out.srow_[n] = static_cast<std::uint32_t>((from_second ? wrows : 0) + row / br);
    for (std::size_t k = 0; k < src.cols; ++k)
      put_code(codes, nibbles, element(out.kp_, n, k), src.code(row, k));
  }
  out.take_checksums();
  contracts::gemm_pack_quantized_post(c, w, second, false, out);
  return out;
}

PackedWeights PackedWeights::pack_transposed(const QuantView& wt, const QuantView& below) {
  const moecert::detail::FpDefaults fp;
  detail::Checker c{"gemm.pack"};
  contracts::gemm_pack_quantized_pre(c, wt, below, true);
  if (c.stop()) return {};
  const bool stacked = below.codes != nullptr;
  const FormatInfo& f = format_info(wt.format);
  PackedWeights out = shaped(wt.cols, wt.rows + (stacked ? below.rows : 0), false);
  out.transposed_ = true;
  const bool nibbles = f.code_bits == 4;
  // Scale columns over np: W's columns are the sources' columns.
  auto* codes = out.quantized_storage(wt, below, out.np_);
  const std::size_t top = wt.scale_rows();
  // Each packed depth k is a source row: its codes, its table row.
  out.srow_.assign(out.kp_, 0);
  const std::size_t br = block(f.block_rows);
  for (std::size_t k = 0; k < out.k_; ++k) {
    const bool from_below = k >= wt.rows;
    const QuantView& src = from_below ? below : wt;
    const std::size_t row = from_below ? k - wt.rows : k;
    out.srow_[k] = static_cast<std::uint32_t>((from_below ? top : 0) + row / br);
    for (std::size_t n = 0; n < src.cols; ++n)
      put_code(codes, nibbles, element(out.kp_, n, k), src.code(row, n));
  }
  out.take_checksums();
  contracts::gemm_pack_quantized_post(c, wt, below, true, out);
  return out;
}

std::uint8_t* PackedWeights::quantized_storage(const QuantView& a, const QuantView& b,
                                               std::size_t span) {
  const FormatInfo& f = format_info(a.format);
  format_ = a.format;
  allocate(np_ * kp_ * f.code_bits / 8, {});
  auto* codes = reinterpret_cast<std::uint8_t*>(data_.get());
  std::memset(codes, 0, storage_bytes_);
  sblock_ = block(f.block_cols);
  sstride_ = f.block_cols ? (span + f.block_cols - 1) / f.block_cols : 1;
  const std::size_t top = a.scale_rows(), rows = top + (b.codes ? b.scale_rows() : 0);
  scales_.assign(rows * sstride_, 1.0f);
  for (std::size_t r = 0; r < rows; ++r) {
    const QuantView& src = r < top ? a : b;
    const std::size_t sr = r < top ? r : r - top;
    std::copy_n(src.scales + sr * src.scale_stride, src.scale_cols(), &scales_[r * sstride_]);
  }
  // Every nonzero code is at least 1 in magnitude (integer formats) or 2^-9
  // (e4m3's least subnormal): every nonzero product is normal where every
  // scale is finite and at least 2^-126 over that.
  const float least = f.code_min < f.code_max ? 0x1p-126f : 0x1p-117f;
  normal_products_ = std::all_of(scales_.begin(), scales_.end(),
                                 [&](float s) { return std::isfinite(s) && s >= least; });
  return codes;
}

unsigned PackedWeights::code_at(std::size_t n, std::size_t k) const {
  return get_code(reinterpret_cast<const std::uint8_t*>(data_.get()),
                  format_info(format_).code_bits == 4, element(kp_, n, k));
}

bf16 PackedWeights::decoded(std::size_t n, std::size_t k, std::size_t e) const {
  const auto* codes = reinterpret_cast<const std::uint8_t*>(data_.get());
  const unsigned c = get_code(codes, format_info(format_).code_bits == 4, e);
  return c ? dequantize(format_, c, scale_of(n, k)) : bf16{};
}

void PackedWeights::decode_panels(std::size_t p0, std::size_t p1, bf16* dst,
                                  void (*decode)(const DecodeArgs&)) const {
  decode({format_, reinterpret_cast<const std::uint8_t*>(data_.get()), kp_, p0, p1, scales_.data(),
          sstride_, sblock_, srow_.data(), transposed_, dst, normal_products_});
}

}  // namespace moecert::gemm
