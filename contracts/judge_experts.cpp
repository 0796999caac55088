// The experts op's clauses on another implementation's tensors: shapes,
// routing, finiteness and range of every input, and y against the judge's
// model of the declared precision (contracts/reference/experts_model.hpp).
#include <string>

#include "contracts/bounds/experts.hpp"
#include "contracts/checks.hpp"
#include "contracts/clauses.hpp"
#include "contracts/compare.hpp"
#include "contracts/experts_train.hpp"
#include "contracts/judge_tensors.hpp"
#include "contracts/reference/experts_model.hpp"

namespace moecert::contracts::judge {
namespace {

namespace k = clauses::experts_train;
namespace kf = clauses::experts;
using bounds::Tracked;

constexpr const char* kLoraNames[] = {"a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down"};

// The clause ids of the two forward ops: experts.forward (no LoRA) and
// experts.forward_train.
struct ForwardClauses {
  const ClauseInfo &shape, &idx_in_range, &idx_unique, &weight_finite, &x_finite, &y_finite,
      &within;
};
constexpr ForwardClauses kForward{kf::kShape,   kf::kIdxInRange, kf::kIdxUnique,  kf::kWeightFinite,
                                  kf::kXFinite, kf::kYFinite,    kf::kWithinBound};
constexpr ForwardClauses kForwardTrain{k::kFwdShape,        k::kFwdIdxInRange, k::kFwdIdxUnique,
                                       k::kFwdWeightFinite, k::kFwdXFinite,    k::kFwdYFinite,
                                       k::kFwdWithin};

bounds::Precision precision_of(const Params& p) {
  const auto it = p.find("precision");
  if (it == p.end())
    throw std::invalid_argument(
        "precision: declare the experts op's arithmetic (fp32, mixed or bf16; docs/JUDGE.md)");
  if (const auto d = bounds::precision_named(it->second)) return *d;
  throw std::invalid_argument(
      fmt::format("precision={}: expected fp32, mixed or bf16 for the experts op", it->second));
}

// The tensors by name, their dimensions read off the weights: H from x,
// I from w_down, E = rows(w_gate) / I, r = rows(a_gate) / E.
ExpertsTensors read_inputs(const Tensors& in, const Params& p, bool lora_allowed) {
  ExpertsTensors t;
  t.x = values(in, "inputs", "x");
  t.idx = indices(in, "inputs", "idx");
  t.weights = values(in, "inputs", "weights");
  t.w_gate = values(in, "inputs", "w_gate");
  t.w_up = values(in, "inputs", "w_up");
  t.w_down = values(in, "inputs", "w_down");
  t.H = t.x.cols, t.I = t.w_down.cols;
  t.E = t.I ? t.w_gate.rows / t.I : 0;
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

// The first input or output whose shape is not the one E, H, I, r, T, K
// imply, or "".
std::string shape_error(const ExpertsTensors& t, MatView<const float> y) {
  const std::size_t T = t.x.rows, K = t.idx.cols, E = t.E, H = t.H, I = t.I, r = t.r;
  const std::pair<const char*, MatView<const float>> base[] = {{"weights", t.weights},
                                                               {"y", y},
                                                               {"w_gate", t.w_gate},
                                                               {"w_up", t.w_up},
                                                               {"w_down", t.w_down}};
  const std::pair<std::size_t, std::size_t> want[] = {
      {T, K}, {T, H}, {E * I, H}, {E * I, H}, {E * H, I}};
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

// Finite, and 0 or within [2^-60, 2^60] (the bounds' range, proofs/bounds.md §0).
bool in_range(float v) {
  const float a = std::fabs(v);
  return a == 0 || (a >= 0x1p-60f && a <= 0x1p60f);
}

// Every value finite and 0 or within [2^-60, 2^60] (the bounds' range).
bool finite_in_range(detail::Checker& c, const ClauseInfo& clause, const char* name,
                     MatView<const float> m) {
  return detail::scan(c, clause, name, m, in_range, "finite, 0 or 2^-60 <= |v| <= 2^60");
}

// y against the model: |y - ref| <= its bound, widened by y's storage.
void y_within(detail::Checker& c, const ClauseInfo& clause, MatView<const float> y,
              const std::vector<Tracked>& ref, const bounds::Precision& p) {
  std::vector<float> got(y.rows * y.cols);
  std::vector<double> v(got.size()), b(got.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    got[i] = y(i / y.cols, i % y.cols);
    v[i] = ref[i].v;
    b[i] = bounds::kReferenceSlack * stored(std::fabs(ref[i].v), ref[i].e);
  }
  const auto cmp = compare::bounded(got, v, b);
  if (!cmp.pass())
    c.fail(clause, fmt::format("y[{}, {}]", cmp.worst / y.cols, cmp.worst % y.cols),
           fmt::format("y={:.9g} ref={:.17g} (utilisation {:.3g})", cmp.worst_got, cmp.worst_ref,
                       cmp.max_utilization),
           fmt::format("|y - ref| <= {:.6g} (precision {}, proofs/experts.md §4)", cmp.worst_bound,
                       p.name));
}

template <const ForwardClauses& k, bool lora>
void forward(detail::Checker& c, const Tensors& in, const Tensors& out, const Params& params) {
  const bounds::Precision p = precision_of(params);
  const ExpertsTensors t = read_inputs(in, params, lora);
  const auto y = values(out, "outputs", "y");
  MOECERT_CONTRACT(c, k.shape) {
    if (const std::string bad = shape_error(t, y); !bad.empty())
      c.fail(k.shape, "", bad,
             fmt::format("the shapes of E={} H={} I={} r={} (docs/JUDGE.md)", t.E, t.H, t.I, t.r));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k.idx_in_range) { routing_in_range(c, k.idx_in_range, t.idx, t.E); }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k.idx_unique) { routing_unique(c, k.idx_unique, t.idx); }
  MOECERT_CONTRACT(c, k.weight_finite) { routing_weights(c, k.weight_finite, t.idx, t.weights); }
  MOECERT_CONTRACT(c, k.x_finite) { finite_in_range(c, k.x_finite, "x", t.x); }
  MOECERT_CONTRACT(c, clauses::gemm::kPackWFinite) {
    for (const auto& [name, m] :
         {std::pair{"w_gate", t.w_gate}, std::pair{"w_up", t.w_up}, std::pair{"w_down", t.w_down}})
      if (!detail::scan_finite(c, clauses::gemm::kPackWFinite, name, m)) break;
  }
  MOECERT_CONTRACT(c, clauses::gemm::kPackWRange) {
    for (const auto& [name, m] :
         {std::pair{"w_gate", t.w_gate}, std::pair{"w_up", t.w_up}, std::pair{"w_down", t.w_down}})
      if (!detail::scan(
              c, clauses::gemm::kPackWRange, name, m,
              [](float v) { return !std::isfinite(v) || in_range(v); },
              "0 or 2^-60 <= |w| <= 2^60"))
        break;
  }
  if constexpr (lora) {
    MOECERT_CONTRACT(c, k::kFwdLoraFinite) {
      const MatView<const float> f[] = {t.a_gate, t.b_gate, t.a_up, t.b_up, t.a_down, t.b_down};
      for (std::size_t i = 0; i < 6 && t.r; ++i)
        if (!finite_in_range(c, k::kFwdLoraFinite, kLoraNames[i], f[i])) break;
    }
    MOECERT_CONTRACT(c, k::kFwdScale) { lora_scale(c, k::kFwdScale, t.r, t.alpha); }
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k.y_finite) { detail::scan_finite(c, k.y_finite, "y", y); }
  // Inputs in range, no overflow; every y within the model's bound for the
  // declared precision; proofs/experts.md §4.
  MOECERT_CONTRACT(c, k.within) { y_within(c, k.within, y, experts_model_forward(t, p), p); }
}

}  // namespace

std::map<std::string, OpEntry> experts_entries() {
  return {
      {"experts.forward",
       {forward<kForward, false>, {"experts.forward.", "gemm.pack.w_finite", "gemm.pack.w_range"}}},
      {"experts.forward_train",
       {forward<kForwardTrain, true>,
        {"experts.forward_train.", "gemm.pack.w_finite", "gemm.pack.w_range"}}}};
}

}  // namespace moecert::contracts::judge
