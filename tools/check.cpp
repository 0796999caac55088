// `moecert check`: judges another implementation's outputs, read from
// safetensors files, with moecert's clauses at level full: ties in any
// order (each named), the outputs' storage rounding added to every bound.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include "contracts/judge/ops.hpp"
#include "tools/commands.hpp"
#include "tools/conform/report.hpp"
#include "tools/tensor_file.hpp"

namespace moecert::tools {
namespace {

using Files = std::map<std::string, Tensor>;
namespace judge = contracts::judge;

struct CheckArgs {
  std::string op, inputs, outputs, precision, out = "build/check";
  std::vector<std::string> params;
};

judge::Params parse_params(const std::vector<std::string>& ps) {
  judge::Params m;
  for (const auto& p : ps) {
    const auto eq = p.find('=');
    if (eq == std::string::npos)
      throw std::invalid_argument(fmt::format("--param {}: expected NAME=VALUE", p));
    m[p.substr(0, eq)] = p.substr(eq + 1);
  }
  return m;
}

// A file's tensors as the judge reads them: indices (integer dtypes, and
// float8 codes as their bytes) in int32, values in fp32 with their
// storage's rounding.
judge::Tensors tensors(const Files& f) {
  judge::Tensors out;
  for (const auto& [name, t] : f) {
    // Rows of the last dimension (a stacked [E, I, H] weight is E*I rows of
    // H); a vector is one column.
    judge::Tensor j;
    j.cols = t.shape.size() >= 2 ? static_cast<std::size_t>(t.shape.back()) : 1;
    j.rows = j.cols ? t.elements() / j.cols : 0;
    if (t.dtype[0] == 'I' || t.dtype == "U8" || t.dtype == "F8_E4M3")
      j.i = to_i32(t, name);
    else
      j.f = to_f32(t, name);
    const Storage st = storage_of(t);
    j.unit = st.unit, j.tiny = st.tiny;
    out.emplace(name, std::move(j));
  }
  return out;
}

void write_reports(const judge::Verdict& v, const CheckArgs& a) {
  namespace fs = std::filesystem;
  write_file(fs::path(a.out) / "report.json",
             judge::verdict_json(
                 v, {{"inputs", a.inputs}, {"outputs", a.outputs}, {"precision", a.precision}}) +
                 "\n");
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
                                      : fmt::format("<failure message=\"{}\"/>", escape_xml(why)));
    failures += !c.passed;
  }
  if (!v.skipped_rows.empty())
    md += fmt::format(
        "\nRows whose expert ids an index clause rejected, skipped by the clauses that read "
        "through the ids: {}\n",
        fmt::join(v.skipped_rows, ", "));
  md += fmt::format("\nTies the implementation ordered its own way (allowed): {}\n", v.ties.size());
  for (const auto& t : v.ties)
    md += t.near ? fmt::format(
                       "- t={}: expert {} before expert {} (score {:.9g}), within the fp32 "
                       "scores' rounding of each other\n",
                       t.t, t.a, t.b, t.score)
                 : fmt::format("- t={}: expert {} before expert {}, both score {:.9g}\n", t.t, t.a,
                               t.b, t.score);
  if (!v.errors.empty())
    md +=
        "\n| output | relative error | worst-case bound | probabilistic bound "
        "|\n|---|---|---|---|\n";
  for (const auto& e : v.errors)
    md += fmt::format("| {} | {:.3g} | {:.3g} | {:.3g} |\n", e.output, e.relative_error,
                      e.relative_worst, e.relative_probable);
  write_file(fs::path(a.out) / "report.md", md);
  write_file(fs::path(a.out) / "junit.xml",
             fmt::format("<?xml version=\"1.0\" encoding=\"UTF-8\"?><testsuite name=\"moecert "
                         "check {}\" tests=\"{}\" failures=\"{}\">{}</testsuite>\n",
                         v.op, v.clauses.size(), failures, junit));
  write_file(fs::path(a.out) / "report.html",
             "<!doctype html><meta charset=\"utf-8\"><title>moecert check</title><pre>" +
                 escape_xml(md) + "</pre>\n");
}

int run_check(const CheckArgs& a) {
  const auto ops = judge::judged_ops();
  if (std::find(ops.begin(), ops.end(), a.op) == ops.end())
    throw std::invalid_argument(
        fmt::format("{}: not an op check judges ({})", a.op, fmt::join(ops, ", ")));
  Files in, out;
  try {  // a file that cannot be read is a file error: exit 2 (docs/JUDGE.md)
    in = read_safetensors(a.inputs), out = read_safetensors(a.outputs);
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(e.what());
  }
  judge::Params params = parse_params(a.params);
  if (!a.precision.empty()) params["precision"] = a.precision;
  const judge::Verdict v = judge::judge_op(a.op, tensors(in), tensors(out), params);
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
  sub->add_option("op", a->op,
                  "router.{softmax_topk,sigmoid_topk,product_key}.{forward,backward}, "
                  "experts.{forward,forward_train,backward}, layer.{forward,backward}")
      ->required();
  sub->add_option("--inputs", a->inputs, "the op's inputs (safetensors)")->required();
  sub->add_option("--outputs", a->outputs, "the implementation's outputs (safetensors)")
      ->required();
  sub->add_option("--param", a->params, "op parameter NAME=VALUE (docs/JUDGE.md)");
  sub->add_option("--precision", a->precision,
                  "declared arithmetic: fp32 (routers, the default there), or for the experts "
                  "op and the layer fp32, mixed or bf16");
  sub->add_option("--out", a->out, "report folder")->capture_default_str();
  sub->callback([a, &run] { run = [a] { return run_check(*a); }; });
}

}  // namespace moecert::tools
