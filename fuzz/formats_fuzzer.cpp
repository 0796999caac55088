// Property (differential): for a fuzzed format, tiny shapes and raw codes
// and scales (any bytes: invalid codes, and NaN, Inf, zero, negative and
// denormal scales), packing either raises exactly a precondition violation
// or reads back every element as the judge dequantizes it, with zero
// padding; the scalar and AVX-512 decoders agree bit for bit on every panel
// (denormal products included, packed at check); and at level full a GEMM
// over the pack on every usable ISA raises nothing (probes, every element
// within its bound).
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "contracts/gemm/formats.hpp"
#include "fuzz/decode.hpp"
#include "moecert/contracts.hpp"
#include "moecert/formats.hpp"
#include "moecert/gemm.hpp"
#include "moecert/isa.hpp"
#include "ops/gemm/ukernel.hpp"

using namespace moecert;

namespace {

// The pack of v at `level`, or nothing when a precondition stopped it (any
// other violation is a finding).
bool pack_at(Level level, const QuantView& v, gemm::PackedWeights& out) {
  try {
    ContractScope s{level, Semantic::enforce};
    out = gemm::PackedWeights::pack(v);
    return true;
  } catch (const ContractViolation& e) {
    if (e.violation().kind != ClauseKind::pre)
      fuzz::finding("formats_fuzzer", fmt::format("pack raised a {}", e.what()));
    return false;
  }
}

void check_decoders(const gemm::PackedWeights& p) {
  const std::size_t panels = p.np() / gemm::kPanel, n = panels * p.kp() * gemm::kPanel;
  std::vector<bf16> a(n), b(n);
  p.decode_panels(0, panels, a.data(), gemm::decode_scalar);
  for (std::size_t q = 0; q < n; ++q) {
    const std::size_t panel = q / (p.kp() * gemm::kPanel), r = q % (p.kp() * gemm::kPanel);
    if (a[q].bits != p.at(panel * gemm::kPanel + (r / 2) % gemm::kPanel, r / 32 * 2 + r % 2).bits)
      fuzz::finding("formats_fuzzer", fmt::format("decode_scalar element {} is not at()'s", q));
  }
  if (!isa_usable(Isa::avx512_bf16)) return;
  p.decode_panels(0, panels, b.data(), gemm::decode_avx512);
  for (std::size_t q = 0; q < n; ++q)
    if (a[q].bits != b[q].bits)
      fuzz::finding("formats_fuzzer",
                    fmt::format("decoders differ at element {}: 0x{:04x}, 0x{:04x}", q, a[q].bits,
                                b[q].bits));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  const auto f = static_cast<WeightFormat>(d.range(1, kFormatCount - 1));
  QuantView v;
  v.format = f, v.rows = d.range(1, 40), v.cols = d.range(1, 300);
  v.stride = v.row_bytes();
  // Codes: raw bytes in one input of 8, else made valid (an invalid code
  // nudged to its neighbour); scales: usually 2^[-20, 20] x [1, 2), one in
  // sixteen a raw bit pattern.
  const bool raw = (d.u8() & 7) == 0;
  std::vector<std::uint8_t> codes(v.rows * v.stride);
  for (auto& c : codes) {
    c = d.u8();
    if (raw) continue;
    if (f == WeightFormat::int4_group) {
      if ((c & 15u) == 8) c ^= 1;
      if ((c >> 4) == 8) c ^= 16;
    } else if (!contracts::code_valid(f, c)) {
      c ^= 1;
    }
  }
  v.scale_stride = v.scale_cols();
  std::vector<float> scales(v.scale_rows() * v.scale_stride);
  for (auto& s : scales) {
    const std::uint8_t sel = d.u8();
    if ((sel & 15) == 0) {
      const std::uint32_t bits = d.u32();
      std::memcpy(&s, &bits, 4);
    } else {
      s = std::ldexp(1.0f + d.u8() / 256.0f, static_cast<int>(d.u8() % 41) - 20);
    }
  }
  v.codes = codes.data(), v.scales = scales.data();
  gemm::PackedWeights p;
  if (!pack_at(Level::check, v, p)) return 0;
  for (std::size_t n = 0; n < p.np(); ++n)
    for (std::size_t k = 0; k < p.kp(); ++k) {
      const bf16 want = n < v.rows && k < v.cols ? contracts::kernel_weight(v, n, k) : bf16{};
      if (p.at(n, k).bits != want.bits)
        fuzz::finding("formats_fuzzer", fmt::format("at({}, {}) is not the judge's weight", n, k));
    }
  check_decoders(p);
  if (!pack_at(Level::full, v, p)) return 0;
  const std::size_t m = d.range(1, 9);
  std::vector<bf16> a(m * v.cols);
  for (auto& x : a) x = bf16(static_cast<float>(static_cast<int>(d.u8() % 9) - 4));
  std::vector<float> c(m * v.rows);
  for (Isa isa : usable_isas()) try {
      ContractScope s{Level::full, Semantic::enforce};
      gemm::matmul(MatView<const bf16>(a.data(), m, v.cols), p, MatView<float>(c.data(), m, v.rows),
                   isa);
    } catch (const ContractViolation& e) {
      if (e.clause() != "gemm.matmul.c_finite")  // products of in-range values may overflow
        fuzz::finding("formats_fuzzer", fmt::format("{}: {}", isa_name(isa), e.what()));
    }
  return 0;
}
