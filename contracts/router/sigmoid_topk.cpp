// Clauses of router.sigmoid_topk, forward and backward (include/moecert/router.hpp).
#include "contracts/router/common.hpp"
#include "ops/router/select.hpp"  // router::detail::sigmoid: the selection scores as declared

namespace moecert::contracts {

using namespace router_detail;

void sigmoid_topk_pre(detail::Checker& c, MatView<const float> z, ByteRange z_bytes,
                      View<const float> bias, const router::SigmoidTopkParams& p,
                      MatView<std::int32_t> idx, MatView<float> w) {
  MOECERT_CONTRACT(c, k::kSgShape) {
    const std::size_t e = z.cols;
    if (idx.rows != z.rows || w.rows != z.rows || w.cols != idx.cols || idx.cols < 1 ||
        idx.cols > e || bias.size != e || p.groups < 1 || e % p.groups != 0 || p.topk_group < 1 ||
        p.topk_group > p.groups || !std::isfinite(p.scaling) || !(p.scaling > 0))
      c.fail(k::kSgShape, "",
             fmt::format("{}, bias {}, {}, {}, G={} topk_group={} c={}", shape_of("z", z.rows, e),
                         bias.size, shape_of("idx", idx.rows, idx.cols),
                         shape_of("w", w.rows, w.cols), p.groups, p.topk_group, p.scaling),
             fmt::format("bias {0}; idx, w {1}xK, 1 <= K <= {0}; G >= 1 divides {0}; 1 <= "
                         "topk_group <= G; c finite > 0",
                         e, z.rows));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kSgFinite) {
    detail::scan(c, k::kSgFinite, "z", z, sigmoid_logit_ok,
                 "finite and >= -87 (sigma(z) normal)") &&
        detail::scan_finite(c, k::kSgFinite, "bias", MatView<const float>(bias.data, 1, bias.size));
  }
  MOECERT_CONTRACT(c, k::kSgNoAlias) {
    disjoint(c, k::kSgNoAlias, {{"idx", idx.bytes()}, {"w", w.bytes()}, {"z", z_bytes}});
    disjoint(c, k::kSgNoAlias, {{"idx", idx.bytes()}, {"w", w.bytes()}, {"bias", bias.bytes()}});
  }
}

void sigmoid_topk_post(detail::Checker& c, MatView<const float> z, View<const float> bias,
                       const router::SigmoidTopkParams& p, MatView<const std::int32_t> idx,
                       MatView<const float> w) {
  const std::size_t e = z.cols, size = e / p.groups;
  MOECERT_CONTRACT(c, k::kSgIdxValid) {
    index_rows(c, k::kSgIdxValid, k::kSgIdxUnique, idx, e, true, true, false);
  }
  MOECERT_CONTRACT(c, k::kSgIdxUnique) {
    index_rows(c, k::kSgIdxValid, k::kSgIdxUnique, idx, e, true, false, true);
  }
  if (c.stop()) return;
  // Selection scores s + bias, as the kernels compute them (select.hpp).
  auto sel = [&](std::size_t t, std::int32_t i) {
    return router::detail::sigmoid(z(t, static_cast<std::size_t>(i))) +
           bias[static_cast<std::size_t>(i)];
  };
  MOECERT_CONTRACT(c, k::kSgSorted) {
    order_rows(c, k::kSgSorted, nullptr, idx, e, sel, [](auto, auto) { return true; });
  }
  MOECERT_CONTRACT(c, k::kSgTopk) {
    [&] {  // a failure ends this clause, not the others (observe goes on)
      // Kept groups by definition: group score = sum of the top two selection
      // scores; the topk_group best groups (score desc, index asc).
      std::vector<char> kept(p.groups);
      std::vector<float> gs(p.groups);
      std::vector<std::int32_t> order(p.groups);
      std::size_t t_now = SIZE_MAX;  // the row kept[] describes
      auto eligible = [&](std::size_t t, std::size_t i) {
        if (t != t_now) {
          t_now = t;
          for (std::size_t q = 0; q < p.groups; ++q) {
            float a = -INFINITY, b = -INFINITY;
            for (std::size_t i2 = q * size; i2 < (q + 1) * size; ++i2) {
              const float v = sel(t, static_cast<std::int32_t>(i2));
              if (v > a)
                b = a, a = v;
              else if (v > b)
                b = v;
            }
            gs[q] = size >= 2 ? a + b : a;
            order[q] = static_cast<std::int32_t>(q);
          }
          std::sort(order.begin(), order.end(), [&](std::int32_t x, std::int32_t y) {
            return ranks_before(gs[x], x, gs[y], y);
          });
          std::fill(kept.begin(), kept.end(), 0);
          for (std::size_t q = 0; q < p.topk_group; ++q)
            kept[static_cast<std::size_t>(order[q])] = 1;
        }
        return kept[i / size] != 0;
      };
      for (std::size_t t = 0; t < idx.rows && !c.stop(); ++t)
        for (std::size_t j = 0; j < valid_slots(idx, t); ++j)
          if (!eligible(t, static_cast<std::size_t>(idx(t, j)))) {
            c.fail(k::kSgTopk, fmt::format("t={} j={}", t, j),
                   fmt::format("expert {} of group {} not kept", idx(t, j),
                               idx(t, j) / static_cast<std::int32_t>(size)),
                   fmt::format("experts of the {} best groups", p.topk_group));
            return;
          }
      order_rows(c, k::kSgSorted, &k::kSgTopk, idx, e, sel, eligible);
    }();
  }
  // Range and sum of each row's weights (bounds::renormalized_rel); proofs/router.md §3.
  MOECERT_CONTRACT(c, k::kSgWeights) {
    // w = c s_j / sum_S s: §7 with eps = gamma_{c+2} (sigma, §4) and one
    // multiplication by c; the sum is c unless rows hold -1 slots only.
    // A denormal c (or product) rounds absolutely: eta per weight (found by
    // router_fuzzer with c = 9e-41).
    const double rel = bounds::renormalized_rel(idx.cols, bounds::gamma(bounds::kExpUlps + 2), 1);
    const double eta = bounds::kMinNormal32;
    weight_rows(c, k::kSgWeights, idx, w, p.scaling * (1 + rel) + eta, 0,
                p.scaling * (1 + rel) + idx.cols * eta);
  }
  // z exact, sigma within §4; every weight within bounds::sigmoid_topk_weights_row
  // of its own slot's binary64 reference; proofs/router.md §3.
  MOECERT_CONTRACT(c, k::kSgWithin) {
    weights_within(c, k::kSgWithin, idx, z.cols, w, [&](std::size_t t) {
      return bounds::sigmoid_topk_weights_row(z.row(t), idx.row(t), idx.cols, p.scaling);
    });
  }
}

void sigmoid_topk_backward_pre(detail::Checker& c, MatView<const float> z,
                               MatView<const std::int32_t> idx, MatView<const float> g,
                               MatView<float> dz) {
  dense_backward_pre<k::kSgbShape, k::kSgbIdx, k::kSgbFinite, k::kSgbNoAlias>(
      c, z, idx, g, dz, sigmoid_logit_ok, "finite and >= -87 (sigma(z) normal)");
}

void sigmoid_topk_backward_post(detail::Checker& c, MatView<const float> z,
                                MatView<const std::int32_t> idx, MatView<const float> g,
                                const router::SigmoidTopkParams& p, MatView<const float> dz) {
  MOECERT_CONTRACT(c, k::kSgbUnselected) {
    [&] {  // a failure ends this clause, not the others (observe goes on)
      std::vector<char> chosen(dz.cols, 0);
      for (std::size_t t = 0; t < dz.rows; ++t) {
        const std::size_t valid = valid_slots(idx, t);
        for (std::size_t j = 0; j < valid; ++j) chosen[static_cast<std::size_t>(idx(t, j))] = 1;
        for (std::size_t i = 0; i < dz.cols; ++i)
          if (!chosen[i] && dz(t, i) != 0.0f) {
            c.fail(k::kSgbUnselected, fmt::format("t={} expert {}", t, i),
                   fmt::format("dz={}", dz(t, i)), "exactly 0");
            return;
          }
        for (std::size_t j = 0; j < valid; ++j) chosen[static_cast<std::size_t>(idx(t, j))] = 0;
      }
    }();
  }
  MOECERT_CONTRACT(c, k::kSgbDzFinite) {
    detail::scan_finite(c, k::kSgbDzFinite, "dz", MatView<const float>(dz));
  }
  // z and g exact, |g| <= 2^126; every finite dz within
  // bounds::sigmoid_topk_grad_row of the binary64 reference; proofs/router.md §4.
  MOECERT_CONTRACT(c, k::kSgbWithin) {
    const std::size_t e = z.cols;
    grads_within(
        c, k::kSgbWithin, idx, e, e,
        [&](std::size_t t) {
          const auto r = ref::sigmoid_topk_grad<double>(z.row(t), e, idx.row(t), g.row(t), idx.cols,
                                                        p.scaling);
          return std::pair(std::vector<double>(r.begin(), r.end()),
                           bounds::sigmoid_topk_grad_row(z.row(t), e, idx.row(t), g.row(t),
                                                         idx.cols, p.scaling));
        },
        [&](std::size_t t, std::size_t i) { return dz(t, i); },
        [](std::size_t i) { return fmt::format("dz[{}]", i); });
  }
}

}  // namespace moecert::contracts
