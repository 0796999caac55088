// Clauses of router.softmax_topk, forward and backward (include/moecert/router.hpp).
#include <algorithm>
#include <vector>

#include "contracts/router/common.hpp"
#include "contracts/router/kind.hpp"

namespace moecert::contracts {

using namespace router_detail;

void softmax_topk_pre(detail::Checker& c, MatView<const float> z, ByteRange z_bytes,
                      MatView<std::int32_t> idx, MatView<float> w) {
  MOECERT_CONTRACT(c, k::kSmShape) {
    if (idx.rows != z.rows || w.rows != z.rows || w.cols != idx.cols || idx.cols < 1 ||
        idx.cols > z.cols)
      c.fail(k::kSmShape, "",
             fmt::format("{}, {}, {}", shape_of("z", z.rows, z.cols),
                         shape_of("idx", idx.rows, idx.cols), shape_of("w", w.rows, w.cols)),
             fmt::format("idx and w {}xK with 1 <= K <= {}", z.rows, z.cols));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kSmFinite) { detail::scan_finite(c, k::kSmFinite, "z", z); }
  MOECERT_CONTRACT(c, k::kSmNoAlias) {
    disjoint(c, k::kSmNoAlias, {{"idx", idx.bytes()}, {"w", w.bytes()}, {"z", z_bytes}});
  }
}

void softmax_topk_post(detail::Checker& c, MatView<const float> z, MatView<const std::int32_t> idx,
                       MatView<const float> w, bool renormalize) {
  const std::size_t e = z.cols, kk = idx.cols;
  MOECERT_CONTRACT(c, k::kSmIdxValid) {
    index_rows(c, k::kSmIdxValid, k::kSmIdxUnique, idx, e, false, true, false);
  }
  MOECERT_CONTRACT(c, k::kSmIdxUnique) {
    index_rows(c, k::kSmIdxValid, k::kSmIdxUnique, idx, e, false, false, true);
  }
  if (c.stop()) return;
  auto score = [&](std::size_t t, std::int32_t i) { return z(t, static_cast<std::size_t>(i)); };
  // By z: equal logits an exact tie; logits within an fp32 softmax's
  // rounding of each other a near tie (proofs/router.md §1b), which reads
  // the row's maximum (formed where an order clause runs).
  std::vector<float> row_max;
  auto form_maxima = [&] {
    row_max.resize(z.rows);
    for (std::size_t t = 0; t < z.rows; ++t) row_max[t] = *std::max_element(z.row(t), z.row(t) + e);
  };
  const double normal_shift = bounds::softmax_normal_shift(e);
  auto rank = [&](std::size_t t, std::int32_t a, std::int32_t b) {
    const float za = score(t, a), zb = score(t, b);
    if (za == zb) return a < b ? Rank::before : Rank::tie;
    const double reach = bounds::softmax_selection_reach(std::max(za, zb), std::min(za, zb),
                                                         row_max[t], normal_shift);
    if (std::fabs(double(za) - zb) <= reach) return za > zb ? Rank::before : Rank::near;
    return ranks_before(za, a, zb, b) ? Rank::before : Rank::after;
  };
  auto any = [](auto, auto) { return true; };
  if (!judge::current().slots_any_order) {
    MOECERT_CONTRACT(c, k::kSmSorted) {
      form_maxima();
      order_rows_by(c, k::kSmSorted, nullptr, idx, e, rank, score, any, true);
    }
  }
  MOECERT_CONTRACT(c, k::kSmTopk) {
    if (row_max.empty()) form_maxima();
    order_rows_by(c, k::kSmSorted, &k::kSmTopk, idx, e, rank, score, any, true);
  }
  // Range and sum of each row's weights (bounds::softmax_rel); proofs/bounds.md §6.
  MOECERT_CONTRACT(c, k::kSmWeights) {
    // Renormalised: a softmax over the K selected, so the sum is 1 within
    // §6's relative bound (shift <= the largest |z_j - z_max| over the row).
    const double shift = oneapi::tbb::parallel_reduce(
        oneapi::tbb::blocked_range<std::size_t>(0, z.rows, 256), 0.0,
        [&](const oneapi::tbb::blocked_range<std::size_t>& r, double m) {
          for (std::size_t t = r.begin(); t < r.end(); ++t)
            if (row_led_by_expert(idx, t, e, false)) {  // rows the index clauses rejected: skipped
              float top = z(t, idx(t, 0));  // the largest selected logit (slot 0's when sorted)
              for (std::size_t j = 1; j < valid_slots(idx, t); ++j)
                top = std::max(top, z(t, idx(t, j)));
              for (std::size_t i = 0; i < e; ++i) m = std::max(m, double(top) - z(t, i));
            }
          return m;
        },
        [](double a, double b) { return std::max(a, b); });
    const double eps =
        bounds::softmax_rel(renormalize ? kk : e, shift) + 2 * kk * bounds::kMinNormal32;
    weight_rows(c, k::kSmWeights, idx, e, w, 1 + eps, renormalize ? 1 - eps : 0, 1 + eps);
  }
  // z exact; every weight within bounds::softmax_topk_weights_row of its own
  // slot's binary64 reference; proofs/router.md §3.
  MOECERT_CONTRACT(c, k::kSmWithin) {
    weights_within(c, k::kSmWithin, idx, e, w, [&](std::size_t t) {
      return bounds::softmax_topk_weights_row(z.row(t), e, idx.row(t), kk, renormalize);
    });
  }
}

void softmax_topk_backward_pre(detail::Checker& c, MatView<const float> z,
                               MatView<const std::int32_t> idx, MatView<const float> g,
                               MatView<float> dz) {
  dense_backward_pre<k::kSmbShape, k::kSmbIdx, k::kSmbFinite, k::kSmbNoAlias>(
      c, z, idx, g, dz, [](float v) { return std::isfinite(v); }, "finite");
}

void softmax_topk_backward_post(detail::Checker& c, MatView<const float> z,
                                MatView<const std::int32_t> idx, MatView<const float> g,
                                MatView<const float> dz, bool renormalize, bool dense) {
  dense = dense && renormalize;  // not renormalised, the dense gradient is the kernel's maths
  MOECERT_CONTRACT(c, k::kSmbUnselected) {
    // Row t's verdict; `fail(location, observed, expected)` reports it.
    auto row = [&](std::size_t t, auto&& fail) {
      const std::size_t valid = valid_slots(idx, t);
      // Not renormalised: every unselected dz_j = -p_j sum_S p g shares the
      // sign of -sum_S p g; the sum is recomputed in double from the row's
      // softmax (its sign is the one that matters; a sum within rounding of
      // 0 lets either sign pass).
      double dot = 0, tol = 0;
      if (!renormalize && valid > 0) {
        double m = z(t, 0), sum = 0, shift = 0;
        for (std::size_t i = 0; i < z.cols; ++i) m = std::max(m, double(z(t, i)));
        for (std::size_t i = 0; i < z.cols; ++i) {
          sum += std::exp(z(t, i) - m);
          shift = std::max(shift, m - z(t, i));
        }
        for (std::size_t j = 0; j < valid; ++j) {
          const double p = std::exp(z(t, idx(t, j)) - m) / sum;
          dot += p * g(t, j);
          tol += p * std::fabs(g(t, j));
        }
        // The kernel's fp32 sum_S p g is within (§6 eps + gamma_K)(1 + eps)
        // sum_S p |g| of this one; within that of 0 either sign may come out.
        const double eps = bounds::softmax_rel(z.cols, shift);
        tol = 2 * (eps + bounds::gamma(static_cast<double>(valid))) * (1 + eps) * tol +
              valid * bounds::kMinNormal32;
      }
      // Dense: unselected experts within §4.4's rounding noise.
      const std::vector<double> noise =
          dense ? bounds::softmax_dense_grad_row(z.row(t), z.cols, idx.row(t), g.row(t), idx.cols)
                : std::vector<double>{};
      thread_local std::vector<char> chosen;
      chosen.assign(z.cols, 0);
      for (std::size_t j = 0; j < valid; ++j)
        if (const std::int32_t e = idx(t, j); e >= 0 && static_cast<std::size_t>(e) < z.cols)
          chosen[static_cast<std::size_t>(e)] = 1;
      for (std::size_t i = 0; i < z.cols; ++i) {
        if (chosen[i]) continue;
        const float d = dz(t, i);
        const bool ok = dense ? std::fabs(d) <= noise[i]
                        : renormalize
                            ? d == 0.0f
                            : (std::fabs(dot) <= tol || d == 0.0f || (d < 0) == (dot > 0));
        if (!ok) {
          fail(fmt::format("t={} expert {}", t, i), fmt::format("dz={}", d),
               dense         ? fmt::format("|dz| <= {:.3g}, a dense softmax's rounding noise "
                                                   "(proofs/router.md §4.4)",
                                           noise[i])
               : renormalize ? "exactly 0 for an unselected expert"
                             : fmt::format("sign of -sum_S p g = {:.6g}", -dot));
          return false;
        }
      }
      return true;
    };
    // Work per row for the parallel pass: an exp in binary64 costs about as
    // much as reading 32 elements (at T1024 E64 the rows ran as one chunk).
    detail::report_first_failing_row(z.rows, renormalize && !dense ? z.cols : 32 * z.cols, row,
                                     [&](std::string loc, std::string obs, std::string exp) {
                                       c.fail(k::kSmbUnselected, loc, obs, exp);
                                     });
  }
  // z and g exact, |g| <= 2^126; every finite dz within
  // bounds::softmax_topk_grad_row of the binary64 reference; proofs/router.md §4.
  MOECERT_CONTRACT(c, k::kSmbWithin) {
    const std::size_t e = z.cols;
    grads_within(
        c, k::kSmbWithin, idx, e, e,
        [&](std::size_t t) {
          const auto r = ref::softmax_topk_grad<double>(z.row(t), e, idx.row(t), g.row(t), idx.cols,
                                                        renormalize);
          return std::pair(
              std::vector<double>(r.begin(), r.end()),
              dense ? bounds::softmax_dense_grad_row(z.row(t), e, idx.row(t), g.row(t), idx.cols)
                    : bounds::softmax_topk_grad_row(z.row(t), e, idx.row(t), g.row(t), idx.cols,
                                                    renormalize));
        },
        [&](std::size_t t, std::size_t i) { return dz(t, i); },
        [](std::size_t i) { return fmt::format("dz[{}]", i); });
  }
}

// softmax_topk in the layer: R = E logits, dz T x R.
namespace {

std::size_t softmax_topk_width(std::size_t experts) { return experts; }

void softmax_topk_validate(detail::Checker&, const MoeConfig&) {}

constexpr std::string_view kSoftmaxTopkParams[] = {"renormalize", "backward"};

// backward=masked (the default: unselected experts' dz exactly 0) or dense
// (the implementation differentiates the dense softmax, §4.4).
RouterSettings softmax_topk_judge_settings(const Params& p) {
  RouterSettings s;
  s.renormalize = flag_param(p, "renormalize", true);
  if (const auto it = p.find("backward"); it != p.end()) {
    if (it->second != "masked" && it->second != "dense")
      throw std::invalid_argument(fmt::format(
          "backward={}: expected masked or dense (a dense softmax's autograd)", it->second));
    s.dense_backward = it->second == "dense";
  }
  return s;
}

void softmax_topk_forward_clauses(detail::Checker& c, MatView<const float> z, View<const float>,
                                  const RouterSettings& s, MatView<const std::int32_t> idx,
                                  MatView<const float> w) {
  softmax_topk_pre(c, z, z.bytes(), writable(idx), writable(w));
  if (!c.stop()) softmax_topk_post(c, z, idx, w, s.renormalize);
}

void softmax_topk_backward_clauses(detail::Checker& c, MatView<const float> z,
                                   MatView<const std::int32_t> idx, MatView<const float> g,
                                   const RouterSettings& s, MatView<const float> dz) {
  softmax_topk_backward_pre(c, z, idx, g, writable(dz));
  if (!c.stop()) softmax_topk_backward_post(c, z, idx, g, dz, s.renormalize, s.dense_backward);
}

std::vector<double> softmax_topk_dz_rounding(const float* z, std::size_t R, const std::int32_t* idx,
                                             const float* g, std::size_t v,
                                             const RouterSettings& s) {
  return s.dense_backward && s.renormalize
             ? bounds::softmax_dense_grad_row(z, R, idx, g, v)
             : bounds::softmax_topk_grad_row(z, R, idx, g, v, s.renormalize);
}

std::size_t softmax_topk_experts(std::size_t width) { return width; }

RouterSettings softmax_topk_abi_settings(double param) {
  RouterSettings s;
  s.renormalize = param != 0;
  return s;
}

bounds::WeightsRow softmax_topk_weights_row(const float* z, std::size_t R, const std::int32_t* idx,
                                            std::size_t k, const RouterSettings& s) {
  return bounds::softmax_topk_weights_row(z, R, idx, k, s.renormalize);
}

std::vector<double> softmax_topk_dz_reference(const float* z, std::size_t R,
                                              const std::int32_t* idx, const float* g,
                                              std::size_t k, const RouterSettings& s) {
  return ref::softmax_topk_grad<double>(z, R, idx, g, k, s.renormalize);
}

}  // namespace

extern const RouterKindInfo kSoftmaxTopkKind = {
    .kind = RouterKind::softmax_topk,
    .name = "softmax_topk",
    .width = softmax_topk_width,
    .experts_of = softmax_topk_experts,
    .expert_bias = false,
    .split_dz = false,
    .validate = softmax_topk_validate,
    .judge_settings = softmax_topk_judge_settings,
    .judge_params = kSoftmaxTopkParams,
    .abi_settings = softmax_topk_abi_settings,
    .forward_clauses = softmax_topk_forward_clauses,
    .backward_clauses = softmax_topk_backward_clauses,
    .dz_rounding = softmax_topk_dz_rounding,
    .weights_row = softmax_topk_weights_row,
    .dz_reference = softmax_topk_dz_reference,
};

}  // namespace moecert::contracts
