// The layer judged from tensors (contracts/judge/layer.cpp): moecert's own
// layer, handed over as another implementation would hand its tensors, lies
// within the `mixed` model on every ISA and router; each stage's error is
// named by that stage's clause.
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "contracts/experts/train.hpp"
#include "contracts/judge/ops.hpp"
#include "moecert/isa.hpp"
#include "moecert/layer.hpp"
#include "ops/layer/state.hpp"
#include "support/layer_judged.hpp"
#include "test_util.hpp"

using namespace moecert;
namespace jg = contracts::judge;

namespace {

using Problem = fixture::LayerProblem;

// One layer step as another implementation's tensors (the fixture's
// layer_inputs, judged_step), every gradient asked for.
struct Step {
  jg::Tensors in, forward_out, backward_in, backward_out;
  jg::Params params;
};

Step layer_step(const Problem& p, Isa isa) {
  std::vector<float> y(p.T * p.H, NAN), dx(p.T * p.H, NAN), dwr(p.R * p.H, NAN), db(p.R, NAN);
  const auto w = p.weights();
  layer::Saved saved;
  layer::forward(p.cfg, w, p.X(), {y.data(), p.T, p.H}, saved, {.isa = isa});
  layer::Gradients g;
  g.dx = {dx.data(), p.T, p.H}, g.router_w = {dwr.data(), p.R, p.H}, g.router_b = {db.data(), p.R};
  const auto shapes = contracts::grad_shapes(p.E, p.H, p.I, p.r);
  std::vector<float> weight_grads[9];
  MatView<float>* views[] = {&g.a_gate, &g.b_gate, &g.a_up, &g.b_up,  &g.a_down,
                             &g.b_down, &g.w_gate, &g.w_up, &g.w_down};
  for (int i = 0; i < 9; ++i) {
    weight_grads[i].assign(shapes[i].rows * shapes[i].cols, NAN);
    *views[i] = {weight_grads[i].data(), shapes[i].rows, shapes[i].cols};
  }
  layer::backward(p.cfg, w, p.X(), p.DY(), saved, g);
  const auto view = layer::saved_view(saved);
  const auto iv = saved.idx();
  const auto wv = saved.weights();
  const std::vector<std::int32_t> idx(iv.data, iv.data + p.T * p.K);
  const std::vector<float> weights(wv.data, wv.data + p.T * p.K);
  const std::vector<float> dw(view.router_dw, view.router_dw + p.T * p.K);
  const auto judged =
      fixture::judged_step(p, view.logits, idx, weights, y, dx, dw, dwr, db, weight_grads);
  return {fixture::layer_inputs(p), judged.forward_out, judged.backward_in, judged.backward_out,
          fixture::layer_params(p)};
}

// The clauses that failed, sorted.
std::vector<std::string> failures(const jg::Verdict& v) {
  std::vector<std::string> ids;
  for (const auto& c : v.clauses)
    if (!c.passed) ids.emplace_back(c.info.id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

bool has(const std::vector<std::string>& ids, std::string_view id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

bool evaluated(const jg::Verdict& v, std::string_view id) {
  for (const auto& c : v.clauses)
    if (c.info.id == id) return c.evaluated;
  return false;
}

const RouterKind kKinds[] = {RouterKind::softmax_topk, RouterKind::sigmoid_topk,
                             RouterKind::product_key};

}  // namespace

TEST_CASE("layer.forward, layer.backward: moecert's layer judged from tensors passes as `mixed`",
          "[layer][judge]") {
  std::vector<Isa> isas = usable_isas();
  isas.push_back(Isa::amx_emu);
  for (RouterKind kind : kKinds)
    for (Isa isa : isas) {
      INFO(router_kind_name(kind) << " " << isa_name(isa));
      const Problem p = fixture::random_layer(
          fixture::layer_config(kind, kind == RouterKind::product_key ? 9 : 8, 40, 24, 3, 4, 21),
          21, 5);
      const Step s = layer_step(p, isa);
      const auto fwd = jg::judge_op("layer.forward", s.in, s.forward_out, s.params);
      CHECK(failures(fwd).empty());
      const std::string router(router_kind_name(kind));
      for (const std::string& id : std::vector<std::string>{
               "layer.router_linear.within_bound", "router." + router + ".within_bound",
               "layer.forward.within_bound", "gemm.pack.w_range", "layer.forward.lora_finite"})
        CHECK(evaluated(fwd, id));
      const auto bwd = jg::judge_op("layer.backward", s.backward_in, s.backward_out, s.params);
      CHECK(failures(bwd).empty());
      for (const std::string& id :
           std::vector<std::string>{"router." + router + "_backward.within_bound",
                                    "layer.backward.within_bound", "layer.backward.router_masked"})
        CHECK(evaluated(bwd, id));
    }
}

TEST_CASE("layer.forward, layer.backward: slots in another order pass unless declared sorted",
          "[layer][judge]") {
  for (RouterKind kind : kKinds) {
    INFO(router_kind_name(kind));
    const Problem p = fixture::random_layer(
        fixture::layer_config(kind, kind == RouterKind::product_key ? 9 : 8, 40, 24, 3, 4, 21), 21,
        5);
    const Step s = layer_step(p, Isa::scalar);
    // Every row's slots reversed, each id with its own weight (and dL/dw).
    auto reversed = [](jg::Tensors t, std::initializer_list<const char*> names) {
      for (const char* name : names) {
        jg::Tensor& m = t.at(name);
        for (std::size_t r = 0; r < m.rows; ++r) {
          if (!m.i.empty()) std::reverse(m.i.begin() + r * m.cols, m.i.begin() + (r + 1) * m.cols);
          if (!m.f.empty()) std::reverse(m.f.begin() + r * m.cols, m.f.begin() + (r + 1) * m.cols);
        }
      }
      return t;
    };
    const jg::Tensors fwd_out = reversed(s.forward_out, {"idx", "weights"});
    jg::Params any_order = s.params;
    any_order.erase("sorted");
    CHECK(failures(jg::judge_op("layer.forward", s.in, fwd_out, any_order)).empty());
    CHECK_FALSE(evaluated(jg::judge_op("layer.forward", s.in, fwd_out, any_order),
                          "router." + std::string(router_kind_name(kind)) + ".sorted"));
    CHECK(failures(jg::judge_op("layer.forward", s.in, fwd_out, s.params)) ==
          std::vector<std::string>{"router." + std::string(router_kind_name(kind)) + ".sorted"});
    const jg::Tensors bwd_in = reversed(s.backward_in, {"idx", "weights"});
    const jg::Tensors bwd_out = reversed(s.backward_out, {"dweights"});
    CHECK(failures(jg::judge_op("layer.backward", bwd_in, bwd_out, any_order)).empty());
    // Weights kept in the sorted slots while the ids are reversed: each id reads another's weight.
    jg::Tensors unpaired = reversed(s.forward_out, {"idx"});
    CHECK(has(failures(jg::judge_op("layer.forward", s.in, unpaired, any_order)),
              "router." + std::string(router_kind_name(kind)) + ".within_bound"));
  }
}

TEST_CASE("layer.forward, layer.backward: each stage's error is named by its clause",
          "[layer][judge]") {
  const Problem p = fixture::random_layer(
      fixture::layer_config(RouterKind::softmax_topk, 8, 40, 24, 3, 4, 21), 21, 5);
  const Step s = layer_step(p, Isa::scalar);
  using Ids = std::vector<std::string>;
  auto forward_with = [&](const char* name, std::size_t i, auto change) {
    jg::Tensors out = s.forward_out;
    auto& t = out.at(name);
    change(t, i);
    return failures(jg::judge_op("layer.forward", s.in, out, s.params));
  };
  // Off by 20 (values up to about 15, bounds up to about 1 under `mixed`).
  auto off = [](jg::Tensor& t, std::size_t i) { t.f[i] += 20; };
  // An unselected expert's logit lowered (the same selection and weights):
  // the router linear alone.
  const auto& idx = s.forward_out.at("idx").i;
  std::size_t unselected = 0;  // in row 0
  while (std::count(idx.begin(), idx.begin() + 3, std::int32_t(unselected))) ++unselected;
  CHECK(forward_with("z", unselected, [](jg::Tensor& t, std::size_t i) { t.f[i] -= 20; }) ==
        Ids{"layer.router_linear.within_bound"});
  // Raised instead: the router's selection on that z is wrong too.
  CHECK(forward_with("z", unselected, off) ==
        Ids{"layer.router_linear.within_bound", "router.softmax_topk.topk_property"});
  // Two selected experts swapped: the router's order on the implementation's z.
  CHECK(has(
      forward_with("idx", 3, [](jg::Tensor& t, std::size_t i) { std::swap(t.i[i], t.i[i + 1]); }),
      "router.softmax_topk.sorted"));
  CHECK(forward_with("y", 50, off) ==
        Ids{"layer.forward.spread_explained", "layer.forward.within_bound"});
  // Every y 5% too large: the error along y.
  jg::Tensors scaled = s.forward_out;
  for (float& v : scaled.at("y").f) v *= 1.05f;
  CHECK(has(failures(jg::judge_op("layer.forward", s.in, scaled, s.params)),
            "layer.forward.scale_explained"));
  CHECK(has(forward_with("y", 50, [](jg::Tensor& t, std::size_t i) { t.f[i] = NAN; }),
            "layer.forward.y_finite"));
  // Every output cut to bf16 by truncation: within the bounds, biased toward zero.
  auto truncated = [](jg::Tensors out, const char* name) {
    for (float& v : out.at(name).f)
      v = bf16::from_bits(static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(v) >> 16))
              .to_float();
    return out;
  };
  const auto cut_y =
      failures(jg::judge_op("layer.forward", s.in, truncated(s.forward_out, "y"), s.params));
  CHECK(has(cut_y, "layer.forward.rounding_unbiased"));
  CHECK(!has(cut_y, "layer.forward.within_bound"));

  const jg::Tensors& in = s.backward_in;
  auto backward_with = [&](const char* name, std::size_t i, auto change) {
    jg::Tensors out = s.backward_out;
    change(out.at(name), i);
    return failures(jg::judge_op("layer.backward", in, out, s.params));
  };
  // dL/dw off: the model's dL/dw, and dz against the router backward of it.
  const Ids beyond{"layer.backward.spread_explained", "layer.backward.within_bound"};
  CHECK(backward_with("dweights", 4, off) == Ids{"layer.backward.spread_explained",
                                                 "layer.backward.within_bound",
                                                 "router.softmax_topk_backward.within_bound"});
  CHECK(backward_with("dx", 33, off) == beyond);
  const auto cut_dx =
      failures(jg::judge_op("layer.backward", in, truncated(s.backward_out, "dx"), s.params));
  CHECK(has(cut_dx, "layer.backward.rounding_unbiased"));
  CHECK(!has(cut_dx, "layer.backward.within_bound"));
  CHECK(backward_with("router_w_grad", 33, off) == Ids{"layer.backward.within_bound"});
  CHECK(backward_with("router_b_grad", 3, off) == Ids{"layer.backward.within_bound"});
  auto far_off = [](jg::Tensor& t, std::size_t i) { t.f[i] += 100; };
  CHECK(backward_with("b_down_grad", 7, far_off) == beyond);
  CHECK(backward_with("w_gate_grad", 7, far_off) == beyond);
  // A gradient at an unselected expert (failure mode 5; any nonzero value,
  // the mask asks for exactly 0): the router's mask.
  const auto masked =
      backward_with("dz", unselected, [](jg::Tensor& t, std::size_t i) { t.f[i] = 1e-3f; });
  CHECK(has(masked, "router.softmax_topk_backward.unselected_grad"));
}

TEST_CASE("layer.forward, layer.backward: the judge refuses what it cannot read",
          "[layer][judge]") {
  const Problem p = fixture::random_layer(
      fixture::layer_config(RouterKind::sigmoid_topk, 8, 40, 24, 3, 4, 21), 21, 5);
  const Step s = layer_step(p, Isa::scalar);
  jg::Params no_router = s.params;
  no_router.erase("router");
  CHECK_THROWS_WITH(jg::judge_op("layer.forward", s.in, s.forward_out, no_router),
                    Catch::Contains("router: name the layer's router"));
  jg::Tensors out = s.forward_out;
  out.erase("z");
  CHECK_THROWS_WITH(jg::judge_op("layer.forward", s.in, out, s.params),
                    Catch::Contains("no tensor 'z'"));
  // router_w of another width: the layer's shape clause.
  jg::Tensors in = s.in;
  in["router_w"].rows -= 1, in["router_w"].f.resize(in["router_w"].rows * p.H);
  const auto v = jg::judge_op("layer.forward", in, s.forward_out, s.params);
  CHECK(failures(v) == std::vector<std::string>{"layer.forward.shape"});
}
