// The layer's clauses on another implementation's tensors, stage by stage
// on its own intermediates (docs/JUDGE.md): the router linear's logits z
// against x W_r^T + b under the declared precision, the router's selection
// and weights on that z (the router's clauses, tie-aware), y against the
// experts model on that selection; backward: dL/dw against the model, dz by
// the router backward's clauses on that dL/dw, dx and the router linear's
// gradients against the model's dx plus the router linear's sums of that dz.
#include <algorithm>
#include <string>

#include "contracts/engine/checks.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/judge/experts.hpp"
#include "contracts/router/kind.hpp"
#include "moecert/config.hpp"

namespace moecert::contracts::judge {
namespace {

namespace kl = clauses::layer;
using bounds::Precision;
using bounds::Tracked;

constexpr const char* kProof = "proofs/layer.md §7";
constexpr const char* kSpreadProof = "probabilistic, proofs/bounds.md §12";

RouterKind router_of(const Params& p) {
  const auto it = p.find("router");
  if (it == p.end())
    throw std::invalid_argument(
        fmt::format("router: name the layer's router ({})", router_kind_list()));
  if (const auto k = parse_router_kind(it->second)) return *k;
  throw std::invalid_argument(
      fmt::format("router={}: expected {}", it->second, router_kind_list()));
}

// The router kind's clauses, and the quantized weights' where declared.
std::vector<std::string> router_families(const Params& p, const char* suffix) {
  std::vector<std::string> out = quantized_families(p);
  out.push_back(fmt::format("router.{}{}", router_kind_name(router_of(p)), suffix));
  return out;
}

// The layer's tensors: the experts op's, the router linear's and the
// forward's intermediates z, idx, weights (outputs of a forward, inputs of
// a backward).
struct LayerTensors {
  RouterKind kind = RouterKind::softmax_topk;
  ExpertsTensors ex;
  MatView<const float> router_w, z;
  View<const float> router_b, router_bias;
};

LayerTensors read_layer(const Tensors& in, const Tensors& routed, const char* side,
                        const Params& p) {
  LayerTensors t;
  t.kind = router_of(p), t.ex = experts_tensors(in, p, true);
  t.router_w = values(in, "inputs", "router_w");
  t.router_b = vector_of(in, "inputs", "router_b");
  if (router_kind(t.kind).expert_bias) t.router_bias = vector_of(in, "inputs", "router_bias");
  t.z = values(routed, side, "z");
  t.ex.idx = indices(routed, side, "idx");
  t.ex.weights = values(routed, side, "weights");
  return t;
}

// The first shape that is not the layer's, or "": the experts op's, then
// router_w R x H with R = E (2n, n^2 = E for product_key), router_b R,
// router_bias E, z T x R.
std::string layer_shape_error(const LayerTensors& t, const char* y_name, MatView<const float> y) {
  if (std::string bad = experts_shape_error(t.ex, y_name, y); !bad.empty()) return bad;
  const std::size_t E = t.ex.E, T = t.ex.x.rows;
  const RouterKindInfo& kind = router_kind(t.kind);
  const std::size_t R = kind.width(E);
  if (R == 0) return fmt::format("E={} experts, not a count {} routes", E, kind.name);
  if (t.router_w.rows != R || t.router_w.cols != t.ex.H)
    return fmt::format("router_w {}x{}, expected {}x{}", t.router_w.rows, t.router_w.cols, R,
                       t.ex.H);
  if (t.router_b.size != R) return fmt::format("router_b {}, expected {}", t.router_b.size, R);
  if (kind.expert_bias && t.router_bias.size != E)
    return fmt::format("router_bias {}, expected {}", t.router_bias.size, E);
  if (t.z.rows != T || t.z.cols != R)
    return fmt::format("z {}x{}, expected {}x{}", t.z.rows, t.z.cols, T, R);
  return "";
}

MatView<const float> row_of(View<const float> v) { return {v.data, 1, v.size, v.size}; }

// x, the router's and the experts' weights finite and in range (the
// layer's input clauses).
void input_clauses(detail::Checker& c, const LayerTensors& t) {
  MOECERT_CONTRACT(c, kl::kFwdXFinite) {
    detail::scan_finite(c, kl::kFwdXFinite, "x", t.ex.x) &&
        detail::scan_finite(c, kl::kFwdXFinite, "router_w", t.router_w) &&
        detail::scan_finite(c, kl::kFwdXFinite, "router_b", row_of(t.router_b)) &&
        (t.router_bias.size == 0 ||
         detail::scan_finite(c, kl::kFwdXFinite, "router_bias", row_of(t.router_bias)));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, kl::kFwdXRange) { scan_range(c, kl::kFwdXRange, "x", t.ex.x); }
  weight_clauses<kl::kFwdLoraFinite, kl::kFwdLoraRange, kl::kFwdScale>(c, t.ex);
}

// The larger bound of two models of one value.
Tracked either(const Tracked& a, const Tracked& b) { return {a.v, std::max(a.e, b.e)}; }

// z = x W_r^T + b from the operands as read, accumulated in fp32 and
// stored: the bias one more term of the sum, or added to the stored
// product (proofs/layer.md §7).
std::vector<Tracked> logits_model(const LayerTensors& t, const Precision& p) {
  const std::size_t T = t.ex.x.rows, H = t.ex.H, R = t.router_w.rows;
  std::vector<Tracked> z(T * R);
  for (std::size_t i = 0; i < T; ++i)
    for (std::size_t e = 0; e < R; ++e) {
      auto x = [&](std::size_t q) { return q < H ? bounds::input(t.ex.x(i, q), p) : Tracked{1.0}; };
      auto w = [&](std::size_t q) {
        return q < H ? bounds::input(t.router_w(e, q), p) : Tracked{t.router_b[e]};
      };
      const Tracked fused = bounds::dot_stored(H + 1, x, w, H + 1, p);
      const Tracked added = bounds::mid(bounds::dot_stored(H, x, w, H, p) + w(H), p);
      z[i * R + e] = either(fused, added);
    }
  return z;
}

// The router's forward clauses on the implementation's z, idx and weights.
void router_forward(detail::Checker& c, const LayerTensors& t, const Params& p) {
  const RouterKindInfo& kind = router_kind(t.kind);
  kind.forward_clauses(c, t.z, t.router_bias, kind.judge_settings(p), t.ex.idx, t.ex.weights);
}

// Whether every row of the router's ids is in [-1, E) (the experts' model
// reads the weights through them); the rows that are not are recorded as
// skipped (the router's index clause reported them).
bool routable(MatView<const std::int32_t> idx, std::size_t experts) {
  bool all = true;
  for (std::size_t t = 0; t < idx.rows; ++t)
    for (std::size_t j = 0; j < idx.cols; ++j)
      if (idx(t, j) < -1 || idx(t, j) >= static_cast<std::int64_t>(experts)) {
        judge::skip_row(t);
        all = false;
        break;
      }
  return all;
}

void layer_forward(detail::Checker& c, const Tensors& in, const Tensors& out,
                   const Params& params) {
  const Precision p = precision_of(params);
  const LayerTensors t = read_layer(in, out, "outputs", params);
  const auto y = values(out, "outputs", "y");
  MOECERT_CONTRACT(c, kl::kFwdShape) {
    if (const std::string bad = layer_shape_error(t, "y", y); !bad.empty())
      c.fail(kl::kFwdShape, "", bad,
             fmt::format("the shapes of E={} H={} I={} r={} (docs/JUDGE.md)", t.ex.E, t.ex.H,
                         t.ex.I, t.ex.r));
  }
  if (c.stop()) return;
  input_clauses(c, t);
  if (c.stop()) return;
  // The router linear: z finite and within its model.
  MOECERT_CONTRACT(c, kl::kRlOutFinite) { detail::scan_finite(c, kl::kRlOutFinite, "z", t.z); }
  MOECERT_CONTRACT(c, kl::kRlWithin) {
    const auto model = logits_model(t, p);
    within_model(c, kl::kRlWithin, "z", t.z, model, p, kProof);
    summarize_error("z", t.z, model);
  }
  // The router on that z; y on the selection it made.
  router_forward(c, t, params);
  if (c.stop()) return;
  MOECERT_CONTRACT(c, kl::kFwdYFinite) { detail::scan_finite(c, kl::kFwdYFinite, "y", y); }
  // y's model on ids the router's index clauses rejected is not computed.
  MOECERT_CONTRACT(c, kl::kFwdWithin) {
    if (routable(t.ex.idx, t.ex.E)) {
      const auto model = experts_model_forward(t.ex, p);
      within_model(c, kl::kFwdWithin, "y", y, model, p, kProof);
      summarize_error("y", y, model);
    }
  }
  // y under the probabilistic model, element by element and along y
  // (proofs/bounds.md §12), unless audit=false.
  if (c.stop() || !audit_asked(params) || !routable(t.ex.idx, t.ex.E)) return;
  const ProbableForward model = experts_model_forward_probable(t.ex, p);
  MOECERT_CONTRACT(c, kl::kFwdRounding) {
    rounding_unbiased(c, kl::kFwdRounding, "y", contracts::values(y), exact(model.y));
  }
  MOECERT_CONTRACT(c, kl::kFwdSpread) {
    within_model(c, kl::kFwdSpread, "y", y, model.y, p, kSpreadProof);
  }
  MOECERT_CONTRACT(c, kl::kFwdScaleExplained) {
    within_projection(c, kl::kFwdScaleExplained, "y", y, model.y, model.along_y, p);
  }
}

// The backward's outputs: dx, dweights (dL/dw) and dz, and the router
// linear's and the experts' weight gradients when given.
struct LayerGrads {
  MatView<const float> dx, dweights, dz, router_w, router_b;
  WeightGrads experts;
};

LayerGrads layer_grads(const Tensors& out) {
  LayerGrads g;
  g.dx = values(out, "outputs", "dx"), g.dweights = values(out, "outputs", "dweights"),
  g.dz = values(out, "outputs", "dz");
  g.experts = weight_grad_outputs(out);
  if (has(out, "router_w_grad")) g.router_w = values(out, "outputs", "router_w_grad");
  if (has(out, "router_b_grad")) {
    const auto b = vector_of(out, "outputs", "router_b_grad");
    g.router_b = row_of(b);
  }
  return g;
}

std::string grads_shape_error(const LayerTensors& t, const LayerGrads& g) {
  const std::size_t T = t.ex.x.rows, H = t.ex.H, K = t.ex.idx.cols, R = t.router_w.rows;
  const std::pair<const char*, MatView<const float>> got[] = {{"dx", g.dx},
                                                              {"dweights", g.dweights},
                                                              {"dz", g.dz},
                                                              {"router_w_grad", g.router_w},
                                                              {"router_b_grad", g.router_b}};
  const std::pair<std::size_t, std::size_t> want[] = {{T, H}, {T, K}, {T, R}, {R, H}, {1, R}};
  for (std::size_t i = 0; i < 5; ++i)
    if (got[i].second.data &&
        (got[i].second.rows != want[i].first || got[i].second.cols != want[i].second))
      return fmt::format("{} {}x{}, expected {}x{}", got[i].first, got[i].second.rows,
                         got[i].second.cols, want[i].first, want[i].second);
  return "";
}

// The forward's z, idx and weights the backward reads: z finite, indices
// in range (-1 at row tails), weights finite and 0 at -1 slots.
void saved_clauses(detail::Checker& c, const LayerTensors& t) {
  MOECERT_CONTRACT(c, kl::kBwdSavedFinite) {
    if (detail::scan_finite(c, kl::kBwdSavedFinite, "z", t.z)) {
      routing_in_range(c, kl::kBwdSavedFinite, t.ex.idx, t.ex.E);
      routing_weights(c, kl::kBwdSavedFinite, t.ex.idx, t.ex.weights);
    }
  }
}

// The router backward's clauses on the implementation's z, idx, dL/dw and dz.
void router_backward(detail::Checker& c, const LayerTensors& t, const LayerGrads& g,
                     const Params& p) {
  const RouterKindInfo& kind = router_kind(t.kind);
  kind.backward_clauses(c, t.z, t.ex.idx, g.dweights, kind.judge_settings(p), g.dz);
}

// dx = the experts' dx + dz W_r: the router linear's sum accumulated into
// the experts' stored dx (R + 1 terms in fp32), or formed, stored and
// added among the slots' rows in any order (K + 1 stored terms).
std::vector<Tracked> dx_model(const LayerTensors& t, const ExpertsBackward& ex,
                              MatView<const float> dz, const Precision& p) {
  const std::size_t T = t.ex.x.rows, H = t.ex.H, R = t.router_w.rows, K = t.ex.idx.cols;
  std::vector<Tracked> dx(T * H);
  for (std::size_t i = 0; i < T; ++i)
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t at = i * H + h;
      auto a = [&](std::size_t q) { return q < R ? bounds::input(dz(i, q), p) : ex.dx[at]; };
      auto w = [&](std::size_t q) {
        return q < R ? bounds::input(t.router_w(q, h), p) : Tracked{1.0};
      };
      const Tracked fused = bounds::dot_stored(R + 1, a, w, R + 1, p);
      const Tracked router = bounds::dot_stored(R, a, w, R, p);
      const Tracked among =
          bounds::sum_stored(ex.dx_rows[at] + router, ex.dx_rows_abs[at] + router.mag(), K + 1, p);
      dx[at] = either(fused, among);
    }
  return dx;
}

// dW_r = dz^T x and db = the column sums of dz: sums of T terms.
std::vector<Tracked> router_w_grad_model(const LayerTensors& t, MatView<const float> dz,
                                         const Precision& p) {
  const std::size_t T = t.ex.x.rows, H = t.ex.H, R = t.router_w.rows;
  std::vector<Tracked> dw(R * H);
  for (std::size_t e = 0; e < R; ++e)
    for (std::size_t h = 0; h < H; ++h)
      dw[e * H + h] = bounds::dot_stored(
          T, [&](std::size_t i) { return bounds::input(dz(i, e), p); },
          [&](std::size_t i) { return bounds::input(t.ex.x(i, h), p); }, T, p);
  return dw;
}
std::vector<Tracked> router_b_grad_model(MatView<const float> dz, const Precision& p) {
  std::vector<Tracked> db(dz.cols);
  for (std::size_t e = 0; e < dz.cols; ++e)
    db[e] = bounds::dot_stored(
        dz.rows, [&](std::size_t i) { return Tracked{dz(i, e)}; },
        [](std::size_t) { return Tracked{1.0}; }, dz.rows, p);
  return db;
}

void layer_backward(detail::Checker& c, const Tensors& in, const Tensors& out,
                    const Params& params) {
  const Precision p = precision_of(params);
  const LayerTensors t = read_layer(in, in, "inputs", params);
  const auto dy = values(in, "inputs", "dy");
  const LayerGrads g = layer_grads(out);
  MOECERT_CONTRACT(c, kl::kBwdShape) {
    std::string bad = layer_shape_error(t, "dy", dy);
    if (bad.empty()) bad = grads_shape_error(t, g);
    if (bad.empty()) bad = weight_grads_shape_error(t.ex, g.experts);
    if (!bad.empty())
      c.fail(kl::kBwdShape, "", bad,
             fmt::format("the shapes of E={} H={} I={} r={} (docs/JUDGE.md)", t.ex.E, t.ex.H,
                         t.ex.I, t.ex.r));
  }
  if (c.stop()) return;
  input_clauses(c, t);
  saved_clauses(c, t);
  MOECERT_CONTRACT(c, kl::kBwdDyFinite) { finite_in_range(c, kl::kBwdDyFinite, "dy", dy); }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, kl::kBwdGradFinite) {
    const std::pair<const char*, MatView<const float>> all[] = {{"dx", g.dx},
                                                                {"dweights", g.dweights},
                                                                {"dz", g.dz},
                                                                {"router_w_grad", g.router_w},
                                                                {"router_b_grad", g.router_b}};
    bool ok = true;
    for (const auto& [name, m] : all)
      if (ok && m.data) ok = detail::scan_finite(c, kl::kBwdGradFinite, name, m);
    if (ok) weight_grads_finite(c, kl::kBwdGradFinite, g.experts);
  }
  MOECERT_CONTRACT(c, kl::kBwdEmptyZero) {
    weight_grads_idle_zero(c, kl::kBwdEmptyZero, t.ex, g.experts);
  }
  MOECERT_CONTRACT(c, kl::kBwdRouterMasked) {
    TrainSaved routing;
    routing.tokens = t.ex.x.rows, routing.topk = t.ex.idx.cols, routing.idx = t.ex.idx.data;
    dweights_masked(c, kl::kBwdRouterMasked, routing, g.dweights);
  }
  // dz by the router backward's clauses, on the implementation's dL/dw.
  router_backward(c, t, g, params);
  if (c.stop()) return;
  // The gradients against the model: dL/dw and the experts' dx from the
  // experts model, dx and the router linear's from the implementation's dz.
  MOECERT_CONTRACT(c, kl::kBwdWithin) {
    const auto ex = experts_model_backward(t.ex, dy, p, any_weight_grad(g.experts));
    const auto dx = dx_model(t, ex, g.dz, p);
    summarize_error("dweights", g.dweights, ex.dweights);
    summarize_error("dx", g.dx, dx);
    within_model(c, kl::kBwdWithin, "dweights", g.dweights, ex.dweights, p, kProof) &&
        within_model(c, kl::kBwdWithin, "dx", g.dx, dx, p, kProof) &&
        (!g.router_w.data || within_model(c, kl::kBwdWithin, "router_w_grad", g.router_w,
                                          router_w_grad_model(t, g.dz, p), p, kProof)) &&
        (!g.router_b.data || within_model(c, kl::kBwdWithin, "router_b_grad", g.router_b,
                                          router_b_grad_model(g.dz, p), p, kProof)) &&
        weight_grads_within(c, kl::kBwdWithin, g.experts, ex, p, kProof);
  }
  // The same under the probabilistic model (proofs/bounds.md §12), unless
  // audit=false; the router linear's gradients are sums of the given dz.
  if (c.stop() || !audit_asked(params)) return;
  const auto ex = experts_model_backward(t.ex, dy, bounds::probable(p), any_weight_grad(g.experts));
  const auto dx = dx_model(t, ex, g.dz, p);
  MOECERT_CONTRACT(c, kl::kBwdSpread) {
    within_model(c, kl::kBwdSpread, "dweights", g.dweights, ex.dweights, p, kSpreadProof) &&
        within_model(c, kl::kBwdSpread, "dx", g.dx, dx, p, kSpreadProof) &&
        weight_grads_within(c, kl::kBwdSpread, g.experts, ex, p, kSpreadProof);
  }
  // Round to nearest: errors without a sign bias (proofs/bounds.md §11).
  MOECERT_CONTRACT(c, kl::kBwdRounding) {
    rounding_unbiased(c, kl::kBwdRounding, "dweights", contracts::values(g.dweights),
                      exact(ex.dweights)) &&
        rounding_unbiased(c, kl::kBwdRounding, "dx", contracts::values(g.dx), exact(dx)) &&
        weight_grads_unbiased(c, kl::kBwdRounding, g.experts, ex, t.ex.E);
  }
}

std::vector<std::string> forward_router(const Params& p) { return router_families(p, "."); }
std::vector<std::string> backward_router(const Params& p) {
  return router_families(p, "_backward.");
}

}  // namespace

std::map<std::string, OpEntry> layer_entries() {
  const std::vector<std::string> weights = {"gemm.pack.w_finite", "gemm.pack.w_range"};
  std::vector<std::string> fwd = {
      "layer.forward.x_finite",          "layer.forward.x_range",
      "layer.forward.lora_finite",       "layer.forward.lora_range",
      "layer.forward.scale_finite",      "layer.forward.shape",
      "layer.forward.y_finite",          "layer.forward.within_bound",
      "layer.forward.spread_explained",  "layer.forward.scale_explained",
      "layer.forward.rounding_unbiased", "layer.router_linear.out_finite",
      "layer.router_linear.within_bound"};
  std::vector<std::string> bwd = {
      "layer.forward.x_finite",          "layer.forward.x_range",
      "layer.forward.lora_finite",       "layer.forward.lora_range",
      "layer.forward.scale_finite",      "layer.backward.shape",
      "layer.backward.saved_finite",     "layer.backward.dy_finite",
      "layer.backward.grad_finite",      "layer.backward.router_masked",
      "layer.backward.within_bound",     "layer.backward.empty_expert_zero",
      "layer.backward.spread_explained", "layer.backward.rounding_unbiased"};
  fwd.insert(fwd.end(), weights.begin(), weights.end());
  bwd.insert(bwd.end(), weights.begin(), weights.end());
  return {{"layer.forward", {layer_forward, fwd, forward_router}},
          {"layer.backward", {layer_backward, bwd, backward_router}}};
}

}  // namespace moecert::contracts::judge
