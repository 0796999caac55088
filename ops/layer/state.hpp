// The layer's internal state: LoRA factors packed for the kernels, and what
// a forward saves for the backward.
#pragma once

#include <cstdint>
#include <vector>

#include "moecert/layer.hpp"
#include "ops/experts/forward.hpp"
#include "ops/experts/lora.hpp"
#include "ops/workspace/arena.hpp"

namespace moecert::layer {

struct Saved::Impl {
  bool valid = false;
  bool training = false;
  MoeConfig cfg;
  std::size_t tokens = 0;
  std::uint64_t generation = 0;  // distinguishes forwards (for tests)
  experts::ForwardState st;      // grouping, layouts, c1 and h (saved)
  workspace::Arena arena;
  experts::PackedLora lora;
  Isa isa = Isa::scalar;
  std::int32_t* idx = nullptr;
  float* weights = nullptr;
  float* logits = nullptr;
};

}  // namespace moecert::layer
