// `moecert check`: judges another implementation's outputs, read from
// safetensors files, with moecert's clauses at level full: ties in any
// order (each named), the outputs' storage rounding added to every bound.
#include <fmt/format.h>

#include <boost/json.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "contracts/engine.hpp"
#include "contracts/judge.hpp"
#include "contracts/router.hpp"
#include "moecert/contracts.hpp"
#include "tools/commands.hpp"
#include "tools/tensor_file.hpp"

namespace moecert::tools {
namespace {

using Files = std::map<std::string, Tensor>;

struct CheckArgs {
  std::string op, inputs, outputs, precision = "fp32", out = "build/check";
  std::vector<std::string> params;
};

// One clause as the judge applied it.
struct ClauseResult {
  ClauseInfo info;
  bool evaluated = false;  // not: a failed precondition or clause before it made it moot
  bool passed = true;
  std::vector<Violation> violations;  // the first failures (observe goes on after each)
};

struct Verdict {
  std::string op;
  std::vector<ClauseResult> clauses;
  std::vector<contracts::judge::Tie> ties;
  bool passed() const {
    for (const auto& c : clauses)
      if (!c.passed) return false;
    return true;
  }
};

// The violations of the run in progress (a handler is a plain function).
std::vector<Violation>& collected() {
  static std::vector<Violation> v;
  return v;
}
void collect(const Violation& v) { collected().push_back(v); }

// A named tensor of a file, or a precise error.
const Tensor& need(const Files& f, const char* file, const std::string& name) {
  const auto it = f.find(name);
  if (it == f.end()) throw std::invalid_argument(fmt::format("{}: no tensor '{}'", file, name));
  return it->second;
}

// An fp32 matrix view's storage: the values and their 2-D shape.
struct Mat {
  std::vector<float> v;
  std::size_t rows = 0, cols = 0;
  MatView<float> view() { return {v.data(), rows, cols}; }
  MatView<const float> cview() const { return {v.data(), rows, cols}; }
};
struct IdxMat {
  std::vector<std::int32_t> v;
  std::size_t rows = 0, cols = 0;
  MatView<std::int32_t> view() { return {v.data(), rows, cols}; }
  MatView<const std::int32_t> cview() const { return {v.data(), rows, cols}; }
};
Mat mat(const Files& f, const char* file, const std::string& name) {
  const Tensor& t = need(f, file, name);
  return {to_f32(t, name), t.rows(), t.cols()};
}
IdxMat idx_mat(const Files& f, const char* file, const std::string& name) {
  const Tensor& t = need(f, file, name);
  return {to_i32(t, name), t.rows(), t.cols()};
}

std::map<std::string, std::string> parse_params(const std::vector<std::string>& ps) {
  std::map<std::string, std::string> m;
  for (const auto& p : ps) {
    const auto eq = p.find('=');
    if (eq == std::string::npos)
      throw std::invalid_argument(fmt::format("--param {}: expected NAME=VALUE", p));
    m[p.substr(0, eq)] = p.substr(eq + 1);
  }
  return m;
}

bool flag_param(const std::map<std::string, std::string>& m, const std::string& name, bool def) {
  const auto it = m.find(name);
  if (it == m.end()) return def;
  if (it->second == "true" || it->second == "1") return true;
  if (it->second == "false" || it->second == "0") return false;
  throw std::invalid_argument(
      fmt::format("--param {}={}: expected true or false", name, it->second));
}

router::KeyWeights key_weights(const std::map<std::string, std::string>& m) {
  const auto it = m.find("weights");
  if (it == m.end() || it->second == "softmax") return router::KeyWeights::softmax;
  if (it->second == "exp") return router::KeyWeights::exp;
  if (it->second == "raw") return router::KeyWeights::raw;
  throw std::invalid_argument(
      fmt::format("--param weights={}: expected softmax, exp or raw", it->second));
}

// The op's clauses, pre then post, on the files' tensors (c: its checker).
using Run = std::function<void(detail::Checker& c, const Files& in, const Files& out,
                               const std::map<std::string, std::string>& params)>;

void softmax_forward(detail::Checker& c, const Files& in, const Files& out,
                     const std::map<std::string, std::string>& p) {
  const bool renorm = flag_param(p, "renormalize", true);
  Mat z = mat(in, "inputs", "z"), w = mat(out, "outputs", "w");
  IdxMat idx = idx_mat(out, "outputs", "idx");
  contracts::softmax_topk_pre(c, z.cview(), z.cview().bytes(), idx.view(), w.view());
  if (!c.stop()) contracts::softmax_topk_post(c, z.cview(), idx.cview(), w.cview(), renorm);
}

void softmax_backward(detail::Checker& c, const Files& in, const Files& out,
                      const std::map<std::string, std::string>& p) {
  const bool renorm = flag_param(p, "renormalize", true);
  Mat z = mat(in, "inputs", "z"), g = mat(in, "inputs", "g"), dz = mat(out, "outputs", "dz");
  IdxMat idx = idx_mat(in, "inputs", "idx");
  contracts::softmax_topk_backward_pre(c, z.cview(), idx.cview(), g.cview(), dz.view());
  if (!c.stop())
    contracts::softmax_topk_backward_post(c, z.cview(), idx.cview(), g.cview(), dz.cview(), renorm);
}

void product_key_forward(detail::Checker& c, const Files& in, const Files& out,
                         const std::map<std::string, std::string>& p) {
  const auto mode = key_weights(p);
  Mat sx = mat(in, "inputs", "sx"), sy = mat(in, "inputs", "sy"), w = mat(out, "outputs", "w");
  IdxMat idx = idx_mat(out, "outputs", "idx");
  contracts::product_key_pre(c, sx.cview(), sy.cview(), sx.cview().bytes(), sy.cview().bytes(),
                             mode, idx.view(), w.view());
  if (!c.stop())
    contracts::product_key_post(c, sx.cview(), sy.cview(), mode, idx.cview(), w.cview());
}

void product_key_backward(detail::Checker& c, const Files& in, const Files& out,
                          const std::map<std::string, std::string>& p) {
  const auto mode = key_weights(p);
  Mat sx = mat(in, "inputs", "sx"), sy = mat(in, "inputs", "sy"), g = mat(in, "inputs", "g");
  Mat dsx = mat(out, "outputs", "dsx"), dsy = mat(out, "outputs", "dsy");
  IdxMat idx = idx_mat(in, "inputs", "idx");
  contracts::product_key_backward_pre(c, sx.cview(), sy.cview(), idx.cview(), g.cview(), dsx.view(),
                                      dsy.view());
  if (!c.stop())
    contracts::product_key_backward_post(c, sx.cview(), sy.cview(), idx.cview(), g.cview(), mode,
                                         dsx.cview(), dsy.cview());
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
      {"router.product_key.forward", {product_key_forward, {"router.product_key."}}},
      {"router.product_key.backward", {product_key_backward, {"router.product_key_backward."}}}};
  return m;
}

// The storage of the outputs: the narrowest dtype among them.
contracts::judge::Options judge_options(const Files& out) {
  contracts::judge::Options o{.ties_any_order = true};
  for (const auto& [name, t] : out) {
    const Storage s = storage_of(t);
    if (s.unit > o.output_unit) o.output_unit = s.unit, o.output_tiny = s.tiny;
  }
  return o;
}

Verdict judge(const CheckArgs& a, const Files& in, const Files& out) {
  const OpEntry& entry = ops().at(a.op);
  Verdict v{a.op, {}, {}};
  auto options = judge_options(out);
  options.ties = &v.ties;
  std::map<std::string, std::uint64_t> before;
  for (const auto& cc : clause_counts()) before[cc.id] = cc.checked;
  collected().clear();
  {
    const contracts::judge::Scope judge_scope{options};
    const ContractScope scope{Level::full, Semantic::observe};
    const ViolationHandler previous = set_violation_handler(collect);
    detail::Checker c{a.op};
    try {
      entry.run(c, in, out, parse_params(a.params));
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

boost::json::object to_json(const Verdict& v, const CheckArgs& a) {
  boost::json::array clauses, ties;
  for (const auto& c : v.clauses) {
    boost::json::object o{{"id", std::string(c.info.id)},
                          {"kind", std::string(clause_kind_name(c.info.kind))},
                          {"group", std::string(group_name(c.info.group))},
                          {"condition", std::string(c.info.text)},
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
    ties.push_back({{"t", t.t}, {"chosen", t.a}, {"other", t.b}, {"score", t.score}});
  return {{"schema", "moecert-check/1"}, {"op", v.op},
          {"inputs", a.inputs},          {"outputs", a.outputs},
          {"precision", a.precision},    {"verdict", v.passed() ? "pass" : "fail"},
          {"clauses", clauses},          {"ties", ties}};
}

void write_reports(const Verdict& v, const CheckArgs& a) {
  namespace fs = std::filesystem;
  fs::create_directories(a.out);
  std::ofstream(fs::path(a.out) / "report.json") << boost::json::serialize(to_json(v, a)) << "\n";
  std::string md = fmt::format(
      "# moecert check: {} — {}\n\ninputs `{}`, outputs `{}`, precision {}\n\n"
      "| clause | verdict | first failure |\n|---|---|---|\n",
      v.op, v.passed() ? "pass" : "FAIL", a.inputs, a.outputs, a.precision);
  std::string junit;
  std::size_t failures = 0;
  for (const auto& c : v.clauses) {
    const std::string why = c.passed ? "" : c.violations.front().one_line();
    const char* verdict = !c.evaluated ? "not evaluated" : c.passed ? "pass" : "FAIL";
    md += fmt::format("| `{}` | {} | {} |\n", c.info.id, verdict, why);
    junit += fmt::format("<testcase classname=\"{}\" name=\"{}\">{}</testcase>", v.op, c.info.id,
                         !c.evaluated ? "<skipped/>"
                         : c.passed   ? ""
                                      : "<failure/>");
    failures += !c.passed;
  }
  md += fmt::format("\nTies the implementation ordered its own way (allowed): {}\n", v.ties.size());
  for (const auto& t : v.ties)
    md += fmt::format("- t={}: expert {} before expert {}, both score {:.9g}\n", t.t, t.a, t.b,
                      t.score);
  std::ofstream(fs::path(a.out) / "report.md") << md;
  std::ofstream(fs::path(a.out) / "junit.xml") << fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?><testsuite name=\"moecert check {}\" "
      "tests=\"{}\" failures=\"{}\">{}</testsuite>\n",
      v.op, v.clauses.size(), failures, junit);
  std::ofstream(fs::path(a.out) / "report.html")
      << "<!doctype html><meta charset=\"utf-8\"><title>moecert check</title><pre>" << md
      << "</pre>\n";
}

int run_check(const CheckArgs& a) {
  if (!ops().count(a.op)) {
    std::string names;
    for (const auto& [name, e] : ops()) names += (names.empty() ? "" : ", ") + name;
    throw std::invalid_argument(fmt::format("{}: not an op check judges ({})", a.op, names));
  }
  if (a.precision != "fp32")
    throw std::invalid_argument(fmt::format(
        "--precision {}: the routers' arithmetic is declared fp32 (outputs may be stored in bf16 "
        "or fp16: the file's dtype says so)",
        a.precision));
  const Files in = read_safetensors(a.inputs), out = read_safetensors(a.outputs);
  const Verdict v = judge(a, in, out);
  write_reports(v, a);
  fmt::print(
      "check {}: {} ({} clauses evaluated, {} failed; {} ties in the implementation's "
      "own order); report in {}\n",
      v.op, v.passed() ? "pass" : "FAIL",
      std::count_if(v.clauses.begin(), v.clauses.end(), [](auto& c) { return c.evaluated; }),
      std::count_if(v.clauses.begin(), v.clauses.end(), [](auto& c) { return !c.passed; }),
      v.ties.size(), a.out);
  for (const auto& c : v.clauses)
    if (!c.passed) fmt::print("check: {}\n", c.violations.front().one_line());
  return v.passed() ? 0 : 1;
}

}  // namespace

void add_check(CLI::App& app, Command& run) {
  auto* sub = app.add_subcommand("check", "judge another implementation's outputs (safetensors)");
  auto a = std::make_shared<CheckArgs>();
  sub->add_option("op", a->op, "router.{softmax_topk,product_key}.{forward,backward}")->required();
  sub->add_option("--inputs", a->inputs, "the op's inputs (safetensors)")->required();
  sub->add_option("--outputs", a->outputs, "the implementation's outputs (safetensors)")
      ->required();
  sub->add_option("--param", a->params, "op parameter NAME=VALUE (renormalize, weights)");
  sub->add_option("--precision", a->precision, "declared arithmetic")->capture_default_str();
  sub->add_option("--out", a->out, "report folder")->capture_default_str();
  sub->callback([a, &run] { run = [a] { return run_check(*a); }; });
}

}  // namespace moecert::tools
