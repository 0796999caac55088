// Property: gemm.matmul given shapes, strides, values (NaN, Inf, denormals,
// out-of-range magnitudes) and byte offsets that may alias A with C either
// raises exactly a precondition violation and leaves every byte of C's
// buffer untouched, or (all preconditions true) raises nothing at level
// full: its postconditions (finite, probe, every element within bound) hold.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "contracts/engine/checks.hpp"
#include "fuzz/decode.hpp"
#include "moecert/gemm.hpp"
#include "moecert/isa.hpp"

using namespace moecert;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  const std::size_t m = d.range(0, 6), k = d.range(1, 40), n = d.range(1, 40);
  std::vector<bf16> wv(n * k);
  for (auto& v : wv) v = d.value_bf16();
  bool w_ok = true;
  for (auto v : wv) w_ok = w_ok && v.is_finite() && detail::bf16_in_range(v);
  gemm::PackedWeights w;
  try {
    ContractScope s{Level::full, Semantic::enforce};
    w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));
    if (!w_ok)
      fuzz::finding("contract_fuzzer", "pack accepted a non-finite or out-of-range weight");
  } catch (const ContractViolation& v) {
    if (w_ok || v.violation().kind != ClauseKind::pre)
      fuzz::finding("contract_fuzzer", std::string("pack: ") + v.what());
    return 0;
  }
  // One buffer holds both A (bf16) and C (fp32) at fuzzed byte offsets.
  const std::size_t a_cols = d.flag() ? k : d.range(1, 40), c_cols = d.flag() ? n : d.range(1, 40);
  std::vector<float> buf(4096, 0.0f);
  const std::size_t a_off = d.range(0, 2000) & ~std::size_t{1}, c_off = d.range(0, 1000) * 4;
  auto* a_ptr = reinterpret_cast<bf16*>(reinterpret_cast<std::uint8_t*>(buf.data()) + a_off);
  for (std::size_t i = 0; i < m * a_cols; ++i) a_ptr[i] = d.value_bf16();
  auto* c_ptr = reinterpret_cast<float*>(reinterpret_cast<std::uint8_t*>(buf.data()) + c_off);
  MatView<const bf16> a(a_ptr, m, a_cols);
  MatView<float> c(c_ptr, m, c_cols);
  bool a_ok = true;
  for (std::size_t i = 0; i < m * a_cols; ++i)
    a_ok = a_ok && a_ptr[i].is_finite() && detail::bf16_in_range(a_ptr[i]);
  const bool valid = a_cols == k && c_cols == n && a_ok && !overlaps(a.bytes(), c.bytes());
  const std::vector<float> before = buf;
  for (Isa isa : usable_isas()) {
    try {
      ContractScope s{Level::full, Semantic::enforce};
      gemm::matmul(a, w, c, isa);
      if (!valid) fuzz::finding("contract_fuzzer", "matmul accepted invalid input");
    } catch (const ContractViolation& v) {
      // Valid input may still overflow to Inf: a c_finite postcondition.
      if (valid && v.clause() == "gemm.matmul.c_finite") continue;
      if (valid || v.violation().kind != ClauseKind::pre)
        fuzz::finding("contract_fuzzer", std::string("matmul: ") + v.what());
      if (std::memcmp(before.data(), buf.data(), buf.size() * 4) != 0)
        fuzz::finding("contract_fuzzer",
                      fmt::format("{} wrote output before failing a precondition", v.clause()));
    }
  }
  return 0;
}
