// Core value types shared by every op: bf16, non-owning views, byte ranges
// for alias checks, and the ISA enum.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string_view>
#include <type_traits>

namespace moecert {

/// 16-bit brain float: the top half of an IEEE binary32.
/// Conversion from float rounds to nearest, ties to even; NaN stays NaN (made
/// quiet, sign and top payload bits kept); ±Inf and denormals convert like any
/// other value (no flushing). Conversion to float is exact.
struct bf16 {
  std::uint16_t bits = 0;

  constexpr bf16() = default;
  static constexpr bf16 from_bits(std::uint16_t b) {
    bf16 r;
    r.bits = b;
    return r;
  }
  /// Round-to-nearest-even from float.
  static constexpr bf16 from_float(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign and payload, set quiet bit
      return from_bits(static_cast<std::uint16_t>((u >> 16) | 0x0040u));
    }
    // Add 0x7fff plus the lowest kept bit: halfway cases round to even; the
    // carry may ripple into the exponent, which is exactly rounding up
    // (including to Inf on overflow).
    const std::uint32_t lsb = (u >> 16) & 1u;
    return from_bits(static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16));
  }
  constexpr explicit bf16(float f) : bits(from_float(f).bits) {}
  constexpr float to_float() const {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }
  constexpr explicit operator float() const { return to_float(); }
  constexpr bool is_nan() const { return (bits & 0x7fffu) > 0x7f80u; }
  constexpr bool is_inf() const { return (bits & 0x7fffu) == 0x7f80u; }
  constexpr bool is_finite() const { return (bits & 0x7f80u) != 0x7f80u; }
  friend constexpr bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }  // bitwise
};
static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable_v<bf16>);

/// Half-open byte range [begin, end) of memory, for alias clauses.
struct ByteRange {
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;
  constexpr bool empty() const { return end <= begin; }
  constexpr std::size_t size() const { return empty() ? 0 : end - begin; }
};

/// True when the two ranges share at least one byte. Empty ranges share none.
constexpr bool overlaps(ByteRange a, ByteRange b) {
  return !a.empty() && !b.empty() && a.begin < b.end && b.begin < a.end;
}

/// Non-owning contiguous 1-D view.
template <class T>
struct View {
  T* data = nullptr;
  std::size_t size = 0;

  constexpr T& operator[](std::size_t i) const { return data[i]; }
  constexpr bool empty() const { return size == 0; }
  ByteRange bytes() const {
    const auto b = reinterpret_cast<std::uintptr_t>(data);
    return {b, b + size * sizeof(T)};
  }
  constexpr operator View<const T>() const { return {data, size}; }
};

/// Non-owning row-major matrix view: element (i, j) at data[i * stride + j],
/// stride >= cols (in elements).
template <class T>
struct MatView {
  T* data = nullptr;
  std::size_t rows = 0;
  std::size_t cols = 0;
  std::size_t stride = 0;

  constexpr MatView() = default;
  constexpr MatView(T* d, std::size_t r, std::size_t c) : data(d), rows(r), cols(c), stride(c) {}
  constexpr MatView(T* d, std::size_t r, std::size_t c, std::size_t s)
      : data(d), rows(r), cols(c), stride(s) {}

  constexpr T& operator()(std::size_t i, std::size_t j) const { return data[i * stride + j]; }
  constexpr T* row(std::size_t i) const { return data + i * stride; }
  constexpr bool empty() const { return rows == 0 || cols == 0; }
  /// The bytes the view can touch: from its first element to one past its last.
  ByteRange bytes() const {
    const auto b = reinterpret_cast<std::uintptr_t>(data);
    if (empty()) return {b, b};
    return {b, b + ((rows - 1) * stride + cols) * sizeof(T)};
  }
  constexpr operator MatView<const T>() const { return {data, rows, cols, stride}; }
};

/// Kernel instruction-set levels. `amx_emu` runs the AMX kernel's code on a
/// software tile model and is usable on every machine. The values are the
/// C ABI's (moecert.h); avx2 came last, so it is 4.
enum class Isa : std::uint8_t { scalar = 0, avx512_bf16 = 1, amx_bf16 = 2, amx_emu = 3, avx2 = 4 };

/// The ISA table: every level once, lowest first (the order `isa_rank`
/// gives, amx_emu last), with its name. A new level is one row here, its
/// `Isa` value, its microkernel file and its row in the kernel table
/// (ops/gemm/dispatch.cpp).
struct IsaInfo {
  Isa isa;
  std::string_view name;
  bool hardware;  // runs on the CPU's own instructions (not scalar, not a model)
};

inline constexpr IsaInfo kIsaTable[] = {
    {Isa::scalar, "scalar", false},          {Isa::avx2, "avx2", true},
    {Isa::avx512_bf16, "avx512_bf16", true}, {Isa::amx_bf16, "amx_bf16", true},
    {Isa::amx_emu, "amx_emu", false},
};

inline constexpr std::size_t kIsaCount = std::size(kIsaTable);

/// Every level, lowest first (amx_emu last).
inline constexpr auto kAllIsas = [] {
  std::array<Isa, kIsaCount> a{};
  for (std::size_t i = 0; i < kIsaCount; ++i) a[i] = kIsaTable[i].isa;
  return a;
}();

/// The hardware levels' order: scalar < avx2 < avx512_bf16 < amx_bf16
/// (amx_emu: above them all, as it is listed last); -1 for a value that is
/// no level.
constexpr int isa_rank(Isa isa) {
  for (std::size_t i = 0; i < kIsaCount; ++i)
    if (kIsaTable[i].isa == isa) return static_cast<int>(i);
  return -1;
}

constexpr std::string_view isa_name(Isa isa) {
  const int i = isa_rank(isa);
  return i < 0 ? "unknown" : kIsaTable[i].name;
}

// Each value 0 .. kIsaCount-1 is in the table once (the C ABI's numbers and
// the kernel table's rows are these values), each name once.
static_assert([] {
  for (std::size_t v = 0; v < kIsaCount; ++v) {
    int seen = 0;
    for (const IsaInfo& i : kIsaTable) seen += static_cast<std::size_t>(i.isa) == v;
    if (seen != 1) return false;
  }
  for (std::size_t i = 0; i < kIsaCount; ++i)
    for (std::size_t j = i + 1; j < kIsaCount; ++j)
      if (kIsaTable[i].name == kIsaTable[j].name) return false;
  return true;
}());

}  // namespace moecert
