// Property (differential): for fuzzed tiny shapes, routing (-1 slots,
// out-of-range and repeated experts), weights and activations (NaN, Inf,
// denormal and out-of-range bf16 included), packing and the expert forward
// either raise exactly a precondition violation with y untouched, or, on
// every usable ISA and amx_emu, raise nothing at level full: the probes of
// both GEMMs and every y element within its chained bound of the reference.
// Where the hardware has AMX, amx_bf16 and amx_emu agree bit for bit (in y,
// or in the clause both violated).
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "contracts/engine/checks.hpp"
#include "fuzz/decode.hpp"
#include "moecert/experts.hpp"
#include "moecert/isa.hpp"

using namespace moecert;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  const std::size_t e = d.range(1, 4), h = d.range(1, 40), in = d.range(1, 40), k = d.range(1, 3),
                    t = d.range(0, 8);
  auto in_range = [](bf16 v) { return v.is_finite() && detail::bf16_in_range(v); };
  std::vector<bf16> wg(e * in * h), wu(e * in * h), wd(e * h * in), x(t * h);
  bool w_ok = true, x_ok = true;
  for (auto* v : {&wg, &wu, &wd})
    for (auto& b : *v) w_ok = w_ok && in_range(b = d.value_bf16());
  for (auto& b : x) x_ok = x_ok && in_range(b = d.value_bf16());
  experts::PackedExperts packed;
  try {
    ContractScope s{Level::full, Semantic::enforce};
    packed = experts::PackedExperts::pack(e, MatView<const bf16>(wg.data(), e * in, h),
                                          MatView<const bf16>(wu.data(), e * in, h),
                                          MatView<const bf16>(wd.data(), e * h, in));
    if (!w_ok) fuzz::finding("experts_fuzzer", "pack accepted invalid weights");
  } catch (const ContractViolation& v) {
    if (w_ok || v.violation().kind != ClauseKind::pre)
      fuzz::finding("experts_fuzzer", std::string("pack: ") + v.what());
    return 0;
  }
  std::vector<std::int32_t> idx(t * k);
  std::vector<float> wt(t * k);
  bool r_ok = true;
  for (std::size_t r = 0; r < t; ++r) {
    bool tail = false;
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t v = idx[r * k + j] = d.index(e);
      wt[r * k + j] = v == -1 && d.flag() ? 0.0f : std::fabs(d.value_f32());
      r_ok = r_ok && v >= -1 && v < static_cast<std::int32_t>(e) && !(tail && v != -1) &&
             std::isfinite(wt[r * k + j]) && !(v == -1 && wt[r * k + j] != 0);
      for (std::size_t l = 0; l < j; ++l) r_ok = r_ok && !(v >= 0 && idx[r * k + l] == v);
      tail = tail || v == -1;
    }
  }
  const bool valid = x_ok && r_ok;
  fuzz::Outcome amx[2];  // amx_bf16, amx_emu (where the hardware has AMX)
  for (Isa isa : usable_isas()) {
    std::vector<float> y(t * h, 11.0f);
    std::string clause;
    try {
      ContractScope s{Level::full, Semantic::enforce};
      experts::forward(packed, MatView<const bf16>(x.data(), t, h),
                       MatView<const std::int32_t>(idx.data(), t, k),
                       MatView<const float>(wt.data(), t, k), MatView<float>(y.data(), t, h),
                       {.isa = isa});
      if (!valid)
        fuzz::finding("experts_fuzzer", fmt::format("{}: invalid input accepted", isa_name(isa)));
    } catch (const ContractViolation& v) {
      clause = v.clause();
      const bool overflow =
          valid && clause == "experts.forward.y_finite";  // in-range values may still overflow
      if (!overflow && (valid || v.violation().kind != ClauseKind::pre))
        fuzz::finding("experts_fuzzer", fmt::format("{}: {}", isa_name(isa), v.what()));
      if (!overflow)
        for (float f : y)
          if (f != 11.0f)
            fuzz::finding("experts_fuzzer",
                          fmt::format("{}: y written before {}", isa_name(isa), clause));
    }
    if (isa == Isa::amx_bf16 || isa == Isa::amx_emu)
      amx[isa == Isa::amx_emu] = {clause, std::move(y)};
  }
  if (isa_usable(Isa::amx_bf16)) fuzz::expect_same_bits("experts_fuzzer", amx[0], amx[1]);
  return 0;
}
