// Clauses of experts.forward (declared in include/moecert/experts.hpp).
#pragma once

#include "contracts/engine.hpp"
#include "contracts/reference/experts.hpp"
#include "moecert/experts.hpp"
#include "ops/experts/forward.hpp"

namespace moecert::contracts {

void experts_forward_pre(detail::Checker& c, const experts::PackedExperts& w, MatView<const bf16> x,
                         MatView<const std::int32_t> idx, MatView<const float> weights,
                         MatView<float> y);
void experts_forward_grouping(detail::Checker& c, MatView<const std::int32_t> idx,
                              const experts::Grouping& g);
void experts_forward_post(detail::Checker& c, const experts::PackedExperts& w,
                          MatView<const bf16> x, MatView<const std::int32_t> idx,
                          MatView<const float> weights, MatView<const float> y,
                          const experts::ForwardState& st);

}  // namespace moecert::contracts
