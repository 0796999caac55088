// The routers' clauses on another implementation's tensors
// (contracts/judge_router.hpp).
#include "contracts/judge_router.hpp"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "contracts/engine.hpp"
#include "contracts/router.hpp"

namespace moecert::contracts::judge {
namespace {

// The violations of the judgement in progress on this thread (a handler is
// a plain function and process-wide: judgements take turns, see
// judge_router).
std::vector<Violation>& collected() {
  thread_local std::vector<Violation> v;
  return v;
}
void collect(const Violation& v) { collected().push_back(v); }

const Tensor& need(const Tensors& f, const char* side, const std::string& name) {
  const auto it = f.find(name);
  if (it == f.end()) throw std::invalid_argument(fmt::format("{}: no tensor '{}'", side, name));
  return it->second;
}
MatView<const float> values(const Tensors& f, const char* side, const std::string& name) {
  const Tensor& t = need(f, side, name);
  if (t.f.size() != t.rows * t.cols)
    throw std::invalid_argument(
        fmt::format("{}: tensor '{}' holds indices, expected values", side, name));
  return {t.f.data(), t.rows, t.cols};
}
MatView<const std::int32_t> indices(const Tensors& f, const char* side, const std::string& name) {
  const Tensor& t = need(f, side, name);
  if (t.i.size() != t.rows * t.cols)
    throw std::invalid_argument(
        fmt::format("{}: tensor '{}' holds values, expected indices", side, name));
  return {t.i.data(), t.rows, t.cols};
}
// The preconditions take the outputs as writable views; the judge never writes them.
template <class T>
MatView<T> writable(MatView<const T> v) {
  return {const_cast<T*>(v.data), v.rows, v.cols, v.stride};
}

bool flag_param(const Params& m, const std::string& name, bool def) {
  const auto it = m.find(name);
  if (it == m.end()) return def;
  if (it->second == "true" || it->second == "1") return true;
  if (it->second == "false" || it->second == "0") return false;
  throw std::invalid_argument(fmt::format("{}={}: expected true or false", name, it->second));
}

double number_param(const Params& m, const std::string& name, double def) {
  const auto it = m.find(name);
  if (it == m.end()) return def;
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != it->second.size())
    throw std::invalid_argument(fmt::format("{}={}: expected a number", name, it->second));
  return v;
}

std::size_t count_param(const Params& m, const std::string& name, std::size_t def) {
  const double v = number_param(m, name, static_cast<double>(def));
  if (!(v >= 1 && v <= 1e9 && v == std::floor(v)))
    throw std::invalid_argument(fmt::format("{}={}: expected a count >= 1", name, v));
  return static_cast<std::size_t>(v);
}

router::SigmoidTopkParams sigmoid_params(const Params& m) {
  return {count_param(m, "groups", 1), count_param(m, "topk_group", 1),
          static_cast<float>(number_param(m, "scaling", 1.0))};
}

// A 1-D tensor (any shape with one row or one column) as a vector view.
View<const float> vector_of(const Tensors& f, const char* side, const std::string& name) {
  const auto m = values(f, side, name);
  if (m.rows != 1 && m.cols != 1)
    throw std::invalid_argument(fmt::format("{}: tensor '{}' is {}x{}, expected one dimension",
                                            side, name, m.rows, m.cols));
  return {m.data, m.rows * m.cols};
}

router::KeyWeights key_weights(const Params& m) {
  const auto it = m.find("weights");
  if (it == m.end() || it->second == "softmax") return router::KeyWeights::softmax;
  if (it->second == "exp") return router::KeyWeights::exp;
  if (it->second == "raw") return router::KeyWeights::raw;
  throw std::invalid_argument(fmt::format("weights={}: expected softmax, exp or raw", it->second));
}

// The op's clauses, pre then post, on the files' tensors (c: its checker).
using Run = std::function<void(detail::Checker& c, const Tensors& in, const Tensors& out,
                               const Params& params)>;

void softmax_forward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& p) {
  const bool renorm = flag_param(p, "renormalize", true);
  const auto z = values(in, "inputs", "z"), w = values(out, "outputs", "w");
  const auto idx = indices(out, "outputs", "idx");
  softmax_topk_pre(c, z, z.bytes(), writable(idx), writable(w));
  if (!c.stop()) softmax_topk_post(c, z, idx, w, renorm);
}

void softmax_backward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& p) {
  const bool renorm = flag_param(p, "renormalize", true);
  const auto z = values(in, "inputs", "z"), g = values(in, "inputs", "g");
  const auto dz = values(out, "outputs", "dz");
  const auto idx = indices(in, "inputs", "idx");
  softmax_topk_backward_pre(c, z, idx, g, writable(dz));
  if (!c.stop()) softmax_topk_backward_post(c, z, idx, g, dz, renorm);
}

void sigmoid_forward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& p) {
  const auto params = sigmoid_params(p);
  const auto z = values(in, "inputs", "z"), w = values(out, "outputs", "w");
  const auto bias = vector_of(in, "inputs", "bias");
  const auto idx = indices(out, "outputs", "idx");
  sigmoid_topk_pre(c, z, z.bytes(), bias, params, writable(idx), writable(w));
  if (!c.stop()) sigmoid_topk_post(c, z, bias, params, idx, w);
}

void sigmoid_backward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& p) {
  const auto params = sigmoid_params(p);
  const auto z = values(in, "inputs", "z"), g = values(in, "inputs", "g");
  const auto dz = values(out, "outputs", "dz");
  const auto idx = indices(in, "inputs", "idx");
  sigmoid_topk_backward_pre(c, z, idx, g, writable(dz));
  if (!c.stop()) sigmoid_topk_backward_post(c, z, idx, g, params, dz);
}

void product_key_forward(detail::Checker& c, const Tensors& in, const Tensors& out,
                         const Params& p) {
  const auto mode = key_weights(p);
  const auto sx = values(in, "inputs", "sx"), sy = values(in, "inputs", "sy");
  const auto w = values(out, "outputs", "w");
  const auto idx = indices(out, "outputs", "idx");
  product_key_pre(c, sx, sy, sx.bytes(), sy.bytes(), mode, writable(idx), writable(w));
  if (!c.stop()) product_key_post(c, sx, sy, mode, idx, w);
}

void product_key_backward(detail::Checker& c, const Tensors& in, const Tensors& out,
                          const Params& p) {
  const auto mode = key_weights(p);
  const auto sx = values(in, "inputs", "sx"), sy = values(in, "inputs", "sy");
  const auto g = values(in, "inputs", "g");
  const auto dsx = values(out, "outputs", "dsx"), dsy = values(out, "outputs", "dsy");
  const auto idx = indices(in, "inputs", "idx");
  product_key_backward_pre(c, sx, sy, idx, g, writable(dsx), writable(dsy));
  if (!c.stop()) product_key_backward_post(c, sx, sy, idx, g, mode, dsx, dsy);
}

// The ops `moecert check` judges, with the clause family each reports.
struct OpEntry {
  Run run;
  std::vector<std::string> families;  // clause id prefixes
};
const std::map<std::string, OpEntry>& ops() {
  static const std::map<std::string, OpEntry> m{
      {"router.softmax_topk.forward", {softmax_forward, {"router.softmax_topk."}}},
      {"router.softmax_topk.backward", {softmax_backward, {"router.softmax_topk_backward."}}},
      {"router.sigmoid_topk.forward", {sigmoid_forward, {"router.sigmoid_topk."}}},
      {"router.sigmoid_topk.backward", {sigmoid_backward, {"router.sigmoid_topk_backward."}}},
      {"router.product_key.forward", {product_key_forward, {"router.product_key."}}},
      {"router.product_key.backward", {product_key_backward, {"router.product_key_backward."}}}};
  return m;
}

// The storage of the outputs: the narrowest among them.
Options options_for(const Tensors& out) {
  Options o{.ties_any_order = true};
  for (const auto& [name, t] : out)
    if (t.unit > o.output_unit) o.output_unit = t.unit, o.output_tiny = t.tiny;
  return o;
}

}  // namespace

bool Verdict::passed() const {
  for (const auto& c : clauses)
    if (!c.passed) return false;
  return true;
}

std::vector<std::string> router_ops() {
  std::vector<std::string> names;
  for (const auto& [name, e] : ops()) names.push_back(name);
  return names;
}

Verdict judge_router(const std::string& op, const Tensors& in, const Tensors& out,
                     const Params& params) {
  const auto it = ops().find(op);
  if (it == ops().end())
    throw std::invalid_argument(fmt::format("{}: not an op the judge reads from tensors", op));
  const OpEntry& entry = it->second;
  Verdict v{op, {}, {}};
  Options options = options_for(out);
  options.ties = &v.ties;
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
  std::map<std::string, std::uint64_t> after;
  for (const auto& cc : clause_counts()) after[cc.id] = cc.checked;
  for (const auto& info : all_clauses()) {
    const std::string id(info.id);
    bool ours = false;
    for (const auto& f : entry.families) ours = ours || id.rfind(f, 0) == 0;
    if (!ours) continue;
    ClauseResult r{info, after[id] != before[id], true, {}};
    for (const auto& viol : collected())
      if (viol.clause == id) r.passed = false, r.violations.push_back(viol);
    v.clauses.push_back(std::move(r));
  }
  return v;
}

std::string verdict_json(const Verdict& v, const Params& about) {
  nlohmann::json clauses = nlohmann::json::array(), ties = nlohmann::json::array();
  for (const auto& c : v.clauses) {
    nlohmann::json o{{"id", c.info.id},
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
    ties.push_back({{"t", t.t},
                    {"chosen", t.a},
                    {"other", t.b},
                    {"score", t.score},
                    {"kind", t.near ? "near" : "exact"}});
  nlohmann::json j{{"schema", "moecert-check/1"},
                   {"op", v.op},
                   {"verdict", v.passed() ? "pass" : "fail"},
                   {"clauses", clauses},
                   {"ties", ties}};
  for (const auto& [k, val] : about) j[k] = val;
  return j.dump();
}

}  // namespace moecert::contracts::judge
