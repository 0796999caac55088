// What a layer forward saves for the backward: the experts op's state
// (arena, grouping, packed LoRA, idx and weights) and the router's logits.
#pragma once

#include "moecert/layer.hpp"
#include "ops/experts/train.hpp"

namespace moecert::layer {

struct Saved::Impl : experts::TrainState {
  MoeConfig cfg;
  float* logits = nullptr;  // router.logits [T x R]
};

}  // namespace moecert::layer
