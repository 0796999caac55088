// Conformance cases for the engine itself: bf16 conversion, MoeConfig
// validation (every clause provoked), contract semantics, ISA dispatch.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <random>

#include "contracts/bounds/experts.hpp"
#include "contracts/engine/clauses.hpp"
#include "moecert/moecert.hpp"
#include "tools/conform/case.hpp"

namespace moecert::tools {

bool expect(CaseResult& r, bool ok, const std::string& detail) {
  if (!ok && r.verdict != Verdict::fail) {
    r.verdict = Verdict::fail;
    r.detail = detail;
  }
  return ok;
}

void compare_output(CaseResult& r, std::string name, const std::vector<float>& got,
                    const std::vector<bounds::Tracked>& ref, bool audit) {
  std::vector<double> v(ref.size()), b(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i)
    v[i] = ref[i].v, b[i] = bounds::kReferenceSlack * ref[i].e;
  OutputError o{std::move(name)};
  if (got.size() != ref.size()) {
    expect(r, false, fmt::format("{}: {} elements, reference {}", o.name, got.size(), ref.size()));
    r.outputs.push_back(std::move(o));
    return;
  }
  const auto cmp = compare::bounded(got, v, b);
  o.count = cmp.count, o.exceeded = cmp.exceeded;
  o.max_abs_err = cmp.max_abs_err, o.max_rel_err = cmp.max_rel_err;
  o.max_utilization = cmp.max_utilization;
  r.histogram.merge(cmp.histogram);
  r.max_abs_err = std::max(r.max_abs_err, cmp.max_abs_err);
  r.max_rel_err = std::max(r.max_rel_err, cmp.max_rel_err);
  if (cmp.count && !(cmp.max_utilization <= r.max_bound_utilization)) {
    r.max_bound_utilization = cmp.max_utilization;
    r.worst = fmt::format("{}[{}]: got {:.9g}, ref {:.17g}, bound {:.3g}", o.name, cmp.worst,
                          cmp.worst_got, cmp.worst_ref, cmp.worst_bound);
  }
  expect(r, cmp.pass(),
         fmt::format("{} of {} {} elements beyond their bound; worst {}", cmp.exceeded, cmp.count,
                     o.name, r.worst));
  if (audit) {
    const auto a = compare::rounding_audit(got, v);
    expect(r, !a.biased(),
           fmt::format("{}: {} of {} errors toward zero, beyond |fraction - 1/2| <= {:.3f} "
                       "(proofs/bounds.md §11)",
                       o.name, a.toward_zero, a.audited, a.eps));
  }
  r.outputs.push_back(std::move(o));
}

std::string digest_of(const std::vector<float>& v) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const float f : v) {
    const auto bits = std::bit_cast<std::uint32_t>(f);
    for (int i = 0; i < 4; ++i) h = (h ^ ((bits >> (8 * i)) & 0xff)) * 0x100000001b3ull;
  }
  return fmt::format("{:016x}", h);
}

namespace {

// The float nearest to f among bf16 values, ties to even, by exact
// comparison in double: the reference for bf16::from_float.
std::uint16_t bf16_reference(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const auto lo = static_cast<std::uint16_t>(u >> 16);  // truncation, toward zero
  if ((u & 0xffffu) == 0) return lo;
  const auto hi = static_cast<std::uint16_t>(lo + 1);  // next away from zero (may be Inf)
  const double x = std::fabs(static_cast<double>(f));
  const double a = std::fabs(static_cast<double>(bf16::from_bits(lo).to_float()));
  double b = std::fabs(static_cast<double>(bf16::from_bits(hi).to_float()));
  if (std::isinf(b)) b = std::ldexp(1.0, 128);  // rounding treats Inf as 2^128
  const double da = x - a, db = b - x;
  if (da < db) return lo;
  if (db < da) return hi;
  return (lo & 1u) ? hi : lo;
}

CaseResult bf16_roundtrip(const RunContext&) {
  CaseResult r;
  std::uint32_t bad = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const bf16 x = bf16::from_bits(static_cast<std::uint16_t>(b));
    const bf16 y = bf16::from_float(x.to_float());
    const bool ok = x.is_nan() ? (y.is_nan() && y.bits == (x.bits | 0x0040u)) : y.bits == x.bits;
    if (!ok && bad++ == 0) r.worst = fmt::format("bits={:#06x} -> {:#06x}", b, y.bits);
  }
  expect(r, bad == 0,
         fmt::format("{} of 65536 patterns do not round-trip; first {}", bad, r.worst));
  r.detail = r.verdict == Verdict::pass ? "65536 patterns" : r.detail;
  return r;
}

CaseResult bf16_rounding(const RunContext& ctx) {
  CaseResult r;
  std::uint64_t bad = 0, n = 0;
  auto check = [&](float f) {
    ++n;
    const std::uint16_t want = bf16_reference(f);
    const std::uint16_t got = bf16::from_float(f).bits;
    if (got != want) {
      if (bad++ == 0) r.worst = fmt::format("f={:a}: got {:#06x}, want {:#06x}", f, got, want);
      r.max_abs_err = std::max(r.max_abs_err, std::fabs(double(bf16::from_bits(got).to_float()) -
                                                        double(bf16::from_bits(want).to_float())));
    }
  };
  // Every halfway point between consecutive finite bf16 values, both signs,
  // and the points one float ulp either side of it.
  for (std::uint32_t b = 0; b < 0x7f80u; ++b) {
    for (std::uint32_t sign : {0u, 0x80000000u}) {
      const std::uint32_t mid = sign | (b << 16) | 0x8000u;
      for (std::uint32_t u : {mid - 1, mid, mid + 1}) check(std::bit_cast<float>(u));
    }
  }
  std::mt19937_64 rng(ctx.seed);
  for (int i = 0; i < 1000000; ++i) {
    const auto u = static_cast<std::uint32_t>(rng());
    if ((u & 0x7f800000u) == 0x7f800000u) continue;  // NaN and Inf: covered by the round trip
    check(std::bit_cast<float>(u));
  }
  expect(r, bad == 0, fmt::format("{} of {} floats rounded wrongly; first {}", bad, n, r.worst));
  if (r.verdict == Verdict::pass) r.detail = fmt::format("{} floats, ties to even", n);
  return r;
}

// One invalid config per clause, under enforce: the clause must fire with
// exactly its id.
struct BadConfig {
  const ClauseInfo* clause;
  std::function<void(MoeConfig&)> spoil;
};

MoeConfig good_config() {
  MoeConfig c;
  c.experts = 64;
  c.hidden = 2048;
  c.inter = 1408;
  c.topk = 6;
  c.lora_rank = 8;
  c.lora_alpha = 16;
  c.max_tokens = 4096;
  return c;
}

std::vector<BadConfig> bad_configs() {
  namespace k = clauses::config;
  return {
      {&k::kExpertsRange, [](MoeConfig& c) { c.experts = 0; }},
      {&k::kHiddenRange, [](MoeConfig& c) { c.hidden = kMaxDim + 1; }},
      {&k::kInterRange, [](MoeConfig& c) { c.inter = -3; }},
      {&k::kTopkRange, [](MoeConfig& c) { c.topk = 65; }},
      {&k::kRankRange, [](MoeConfig& c) { c.lora_rank = 257; }},
      {&k::kAlphaFinite, [](MoeConfig& c) { c.lora_alpha = std::nan(""); }},
      {&k::kTokensRange, [](MoeConfig& c) { c.max_tokens = 0; }},
      {&k::kRouterKind, [](MoeConfig& c) { c.router = static_cast<RouterKind>(7); }},
      {&k::kProductKeySquare,
       [](MoeConfig& c) {
         c.router = RouterKind::product_key;
         c.experts = 60;
       }},
      {&k::kGroupsDivide,
       [](MoeConfig& c) {
         c.router = RouterKind::sigmoid_topk;
         c.groups = 5;
       }},
      {&k::kTopkGroupRange,
       [](MoeConfig& c) {
         c.router = RouterKind::sigmoid_topk;
         c.groups = 8;
         c.topk_group = 9;
       }},
      {&k::kScalingFinite,
       [](MoeConfig& c) {
         c.router = RouterKind::sigmoid_topk;
         c.scaling = -1;
       }},
  };
}

CaseResult config_clause(const BadConfig& bad) {
  CaseResult r;
  MoeConfig cfg = good_config();
  bad.spoil(cfg);
  ContractScope scope{Level::check, Semantic::enforce};
  try {
    validate(cfg);
    expect(r, false, fmt::format("{} did not fire", bad.clause->id));
  } catch (const ContractViolation& v) {
    if (expect(r, v.clause() == bad.clause->id,
               fmt::format("expected {}, got {}: {}", bad.clause->id, v.clause(), v.what()))) {
      r.clauses_fired.push_back(v.clause());
      r.detail = v.what();
    }
  }
  return r;
}

CaseResult config_valid(const RunContext&) {
  CaseResult r;
  ContractScope scope{Level::full, Semantic::enforce};
  std::vector<MoeConfig> ok;
  ok.push_back(good_config());
  MoeConfig pk = good_config();
  pk.router = RouterKind::product_key;
  pk.experts = 4096;
  ok.push_back(pk);
  MoeConfig ds = good_config();
  ds.router = RouterKind::sigmoid_topk;
  ds.experts = 256;
  ds.groups = 8;
  ds.topk_group = 4;
  ds.topk = 8;
  ds.scaling = 2.5;
  ok.push_back(ds);
  for (const auto& c : ok) {
    try {
      validate(c);
    } catch (const ContractViolation& v) {
      expect(r, false, fmt::format("valid config refused: {}", v.what()));
    }
  }
  if (r.verdict == Verdict::pass) r.detail = fmt::format("{} valid configs accepted", ok.size());
  return r;
}

CaseResult contract_semantics(const RunContext&) {
  CaseResult r;
  MoeConfig cfg = good_config();
  cfg.topk = 0;
  const std::string id(clauses::config::kTopkRange.id);
  const auto before = violation_count(id);
  {  // observe: counted, no throw, handler called
    static int calls;
    calls = 0;
    auto prev = set_violation_handler([](const Violation&) { ++calls; });
    ContractScope scope{Level::check, Semantic::observe};
    bool threw = false;
    try {
      validate(cfg);
      validate(cfg);
    } catch (const ContractViolation&) {
      threw = true;
    }
    set_violation_handler(prev);
    expect(r, !threw, "observe threw");
    expect(r, calls == 2, fmt::format("observe: handler called {} times, expected 2", calls));
    expect(r, violation_count(id) == before + 2,
           fmt::format("observe: count {} expected {}", violation_count(id), before + 2));
  }
  {  // ignore: nothing evaluated
    ContractScope scope{Level::full, Semantic::ignore};
    validate(cfg);
    expect(r, violation_count(id) == before + 2, "ignore evaluated a clause");
  }
  {  // off: nothing evaluated
    ContractScope scope{Level::off, Semantic::enforce};
    validate(cfg);
    expect(r, violation_count(id) == before + 2, "level off evaluated a clause");
  }
  {  // enforce: throws with the clause id
    ContractScope scope{Level::check, Semantic::enforce};
    try {
      validate(cfg);
      expect(r, false, "enforce did not throw");
    } catch (const ContractViolation& v) {
      expect(r, v.clause() == id, fmt::format("enforce threw {}", v.clause()));
    }
  }
  if (r.verdict == Verdict::pass)
    r.detail = "enforce throws, observe counts and continues, ignore/off evaluate nothing";
  return r;
}

CaseResult alias_helper(const RunContext& ctx) {
  CaseResult r;
  std::mt19937_64 rng(ctx.seed);
  // Byte-exact overlap against a brute-force membership test.
  for (int i = 0; i < 20000; ++i) {
    const ByteRange a{rng() % 64, rng() % 64}, b{rng() % 64, rng() % 64};
    bool brute = false;
    for (std::uintptr_t x = 0; x < 64; ++x)
      brute |= (a.begin <= x && x < a.end) && (b.begin <= x && x < b.end);
    if (!expect(r, overlaps(a, b) == brute,
                fmt::format("[{},{}) vs [{},{}): got {}", a.begin, a.end, b.begin, b.end, !brute)))
      break;
  }
  float buf[64];
  MatView<float> m(buf, 4, 8, 16);  // touches buf[0..56)
  expect(r, m.bytes().size() == 56 * sizeof(float), "MatView byte range");
  expect(r, !overlaps(m.bytes(), View<float>{buf + 56, 8}.bytes()), "MatView tail overlap");
  expect(r, overlaps(m.bytes(), View<float>{buf + 55, 1}.bytes()), "MatView last element");
  if (r.verdict == Verdict::pass) r.detail = "20000 random range pairs against brute force";
  return r;
}

CaseResult isa_dispatch(const RunContext&) {
  CaseResult r;
  expect(r, isa_usable(default_isa()), "default ISA not usable");
  expect(r, isa_usable(Isa::scalar) && isa_usable(Isa::amx_emu), "scalar/amx_emu not usable");
  for (Isa isa : kAllIsas) {
    expect(r, !isa_usable(isa) || isa_detected(isa),
           fmt::format("{} usable but not detected", isa_name(isa)));
    expect(r, parse_isa(isa_name(isa)) == isa, "isa names do not round-trip");
  }
  r.detail = fmt::format("default {}", isa_name(default_isa()));
  return r;
}

}  // namespace

void add_core_cases(std::vector<CaseDef>& out) {
  out.push_back({"core.bf16.convert", "roundtrip", "any", "all-65536", "all-patterns", Suite::smoke,
                 Level::off, bf16_roundtrip});
  out.push_back({"core.bf16.convert", "rne", "any", "halfway+1e6", "ties,random", Suite::smoke,
                 Level::off, bf16_rounding});
  out.push_back({"core.config.validate", "valid", "any", "tiny", "normal", Suite::smoke,
                 Level::full, config_valid});
  for (const auto& bad : bad_configs()) {
    std::string variant(bad.clause->id.substr(bad.clause->id.rfind('.') + 1));
    out.push_back({"core.config.validate", "bad_" + variant, "any", "tiny", "invalid", Suite::smoke,
                   Level::check, [bad](const RunContext&) { return config_clause(bad); }});
  }
  out.push_back({"core.contracts.engine", "semantics", "any", "tiny", "invalid", Suite::smoke,
                 Level::check, contract_semantics});
  out.push_back({"core.contracts.alias", "overlaps", "any", "tiny", "random", Suite::smoke,
                 Level::off, alias_helper});
  out.push_back({"core.isa.dispatch", "detect", "any", "none", "none", Suite::smoke, Level::off,
                 isa_dispatch});
}

}  // namespace moecert::tools
