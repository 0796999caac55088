// The experts op's forward reference (contracts/bounds/experts_forward.hpp): each
// token's routed experts in binary64 (bounds::expert_row), combined with the
// routing weights; the bound of the kernel's combine on top.
#include "contracts/bounds/experts_forward.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <cmath>

#include "contracts/bounds/experts.hpp"
#include "contracts/engine/tbb_sync.hpp"

namespace moecert::contracts {

ExpertsReference experts_forward_reference(const experts::PackedExperts& w, MatView<const bf16> x,
                                           MatView<const std::int32_t> idx,
                                           MatView<const float> weights) {
  const std::size_t t_count = x.rows, kk = idx.cols, hidden = w.hidden(), inter = w.inter();
  ExpertsReference r;
  r.y.assign(t_count * hidden, 0.0);
  r.bound.assign(t_count * hidden, 0.0);
  oneapi::tbb::parallel_for(
      std::size_t{0}, t_count, detail::TbbBody([&](std::size_t t) {
        std::vector<double> sum_we(hidden, 0.0), sum_wmag(hidden, 0.0);
        for (std::size_t j = 0; j < kk; ++j) {
          const std::int32_t e = idx(t, j);
          if (e < 0) continue;
          const auto ue = static_cast<std::size_t>(e);
          const auto row = bounds::expert_row(
              hidden, inter, [&](std::size_t h) { return double(x(t, h).to_float()); },
              [&](std::size_t i, std::size_t h) { return double(w.gate(ue, i, h).to_float()); },
              [&](std::size_t i, std::size_t h) { return double(w.up(ue, i, h).to_float()); },
              [&](std::size_t m, std::size_t i) { return double(w.down(ue, m, i).to_float()); });
          const double wt = weights(t, j);
          for (std::size_t m = 0; m < hidden; ++m) {
            r.y[t * hidden + m] += wt * row.o[m];
            sum_we[m] += std::fabs(wt) * row.o_bound[m];
            sum_wmag[m] += std::fabs(wt) * (std::fabs(row.o[m]) + row.o_bound[m]);
          }
        }
        for (std::size_t m = 0; m < hidden; ++m)
          r.bound[t * hidden + m] =
              bounds::kReferenceSlack * bounds::combine(sum_we[m], sum_wmag[m], kk);
      }));
  return r;
}

}  // namespace moecert::contracts
