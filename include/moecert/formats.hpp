// Weight formats: how frozen base weights are stored (bf16, or codes with
// scales), registered in one table as the ISAs are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>

#include "moecert/types.hpp"

namespace moecert {

/// The weight formats. The values are the C ABI's (moecert.h).
enum class WeightFormat : std::uint8_t {
  bf16 = 0,               // bf16 weights
  int8_channel = 1,       // int8 codes in [-127, 127], one fp32 scale per row (output)
  int4_group = 2,         // int4 codes in [-7, 7], two per byte (low nibble first), one fp32
                          // scale per row and group of 128 along the input dimension
  fp8_e4m3_block128 = 3,  // float8 e4m3 (OCP e4m3fn: bias 7, no Inf, NaN = S.1111.111), one
                          // fp32 scale per 128 x 128 block (DeepSeek-V3's weight_scale_inv)
};

/// A format as the rest of the library reads it. A quantized weight W [N x K]
/// (row n = output n, as W[out, in]) is w[n][k] = code[n][k] * scale[n / block_rows]
/// [k / block_cols], block_rows or block_cols 0 meaning the whole dimension.
/// The kernels compute with bf16(fp32(code * scale)): the product rounded to
/// nearest even in fp32, then to bf16 (proofs/bounds.md §13).
struct FormatInfo {
  WeightFormat format;
  std::string_view name;
  unsigned code_bits;      // 16 for bf16
  std::size_t block_rows;  // rows of W per scale (0: all)
  std::size_t block_cols;  // columns of W per scale (0: all)
  int code_min, code_max;  // integer formats: the valid codes
};

inline constexpr FormatInfo kFormatTable[] = {
    {WeightFormat::bf16, "bf16", 16, 0, 0, 0, 0},
    {WeightFormat::int8_channel, "int8_channel", 8, 1, 0, -127, 127},
    {WeightFormat::int4_group, "int4_group", 4, 1, 128, -7, 7},
    {WeightFormat::fp8_e4m3_block128, "fp8_e4m3_block128", 8, 128, 128, 0, 0},
};
inline constexpr std::size_t kFormatCount = std::size(kFormatTable);

// The table is in value order (the C ABI's numbers), each name once.
static_assert([] {
  for (std::size_t v = 0; v < kFormatCount; ++v)
    if (static_cast<std::size_t>(kFormatTable[v].format) != v) return false;
  for (std::size_t i = 0; i < kFormatCount; ++i)
    for (std::size_t j = i + 1; j < kFormatCount; ++j)
      if (kFormatTable[i].name == kFormatTable[j].name) return false;
  return true;
}());

constexpr const FormatInfo& format_info(WeightFormat f) {
  return kFormatTable[static_cast<std::size_t>(f)];
}
constexpr std::string_view format_name(WeightFormat f) {
  return static_cast<std::size_t>(f) < kFormatCount ? format_info(f).name : "unknown";
}
/// The format named `name`, if any.
std::optional<WeightFormat> parse_format(std::string_view name);
/// "bf16, int8_channel, int4_group or fp8_e4m3_block128", for messages.
std::string format_name_list();

/// Quantized weights W [rows x cols] as a checkpoint stores them: codes
/// (row-major, `stride` bytes from one row to the next; int4: element 2j of
/// a row in the low nibble of byte j, 2j + 1 in the high one) and fp32 scales
/// [ceil(rows / block_rows) x ceil(cols / block_cols)] (row-major,
/// scale_stride floats apart). A block at the matrix's edge is partial: its
/// scale serves the rows and columns it has.
struct QuantView {
  WeightFormat format = WeightFormat::int8_channel;
  const std::uint8_t* codes = nullptr;
  std::size_t rows = 0, cols = 0, stride = 0;
  const float* scales = nullptr;
  std::size_t scale_stride = 0;

  /// Bytes of one row's codes.
  constexpr std::size_t row_bytes() const { return (cols * format_info(format).code_bits + 7) / 8; }
  /// Scale rows and columns.
  constexpr std::size_t scale_rows() const { return blocks(rows, format_info(format).block_rows); }
  constexpr std::size_t scale_cols() const { return blocks(cols, format_info(format).block_cols); }
  /// The code of element (n, k) as stored (4-bit codes: the nibble, 0..15).
  constexpr unsigned code(std::size_t n, std::size_t k) const {
    if (format_info(format).code_bits == 8) return codes[n * stride + k];
    const unsigned byte = codes[n * stride + k / 2];
    return k % 2 ? byte >> 4 : byte & 15u;
  }
  constexpr float scale(std::size_t n, std::size_t k) const {
    const FormatInfo& f = format_info(format);
    return scales[(f.block_rows ? n / f.block_rows : 0) * scale_stride +
                  (f.block_cols ? k / f.block_cols : 0)];
  }
  ByteRange code_bytes() const {
    const auto b = reinterpret_cast<std::uintptr_t>(codes);
    return rows ? ByteRange{b, b + (rows - 1) * stride + row_bytes()} : ByteRange{b, b};
  }
  ByteRange scale_bytes() const {
    const auto b = reinterpret_cast<std::uintptr_t>(scales);
    return rows ? ByteRange{b,
                            b + ((scale_rows() - 1) * scale_stride + scale_cols()) * sizeof(float)}
                : ByteRange{b, b};
  }

 private:
  static constexpr std::size_t blocks(std::size_t n, std::size_t block) {
    return block ? (n + block - 1) / block : (n ? 1 : 0);
  }
};

/// Where to write quantized weights [rows x cols] of a format (QuantView's
/// layout): codes with `stride` bytes a row, scales with `scale_stride`.
struct QuantOut {
  std::uint8_t* codes = nullptr;
  std::size_t stride = 0;
  float* scales = nullptr;
  std::size_t scale_stride = 0;

  /// Writes code c of element (n, k) (nibbles: int4, c 0..15, the byte's
  /// other nibble kept).
  void set_code(bool nibbles, std::size_t n, std::size_t k, unsigned c) const {
    std::uint8_t& b = codes[n * stride + (nibbles ? k / 2 : k)];
    b = !nibbles ? static_cast<std::uint8_t>(c)
        : k % 2  ? static_cast<std::uint8_t>((b & 0x0fu) | (c << 4))
                 : static_cast<std::uint8_t>((b & 0xf0u) | (c & 0x0fu));
  }
};

/// The quantizer, for weights that start in bf16 or fp32: w [rows x cols]
/// into format f (not bf16), round to nearest. Per block of the format
/// (int8_channel: a row; int4_group: a row's 128 columns; fp8: 128 x 128):
/// scale = fp32(max |w| / code_max) (code_max 127, 7 or 448; 1 for an
/// all-zero block), then each code the value nearest w / scale (binary64),
/// ties to even: an integer clamped to [-code_max, code_max], or an e4m3
/// value. So |code * scale - w| <= scale / 2 (integers) or half an e4m3 ulp
/// of w / scale times scale, plus scale's own rounding. w must be finite.
void quantize(WeightFormat f, MatView<const float> w, const QuantOut& out);

}  // namespace moecert
