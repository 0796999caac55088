// Conformance cases for the GEMM and the grouped expert forward: every ISA
// the run covers x shape class x data class; bound utilisation against the
// high-precision reference, determinism across thread counts, and for
// amx_bf16 bit-exact agreement with amx_emu.
#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>

#include <cmath>
#include <cstring>
#include <random>

#include "contracts/engine/checks.hpp"
#include "contracts/engine/compare.hpp"
#include "contracts/experts/experts.hpp"
#include "contracts/judge/ops.hpp"
#include "contracts/probes/verify.hpp"
#include "moecert/experts.hpp"
#include "moecert/gemm.hpp"
#include "moecert/isa.hpp"
#include "tools/conform/case.hpp"

namespace moecert::tools {
namespace {

enum class Data { normal, wide, zeros, near_overflow };
const char* data_name(Data d) {
  switch (d) {
    case Data::normal:
      return "normal";
    case Data::wide:
      return "wide_exponent";
    case Data::zeros:
      return "zeros";
    case Data::near_overflow:
      return "near_overflow";
  }
  return "?";
}

std::vector<bf16> draw(std::mt19937_64& rng, std::size_t n, Data d, float scale) {
  std::normal_distribution<float> nd(0, scale);
  std::uniform_int_distribution<int> ex(-20, 20);
  std::vector<bf16> v(n);
  for (auto& x : v) {
    float f = nd(rng);
    if (d == Data::wide) f = std::ldexp(f, ex(rng));
    if (d == Data::near_overflow) f = std::ldexp(f, 59);  // products near 2^118, sums within 2^128
    if (d == Data::zeros && rng() % 3) f = 0;
    x = bf16(f);
    if (!detail::bf16_in_range(x)) x = bf16(0.0f);
  }
  return v;
}

}  // namespace

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::string skip_reason(Isa isa) {
  return fmt::format(
      "{} not usable on this CPU ({})", isa_name(isa),
      isa == Isa::amx_bf16 ? "no AMX-BF16 tiles or no permission" : "no AVX-512 BF16");
}

CaseResult fill_from(const compare::Bounded& b, CaseResult r) {
  r.max_abs_err = b.max_abs_err;
  r.max_rel_err = b.max_rel_err;
  r.max_bound_utilization = b.max_utilization;
  r.worst = fmt::format("element {}: got {:.9g}, ref {:.17g}, bound {:.3g}", b.worst, b.worst_got,
                        b.worst_ref, b.worst_bound);
  r.histogram.merge(b.histogram);
  if (!b.pass()) {
    r.verdict = Verdict::fail;
    r.detail =
        fmt::format("{} of {} elements beyond their bound; worst {}", b.exceeded, b.count, r.worst);
  }
  return r;
}

namespace {

CaseResult gemm_case(Isa isa, std::size_t m, std::size_t n, std::size_t k, Data d,
                     const RunContext& ctx, bool sampled) {
  CaseResult r;
  if (!isa_usable(isa)) return CaseResult::only(Verdict::skip, skip_reason(isa));
  std::mt19937_64 rng(ctx.seed ^ (m * 131 + n * 17 + k));
  const auto a = draw(rng, m * k, d, 1), wv = draw(rng, n * k, d, 1);
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));
  auto run = [&](Isa which) {
    std::vector<float> c(m * n);
    gemm::matmul(MatView<const bf16>(a.data(), m, k), w, MatView<float>(c.data(), m, n), which);
    return c;
  };
  const auto c = with_threads(ctx.threads, [&] { return run(isa); });
  r.deterministic = same_bits(c, with_threads(1, [&] { return run(isa); }));
  std::vector<std::size_t> rows;
  for (std::size_t i = 0; i < m; i += sampled ? std::max<std::size_t>(1, m / 8) : 1)
    rows.push_back(i);
  r = fill_from(verify::check_rows_gemm_nt(MatView<const bf16>(a.data(), m, k),
                                           MatView<const bf16>(wv.data(), n, k),
                                           MatView<const float>(c.data(), m, n), rows),
                r);
  const auto probe = verify::probe_gemm_nt(MatView<const bf16>(a.data(), m, k),
                                           MatView<const bf16>(wv.data(), n, k),
                                           MatView<const float>(c.data(), m, n));
  if (!probe.pass && r.verdict != Verdict::fail)
    r.fail(fmt::format("probe: residual {:.6g} > {:.6g} at row {}", probe.residual, probe.threshold,
                       probe.row));
  if (!r.deterministic && r.verdict != Verdict::fail)
    r.fail("results differ between 1 and N threads");
  if (r.verdict == Verdict::pass) {
    r.detail =
        fmt::format("{} rows compared, probe max ratio {:.3g}", rows.size(), probe.max_ratio);
    if (isa == Isa::amx_bf16) {
      const bool exact = same_bits(c, run(Isa::amx_emu));
      r.detail += exact ? "; bit-exact with amx_emu" : "";
      if (!exact) r.fail("amx_bf16 and amx_emu differ bitwise");
    }
  }
  return r;
}

enum class Routing { normal, one_expert, empty_experts, empty_slots, sparse };
const char* routing_name(Routing r) {
  switch (r) {
    case Routing::normal:
      return "normal";
    case Routing::one_expert:
      return "all_on_one_expert";
    case Routing::empty_experts:
      return "empty_experts";
    case Routing::empty_slots:
      return "minus1_slots";
    case Routing::sparse:
      return "sparse_routing";
  }
  return "?";
}

// y judged by `moecert check`'s judge as another implementation's under the
// declared precision `mixed` (every clause of experts.forward it applies,
// with `audit` the rounding audit); fails the case on any failed clause.
void judged_as_foreign(CaseResult& r, MatView<const bf16> x, MatView<const std::int32_t> idx,
                       MatView<const float> w, const std::vector<bf16> (&weights)[3], std::size_t e,
                       const std::vector<float>& y, bool audit) {
  namespace jg = contracts::judge;
  auto tensor = [](const bf16* v, std::size_t rows, std::size_t cols) {
    jg::Tensor t{.rows = rows, .cols = cols};
    for (std::size_t q = 0; q < rows * cols; ++q) t.f.push_back(v[q].to_float());
    return t;
  };
  const std::size_t h = x.cols, i = weights[2].size() / (e * h);
  const jg::Tensors in{
      {"x", tensor(x.data, x.rows, h)},
      {"idx",
       {.i = {idx.data, idx.data + idx.rows * idx.cols}, .rows = idx.rows, .cols = idx.cols}},
      {"weights", {.f = {w.data, w.data + w.rows * w.cols}, .rows = w.rows, .cols = w.cols}},
      {"w_gate", tensor(weights[0].data(), e * i, h)},
      {"w_up", tensor(weights[1].data(), e * i, h)},
      {"w_down", tensor(weights[2].data(), e * h, i)}};
  const auto v = jg::judge_op("experts.forward", in, {{"y", {.f = y, .rows = x.rows, .cols = h}}},
                              {{"precision", "mixed"}, {"audit", audit ? "true" : "false"}});
  for (const auto& c : v.clauses)
    if (!c.passed) r.fail("judged as another implementation: " + c.violations.front().one_line());
}

CaseResult experts_case(Isa isa, std::size_t e, std::size_t h, std::size_t i, std::size_t k,
                        std::size_t t, Routing routing, Data data, const RunContext& ctx) {
  if (!isa_usable(isa)) return CaseResult::only(Verdict::skip, skip_reason(isa));
  std::mt19937_64 rng(ctx.seed ^ (e * 7 + h * 11 + i * 13 + t));
  const std::vector<bf16> weights[3] = {draw(rng, e * i * h, data, 1 / std::sqrt(float(h))),
                                        draw(rng, e * i * h, data, 1 / std::sqrt(float(h))),
                                        draw(rng, e * h * i, data, 1 / std::sqrt(float(i)))};
  const auto &wg = weights[0], &wu = weights[1], &wd = weights[2];
  const auto x = draw(rng, t * h, data, 1);
  std::vector<std::int32_t> idx(t * k, -1);
  std::vector<float> w(t * k, 0.0f);
  const std::size_t usable_experts =
      routing == Routing::empty_experts ? std::max<std::size_t>(1, e / 2) : e;
  for (std::size_t r = 0; r < t; ++r) {
    std::vector<std::int32_t> perm(usable_experts);
    for (std::size_t q = 0; q < usable_experts; ++q) perm[q] = static_cast<std::int32_t>(q);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::size_t valid = std::min(k, usable_experts);
    if (routing == Routing::one_expert) valid = 1, perm[0] = 0;
    if (routing == Routing::empty_slots) valid = rng() % (valid + 1);
    if (routing == Routing::sparse)
      valid = rng() % 4 == 0 ? 1 : 0;  // a quarter of the tokens, one expert each
    for (std::size_t j = 0; j < valid; ++j) {
      idx[r * k + j] = perm[j];
      w[r * k + j] = std::uniform_real_distribution<float>(0, 1)(rng);
    }
  }
  const auto packed = experts::PackedExperts::pack(e, MatView<const bf16>(wg.data(), e * i, h),
                                                   MatView<const bf16>(wu.data(), e * i, h),
                                                   MatView<const bf16>(wd.data(), e * h, i));
  MatView<const bf16> xv(x.data(), t, h);
  MatView<const std::int32_t> iv(idx.data(), t, k);
  MatView<const float> wv(w.data(), t, k);
  auto run = [&](Isa which) {
    std::vector<float> y(t * h);
    experts::forward(packed, xv, iv, wv, MatView<float>(y.data(), t, h), {.isa = which});
    return y;
  };
  const auto y = with_threads(ctx.threads, [&] { return run(isa); });
  CaseResult r;
  r.deterministic = same_bits(y, with_threads(1, [&] { return run(isa); }));
  const auto ref = contracts::experts_forward_reference(packed, xv, iv, wv);
  r = fill_from(compare::bounded(y, ref.y, ref.bound), r);
  if (!r.deterministic && r.verdict != Verdict::fail)
    r.fail("results differ between 1 and N threads");
  // Wide exponents: one operand dominates a row, whose errors are then not
  // independent (the audit's model): the bounds only.
  if (r.verdict == Verdict::pass)
    judged_as_foreign(r, xv, iv, wv, weights, e, y, data != Data::wide);
  if (r.verdict == Verdict::pass) {
    r.detail = fmt::format(
        "{} tokens, chained bound (proofs/bounds.md §10); judged from tensors as a "
        "mixed-precision implementation",
        t);
    if (isa == Isa::amx_bf16) {
      const bool exact = same_bits(y, run(Isa::amx_emu));
      r.detail += exact ? "; bit-exact with amx_emu" : "";
      if (!exact) r.fail("amx_bf16 and amx_emu differ bitwise");
    }
  }
  return r;
}

}  // namespace

void add_kernel_cases(std::vector<CaseDef>& out, const std::vector<Isa>& isas) {
  struct G {
    const char* cls;
    std::size_t m, n, k;
    Suite suite;
    bool sampled;
  };
  const G gemms[] = {{"tiny", 1, 16, 32, Suite::smoke, false},
                     {"odd", 37, 50, 100, Suite::smoke, false},
                     {"odd", 65, 33, 257, Suite::def, false},
                     {"realistic", 256, 1024, 2048, Suite::def, true},
                     {"realistic", 1024, 2816, 2048, Suite::full, true}};
  for (Isa isa : isas)
    for (const auto& g : gemms)
      for (Data d : {Data::normal, Data::wide, Data::zeros, Data::near_overflow}) {
        if ((g.suite == Suite::full && d != Data::normal) ||
            (d == Data::near_overflow && g.k > 300))
          continue;
        out.push_back({"gemm.matmul.forward", "bf16_fp32", std::string(isa_name(isa)),
                       fmt::format("{}:M{}_N{}_K{}", g.cls, g.m, g.n, g.k), data_name(d), g.suite,
                       g.suite == Suite::smoke ? Level::full : Level::check,
                       [=](const RunContext& ctx) {
                         return gemm_case(isa, g.m, g.n, g.k, d, ctx, g.sampled);
                       }});
      }
  struct X {
    const char* cls;
    std::size_t e, h, i, k, t;
    Suite suite;
  };
  const X xs[] = {{"one_token", 4, 40, 24, 2, 1, Suite::smoke},
                  {"tiny", 2, 16, 16, 1, 3, Suite::smoke},
                  {"odd", 5, 40, 33, 2, 23, Suite::smoke},
                  {"odd", 9, 72, 50, 3, 61, Suite::def},
                  {"realistic", 16, 512, 384, 4, 128, Suite::def},
                  {"realistic", 64, 2048, 1408, 6, 64, Suite::full}};
  for (Isa isa : isas)
    for (const auto& x : xs)
      for (Routing rt : {Routing::normal, Routing::one_expert, Routing::empty_experts,
                         Routing::empty_slots, Routing::sparse}) {
        if (x.suite != Suite::smoke && rt != Routing::normal && rt != Routing::empty_slots)
          continue;
        out.push_back({"experts.forward", "swiglu", std::string(isa_name(isa)),
                       fmt::format("{}:E{}_H{}_I{}_K{}_T{}", x.cls, x.e, x.h, x.i, x.k, x.t),
                       routing_name(rt), x.suite,
                       x.suite == Suite::smoke ? Level::full : Level::check,
                       [=](const RunContext& ctx) {
                         return experts_case(isa, x.e, x.h, x.i, x.k, x.t, rt, Data::normal, ctx);
                       }});
      }
  // Inputs and weights with exponents spread over 2^-20 .. 2^20.
  for (Isa isa : isas)
    out.push_back({"experts.forward", "swiglu", std::string(isa_name(isa)), "odd:E5_H40_I33_K2_T23",
                   data_name(Data::wide), Suite::smoke, Level::full, [=](const RunContext& ctx) {
                     return experts_case(isa, 5, 40, 33, 2, 23, Routing::normal, Data::wide, ctx);
                   }});
}

}  // namespace moecert::tools
