// What a layer forward saves for the backward: the experts op's state
// (arena, grouping, packed LoRA, idx and weights) and the router's logits.
#pragma once

#include "contracts/engine/saved.hpp"
#include "moecert/layer.hpp"
#include "ops/experts/train.hpp"

namespace moecert::layer {

struct Saved::Impl : experts::TrainState {
  MoeConfig cfg;
  float* logits = nullptr;    // router.logits [T x R]
  bool logits_kept = false;   // a training forward's logits, until a backward reuses them
  bool router_grads = false;  // router.dw and router.dz of a backward's router path
};

/// The saved state as the contracts read it: the experts op's, the config,
/// the logits, and dL/dw where a backward formed it.
inline contracts::LayerSaved saved_view(const Saved::Impl& s) {
  contracts::LayerSaved v{.train = experts::saved_view(s), .cfg = s.cfg, .logits = s.logits};
  v.train.experts = static_cast<std::size_t>(s.cfg.experts);
  v.train.hidden = static_cast<std::size_t>(s.cfg.hidden);
  v.train.inter = static_cast<std::size_t>(s.cfg.inter);
  v.train.rank = static_cast<std::size_t>(s.cfg.lora_rank);
  v.train.alpha = s.cfg.lora_alpha;
  if (s.valid && s.arena.plan().find("router.dw"))
    v.router_dw = s.arena.get<float>("router.dw", s.tokens * s.topk);
  return v;
}
inline contracts::LayerSaved saved_view(const Saved& s) { return saved_view(s.impl()); }

/// The layer's gradients that the experts op computes (its expert path;
/// dL/dw stays in the layer's arena).
inline experts::Gradients expert_gradients(const Gradients& g) {
  experts::Gradients e;
  e.dx = g.dx;
  e.a_gate = g.a_gate, e.b_gate = g.b_gate, e.a_up = g.a_up, e.b_up = g.b_up, e.a_down = g.a_down,
  e.b_down = g.b_down;
  e.w_gate = g.w_gate, e.w_up = g.w_up, e.w_down = g.w_down;
  e.m_a = g.m_a, e.m_g = g.m_g;
  return e;
}

}  // namespace moecert::layer
