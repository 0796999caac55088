// Clauses of the routers: shapes, finite scores, aliasing, index validity,
// the total order and top-k property, weight ranges and (full) every weight
// against its slot's reference, zero gradients.
#include "contracts/router.hpp"

#include <cmath>
#include <set>
#include <vector>

#include "contracts/bounds/basic.hpp"
#include "contracts/bounds/router.hpp"
#include "contracts/checks.hpp"
#include "contracts/clauses.hpp"
#include "contracts/order.hpp"
#include "ops/router/select.hpp"  // router::detail::sigmoid: the selection scores as declared

namespace moecert::contracts {

namespace k = clauses::router;
using order::ranks_before;

namespace {

std::string shape_of(const char* name, std::size_t r, std::size_t c) {
  return fmt::format("{} {}x{}", name, r, c);
}

// Fails `clause` unless all byte ranges are pairwise disjoint.
void disjoint(detail::Checker& c, const ClauseInfo& clause,
              std::initializer_list<std::pair<const char*, ByteRange>> rs) {
  std::vector<std::pair<const char*, ByteRange>> v(rs);
  for (std::size_t a = 0; a < v.size(); ++a)
    for (std::size_t b = a + 1; b < v.size(); ++b)
      if (overlaps(v[a].second, v[b].second)) {
        c.fail(clause, "",
               fmt::format("{} {} overlaps {} {}", v[a].first, detail::format_range(v[a].second),
                           v[b].first, detail::format_range(v[b].second)),
               "disjoint");
        return;
      }
}

// Index clauses on rows of idx: each entry in [0, e) or -1; -1 only at the
// tail (and not at all unless `allow_empty`); no expert twice. One clause
// may cover both (backward preconditions) or two (forward postconditions).
void index_rows(detail::Checker& c, const ClauseInfo& valid, const ClauseInfo& unique,
                MatView<const std::int32_t> idx, std::size_t e, bool allow_empty, bool check_valid,
                bool check_unique) {
  std::vector<char> seen(e, 0);
  for (std::size_t t = 0; t < idx.rows; ++t) {
    bool tail = false;
    for (std::size_t j = 0; j < idx.cols; ++j) {
      const std::int32_t x = idx(t, j);
      const bool bad = x < -1 || x >= static_cast<std::int64_t>(e) || (x == -1 && !allow_empty) ||
                       (tail && x != -1);
      if (check_valid && bad) {
        c.fail(valid, fmt::format("t={} j={}", t, j), fmt::format("idx={}", x),
               tail          ? "-1 (after a -1 slot)"
               : allow_empty ? fmt::format("-1 <= idx < {}", e)
                             : fmt::format("0 <= idx < {}", e));
        return;
      }
      if (bad) return;  // unique is meaningless on invalid indices
      tail = tail || x == -1;
      if (x >= 0 && check_unique && seen[static_cast<std::size_t>(x)]) {
        c.fail(unique, fmt::format("t={} j={}", t, j), fmt::format("idx={} selected twice", x),
               "distinct experts");
        return;
      }
      if (x >= 0) seen[static_cast<std::size_t>(x)] = 1;
    }
    for (std::size_t j = 0; j < idx.cols; ++j)
      if (idx(t, j) >= 0) seen[static_cast<std::size_t>(idx(t, j))] = 0;
  }
}

std::size_t valid_slots(MatView<const std::int32_t> idx, std::size_t t) {
  return order::filled_slots(idx.row(t), idx.cols);
}

// sorted and top-k property for a router whose eligible experts of row t
// are given by `eligible(t, i)` and ranked by `score(t, i)` (desc, index asc).
template <class Score, class Eligible>
void order_rows(detail::Checker& c, const ClauseInfo& sorted, const ClauseInfo* topk,
                MatView<const std::int32_t> idx, std::size_t e, Score score, Eligible eligible) {
  std::vector<char> chosen(e, 0);
  for (std::size_t t = 0; t < idx.rows; ++t) {
    const std::size_t valid = valid_slots(idx, t);
    for (std::size_t j = 1; j < valid; ++j) {
      const std::int32_t a = idx(t, j - 1), b = idx(t, j);
      if (!ranks_before(score(t, a), a, score(t, b), b)) {
        c.fail(sorted, fmt::format("t={} j={}", t, j),
               fmt::format("slot {} expert {} score {} before expert {} score {}", j - 1, a,
                           score(t, a), b, score(t, b)),
               "score descending, then index ascending");
        return;
      }
    }
    if (!topk || valid == 0) continue;
    for (std::size_t j = 0; j < valid; ++j) chosen[static_cast<std::size_t>(idx(t, j))] = 1;
    const std::int32_t kth = idx(t, valid - 1);
    for (std::size_t i = 0; i < e; ++i) {
      const auto ii = static_cast<std::int32_t>(i);
      const bool beats = eligible(t, i) && !chosen[i] &&
                         (valid < idx.cols || ranks_before(score(t, ii), ii, score(t, kth), kth));
      if (beats) {
        c.fail(
            *topk, fmt::format("t={}", t),
            valid < idx.cols
                ? fmt::format("eligible expert {} left out while slot {} is -1", i, valid)
                : fmt::format("unselected expert {} score {} outranks the K-th, expert {} score {}",
                              i, score(t, ii), kth, score(t, kth)),
            "no eligible unselected expert outranks the K-th");
        return;
      }
    }
    for (std::size_t j = 0; j < valid; ++j) chosen[static_cast<std::size_t>(idx(t, j))] = 0;
  }
}

// Weights of a row: each within [0, hi]; their sum within [lo_sum, hi_sum].
void weight_rows(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx,
                 MatView<const float> w, double hi, double lo_sum, double hi_sum) {
  for (std::size_t t = 0; t < w.rows; ++t) {
    double sum = 0;
    for (std::size_t j = 0; j < w.cols; ++j) {
      const float v = w(t, j);
      if (!(v >= 0 && v <= hi) || (idx(t, j) < 0 && v != 0)) {
        c.fail(clause, fmt::format("t={} j={}", t, j), fmt::format("w={} (idx {})", v, idx(t, j)),
               idx(t, j) < 0 ? "0 at a -1 slot" : fmt::format("0 <= w <= {}", hi));
        return;
      }
      sum += v;
    }
    if (!(sum >= lo_sum && sum <= hi_sum)) {
      c.fail(clause, fmt::format("t={}", t), fmt::format("sum w = {:.9g}", sum),
             fmt::format("in [{:.9g}, {:.9g}]", lo_sum, hi_sum));
      return;
    }
  }
}

// Every value of each row within its bound of the binary64 reference, plus
// that reference's own rounding: row(t) gives the row's reference values and
// bounds (the bounds::*_row helpers), value(t, i) the kernel's and name(i) its
// label; `section` is the bound's place in proofs/router.md. finite_only
// leaves non-finite values to the finite clauses (gradients that overflow).
// Rows with an index out of range are skipped (the index clauses report them).
template <class Row, class Value, class Name>
void within_reference(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx,
                      std::size_t experts, std::size_t cols, bool finite_only, const char* section,
                      Row row, Value value, Name name) {
  for (std::size_t t = 0; t < idx.rows; ++t) {
    bool in_range = true;
    for (std::size_t j = 0; j < idx.cols; ++j)
      in_range = in_range && idx(t, j) >= -1 && idx(t, j) < static_cast<std::int64_t>(experts);
    if (!in_range) continue;
    const auto [ref, bound] = row(t);
    for (std::size_t i = 0; i < cols; ++i) {
      const double got = value(t, i);
      if ((finite_only && !std::isfinite(got)) ||
          std::fabs(got - ref[i]) <= bound[i] + bounds::gamma(64, bounds::kU64) * std::fabs(ref[i]))
        continue;
      c.fail(clause, fmt::format("t={} {}", t, name(i)),
             fmt::format("{}={:.9g} ref={:.17g}", name(i), got, ref[i]),
             fmt::format("|{} - ref| <= {:.3g} (proofs/router.md {})", name(i), bound[i], section));
      return;
    }
  }
}

// Every weight within §3 of its own slot's reference (a weight written to
// another slot passes weights_range, not this).
template <class Row>
void weights_within(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx,
                    std::size_t experts, MatView<const float> w, Row row) {
  within_reference(
      c, clause, idx, experts, idx.cols, false, "§3", row,
      [&](std::size_t t, std::size_t j) { return w(t, j); },
      [](std::size_t j) { return fmt::format("w[{}]", j); });
}

// Every finite gradient of a row within §4 of the reference given g.
template <class Row, class Value, class Name>
void grads_within(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx,
                  std::size_t experts, std::size_t cols, Row row, Value value, Name name) {
  within_reference(c, clause, idx, experts, cols, true, "§4", row, value, name);
}

// sigma(z) is a normal float for z >= -87 (e^-87 > 2^-126); below, it
// underflows, and a row of such logits has no weights (0 / 0; router_fuzzer).
bool sigmoid_logit_ok(float z) { return std::isfinite(z) && z >= -87.0f; }

// Finite and |v| <= 2^126: a sum or difference of two such values stays
// below the fp32 maximum. Product-key scores (sx + sy) and the backwards'
// gradients (g - sum_S w g with w summing to at most 1; proofs/router.md §4
// assumes no overflow, router_fuzzer finding 7).
bool within_2p126(float v) { return std::isfinite(v) && std::fabs(v) <= 0x1p126f; }
constexpr std::string_view kGradExpected = "finite, |g| <= 2^126";

// The preconditions the dense router backwards share: shapes, slot indices,
// finite g and acceptable z, dz disjoint from every input. (Clauses as
// template arguments keep MOECERT_CONTRACT's compile-time cap.)
template <const ClauseInfo& kShape, const ClauseInfo& kIdx, const ClauseInfo& kFinite,
          const ClauseInfo& kAlias, class ZOk>
void dense_backward_pre(detail::Checker& c, MatView<const float> z, MatView<const std::int32_t> idx,
                        MatView<const float> g, MatView<float> dz, ZOk z_ok,
                        std::string_view z_expected) {
  MOECERT_CONTRACT(c, kShape) {
    if (idx.rows != z.rows || g.rows != z.rows || g.cols != idx.cols || dz.rows != z.rows ||
        dz.cols != z.cols || idx.cols < 1)
      c.fail(kShape, "",
             fmt::format("{}, {}, {}, {}", shape_of("z", z.rows, z.cols),
                         shape_of("idx", idx.rows, idx.cols), shape_of("g", g.rows, g.cols),
                         shape_of("dz", dz.rows, dz.cols)),
             "z, dz T x E; idx, g T x K");
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, kIdx) { index_rows(c, kIdx, kIdx, idx, z.cols, true, true, true); }
  MOECERT_CONTRACT(c, kFinite) {
    detail::scan(c, kFinite, "g", g, within_2p126, kGradExpected) &&
        detail::scan(c, kFinite, "z", z, z_ok, z_expected);
  }
  MOECERT_CONTRACT(c, kAlias) {
    for (const auto& in : {std::pair<const char*, ByteRange>{"z", z.bytes()},
                           {"idx", idx.bytes()},
                           {"g", g.bytes()}})
      disjoint(c, kAlias, {{"dz", dz.bytes()}, in});
  }
}

}  // namespace

// ---- softmax_topk -------------------------------------------------------------

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
  MOECERT_CONTRACT(c, k::kSmSorted) {
    order_rows(c, k::kSmSorted, nullptr, idx, e, score, [](auto, auto) { return true; });
  }
  MOECERT_CONTRACT(c, k::kSmTopk) {
    order_rows(c, k::kSmSorted, &k::kSmTopk, idx, e, score, [](auto, auto) { return true; });
  }
  MOECERT_CONTRACT(c, k::kSmWeights) {
    // Renormalised: a softmax over the K selected, so the sum is 1 within
    // §6's relative bound (shift <= the largest |z_j - z_max| over the row).
    double shift = 0;
    for (std::size_t t = 0; t < z.rows; ++t)
      for (std::size_t i = 0; i < e; ++i)
        shift = std::max(shift, double(z(t, idx(t, 0))) - z(t, i));
    const double eps =
        bounds::softmax_rel(renormalize ? kk : e, shift) + 2 * kk * bounds::kMinNormal32;
    weight_rows(c, k::kSmWeights, idx, w, 1 + eps, renormalize ? 1 - eps : 0, 1 + eps);
  }
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
                                MatView<const float> dz, bool renormalize) {
  MOECERT_CONTRACT(c, k::kSmbUnselected) {
    std::vector<char> chosen(z.cols, 0);
    for (std::size_t t = 0; t < z.rows; ++t) {
      const std::size_t valid = valid_slots(idx, t);
      for (std::size_t j = 0; j < valid; ++j) chosen[static_cast<std::size_t>(idx(t, j))] = 1;
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
      for (std::size_t i = 0; i < z.cols; ++i) {
        if (chosen[i]) continue;
        const float d = dz(t, i);
        const bool ok =
            renormalize ? d == 0.0f : (std::fabs(dot) <= tol || d == 0.0f || (d < 0) == (dot > 0));
        if (!ok) {
          c.fail(k::kSmbUnselected, fmt::format("t={} expert {}", t, i), fmt::format("dz={}", d),
                 renormalize ? "exactly 0 for an unselected expert"
                             : fmt::format("sign of -sum_S p g = {:.6g}", -dot));
          return;
        }
      }
      for (std::size_t j = 0; j < valid; ++j) chosen[static_cast<std::size_t>(idx(t, j))] = 0;
    }
  }
  MOECERT_CONTRACT(c, k::kSmbWithin) {
    const std::size_t e = z.cols;
    grads_within(
        c, k::kSmbWithin, idx, e, e,
        [&](std::size_t t) {
          const auto r = ref::softmax_topk_grad<double>(z.row(t), e, idx.row(t), g.row(t), idx.cols,
                                                        renormalize);
          return std::pair(std::vector<double>(r.begin(), r.end()),
                           bounds::softmax_topk_grad_row(z.row(t), e, idx.row(t), g.row(t),
                                                         idx.cols, renormalize));
        },
        [&](std::size_t t, std::size_t i) { return dz(t, i); },
        [](std::size_t i) { return fmt::format("dz[{}]", i); });
  }
}

// ---- sigmoid_topk -------------------------------------------------------------

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
        std::sort(order.begin(), order.end(),
                  [&](std::int32_t x, std::int32_t y) { return ranks_before(gs[x], x, gs[y], y); });
        std::fill(kept.begin(), kept.end(), 0);
        for (std::size_t q = 0; q < p.topk_group; ++q) kept[static_cast<std::size_t>(order[q])] = 1;
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
  }
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
  }
  MOECERT_CONTRACT(c, k::kSgbDzFinite) {
    detail::scan_finite(c, k::kSgbDzFinite, "dz", MatView<const float>(dz));
  }
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

// ---- product_key ----------------------------------------------------------------

void product_key_pre(detail::Checker& c, MatView<const float> sx, MatView<const float> sy,
                     ByteRange in_x, ByteRange in_y, router::KeyWeights mode,
                     MatView<std::int32_t> idx, MatView<float> w) {
  MOECERT_CONTRACT(c, k::kPkShape) {
    if (sy.rows != sx.rows || sy.cols != sx.cols || idx.rows != sx.rows || w.rows != sx.rows ||
        w.cols != idx.cols || idx.cols < 1 || idx.cols > sx.cols * sx.cols ||
        sx.cols * sx.cols > (std::size_t{1} << 31))
      c.fail(k::kPkShape, "",
             fmt::format("{}, {}, {}, {}", shape_of("sx", sx.rows, sx.cols),
                         shape_of("sy", sy.rows, sy.cols), shape_of("idx", idx.rows, idx.cols),
                         shape_of("w", w.rows, w.cols)),
             fmt::format("sy {0}x{1}; idx, w {0}xK with 1 <= K <= {1}^2", sx.rows, sx.cols));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kPkFinite) {
    // Finite, and small enough that every fp32 sum sx + sy is finite (and,
    // for exp weights, that exp(sx + sy) is).
    if (detail::scan(c, k::kPkFinite, "sx", sx, within_2p126, "finite, |s| <= 2^126") &&
        detail::scan(c, k::kPkFinite, "sy", sy, within_2p126, "finite, |s| <= 2^126") &&
        mode == router::KeyWeights::exp)
      for (std::size_t t = 0; t < sx.rows; ++t) {
        float mx = -INFINITY, my = -INFINITY;
        for (std::size_t i = 0; i < sx.cols; ++i)
          mx = std::max(mx, sx(t, i)), my = std::max(my, sy(t, i));
        if (!(double(mx) + my <= 88.0)) {
          c.fail(k::kPkFinite, fmt::format("t={}", t),
                 fmt::format("max sx + max sy = {}", double(mx) + my),
                 "<= 88 for exp weights (exp stays finite)");
          return;
        }
      }
  }
  MOECERT_CONTRACT(c, k::kPkNoAlias) {
    disjoint(c, k::kPkNoAlias, {{"idx", idx.bytes()}, {"w", w.bytes()}, {"sx", in_x}});
    disjoint(c, k::kPkNoAlias, {{"idx", idx.bytes()}, {"w", w.bytes()}, {"sy", in_y}});
  }
}

void product_key_post(detail::Checker& c, MatView<const float> sx, MatView<const float> sy,
                      router::KeyWeights mode, MatView<const std::int32_t> idx,
                      MatView<const float> w) {
  const std::size_t n = sx.cols, e = n * n;
  MOECERT_CONTRACT(c, k::kPkIdxValid) {
    index_rows(c, k::kPkIdxValid, k::kPkIdxUnique, idx, e, false, true, false);
  }
  MOECERT_CONTRACT(c, k::kPkIdxUnique) {
    index_rows(c, k::kPkIdxValid, k::kPkIdxUnique, idx, e, false, false, true);
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kPkSorted) {
    // The total order on the exact sum (then the expert index).
    for (std::size_t t = 0; t < idx.rows; ++t)
      for (std::size_t j = 1; j < idx.cols; ++j) {
        const std::int32_t a = idx(t, j - 1), b = idx(t, j), ni = static_cast<std::int32_t>(n);
        const int cmp = order::compare(order::pair_sum(sx(t, a / ni), sy(t, a % ni)),
                                       order::pair_sum(sx(t, b / ni), sy(t, b % ni)));
        if (!(cmp > 0 || (cmp == 0 && a < b))) {
          c.fail(k::kPkSorted, fmt::format("t={} j={}", t, j),
                 fmt::format("expert {} before expert {}", a, b),
                 "exact score descending, then index ascending");
          return;
        }
      }
  }
  MOECERT_CONTRACT(c, k::kPkWeights) {
    if (mode == router::KeyWeights::softmax) {
      double shift = 0;
      for (std::size_t t = 0; t < idx.rows; ++t) {
        const std::int32_t ni = static_cast<std::int32_t>(n);
        const double top = double(sx(t, idx(t, 0) / ni)) + sy(t, idx(t, 0) % ni);
        for (std::size_t j = 0; j < idx.cols; ++j)
          shift = std::max(shift, top - (double(sx(t, idx(t, j) / ni)) + sy(t, idx(t, j) % ni)));
      }
      const double eps = bounds::softmax_rel(idx.cols, shift) + 2 * idx.cols * bounds::kMinNormal32;
      weight_rows(c, k::kPkWeights, idx, w, 1 + eps, 1 - eps, 1 + eps);
    } else {
      detail::scan_finite(c, k::kPkWeights, "w", w);
    }
  }
  MOECERT_CONTRACT(c, k::kPkWithin) {
    weights_within(c, k::kPkWithin, idx, n * n, w, [&](std::size_t t) {
      return bounds::product_key_weights_row(sx.row(t), sy.row(t), n, idx.row(t), idx.cols, mode);
    });
  }
}

void product_key_backward_pre(detail::Checker& c, MatView<const float> sx, MatView<const float> sy,
                              MatView<const std::int32_t> idx, MatView<const float> g,
                              MatView<float> dsx, MatView<float> dsy) {
  MOECERT_CONTRACT(c, k::kPkbShape) {
    const std::size_t t = sx.rows, n = sx.cols;
    if (sy.rows != t || sy.cols != n || dsx.rows != t || dsx.cols != n || dsy.rows != t ||
        dsy.cols != n || idx.rows != t || g.rows != t || g.cols != idx.cols || idx.cols < 1)
      c.fail(k::kPkbShape, "",
             fmt::format("{}, {}, {}, {}, {}, {}", shape_of("sx", t, n),
                         shape_of("sy", sy.rows, sy.cols), shape_of("idx", idx.rows, idx.cols),
                         shape_of("g", g.rows, g.cols), shape_of("dsx", dsx.rows, dsx.cols),
                         shape_of("dsy", dsy.rows, dsy.cols)),
             "sx, sy, dsx, dsy T x n; idx, g T x K");
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kPkbIdx) {
    index_rows(c, k::kPkbIdx, k::kPkbIdx, idx, sx.cols * sx.cols, true, true, true);
  }
  MOECERT_CONTRACT(c, k::kPkbFinite) {
    detail::scan(c, k::kPkbFinite, "g", g, within_2p126, kGradExpected) &&
        detail::scan_finite(c, k::kPkbFinite, "sx", sx) &&
        detail::scan_finite(c, k::kPkbFinite, "sy", sy);
  }
  MOECERT_CONTRACT(c, k::kPkbNoAlias) {
    for (const auto& in : {std::pair<const char*, ByteRange>{"sx", sx.bytes()},
                           {"sy", sy.bytes()},
                           {"idx", idx.bytes()},
                           {"g", g.bytes()}})
      disjoint(c, k::kPkbNoAlias, {{"dsx", dsx.bytes()}, {"dsy", dsy.bytes()}, in});
  }
}

void product_key_backward_post(detail::Checker& c, MatView<const float> sx, MatView<const float> sy,
                               MatView<const std::int32_t> idx, MatView<const float> g,
                               router::KeyWeights mode, MatView<const float> dsx,
                               MatView<const float> dsy) {
  MOECERT_CONTRACT(c, k::kPkbUnused) {
    const std::size_t n = dsx.cols;
    std::vector<char> ux(n), uy(n);
    for (std::size_t t = 0; t < idx.rows; ++t) {
      std::fill(ux.begin(), ux.end(), 0);
      std::fill(uy.begin(), uy.end(), 0);
      for (std::size_t j = 0; j < valid_slots(idx, t); ++j) {
        ux[static_cast<std::size_t>(idx(t, j)) / n] = 1;
        uy[static_cast<std::size_t>(idx(t, j)) % n] = 1;
      }
      for (std::size_t i = 0; i < n; ++i)
        if ((!ux[i] && dsx(t, i) != 0.0f) || (!uy[i] && dsy(t, i) != 0.0f)) {
          c.fail(k::kPkbUnused, fmt::format("t={} i={}", t, i),
                 fmt::format("{}={} but no valid slot selects it",
                             !ux[i] && dsx(t, i) != 0.0f ? "dsx" : "dsy",
                             !ux[i] && dsx(t, i) != 0.0f ? dsx(t, i) : dsy(t, i)),
                 "exactly 0");
          return;
        }
    }
  }
  MOECERT_CONTRACT(c, k::kPkbGradFinite) {
    detail::scan_finite(c, k::kPkbGradFinite, "dsx", dsx) &&
        detail::scan_finite(c, k::kPkbGradFinite, "dsy", dsy);
  }
  MOECERT_CONTRACT(c, k::kPkbWithin) {
    const std::size_t n = sx.cols;
    grads_within(
        c, k::kPkbWithin, idx, n * n, 2 * n,
        [&](std::size_t t) {
          std::vector<double> rx, ry;
          ref::product_key_grad<double>(sx.row(t), sy.row(t), n, idx.row(t), g.row(t), idx.cols,
                                        mode, rx, ry);
          rx.insert(rx.end(), ry.begin(), ry.end());
          return std::pair(rx, bounds::product_key_grad_row(sx.row(t), sy.row(t), n, idx.row(t),
                                                            g.row(t), idx.cols, mode));
        },
        [&](std::size_t t, std::size_t i) { return i < n ? dsx(t, i) : dsy(t, i - n); },
        [n](std::size_t i) {
          return i < n ? fmt::format("dsx[{}]", i) : fmt::format("dsy[{}]", i - n);
        });
  }
}

}  // namespace moecert::contracts
