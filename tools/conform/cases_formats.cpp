// Conformance cases for quantized base weights: the GEMM over a pack of each
// format on every ISA the run covers x shape class x data class, against
// the reference over the exact weights code * scale (binary64) within
// bounds::dot of the weights the kernels compute with plus their
// dequantization's own deviation (proofs/bounds.md §13); bit for bit the
// GEMM over the bf16 pack of those weights, the same for 1 and N threads,
// and for amx_bf16 bit-exact with amx_emu.
#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>

#include <cmath>
#include <cstring>
#include <random>

#include "contracts/engine/compare.hpp"
#include "contracts/gemm/formats.hpp"
#include "contracts/numeric/rounding.hpp"
#include "moecert/formats.hpp"
#include "moecert/gemm.hpp"
#include "moecert/isa.hpp"
#include "support/quantized.hpp"
#include "tools/conform/case.hpp"

namespace moecert::tools {
namespace {

// wide: scales over 2^-20 .. 2^20; zeros: every code of the first block
// (row block x column block) zero; max_codes: every code at its format's
// largest magnitude, signs random.
enum class QData { wide, zeros, max_codes };
const char* qdata_name(QData d) {
  return d == QData::wide ? "wide_scales" : d == QData::zeros ? "zero_block" : "max_codes";
}

fixture::QuantMatrix draw(WeightFormat f, std::size_t n, std::size_t k, QData d,
                          std::mt19937_64& rng) {
  fixture::QuantMatrix q = fixture::random_quantized(f, n, k, rng);
  const FormatInfo& info = format_info(f);
  const std::size_t br = info.block_rows ? info.block_rows : n,
                    bc = info.block_cols ? info.block_cols : k;
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t c = 0; c < k; ++c) {
      if (d == QData::zeros && r < br && c < bc) q.set_code(r, c, 0);
      if (d == QData::max_codes) {
        const bool neg = rng() & 1;
        const unsigned top = f == WeightFormat::fp8_e4m3_block128 ? 0x7eu
                             : f == WeightFormat::int4_group      ? 7u
                                                                  : 127u;
        const unsigned negative = f == WeightFormat::fp8_e4m3_block128 ? 0xfeu
                                  : f == WeightFormat::int4_group      ? 9u
                                                                       : 0x81u;
        q.set_code(r, c, neg ? negative : top);
      }
    }
  return q;
}

CaseResult format_case(WeightFormat f, Isa isa, std::size_t m, std::size_t n, std::size_t k,
                       QData d, const RunContext& ctx) {
  if (!isa_usable(isa)) return CaseResult::only(Verdict::skip, skip_reason(isa));
  CaseResult r;
  std::mt19937_64 rng(ctx.seed ^ (m * 131 + n * 17 + k + static_cast<unsigned>(f)));
  const fixture::QuantMatrix q = draw(f, n, k, d, rng);
  const std::vector<bf16> wh = q.dequantized();
  std::vector<bf16> a(m * k);
  std::normal_distribution<float> nd(0, 1);
  for (auto& x : a) x = bf16(nd(rng));
  const auto packed = gemm::PackedWeights::pack(q.view);
  const auto dense = gemm::PackedWeights::pack(MatView<const bf16>(wh.data(), n, k));
  auto run = [&](const gemm::PackedWeights& w, Isa which) {
    std::vector<float> c(m * n);
    gemm::matmul(MatView<const bf16>(a.data(), m, k), w, MatView<float>(c.data(), m, n), which);
    return c;
  };
  const auto c = with_threads(ctx.threads, [&] { return run(packed, isa); });
  r.deterministic = same_bits(c, with_threads(1, [&] { return run(packed, isa); }));
  const fixture::ExactGemm e = fixture::exact_gemm(a, m, k, q.view, wh);
  r = fill_from(compare::bounded(c, e.ref, e.bound), r);  // fails beyond a bound
  if (r.verdict == Verdict::pass && !same_bits(c, run(dense, isa)))
    r.fail("differs bitwise from the GEMM over the bf16 pack of the dequantized weights");
  if (r.verdict == Verdict::pass && !r.deterministic)
    r.fail("results differ between 1 and N threads");
  if (r.verdict == Verdict::pass && isa == Isa::amx_bf16 &&
      !same_bits(c, run(packed, Isa::amx_emu)))
    r.fail("amx_bf16 and amx_emu differ bitwise");
  if (r.verdict == Verdict::pass)
    r.detail = fmt::format("bit for bit the bf16 pack of the dequantized weights{}",
                           isa == Isa::amx_bf16 ? "; bit-exact with amx_emu" : "");
  return r;
}

}  // namespace

void add_format_cases(std::vector<CaseDef>& out, const std::vector<Isa>& isas) {
  struct S {
    const char* cls;
    std::size_t m, n, k;
    Suite suite;
  };
  // Partial blocks at both edges (fp8's 128 x 128, int4's 128 columns).
  const S shapes[] = {{"odd", 7, 150, 260, Suite::smoke}, {"odd", 33, 300, 520, Suite::def}};
  for (WeightFormat f :
       {WeightFormat::int8_channel, WeightFormat::int4_group, WeightFormat::fp8_e4m3_block128})
    for (Isa isa : isas)
      for (const auto& s : shapes)
        for (QData d : {QData::wide, QData::zeros, QData::max_codes})
          out.push_back(
              {"gemm.matmul.forward", std::string(format_name(f)), std::string(isa_name(isa)),
               fmt::format("{}:M{}_N{}_K{}", s.cls, s.m, s.n, s.k), qdata_name(d), s.suite,
               s.suite == Suite::smoke ? Level::full : Level::check,
               [=](const RunContext& ctx) { return format_case(f, isa, s.m, s.n, s.k, d, ctx); }});
}

}  // namespace moecert::tools
