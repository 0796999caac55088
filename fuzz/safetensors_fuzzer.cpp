// Property, for any bytes read as a safetensors file (`moecert check`'s
// reader, tools/tensor_file.hpp): it yields tensors or refuses with
// std::runtime_error, and nothing else; every tensor it yields holds exactly
// its shape's bytes, inside the file, so the tensors together hold at most
// the file's bytes (no allocation beyond what the input's size justifies);
// converting a tensor to fp32 or int32 gives its element count or refuses
// with std::invalid_argument.
#include <fmt/format.h>

#include <stdexcept>
#include <vector>

#include "fuzz/decode.hpp"
#include "tools/tensor_file.hpp"

using namespace moecert;

namespace {

constexpr const char* kName = "safetensors_fuzzer";

std::size_t width(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  return 1;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<std::uint8_t> bytes(data, data + size);
  std::map<std::string, tools::Tensor> files;
  try {
    files = tools::parse_safetensors(bytes, "input");
  } catch (const std::runtime_error&) {
    return 0;
  } catch (const std::exception& e) {
    fuzz::finding(kName, fmt::format("{} escaped the reader", e.what()));
  }
  std::size_t total = 0;
  for (const auto& [name, t] : files) {
    __int128 elements = 1;
    for (auto dim : t.shape) elements *= dim;
    if (elements * static_cast<__int128>(width(t.dtype)) != static_cast<__int128>(t.bytes.size()))
      fuzz::finding(kName,
                    fmt::format("{}: {} bytes for its shape of {}", name, t.bytes.size(), t.dtype));
    total += t.bytes.size();
    try {
      const std::size_t n =
          t.dtype[0] == 'I' ? tools::to_i32(t, name).size() : tools::to_f32(t, name).size();
      if (n != t.elements()) fuzz::finding(kName, fmt::format("{}: {} values converted", name, n));
    } catch (const std::invalid_argument&) {
      // a dtype the judge does not read, or an I64 outside int32
    }
  }
  if (total > size)
    fuzz::finding(kName, fmt::format("{} tensor bytes from {} input bytes", total, size));
  return 0;
}
