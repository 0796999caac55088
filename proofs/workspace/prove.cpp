// The workspace proof (proofs/workspace.md): the planner of
// ops/workspace/planner.hpp, instantiated with z3 integer expressions over
// a symbolic config, must give, for every config within the limits,
//   (1) no intermediate size or offset of 2^64 or more,
//   (2) co-live buffers disjoint,
//   (3) every buffer inside the total, every offset a multiple of 64.
// Each obligation is checked by asking z3 for a config that violates it
// (unsat = proved). With --flaw the test-only broken planner is checked
// instead, and the run succeeds only if z3 finds and prints a counterexample.
#include <fmt/format.h>
#include <z3++.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "ops/workspace/planner.hpp"

namespace {

z3::context& ctx() {
  static z3::context c;
  return c;
}

z3::expr num(std::uint64_t x) { return ctx().int_val(static_cast<std::uint64_t>(x)); }

// Overflow (obligation 1) is proved by induction over the planner's
// expression DAG: every value the planner computes carries a constant upper
// bound `hi` (and is >= 0); for each +, *, / and max/min node, z3 proves
// that operands within their bounds give a result within the node's bound
// (a lemma over fresh variables, so the solver never sees the whole
// nonlinear term at once). The leaves' bounds are the config limits. Every
// node's bound below 2^64 is then obligation 1.
struct Lemmas {
  int proved = 0;
  std::vector<std::string> failed;
};
Lemmas& lemmas() {
  static Lemmas l;
  return l;
}
std::vector<z3::expr>& bounds_seen() {
  static std::vector<z3::expr> v;
  return v;
}

// Checks: 0 <= x <= ha, 0 <= y <= hb  implies  0 <= op(x, y) <= h.
template <class Op>
z3::expr lemma(const char* name, const z3::expr& ha, const z3::expr& hb, Op op) {
  const z3::expr h = op(ha, hb).simplify();
  bounds_seen().push_back(h);
  // The same lemma (operation and operand bounds) is proved once.
  static std::set<std::string> known;
  if (!known.insert(fmt::format("{} {} {}", name, ha.to_string(), hb.to_string())).second) return h;
  z3::expr x = ctx().int_const("x"), y = ctx().int_const("y");
  z3::solver solver(ctx());
  solver.add(x >= 0 && x <= ha && y >= 0 && y <= hb);
  solver.add(!(op(x, y) >= 0 && op(x, y) <= h));
  if (solver.check() == z3::unsat)
    ++lemmas().proved;
  else
    lemmas().failed.push_back(
        fmt::format("{} with operands <= {}, {}", name, ha.to_string(), hb.to_string()));
  return h;
}

// A product of two non-constants becomes a fresh variable m >= 0, its
// definition m = a * b kept aside: obligations 2 and 3 follow from the
// placement's structure (sums and maxima of non-negative sizes), so they are
// first proved with products as free non-negative values - linear
// arithmetic, which is stronger than needed and fast. Only when that fails
// are the definitions added, so that a counterexample is a real config.
std::vector<z3::expr>& atoms() {
  static std::vector<z3::expr> v;
  return v;
}
std::vector<z3::expr>& definitions() {
  static std::vector<z3::expr> v;
  return v;
}
z3::expr atom(const z3::expr& product) {
  z3::expr m = ctx().int_const(fmt::format("m{}", atoms().size()).c_str());
  atoms().push_back(m);
  definitions().push_back(m == product);
  return m;
}

struct Z {
  z3::expr e, hi;
  explicit Z(std::uint64_t x) : e(num(x)), hi(num(x)) {}
  Z(z3::expr x, z3::expr h) : e(std::move(x)), hi(std::move(h)) {}
  friend Z operator+(const Z& a, const Z& b) {
    return {a.e + b.e,
            lemma("+", a.hi, b.hi, [](const z3::expr& x, const z3::expr& y) { return x + y; })};
  }
  friend Z operator*(const Z& a, const Z& b) {
    const z3::expr h =
        lemma("*", a.hi, b.hi, [](const z3::expr& x, const z3::expr& y) { return x * y; });
    if (a.e.is_numeral() || b.e.is_numeral()) return {a.e * b.e, h};
    return {atom(a.e * b.e), h};
  }
  // By a positive constant only (round_up).
  friend Z operator/(const Z& a, const Z& b) {
    return {a.e / b.e,
            lemma("/", a.hi, b.hi, [&](const z3::expr& x, const z3::expr&) { return x / b.e; })};
  }
  friend Z max_of(const Z& a, const Z& b) {
    auto f = [](const z3::expr& x, const z3::expr& y) { return z3::ite(x >= y, x, y); };
    return {f(a.e, b.e), lemma("max", a.hi, b.hi, f)};
  }
  friend Z min_of(const Z& a, const Z& b) {
    auto f = [](const z3::expr& x, const z3::expr& y) { return z3::ite(x <= y, x, y); };
    return {f(a.e, b.e), lemma("min", a.hi, b.hi, f)};
  }
};

struct Symbols {
  z3::expr E = ctx().int_const("E"), H = ctx().int_const("H"), I = ctx().int_const("I"),
           K = ctx().int_const("K"), r = ctx().int_const("r"), T = ctx().int_const("T"),
           R = ctx().int_const("router_out");
  // The documented limits (include/moecert/config.hpp; proofs/workspace.md).
  z3::expr limits() const {
    return E >= 1 && E <= 65536 && H >= 1 && H <= 65536 && I >= 1 && I <= 65536 && K >= 1 &&
           K <= 64 && K <= E && r >= 0 && r <= 256 && T >= 0 && T <= (1 << 20) && R >= 1 &&
           R <= 2 * E;
  }
};

std::string largest(const std::vector<z3::expr>& v) {
  z3::expr m = num(0);
  for (const auto& h : v) m = z3::ite(h >= m, h, m).simplify();
  return m.to_string();
}

std::string config_of(const z3::model& m, const Symbols& s) {
  auto v = [&](const z3::expr& x) { return m.eval(x, true).get_decimal_string(0); };
  return fmt::format("E={} H={} I={} K={} r={} T={} router_out={}", v(s.E), v(s.H), v(s.I), v(s.K),
                     v(s.r), v(s.T), v(s.R));
}

// Returns a counterexample config to `claim` under the limits, or "".
std::string refute(const Symbols& s, const z3::expr& claim) {
  z3::solver solver(ctx());
  solver.add(s.limits());
  for (const auto& m : atoms()) solver.add(m >= 0);
  solver.add(!claim);
  if (solver.check() == z3::unsat) return "";  // proved even for free products
  for (const auto& d : definitions()) solver.add(d);
  z3::params p(ctx());
  p.set("timeout", 60000u);
  solver.set(p);
  switch (solver.check()) {
    case z3::unsat:
      return "";
    case z3::sat:
      return config_of(solver.get_model(), s);
    default:
      return "unknown (z3 could not decide within 60 s)";
  }
}

template <moecert::workspace::Flaw flaw>
int prove(bool training, int& obligations) {
  constexpr bool stop_at_first = flaw != moecert::workspace::Flaw::none;
  using namespace moecert::workspace;
  const Symbols s;
  lemmas() = {};
  bounds_seen().clear();
  atoms().clear();
  definitions().clear();
  const Dims<Z> d{Z(s.E, num(65536)), Z(s.H, num(65536)),   Z(s.I, num(65536)),    Z(s.K, num(64)),
                  Z(s.r, num(256)),   Z(s.T, num(1 << 20)), Z(s.R, num(2 * 65536))};
  Z total(0);
  const auto bufs = plan_buffers<Z, flaw>(d, training, total);
  const Z weights = packed_weight_bytes(d, training);
  // Every weight format's packed bytes too: their nodes' bounds enter (1).
  for (const moecert::FormatInfo& f : moecert::kFormatTable)
    (void)packed_weight_bytes(d, training, f);
  const std::string mode = training ? "training" : "forward";
  int failed = 0;
  auto obligation = [&](const std::string& what, const z3::expr& claim) {
    ++obligations;
    if (std::getenv("PROOF_VERBOSE")) fmt::print("{}\n", what), std::fflush(stdout);
    if (stop_at_first && failed > 0) return;
    const std::string cex = refute(s, claim);
    if (cex.empty()) return;
    ++failed;
    fmt::print("FAILED [{}] {}\n  counterexample: {}\n", mode, what, cex);
  };
  // (1) Every node's bound below 2^64, each bound a proved lemma.
  {
    ++obligations;
    const z3::expr max64 = ctx().int_val("18446744073709551615");
    std::string worst;
    for (const auto& h : bounds_seen())
      if (!z3::eq((h <= max64).simplify(), ctx().bool_val(true))) worst = h.to_string();
    for (const auto& f : lemmas().failed) fmt::print("FAILED [{}] lemma {}\n", mode, f);
    if (!worst.empty()) fmt::print("FAILED [{}] a value may reach {} >= 2^64\n", mode, worst);
    if (!worst.empty() || !lemmas().failed.empty()) ++failed;
    if (std::getenv("PROOF_VERBOSE"))
      fmt::print("{} node lemmas proved, largest bound {}\n", lemmas().proved,
                 largest(bounds_seen()));
  }
  // (2) and (3).
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    const auto& a = bufs[i];
    obligation(fmt::format("{} aligned and inside the total", a.name),
               z3::mod(a.offset.e, num(kAlign)) == 0 && a.offset.e >= 0 && a.end.e <= total.e &&
                   a.offset.e + a.bytes.e <= a.end.e);
    for (std::size_t j = i + 1; j < bufs.size(); ++j) {
      const auto& b = bufs[j];
      if (!co_live(a.first, a.last, b.first, b.last)) continue;
      obligation(fmt::format("{} and {} (co-live) disjoint", a.name, b.name),
                 a.end.e <= b.offset.e || b.end.e <= a.offset.e);
    }
  }
  return failed;
}

}  // namespace

int main(int argc, char** argv) {
  using moecert::workspace::Flaw;
  const bool flaw = argc > 1 && std::strcmp(argv[1], "--flaw") == 0;
  int obligations = 0, failed = 0;
  for (const bool training : {true, false})
    failed += flaw ? prove<Flaw::stack_on_previous_only>(training, obligations)
                   : prove<Flaw::none>(training, obligations);
  if (flaw) {
    fmt::print("broken planner: {} of {} obligations refuted\n", failed, obligations);
    return failed > 0 ? 0 : 1;
  }
  fmt::print("workspace plan: {} obligations proved for every config within the limits{}\n",
             obligations - failed, failed ? fmt::format(", {} FAILED", failed) : "");
  return failed == 0 ? 0 : 1;
}
