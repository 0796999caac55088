// Clauses of experts.forward (declared in include/moecert/experts.hpp).
#pragma once

#include "contracts/engine.hpp"
#include "contracts/reference/experts.hpp"
#include "contracts/saved.hpp"
#include "moecert/experts.hpp"

namespace moecert::contracts {

void experts_forward_pre(detail::Checker& c, const experts::PackedExperts& w, MatView<const bf16> x,
                         MatView<const std::int32_t> idx, MatView<const float> weights,
                         MatView<float> y);
void experts_forward_grouping(detail::Checker& c, MatView<const std::int32_t> idx,
                              const GroupingView& g);
void experts_forward_post(detail::Checker& c, const experts::PackedExperts& w,
                          MatView<const bf16> x, MatView<const std::int32_t> idx,
                          MatView<const float> weights, MatView<const float> y,
                          const ExpertRows& st);

}  // namespace moecert::contracts
