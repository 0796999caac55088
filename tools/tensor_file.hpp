// Tensors from a safetensors file (https://huggingface.co/docs/safetensors:
// an 8-byte little-endian header length, a JSON header naming each tensor's
// dtype, shape and byte range, then the data), for `moecert check`. The
// header is parsed with Boost.JSON; every range is checked against the
// file before any byte is read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moecert::tools {

struct Tensor {
  std::string dtype;                // safetensors name: F64, F32, F16, BF16, I64, I32, ...
  std::vector<std::int64_t> shape;  // row-major
  std::vector<std::uint8_t> bytes;  // little-endian, as stored
  std::size_t elements() const;
  std::size_t rows() const { return shape.empty() ? 1 : static_cast<std::size_t>(shape[0]); }
  /// Elements per row: the product of all dimensions but the first.
  std::size_t cols() const;
};

/// All tensors of a safetensors file by name; std::runtime_error naming
/// the file and what is wrong when it is not one, or not a regular file.
std::map<std::string, Tensor> read_safetensors(const std::string& path);

/// The tensors of a safetensors file's bytes (`path` names it in errors):
/// every shape's element count in checked arithmetic and equal to its byte
/// range, every dimension at most its data's bytes (2^16 for no elements),
/// every range inside the data; else std::runtime_error.
std::map<std::string, Tensor> parse_safetensors(const std::vector<std::uint8_t>& all,
                                                const std::string& path);

/// The values as fp32: F32 as stored, BF16 and F16 widened exactly, F64
/// rounded to nearest. Other dtypes: std::invalid_argument.
std::vector<float> to_f32(const Tensor& t, const std::string& name);

/// The values as int32: I32 as stored, I64 and I16 if every value fits,
/// I8 as signed values, U8 and F8_E4M3 as their bytes (quantized codes).
std::vector<std::int32_t> to_i32(const Tensor& t, const std::string& name);

/// Unit roundoff of the dtype's storage (0 for F32 and F64) and half its
/// least positive denormal: what storing a value in it adds to an error.
struct Storage {
  double unit = 0, tiny = 0;
};
Storage storage_of(const Tensor& t);

}  // namespace moecert::tools
