// The judge's engine (contracts/judge/ops.hpp): an op's runner under
// observe at level full, its violations collected per clause.
#include "contracts/judge/ops.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <boost/json.hpp>
#include <mutex>

#include "contracts/judge/tensors.hpp"
#include "contracts/router/kind.hpp"

namespace moecert::contracts::judge {
namespace {

// The violations of the judgement in progress on this thread (a handler is
// a plain function and process-wide: judgements take turns, see
// judge_op).
std::vector<Violation>& collected() {
  thread_local std::vector<Violation> v;
  return v;
}
void collect(const Violation& v) { collected().push_back(v); }

const std::map<std::string, OpEntry>& ops() {
  static const std::map<std::string, OpEntry> m = [] {
    auto all = router_entries();
    all.merge(experts_entries());
    all.merge(layer_entries());
    return all;
  }();
  return m;
}

// The storage of the outputs: the narrowest among them.
Options options_for(const Tensors& out) {
  Options o{.ties_any_order = true};
  for (const auto& [name, t] : out)
    if (t.unit > o.output_unit) o.output_unit = t.unit, o.output_tiny = t.tiny;
  return o;
}

// The parameters op reads (docs/JUDGE.md): a name outside them is refused
// rather than ignored (a misspelt one would change the verdict silently).
std::vector<std::string> accepted_params(const std::string& op) {
  auto starts = [&](std::string_view prefix) { return op.starts_with(prefix); };
  for (const RouterKindInfo* k : router_kinds())
    if (starts(fmt::format("router.{}.", k->name))) {
      std::vector<std::string> v = {"precision"};
      v.insert(v.end(), k->judge_params.begin(), k->judge_params.end());
      if (op.ends_with(".forward")) v.emplace_back("sorted");  // its slots' order
      return v;
    }
  if (starts("experts.")) return {"precision", "alpha", "audit", "format"};
  std::vector<std::string> layer = {"precision", "router", "alpha", "sorted", "format", "audit"};
  for (const RouterKindInfo* k : router_kinds())  // the layer's router's params
    layer.insert(layer.end(), k->judge_params.begin(), k->judge_params.end());
  return layer;
}

void check_params(const std::string& op, const Params& params) {
  const auto accepted = accepted_params(op);
  for (const auto& [name, value] : params)
    if (std::find(accepted.begin(), accepted.end(), name) == accepted.end())
      throw std::invalid_argument(fmt::format("{}: unknown parameter {}={}, expected one of {}", op,
                                              name, value, fmt::join(accepted, ", ")));
}

}  // namespace

bool Verdict::passed() const {
  for (const auto& c : clauses)
    if (!c.passed) return false;
  return true;
}

std::vector<std::string> judged_ops() {
  std::vector<std::string> names;
  for (const auto& [name, e] : ops()) names.push_back(name);
  return names;
}

Verdict judge_op(const std::string& op, const Tensors& in, const Tensors& out,
                 const Params& params) {
  const auto it = ops().find(op);
  if (it == ops().end())
    throw std::invalid_argument(fmt::format("{}: not an op the judge reads from tensors", op));
  const OpEntry& entry = it->second;
  check_params(op, params);
  Verdict v{op, {}, {}, {}, {}};
  Options options = options_for(out);
  options.slots_any_order = !flag_param(params, "sorted", false);
  options.ties = &v.ties;
  options.skipped_rows = &v.skipped_rows;
  options.errors = &v.errors;
  // One judgement at a time: the handler and the clause counts are the
  // process's (a violation another thread meets meanwhile is recorded in
  // that thread's list, not printed, and still raised under enforce).
  static std::mutex turn;
  const std::lock_guard<std::mutex> lock(turn);
  std::map<std::string, std::uint64_t> before;
  for (const auto& cc : clause_counts()) before[cc.id] = cc.checked;
  collected().clear();
  {
    const Scope judge_scope{options};
    const ContractScope scope{Level::full, Semantic::observe};
    const ViolationHandler previous = set_violation_handler(collect);
    detail::Checker c{op};
    try {
      entry.run(c, in, out, params);
    } catch (...) {
      set_violation_handler(previous);
      throw;
    }
    set_violation_handler(previous);
  }
  std::sort(v.skipped_rows.begin(), v.skipped_rows.end());
  v.skipped_rows.erase(std::unique(v.skipped_rows.begin(), v.skipped_rows.end()),
                       v.skipped_rows.end());
  std::map<std::string, std::uint64_t> after;
  for (const auto& cc : clause_counts()) after[cc.id] = cc.checked;
  std::vector<std::string> families = entry.families;
  if (entry.families_for)
    for (auto& f : entry.families_for(params)) families.push_back(std::move(f));
  for (const auto& info : all_clauses()) {
    const std::string id(info.id);
    bool ours = false;
    for (const auto& f : families) ours = ours || id.rfind(f, 0) == 0;
    if (!ours) continue;
    ClauseResult r{info, after[id] != before[id], true, {}};
    for (const auto& viol : collected())
      if (viol.clause == id) r.passed = false, r.violations.push_back(viol);
    v.clauses.push_back(std::move(r));
  }
  return v;
}

std::string verdict_json(const Verdict& v, const Params& about) {
  namespace json = boost::json;
  json::array clauses, ties;
  for (const auto& c : v.clauses) {
    json::object o{{"id", c.info.id},
                   {"kind", clause_kind_name(c.info.kind)},
                   {"group", group_name(c.info.group)},
                   {"condition", c.info.text},
                   {"verdict", !c.evaluated ? "not evaluated"
                               : c.passed   ? "pass"
                                            : "fail"}};
    if (!c.passed) {
      const Violation& f = c.violations.front();
      o["location"] = f.location, o["observed"] = f.observed, o["expected"] = f.expected;
      o["message"] = f.one_line();
    }
    clauses.push_back(std::move(o));
  }
  for (const auto& t : v.ties)
    ties.push_back(json::object{{"t", t.t},
                                {"chosen", t.a},
                                {"other", t.b},
                                {"score", t.score},
                                {"kind", t.near ? "near" : "exact"}});
  json::array errors;
  auto number = [](double x) { return std::isfinite(x) ? json::value(x) : json::value(nullptr); };
  for (const auto& e : v.errors)
    errors.push_back(json::object{{"output", e.output},
                                  {"relative_error", number(e.relative_error)},
                                  {"relative_worst", number(e.relative_worst)},
                                  {"relative_probable", number(e.relative_probable)}});
  json::object j{{"schema", "moecert-check/1"},
                 {"op", v.op},
                 {"verdict", v.passed() ? "pass" : "fail"},
                 {"clauses", std::move(clauses)},
                 {"ties", std::move(ties)},
                 {"skipped_rows", json::value_from(v.skipped_rows)},
                 {"errors", std::move(errors)}};
  for (const auto& [k, val] : about) j[k] = val;
  return json::serialize(j);
}

}  // namespace moecert::contracts::judge
