// One layer step of moecert's own layer handed to the judge as another
// implementation hands it over (contracts/judge/layer.cpp): the inputs, the
// forward's z, idx, weights and y, the backward's dx, dL/dw, dz, the router
// linear's and the experts' weight gradients. Shared by the judge's tests
// and the conformance cases.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <string>
#include <vector>

#include "contracts/experts/train.hpp"
#include "contracts/judge/ops.hpp"
#include "moecert/experts.hpp"
#include "moecert/layer.hpp"
#include "moecert/router.hpp"
#include "support/layer_problem.hpp"

namespace moecert::fixture {

namespace jg = contracts::judge;

inline jg::Tensor tensor(const std::vector<float>& v, std::size_t rows) {
  return {.f = v, .rows = rows, .cols = v.size() / rows};
}
inline jg::Tensor tensor(const std::vector<bf16>& v, std::size_t rows) {
  jg::Tensor t{.rows = rows, .cols = v.size() / rows};
  for (const bf16 b : v) t.f.push_back(b.to_float());
  return t;
}

/// The layer's inputs (x, the experts' weights and LoRA, the router's
/// weights, bias and selection bias) and the params naming its config,
/// under the declared precision `mixed`.
inline jg::Tensors layer_inputs(const LayerProblem& p) {
  jg::Tensors in{{"x", tensor(p.x, p.T)},           {"w_gate", tensor(p.wg, p.E * p.I)},
                 {"w_up", tensor(p.wu, p.E * p.I)}, {"w_down", tensor(p.wd, p.E * p.H)},
                 {"router_w", tensor(p.wr, p.R)},   {"router_b", tensor(p.b, 1)}};
  if (p.cfg.router == RouterKind::sigmoid_topk) in["router_bias"] = tensor(p.bias, 1);
  const auto shapes = contracts::lora_shapes(p.E, p.H, p.I, p.r);
  for (int i = 0; i < 6 && p.r; ++i) in[shapes[i].name] = tensor(p.lora[i], shapes[i].rows);
  return in;
}
inline jg::Params layer_params(const LayerProblem& p) {
  return {{"precision", "mixed"},
          {"router", std::string(router_kind_name(p.cfg.router))},
          {"sorted", "true"},  // moecert's slots follow the declared order
          {"renormalize", p.cfg.renormalize ? "true" : "false"},
          {"alpha", fmt::format("{}", p.cfg.lora_alpha)},
          {"groups", fmt::format("{}", p.cfg.groups)},
          {"topk_group", fmt::format("{}", p.cfg.topk_group)},
          {"scaling", fmt::format("{}", p.cfg.scaling)}};
}

/// dz [T x R] of the layer's router backward from its logits z, selection
/// and dL/dw (the layer keeps it inside; product_key's as [dsx | dsy]).
inline std::vector<float> router_dz(const LayerProblem& p, const float* z,
                                    const std::vector<std::int32_t>& idx,
                                    const std::vector<float>& dw) {
  std::vector<float> dz(p.T * p.R, NAN);
  const MatView<const float> zv{z, p.T, p.R}, g{dw.data(), p.T, p.K};
  const MatView<const std::int32_t> iv{idx.data(), p.T, p.K};
  switch (p.cfg.router) {
    case RouterKind::softmax_topk:
      router::softmax_topk_backward(zv, iv, g, {dz.data(), p.T, p.R}, p.cfg.renormalize);
      break;
    case RouterKind::sigmoid_topk:
      router::sigmoid_topk_backward(
          zv, iv, g,
          {std::size_t(p.cfg.groups), std::size_t(p.cfg.topk_group), float(p.cfg.scaling)},
          {dz.data(), p.T, p.R});
      break;
    case RouterKind::product_key: {
      const std::size_t n = p.R / 2;
      std::vector<float> dsx(p.T * n), dsy(p.T * n);
      router::product_key_backward({z, p.T, n, p.R}, {z + n, p.T, n, p.R}, iv, g,
                                   router::KeyWeights::softmax, {dsx.data(), p.T, n},
                                   {dsy.data(), p.T, n});
      for (std::size_t t = 0; t < p.T; ++t)
        for (std::size_t j = 0; j < n; ++j)
          dz[t * p.R + j] = dsx[t * n + j], dz[t * p.R + n + j] = dsy[t * n + j];
      break;
    }
  }
  return dz;
}

/// A layer step's outputs as the judge reads them.
struct JudgedStep {
  jg::Tensors forward_out, backward_in, backward_out;
};

/// The forward's z (the saved logits), idx, weights and y; the backward's
/// dx, dL/dw (the saved router_dw), dz, router gradients and the weight
/// gradients given (`weight_grads` in contracts::grad_shapes' order, empty
/// vectors left out).
inline JudgedStep judged_step(const LayerProblem& p, const float* z,
                              const std::vector<std::int32_t>& idx,
                              const std::vector<float>& weights, const std::vector<float>& y,
                              const std::vector<float>& dx, const std::vector<float>& dw,
                              const std::vector<float>& router_w_grad,
                              const std::vector<float>& router_b_grad,
                              const std::vector<float> (&weight_grads)[9]) {
  JudgedStep s;
  const std::vector<float> zv(z, z + p.T * p.R);
  s.forward_out = {{"z", tensor(zv, p.T)},
                   {"idx", {.i = idx, .rows = p.T, .cols = p.K}},
                   {"weights", tensor(weights, p.T)},
                   {"y", tensor(y, p.T)}};
  s.backward_in = layer_inputs(p);
  for (const char* name : {"z", "idx", "weights"}) s.backward_in[name] = s.forward_out.at(name);
  s.backward_in["dy"] = tensor(p.dy, p.T);
  s.backward_out = {{"dx", tensor(dx, p.T)},
                    {"dweights", tensor(dw, p.T)},
                    {"dz", tensor(router_dz(p, z, idx, dw), p.T)},
                    {"router_w_grad", tensor(router_w_grad, p.R)},
                    {"router_b_grad", tensor(router_b_grad, 1)}};
  const auto shapes = contracts::grad_shapes(p.E, p.H, p.I, p.r);
  for (int i = 0; i < 9; ++i)
    if (!weight_grads[i].empty())
      s.backward_out[fmt::format("{}_grad", shapes[i].name)] =
          tensor(weight_grads[i], shapes[i].rows);
  return s;
}

}  // namespace moecert::fixture
