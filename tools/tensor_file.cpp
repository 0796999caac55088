// Reading safetensors files (tools/tensor_file.hpp).
#include "tools/tensor_file.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <boost/json.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>

#include "moecert/types.hpp"

namespace moecert::tools {
namespace {

std::size_t dtype_bytes(const std::string& d) {
  static const std::map<std::string, std::size_t> sizes{
      {"F64", 8}, {"F32", 4}, {"F16", 2},  {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2},
      {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"U16", 2},  {"U32", 4}, {"U64", 8}, {"F8_E4M3", 1}};
  const auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

template <class T>
T load(const std::uint8_t* p) {
  static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// IEEE binary16 to binary32, exact: (1024 + m) 2^(e - 25) for a normal
// exponent e, m 2^-24 below it; infinities and NaN (payload not kept).
float half_to_float(std::uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float magnitude = e == 0    ? std::ldexp(static_cast<float>(m), -24)
                          : e == 31 ? (m ? NAN : INFINITY)
                                    : std::ldexp(static_cast<float>(1024 + m), e - 25);
  return h & 0x8000 ? -magnitude : magnitude;
}

namespace json = boost::json;

// Field `key` of entry e; a missing one is refused naming it.
const json::value& field(const std::string& path, const std::string& name, const json::object& e,
                         const char* key) {
  const json::value* v = e.if_contains(key);
  if (!v) throw std::runtime_error(fmt::format("{}: {}: no {}", path, name, key));
  return *v;
}

// The array `key` of entry e as unsigned 64-bit integers: a negative,
// fractional or too large number is refused here (a JSON number beyond
// 2^64 is stored as a double, and converting it would be undefined).
std::vector<std::uint64_t> naturals(const std::string& path, const std::string& name,
                                    const json::object& e, const char* key) {
  const json::array* a = field(path, name, e, key).if_array();
  if (!a) throw std::runtime_error(fmt::format("{}: {}: {} is not an array", path, name, key));
  std::vector<std::uint64_t> out;
  for (const auto& v : *a) {
    if (v.is_uint64())
      out.push_back(v.get_uint64());
    else if (v.is_int64() && v.get_int64() >= 0)
      out.push_back(static_cast<std::uint64_t>(v.get_int64()));
    else
      throw std::runtime_error(fmt::format("{}: {}: {} holds {}, expected integers 0 to 2^64 - 1",
                                           path, name, key, json::serialize(v)));
  }
  return out;
}

// The largest dimension a tensor may declare: its data's size in bytes, or
// 2^16 for a tensor of no elements (e.g. [0, 64]: zero tokens), so that no
// shape asks the judge for more memory than the file justifies.
constexpr std::uint64_t kEmptyDimension = std::uint64_t{1} << 16;

// Entry `name` of the header, its bytes copied from `data`; its non-empty
// byte range is appended to `ranges`.
Tensor parse_entry(const std::string& path, const std::string& name, const json::value& entry,
                   const std::vector<std::uint8_t>& data,
                   std::vector<std::pair<std::uint64_t, std::uint64_t>>& ranges) {
  const json::object* e = entry.if_object();
  if (!e) throw std::runtime_error(fmt::format("{}: {}: not a JSON object", path, name));
  const json::string* dtype = field(path, name, *e, "dtype").if_string();
  if (!dtype) throw std::runtime_error(fmt::format("{}: {}: dtype is not a string", path, name));
  Tensor t;
  t.dtype = std::string(*dtype);
  for (std::uint64_t d : naturals(path, name, *e, "shape")) {
    if (d > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      throw std::runtime_error(fmt::format("{}: {}: dimension {} out of range", path, name, d));
    t.shape.push_back(static_cast<std::int64_t>(d));
  }
  const auto off = naturals(path, name, *e, "data_offsets");
  const std::size_t width = dtype_bytes(t.dtype);
  if (width == 0)
    throw std::runtime_error(fmt::format("{}: {}: unknown dtype {}", path, name, t.dtype));
  if (off.size() != 2 || off[0] > off[1] || off[1] > data.size())
    throw std::runtime_error(fmt::format("{}: {}: data_offsets outside the file's {} data bytes",
                                         path, name, data.size()));
  // Elements and bytes in checked 64-bit arithmetic: a shape whose product
  // wraps is refused, not read as another shape.
  const std::uint64_t stored = off[1] - off[0];
  std::uint64_t elements = 1, bytes = 0;
  for (auto d : t.shape) {
    if (static_cast<std::uint64_t>(d) > std::max(stored, kEmptyDimension) ||
        __builtin_mul_overflow(elements, static_cast<std::uint64_t>(d), &elements))
      throw std::runtime_error(fmt::format("{}: {}: shape {} larger than its {} data bytes", path,
                                           name, fmt::join(t.shape, "x"), stored));
  }
  if (__builtin_mul_overflow(elements, std::uint64_t{width}, &bytes) || bytes != stored)
    throw std::runtime_error(fmt::format("{}: {}: {} bytes for shape {} of {}", path, name, stored,
                                         fmt::join(t.shape, "x"), t.dtype));
  if (off[1] > off[0]) ranges.emplace_back(off[0], off[1]);
  t.bytes.assign(data.begin() + static_cast<std::ptrdiff_t>(off[0]),
                 data.begin() + static_cast<std::ptrdiff_t>(off[1]));
  return t;
}

}  // namespace

std::size_t Tensor::elements() const {  // checked against the data when read
  std::size_t n = 1;
  for (auto d : shape) n *= static_cast<std::size_t>(d);
  return n;
}

std::size_t Tensor::cols() const {
  std::size_t n = 1;
  for (std::size_t i = 1; i < shape.size(); ++i) n *= static_cast<std::size_t>(shape[i]);
  return n;
}

std::map<std::string, Tensor> read_safetensors(const std::string& path) {
  // A regular file only, read to its size: a FIFO, a device (/dev/zero) or
  // a directory is refused before any read.
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec) throw std::runtime_error(fmt::format("{}: cannot open: {}", path, ec.message()));
  if (!std::filesystem::is_regular_file(status))
    throw std::runtime_error(fmt::format("{}: not a regular file", path));
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) throw std::runtime_error(fmt::format("{}: cannot open: {}", path, ec.message()));
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(fmt::format("{}: cannot open", path));
  std::vector<std::uint8_t> all(static_cast<std::size_t>(size));
  if (!f.read(reinterpret_cast<char*>(all.data()), static_cast<std::streamsize>(size)))
    throw std::runtime_error(fmt::format("{}: cannot read its {} bytes", path, size));
  return parse_safetensors(all, path);
}

std::map<std::string, Tensor> parse_safetensors(const std::vector<std::uint8_t>& all,
                                                const std::string& path) {
  if (all.size() < 8) throw std::runtime_error(fmt::format("{}: shorter than a header", path));
  const auto n = load<std::uint64_t>(all.data());
  if (n > all.size() - 8)
    throw std::runtime_error(
        fmt::format("{}: header of {} bytes in a {}-byte file", path, n, all.size()));
  std::error_code ec;
  const json::value header = json::parse(
      json::string_view(reinterpret_cast<const char*>(all.data()) + 8, static_cast<std::size_t>(n)),
      ec);
  if (ec) throw std::runtime_error(fmt::format("{}: header is not JSON: {}", path, ec.message()));
  const json::object* entries = header.if_object();
  if (!entries) throw std::runtime_error(fmt::format("{}: header is not a JSON object", path));
  const std::vector<std::uint8_t> data(all.begin() + 8 + static_cast<std::ptrdiff_t>(n), all.end());
  std::map<std::string, Tensor> out;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (const auto& [key, e] : *entries) {
    const std::string name(key);
    if (name == "__metadata__") continue;
    out.insert_or_assign(name, parse_entry(path, name, e, data, ranges));
  }
  // No byte in two tensors (the format's rule): the tensors hold at most the
  // file's bytes.
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second)
      throw std::runtime_error(fmt::format("{}: two tensors share data bytes [{}, {})", path,
                                           ranges[i].first,
                                           std::min(ranges[i].second, ranges[i - 1].second)));
  return out;
}

std::vector<float> to_f32(const Tensor& t, const std::string& name) {
  std::vector<float> v(t.elements());
  const std::uint8_t* p = t.bytes.data();
  if (t.dtype == "F32")
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = load<float>(p + 4 * i);
  else if (t.dtype == "BF16")
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = bf16::from_bits(load<std::uint16_t>(p + 2 * i)).to_float();
  else if (t.dtype == "F16")
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = half_to_float(load<std::uint16_t>(p + 2 * i));
  else if (t.dtype == "F64")
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(load<double>(p + 8 * i));
  else
    throw std::invalid_argument(
        fmt::format("tensor {}: dtype {}, expected F32, BF16, F16 or F64", name, t.dtype));
  return v;
}

std::vector<std::int32_t> to_i32(const Tensor& t, const std::string& name) {
  std::vector<std::int32_t> v(t.elements());
  const std::uint8_t* p = t.bytes.data();
  auto narrow = [&](std::int64_t x, std::size_t i) {
    if (x < std::numeric_limits<std::int32_t>::min() ||
        x > std::numeric_limits<std::int32_t>::max())
      throw std::invalid_argument(
          fmt::format("tensor {}: element {} = {} outside int32", name, i, x));
    return static_cast<std::int32_t>(x);
  };
  if (t.dtype == "I32")
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = load<std::int32_t>(p + 4 * i);
  else if (t.dtype == "I64")
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = narrow(load<std::int64_t>(p + 8 * i), i);
  else if (t.dtype == "I16")
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = load<std::int16_t>(p + 2 * i);
  else if (t.dtype == "I8")
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = load<std::int8_t>(p + i);
  else if (t.dtype == "U8" || t.dtype == "F8_E4M3")  // quantized codes: their bytes
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = p[i];
  else
    throw std::invalid_argument(fmt::format(
        "tensor {}: dtype {}, expected I32, I64, I16, I8, U8 or F8_E4M3", name, t.dtype));
  return v;
}

Storage storage_of(const Tensor& t) {
  if (t.dtype == "BF16") return {0x1p-8, 0x1p-134};
  if (t.dtype == "F16") return {0x1p-11, 0x1p-25};
  return {};
}

}  // namespace moecert::tools
