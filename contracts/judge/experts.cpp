// The experts op's clauses on another implementation's tensors: shapes,
// routing, finiteness and range of every input, and y (forward) or dx and
// dL/dw (backward) against the judge's model of the declared precision
// (contracts/reference/experts_model.hpp).
#include "contracts/judge/experts.hpp"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>

#include "contracts/bounds/experts.hpp"
#include "contracts/engine/checks.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/engine/compare.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/gemm/formats.hpp"

namespace moecert::contracts::judge {
namespace {

namespace kt = clauses::experts_train;
namespace kf = clauses::experts;
using bounds::Tracked;

constexpr const char* kForwardProof = "proofs/experts.md §4";
constexpr const char* kBackwardProof = "proofs/experts.md §5";
constexpr const char* kLoraNames[] = {"a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down"};

// The clause ids of the two forward ops: experts.forward (no LoRA) and
// experts.forward_train.
struct ForwardClauses {
  const ClauseInfo &shape, &idx_in_range, &idx_unique, &weight_finite, &x_finite, &x_range,
      &y_finite, &within, &rounding, &spread, &scale;
};
constexpr ForwardClauses kForward{kf::kShape,        kf::kIdxInRange,    kf::kIdxUnique,
                                  kf::kWeightFinite, kf::kXFinite,       kf::kXRange,
                                  kf::kYFinite,      kf::kWithinBound,   kf::kRounding,
                                  kf::kSpread,       kf::kScaleExplained};
constexpr ForwardClauses kForwardTrain{
    kt::kFwdShape,    kt::kFwdIdxInRange, kt::kFwdIdxUnique,     kt::kFwdWeightFinite,
    kt::kFwdXFinite,  kt::kFwdXRange,     kt::kFwdYFinite,       kt::kFwdWithin,
    kt::kFwdRounding, kt::kFwdSpread,     kt::kFwdScaleExplained};
constexpr const char* kSpreadProof = "probabilistic, proofs/bounds.md §12";

// Finite, and 0 or within [2^-60, 2^60] (the bounds' range, proofs/bounds.md §0).
bool in_range(float v) {
  const float a = std::fabs(v);
  return a == 0 || (a >= 0x1p-60f && a <= 0x1p60f);
}

// The base weights' names, in QuantizedBase's order.
constexpr const char* kBaseNames[] = {"w_gate", "w_up", "w_down"};

// Matrix m (0 gate, 1 up, 2 down) of E experts' rows x cols, its codes
// and scales as given: whether their shapes are the format's.
std::string quantized_shape_error(const QuantizedBase& q, std::size_t m, std::size_t E,
                                  std::size_t rows, std::size_t cols) {
  const QuantView v{q.format, nullptr, rows, cols, 0, nullptr, 0};
  if (q.codes[m].rows != E * rows || q.codes[m].cols != v.row_bytes())
    return fmt::format("{}.codes {}x{}, expected {}x{} ({} {}x{} per expert)", kBaseNames[m],
                       q.codes[m].rows, q.codes[m].cols, E * rows, v.row_bytes(),
                       format_name(q.format), rows, cols);
  if (q.scales[m].rows != E * v.scale_rows() || q.scales[m].cols != v.scale_cols())
    return fmt::format("{}.scales {}x{}, expected {}x{}", kBaseNames[m], q.scales[m].rows,
                       q.scales[m].cols, E * v.scale_rows(), v.scale_cols());
  return "";
}

// Matrix m's values fp32(code * scale), expert by expert (codes as bytes).
std::vector<float> dequantized(const QuantizedBase& q, std::size_t m, std::size_t E,
                               std::size_t rows, std::size_t cols) {
  QuantView v{q.format, nullptr, rows, cols, 0, nullptr, 0};
  v.stride = v.row_bytes(), v.scale_stride = v.scale_cols();
  std::vector<std::uint8_t> bytes(rows * v.stride);
  std::vector<float> out(E * rows * cols);
  for (std::size_t e = 0; e < E; ++e) {
    for (std::size_t i = 0; i < bytes.size(); ++i)
      bytes[i] = static_cast<std::uint8_t>(q.codes[m].data[e * bytes.size() + i]);
    v.codes = bytes.data(), v.scales = q.scales[m].data + e * v.scale_rows() * v.scale_stride;
    for (std::size_t n = 0; n < rows; ++n)
      for (std::size_t k = 0; k < cols; ++k)
        out[(e * rows + n) * cols + k] = static_cast<float>(exact_weight(v, n, k));
  }
  return out;
}

}  // namespace

void read_quantized(const Tensors& in, WeightFormat f, ExpertsTensors& t) {
  auto q = std::make_shared<QuantizedBase>();
  q->format = f;
  for (std::size_t m = 0; m < 3; ++m) {
    q->codes[m] = indices(in, "inputs", fmt::format("{}.codes", kBaseNames[m]));
    q->scales[m] = values(in, "inputs", fmt::format("{}.scales", kBaseNames[m]));
  }
  // E from w_down's rows (H each), I from w_gate's (I each).
  const std::size_t H = t.H, E = H ? q->codes[2].rows / H : 0, I = E ? q->codes[0].rows / E : 0;
  const std::pair<std::size_t, std::size_t> dims[] = {{I, H}, {I, H}, {H, I}};
  if (E == 0 || I == 0)
    q->shape_error = fmt::format("w_down.codes {} rows, w_gate.codes {} rows for H={}",
                                 q->codes[2].rows, q->codes[0].rows, H);
  for (std::size_t m = 0; m < 3 && q->shape_error.empty(); ++m) {
    q->cols[m] = dims[m].second;
    q->shape_error = quantized_shape_error(*q, m, E, dims[m].first, dims[m].second);
  }
  t.E = E, t.I = I;
  if (q->shape_error.empty()) {
    MatView<const float>* w[] = {&t.w_gate, &t.w_up, &t.w_down};
    for (std::size_t m = 0; m < 3; ++m) {
      q->values[m] = dequantized(*q, m, E, dims[m].first, dims[m].second);
      *w[m] = {q->values[m].data(), E * dims[m].first, dims[m].second};
    }
  }
  t.quantized = std::move(q);
}

bounds::Precision precision_of(const Params& p) {
  const auto it = p.find("precision");
  if (it == p.end())
    throw std::invalid_argument(
        "precision: declare the experts op's arithmetic (fp32, mixed or bf16; docs/JUDGE.md)");
  if (const auto d = bounds::precision_named(it->second)) return *d;
  throw std::invalid_argument(
      fmt::format("precision={}: expected fp32, mixed or bf16 for the experts op", it->second));
}

std::optional<WeightFormat> format_of(const Params& p) {
  const auto it = p.find("format");
  if (it == p.end() || it->second == "bf16") return std::nullopt;
  if (const auto f = parse_format(it->second)) return *f;
  throw std::invalid_argument(
      fmt::format("format={}: expected one of {}", it->second, format_name_list()));
}

ExpertsTensors experts_tensors(const Tensors& in, const Params& p, bool lora_allowed) {
  ExpertsTensors t;
  t.x = values(in, "inputs", "x");
  t.H = t.x.cols;
  if (const auto f = format_of(p)) {
    read_quantized(in, *f, t);
  } else {
    t.w_gate = values(in, "inputs", "w_gate");
    t.w_up = values(in, "inputs", "w_up");
    t.w_down = values(in, "inputs", "w_down");
    t.I = t.w_down.cols;
    t.E = t.I ? t.w_gate.rows / t.I : 0;
  }
  if (!has(in, "a_gate")) return t;
  if (!lora_allowed)
    throw std::invalid_argument("inputs: LoRA factors given; judge them as experts.forward_train");
  MatView<const float>* lora[] = {&t.a_gate, &t.b_gate, &t.a_up, &t.b_up, &t.a_down, &t.b_down};
  for (std::size_t i = 0; i < 6; ++i) *lora[i] = values(in, "inputs", kLoraNames[i]);
  t.r = t.E ? t.a_gate.rows / t.E : 0;
  if (p.count("alpha") == 0)
    throw std::invalid_argument("alpha: required with LoRA factors (the scale is alpha / r)");
  t.alpha = number_param(p, "alpha", 0);
  return t;
}

std::string experts_shape_error(const ExpertsTensors& t, const char* y_name,
                                MatView<const float> y) {
  const std::size_t T = t.x.rows, K = t.idx.cols, E = t.E, H = t.H, I = t.I, r = t.r;
  const std::pair<const char*, MatView<const float>> base[] = {{"weights", t.weights},
                                                               {y_name, y},
                                                               {"w_gate", t.w_gate},
                                                               {"w_up", t.w_up},
                                                               {"w_down", t.w_down}};
  const std::pair<std::size_t, std::size_t> want[] = {
      {T, K}, {T, H}, {E * I, H}, {E * I, H}, {E * H, I}};
  if (t.quantized && !t.quantized->shape_error.empty()) return t.quantized->shape_error;
  if (E == 0 || E * I != t.w_gate.rows)
    return fmt::format("w_gate {}x{}", t.w_gate.rows, t.w_gate.cols);
  if (t.idx.rows != T || K < 1 || K > E) return fmt::format("idx {}x{}", t.idx.rows, K);
  for (std::size_t i = 0; i < 5; ++i)
    if (base[i].second.rows != want[i].first || base[i].second.cols != want[i].second)
      return fmt::format("{} {}x{}", base[i].first, base[i].second.rows, base[i].second.cols);
  const MatView<const float> lora[] = {t.a_gate, t.b_gate, t.a_up, t.b_up, t.a_down, t.b_down};
  const auto shapes = lora_shapes(E, H, I, r);
  for (std::size_t i = 0; i < 6 && r; ++i)
    if (lora[i].rows != shapes[i].rows || lora[i].cols != shapes[i].cols)
      return fmt::format("{} {}x{}, expected {}x{}", kLoraNames[i], lora[i].rows, lora[i].cols,
                         shapes[i].rows, shapes[i].cols);
  return "";
}

bool finite_in_range(detail::Checker& c, const ClauseInfo& clause, const char* name,
                     MatView<const float> m) {
  return detail::scan(c, clause, name, m, in_range, "finite, 0 or 2^-60 <= |v| <= 2^60");
}

bool finite_then_range(detail::Checker& c, const ClauseInfo& finite, const ClauseInfo& range,
                       const char* name, MatView<const float> m) {
  // The clauses are arguments here (not constants): their cap and settings
  // checked as MOECERT_CONTRACT does.
  if (detail::cap_allows(finite.level) && c.on(finite)) {
    const detail::ClauseTimer timer{finite};
    if (!detail::scan_finite(c, finite, name, m)) return false;
  }
  if (detail::cap_allows(range.level) && c.on(range)) {
    const detail::ClauseTimer timer{range};
    return scan_range(c, range, name, m);
  }
  return true;
}

bool scan_range(detail::Checker& c, const ClauseInfo& clause, const char* name,
                MatView<const float> m) {
  return detail::scan(
      c, clause, name, m, [](float v) { return !std::isfinite(v) || in_range(v); },
      "0 or 2^-60 <= |v| <= 2^60");
}

void summarize_error(const char* name, MatView<const float> m, const std::vector<Tracked>& ref,
                     const std::vector<Tracked>* probable) {
  std::vector<ErrorSummary>* out = judge::current().errors;
  if (!out || !m.data) return;
  const std::vector<float> got = contracts::values(m);
  double err = 0, norm = 0, worst = 0, likely = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double r = ref[i].v, b = bounds::kReferenceSlack * stored(std::fabs(r), ref[i].e);
    err += (got[i] - r) * (got[i] - r), norm += r * r, worst += b * b;
    if (probable) {
      const double pb =
          bounds::kReferenceSlack * stored(std::fabs((*probable)[i].v), (*probable)[i].e);
      likely += pb * pb;
    }
  }
  auto ratio = [&](double x) { return norm > 0 ? std::sqrt(x / norm) : NAN; };
  out->push_back({name, ratio(err), ratio(worst), probable ? ratio(likely) : NAN});
}

bool within_model(detail::Checker& c, const ClauseInfo& clause, const char* name,
                  MatView<const float> m, const std::vector<Tracked>& ref,
                  const bounds::Precision& p, const char* proof) {
  const std::vector<float> got = contracts::values(m);
  std::vector<double> v(got.size()), b(got.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    v[i] = ref[i].v;
    b[i] = bounds::kReferenceSlack * stored(std::fabs(ref[i].v), ref[i].e);
  }
  const auto cmp = compare::bounded(got, v, b);
  if (cmp.pass()) return true;
  c.fail(
      clause, fmt::format("{}[{}, {}]", name, cmp.worst / m.cols, cmp.worst % m.cols),
      fmt::format("{}={:.9g} ref={:.17g} (utilisation {:.3g})", name, cmp.worst_got, cmp.worst_ref,
                  cmp.max_utilization),
      fmt::format("|{} - ref| <= {:.6g} (precision {}, {})", name, cmp.worst_bound, p.name, proof));
  return false;
}

bool within_projection(detail::Checker& c, const ClauseInfo& clause, const char* name,
                       MatView<const float> m, const std::vector<Tracked>& ref,
                       const Projection& along, const bounds::Precision& p) {
  const std::vector<float> got = contracts::values(m);
  // The output's storage rounding, the last one: at its worst case, or as
  // one more rounding of the combination (coefficient |r| times the value
  // rounded, |r| + hp), whichever bounds it lower (a choice made from the
  // exact values, before any rounding is drawn); its flushes at worst.
  const judge::Options& o = judge::current();
  double dot = 0, out_worst = 0, out_tiny = 0, out_rnd2 = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double r = ref[i].v, a = std::fabs(r) * o.output_unit * (std::fabs(r) + ref[i].e);
    dot += (got[i] - r) * r;
    out_worst += a, out_tiny += std::fabs(r) * (o.output_unit ? o.output_tiny : 0.0);
    out_rnd2 += a * a;
  }
  const double lambda = bounds::kProjectionLambda;
  const double bound =
      bounds::kReferenceSlack * (along.det + out_tiny +
                                 std::min(out_worst + lambda * along.rnd,
                                          lambda * std::hypot(along.rnd, std::sqrt(out_rnd2))));
  if (std::fabs(dot) <= bound) return true;
  const double n2 = along.norm2 > 0 ? along.norm2 : 1;
  c.fail(clause, name, fmt::format("<{0} - ref, ref> / <ref, ref> = {1:.4g}", name, dot / n2),
         fmt::format("|<{} - ref, ref>| <= {:.4g} <ref, ref> (precision {}, {})", name, bound / n2,
                     p.name, kSpreadProof));
  return false;
}

namespace {

// The codes (each a byte, or an int8 code as a signed value, and every
// element's code valid: int4 the nibbles of its columns) and scales
// (finite, > 0) of quantized base weights whose shapes are the format's.
void quantized_clauses(detail::Checker& c, const QuantizedBase& q) {
  const bool nibbles = format_info(q.format).code_bits == 4;
  MOECERT_CONTRACT(c, clauses::gemm::kPackQCode) {
    for (std::size_t m = 0; m < 3; ++m) {
      const MatView<const std::int32_t> codes = q.codes[m];
      const auto bad = [&](std::size_t n, std::size_t k) {  // element (n, k)
        const std::int32_t b = codes(n, nibbles ? k / 2 : k);
        const auto byte = static_cast<unsigned>(b) & 255u;
        return b < -128 || b > 255 ||
               !code_valid(q.format, nibbles ? (k % 2 ? byte >> 4 : byte & 15u) : byte);
      };
      bool found = false;
      for (std::size_t n = 0; n < codes.rows && !found; ++n)
        for (std::size_t k = 0; k < q.cols[m] && !found; ++k)
          if ((found = bad(n, k)))
            c.fail(clauses::gemm::kPackQCode,
                   fmt::format("{}.codes[{}, {}]", kBaseNames[m], n, nibbles ? k / 2 : k),
                   fmt::format("{:#04x}{}", codes(n, nibbles ? k / 2 : k),
                               nibbles ? fmt::format(" (element {})", k) : ""),
                   fmt::format("a byte of {} codes in [{}, {}]", format_name(q.format),
                               format_info(q.format).code_min, format_info(q.format).code_max));
    }
  }
  MOECERT_CONTRACT(c, clauses::gemm::kPackQScale) {
    for (std::size_t m = 0; m < 3; ++m)
      if (!detail::scan(
              c, clauses::gemm::kPackQScale, fmt::format("{}.scales", kBaseNames[m]).c_str(),
              q.scales[m], [](float s) { return std::isfinite(s) && s > 0; }, "finite and > 0"))
        break;
  }
}

}  // namespace

void base_weight_clauses(detail::Checker& c, const ExpertsTensors& t) {
  if (t.quantized && t.quantized->shape_error.empty()) quantized_clauses(c, *t.quantized);
  if (c.stop()) return;
  const std::pair<const char*, MatView<const float>> base[] = {
      {"w_gate", t.w_gate}, {"w_up", t.w_up}, {"w_down", t.w_down}};
  MOECERT_CONTRACT(c, clauses::gemm::kPackWFinite) {
    for (const auto& [name, m] : base)
      if (!detail::scan_finite(c, clauses::gemm::kPackWFinite, name, m)) break;
  }
  MOECERT_CONTRACT(c, clauses::gemm::kPackWRange) {
    for (const auto& [name, m] : base)
      if (!detail::scan(
              c, clauses::gemm::kPackWRange, name, m,
              [](float v) { return !std::isfinite(v) || in_range(v); },
              "0 or 2^-60 <= |w| <= 2^60"))
        break;
  }
}

bool lora_in_range(detail::Checker& c, const ClauseInfo& finite, const ClauseInfo& range,
                   const ExpertsTensors& t) {
  const MatView<const float> f[] = {t.a_gate, t.b_gate, t.a_up, t.b_up, t.a_down, t.b_down};
  for (std::size_t i = 0; i < 6; ++i)
    if (!finite_then_range(c, finite, range, kLoraNames[i], f[i])) return false;
  return true;
}

WeightGrads weight_grad_outputs(const Tensors& out) {
  WeightGrads g{};
  const auto names = grad_shapes(0, 0, 0, 0);
  for (std::size_t i = 0; i < kWeightGrads; ++i)
    if (const std::string name = fmt::format("{}_grad", names[i].name); has(out, name))
      g[i] = values(out, "outputs", name);
  return g;
}

bool any_weight_grad(const WeightGrads& g) {
  return std::any_of(g.begin(), g.end(), [](const auto& m) { return m.data != nullptr; });
}

std::string weight_grads_shape_error(const ExpertsTensors& t, const WeightGrads& g) {
  const auto want = grad_shapes(t.E, t.H, t.I, t.r);
  for (std::size_t i = 0; i < kWeightGrads; ++i) {
    if (!g[i].data) continue;
    if (i < 6 && t.r == 0) return fmt::format("{}_grad given without LoRA factors", want[i].name);
    if (g[i].rows != want[i].rows || g[i].cols != want[i].cols)
      return fmt::format("{}_grad {}x{}, expected {}x{}", want[i].name, g[i].rows, g[i].cols,
                         want[i].rows, want[i].cols);
  }
  return "";
}

bool weight_grads_finite(detail::Checker& c, const ClauseInfo& clause, const WeightGrads& g) {
  const auto names = grad_shapes(0, 0, 0, 0);
  for (std::size_t i = 0; i < kWeightGrads; ++i)
    if (g[i].data && !detail::scan_finite(c, clause, fmt::format("{}_grad", names[i].name), g[i]))
      return false;
  return true;
}

void weight_grads_idle_zero(detail::Checker& c, const ClauseInfo& clause, const ExpertsTensors& t,
                            const WeightGrads& g) {
  std::vector<std::size_t> count(t.E, 0);
  for (std::size_t q = 0; q < t.idx.rows; ++q)
    for (std::size_t j = 0; j < t.idx.cols; ++j)
      if (t.idx(q, j) >= 0 && static_cast<std::size_t>(t.idx(q, j)) < t.E)
        ++count[static_cast<std::size_t>(t.idx(q, j))];
  TrainSaved s;
  s.tokens = t.idx.rows, s.topk = t.idx.cols, s.idx = t.idx.data;
  s.rows.grouping.experts = t.E, s.rows.grouping.count = count;
  experts::Gradients views;
  MatView<float>* all[] = {&views.a_gate, &views.b_gate, &views.a_up, &views.b_up,  &views.a_down,
                           &views.b_down, &views.w_gate, &views.w_up, &views.w_down};
  for (std::size_t i = 0; i < kWeightGrads; ++i)
    if (g[i].data) *all[i] = writable(g[i]);
  empty_expert_zero(c, clause, s, views);
}

bool weight_grads_within(detail::Checker& c, const ClauseInfo& clause, const WeightGrads& g,
                         const ExpertsBackward& model, const bounds::Precision& p,
                         const char* proof) {
  const auto names = grad_shapes(0, 0, 0, 0);
  for (std::size_t i = 0; i < kWeightGrads; ++i) {
    const std::string name = fmt::format("{}_grad", names[i].name);
    if (g[i].data && !within_model(c, clause, name.c_str(), g[i], model.weight_grads[i], p, proof))
      return false;
  }
  return true;
}

bool audit_asked(const Params& p) { return flag_param(p, "audit", true); }

// A row (or a column) of a weight gradient shares the roundings of one
// operand row (dg, h, ...), so a few tokens give whole rows one sign, while
// elements on distinct rows and columns depend on disjoint roundings.
bool weight_grads_unbiased(detail::Checker& c, const ClauseInfo& clause, const WeightGrads& g,
                           const ExpertsBackward& ref, std::size_t E) {
  const auto names = grad_shapes(0, 0, 0, 0);
  for (std::size_t i = 0; i < kWeightGrads; ++i) {
    if (!g[i].data || E == 0) continue;
    const std::size_t rows = g[i].rows / E, cols = g[i].cols;
    std::vector<float> got;
    std::vector<double> want;
    for (std::size_t e = 0; e < E; ++e)
      for (std::size_t d = 0; d < std::min(rows, cols); ++d) {
        got.push_back(g[i](e * rows + d, d));
        want.push_back(ref.weight_grads[i][(e * rows + d) * cols + d].v);
      }
    const std::string name =
        fmt::format("{}_grad (one element per row and column of an expert)", names[i].name);
    if (!rounding_unbiased(c, clause, name, got, want)) return false;
  }
  return true;
}

namespace {

// The weight gradients' summaries (those given).
void summarize_weight_grads(const WeightGrads& g, const ExpertsBackward& ref,
                            const ExpertsBackward* probable) {
  const auto names = grad_shapes(0, 0, 0, 0);
  for (std::size_t i = 0; i < kWeightGrads; ++i)
    if (g[i].data)
      summarize_error(fmt::format("{}_grad", names[i].name).c_str(), g[i], ref.weight_grads[i],
                      probable ? &probable->weight_grads[i] : nullptr);
}

// The experts op's inputs: the tensors by name, idx and weights among them.
ExpertsTensors read_inputs(const Tensors& in, const Params& p, bool lora_allowed) {
  ExpertsTensors t = experts_tensors(in, p, lora_allowed);
  t.idx = indices(in, "inputs", "idx");
  t.weights = values(in, "inputs", "weights");
  return t;
}

// The inputs' clauses after the shapes: routing, and every input finite
// and in range (x by the op's clause, the base weights by gemm.pack's, the
// LoRA factors by forward_train's).
template <const ForwardClauses& k>
void input_clauses(detail::Checker& c, const ExpertsTensors& t) {
  MOECERT_CONTRACT(c, k.idx_in_range) { routing_in_range(c, k.idx_in_range, t.idx, t.E); }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k.idx_unique) { routing_unique(c, k.idx_unique, t.idx); }
  MOECERT_CONTRACT(c, k.weight_finite) { routing_weights(c, k.weight_finite, t.idx, t.weights); }
  finite_then_range(c, k.x_finite, k.x_range, "x", t.x);
  weight_clauses<kt::kFwdLoraFinite, kt::kFwdLoraRange, kt::kFwdScale>(c, t);  // LoRA where given
}

template <const ForwardClauses& k, bool lora>
void forward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& params) {
  const bounds::Precision p = precision_of(params);
  const ExpertsTensors t = read_inputs(in, params, lora);
  const auto y = values(out, "outputs", "y");
  MOECERT_CONTRACT(c, k.shape) {
    if (const std::string bad = experts_shape_error(t, "y", y); !bad.empty())
      c.fail(k.shape, "", bad,
             fmt::format("the shapes of E={} H={} I={} r={} (docs/JUDGE.md)", t.E, t.H, t.I, t.r));
  }
  if (c.stop()) return;
  input_clauses<k>(c, t);
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k.y_finite) { detail::scan_finite(c, k.y_finite, "y", y); }
  // Inputs in range, no overflow; every y within the model's bound for the
  // declared precision; proofs/experts.md §4.
  const auto ref = experts_model_forward(t, p);
  MOECERT_CONTRACT(c, k.within) { within_model(c, k.within, "y", y, ref, p, kForwardProof); }
  const bool audit = audit_asked(params);
  const ProbableForward model = audit ? experts_model_forward_probable(t, p) : ProbableForward{};
  const std::vector<Tracked>& probable = model.y;
  summarize_error("y", y, ref, audit ? &probable : nullptr);
  // Round to nearest: errors without a sign bias (proofs/bounds.md §11).
  if (!audit) return;
  MOECERT_CONTRACT(c, k.rounding) {
    rounding_unbiased(c, k.rounding, "y", contracts::values(y), exact(ref));
  }
  // Independent mean-zero rounding errors: every y within the probabilistic
  // bound of the declared precision (proofs/bounds.md §12).
  MOECERT_CONTRACT(c, k.spread) { within_model(c, k.spread, "y", y, probable, p, kSpreadProof); }
  // The same model along the exact y: a scale error fails it long before
  // any element leaves its bound (proofs/bounds.md §12).
  MOECERT_CONTRACT(c, k.scale) {
    within_projection(c, k.scale, "y", y, probable, model.along_y, p);
  }
}

// The outputs given (dx, dweights: at least one) with their shapes.
struct BackwardOutputs {
  MatView<const float> dx, dweights;
  WeightGrads weights;
};
BackwardOutputs backward_outputs(const Tensors& out) {
  BackwardOutputs o;
  if (has(out, "dx")) o.dx = values(out, "outputs", "dx");
  if (has(out, "dweights")) o.dweights = values(out, "outputs", "dweights");
  o.weights = weight_grad_outputs(out);
  if (!o.dx.data && !o.dweights.data && !any_weight_grad(o.weights))
    throw std::invalid_argument("outputs: no tensor 'dx', 'dweights' or '<weight>_grad'");
  return o;
}

void backward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& params) {
  const bounds::Precision p = precision_of(params);
  const ExpertsTensors t = read_inputs(in, params, true);
  const auto dy = values(in, "inputs", "dy");
  const BackwardOutputs o = backward_outputs(out);
  const std::size_t T = t.x.rows, K = t.idx.cols;
  MOECERT_CONTRACT(c, kt::kBwdShape) {
    std::string bad = experts_shape_error(t, "dy", dy);
    if (bad.empty() && o.dx.data && (o.dx.rows != T || o.dx.cols != t.H))
      bad = fmt::format("dx {}x{}", o.dx.rows, o.dx.cols);
    if (bad.empty() && o.dweights.data && (o.dweights.rows != T || o.dweights.cols != K))
      bad = fmt::format("dweights {}x{}", o.dweights.rows, o.dweights.cols);
    if (bad.empty()) bad = weight_grads_shape_error(t, o.weights);
    if (!bad.empty())
      c.fail(kt::kBwdShape, "", bad,
             fmt::format("the shapes of E={} H={} I={} r={}, T={} K={} (docs/JUDGE.md)", t.E, t.H,
                         t.I, t.r, T, K));
  }
  if (c.stop()) return;
  input_clauses<kForwardTrain>(c, t);
  MOECERT_CONTRACT(c, kt::kBwdDyFinite) { finite_in_range(c, kt::kBwdDyFinite, "dy", dy); }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, kt::kBwdGradFinite) {
    (!o.dx.data || detail::scan_finite(c, kt::kBwdGradFinite, "dx", o.dx)) &&
        (!o.dweights.data || detail::scan_finite(c, kt::kBwdGradFinite, "dweights", o.dweights)) &&
        weight_grads_finite(c, kt::kBwdGradFinite, o.weights);
  }
  MOECERT_CONTRACT(c, kt::kBwdEmptyZero) {
    weight_grads_idle_zero(c, kt::kBwdEmptyZero, t, o.weights);
  }
  MOECERT_CONTRACT(c, kt::kBwdDwMasked) {
    if (o.dweights.data) {
      TrainSaved routing;
      routing.tokens = T, routing.topk = K, routing.idx = t.idx.data;
      dweights_masked(c, kt::kBwdDwMasked, routing, o.dweights);
    }
  }
  // Inputs and dy in range, no overflow; dx and dL/dw within the model's
  // bounds for the declared precision; proofs/experts.md §5.
  const auto ref = experts_model_backward(t, dy, p, any_weight_grad(o.weights));
  MOECERT_CONTRACT(c, kt::kBwdWithin) {
    (!o.dweights.data ||
     within_model(c, kt::kBwdWithin, "dweights", o.dweights, ref.dweights, p, kBackwardProof)) &&
        (!o.dx.data || within_model(c, kt::kBwdWithin, "dx", o.dx, ref.dx, p, kBackwardProof)) &&
        weight_grads_within(c, kt::kBwdWithin, o.weights, ref, p, kBackwardProof);
  }
  const bool audit = audit_asked(params);
  const ExpertsBackward probable =
      audit ? experts_model_backward(t, dy, bounds::probable(p), any_weight_grad(o.weights))
            : ExpertsBackward{};
  summarize_error("dx", o.dx, ref.dx, audit ? &probable.dx : nullptr);
  summarize_error("dweights", o.dweights, ref.dweights, audit ? &probable.dweights : nullptr);
  summarize_weight_grads(o.weights, ref, audit ? &probable : nullptr);
  // Round to nearest: errors without a sign bias (proofs/bounds.md §11).
  if (!audit) return;
  // Independent mean-zero rounding errors: every output within the
  // probabilistic bound of the declared precision (proofs/bounds.md §12).
  MOECERT_CONTRACT(c, kt::kBwdSpread) {
    (!o.dweights.data ||
     within_model(c, kt::kBwdSpread, "dweights", o.dweights, probable.dweights, p, kSpreadProof)) &&
        (!o.dx.data || within_model(c, kt::kBwdSpread, "dx", o.dx, probable.dx, p, kSpreadProof)) &&
        weight_grads_within(c, kt::kBwdSpread, o.weights, probable, p, kSpreadProof);
  }
  // The same model along the exact dx and dL/dw: an error a token's
  // elements share fails it where each element's bound holds it.
  MOECERT_CONTRACT(c, kt::kBwdScaleExplained) {
    (!o.dweights.data || within_projection(c, kt::kBwdScaleExplained, "dweights", o.dweights,
                                           probable.dweights, probable.along_dweights, p)) &&
        (!o.dx.data || within_projection(c, kt::kBwdScaleExplained, "dx", o.dx, probable.dx,
                                         probable.along_dx, p));
  }
  MOECERT_CONTRACT(c, kt::kBwdRounding) {
    (!o.dweights.data || rounding_unbiased(c, kt::kBwdRounding, "dweights",
                                           contracts::values(o.dweights), exact(ref.dweights))) &&
        (!o.dx.data ||
         rounding_unbiased(c, kt::kBwdRounding, "dx", contracts::values(o.dx), exact(ref.dx))) &&
        weight_grads_unbiased(c, kt::kBwdRounding, o.weights, ref, t.E);
  }
}

}  // namespace

std::vector<std::string> quantized_families(const Params& p) {
  if (!format_of(p)) return {};
  return {"gemm.pack.q_code", "gemm.pack.q_scale"};
}

std::map<std::string, OpEntry> experts_entries() {
  return {{"experts.forward",
           {forward<kForward, false>,
            {"experts.forward.", "gemm.pack.w_finite", "gemm.pack.w_range"},
            quantized_families}},
          {"experts.forward_train",
           {forward<kForwardTrain, true>,
            {"experts.forward_train.", "gemm.pack.w_finite", "gemm.pack.w_range"},
            quantized_families}},
          {"experts.backward",
           {backward,
            {"experts.backward.", "experts.forward_train.idx_in_range",
             "experts.forward_train.idx_unique", "experts.forward_train.weight_finite",
             "experts.forward_train.x_finite", "experts.forward_train.x_range",
             "experts.forward_train.lora_finite", "experts.forward_train.lora_range",
             "experts.forward_train.scale_finite", "gemm.pack.w_finite", "gemm.pack.w_range"},
            quantized_families}}};
}

}  // namespace moecert::contracts::judge
