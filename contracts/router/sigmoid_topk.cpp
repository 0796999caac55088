// Clauses of router.sigmoid_topk, forward and backward (include/moecert/router.hpp).
#include "contracts/bounds/experts.hpp"
#include "contracts/router/common.hpp"
#include "contracts/router/kind.hpp"

namespace moecert::contracts {

using namespace router_detail;

namespace {

// One row's selection judged from its exact scores (proofs/router.md §1a):
// expert i's exact selection score sigma(z_i) + b_i and the bound on an fp32
// implementation's, each group's exact score (its best two) and bound.
class SigmoidRanking {
 public:
  SigmoidRanking(MatView<const float> z, View<const float> bias, std::size_t groups,
                 std::size_t topk_group)
      : z_(z), bias_(bias), groups_(groups), topk_group_(topk_group) {}

  double score(std::size_t t, std::int32_t i) { return row(t).s[static_cast<std::size_t>(i)]; }

  Rank rank(std::size_t t, std::int32_t a, std::int32_t b) {
    const auto ua = static_cast<std::size_t>(a), ub = static_cast<std::size_t>(b);
    // Equal inputs give equal fp32 scores in any implementation: an exact tie.
    if (z_(t, ua) == z_(t, ub) && bias_[ua] == bias_[ub]) return a < b ? Rank::before : Rank::tie;
    const Row& r = row(t);
    const Rank k = compare(r.s[ua], r.d[ua], r.s[ub], r.d[ub]);
    // Within the bounds, the exact order needs no near tie named.
    return k == Rank::near && r.s[ua] > r.s[ub] ? Rank::before : k;
  }

  /// Whether expert i's group may be among the kept (fewer than topk_group
  /// groups surely better) / surely is (fewer than topk_group others may be
  /// as good).
  bool may_be_kept(std::size_t t, std::size_t i) {
    return better(t, i / size(), false) < topk_group_;
  }
  bool surely_kept(std::size_t t, std::size_t i) {
    return better(t, i / size(), true) < topk_group_;
  }

 private:
  struct Row {
    std::vector<double> s, d, gs, gd;
  };

  std::size_t size() const { return z_.cols / groups_; }

  // a's score sa (bound da) against b's: apart by more than both bounds, or
  // within them (near: either order is an fp32 implementation's, equal
  // exact scores included, as their fp32 scores may differ).
  static Rank compare(double sa, double da, double sb, double db) {
    const double apart = (da + db) * bounds::kReferenceSlack;  // and binary64's own rounding
    if (sa - sb > apart) return Rank::before;
    if (sb - sa > apart) return Rank::after;
    return Rank::near;
  }

  // Groups other than q that surely rank before it (or, `or_may`, may).
  // Groups of identical inputs have equal fp32 scores in any implementation:
  // an exact tie, ordered by index unless ties_any_order.
  std::size_t better(std::size_t t, std::size_t q, bool or_may) {
    const Row& r = row(t);
    const bool by_index = !judge::current().ties_any_order;
    std::size_t n = 0;
    for (std::size_t o = 0; o < groups_; ++o) {
      if (o == q) continue;
      const bool surely = identical_groups(t, o, q)
                              ? by_index && o < q
                              : compare(r.gs[o], r.gd[o], r.gs[q], r.gd[q]) == Rank::before;
      const bool may = identical_groups(t, o, q)
                           ? !by_index || o < q
                           : compare(r.gs[o], r.gd[o], r.gs[q], r.gd[q]) != Rank::after;
      n += or_may ? may : surely;
    }
    return n;
  }

  // Whether groups o and q hold the same (z, bias) pairs in the same order.
  bool identical_groups(std::size_t t, std::size_t o, std::size_t q) const {
    const std::size_t n = size();
    for (std::size_t i = 0; i < n; ++i)
      if (z_(t, o * n + i) != z_(t, q * n + i) || bias_[o * n + i] != bias_[q * n + i])
        return false;
    return true;
  }

  const Row& row(std::size_t t) {
    if (t == t_now_) return row_;
    t_now_ = t;
    const std::size_t e = z_.cols, n = size();
    row_.s.resize(e), row_.d.resize(e), row_.gs.assign(groups_, 0), row_.gd.assign(groups_, 0);
    for (std::size_t i = 0; i < e; ++i) {
      const double sigma = ref::sigmoid(double(z_(t, i)));
      row_.s[i] = sigma + bias_[i];
      row_.d[i] = bounds::sigmoid_selection(sigma, bias_[i]);
    }
    for (std::size_t q = 0; q < groups_; ++q) {
      double a = -INFINITY, b = -INFINITY, d_max = 0;
      for (std::size_t i = q * n; i < (q + 1) * n; ++i) {
        d_max = std::max(d_max, row_.d[i]);
        if (row_.s[i] > a)
          b = a, a = row_.s[i];
        else if (row_.s[i] > b)
          b = row_.s[i];
      }
      row_.gs[q] = n >= 2 ? a + b : a;
      row_.gd[q] = bounds::sigmoid_group_score(row_.gs[q], d_max, n);
    }
    return row_;
  }

  MatView<const float> z_;
  View<const float> bias_;
  std::size_t groups_, topk_group_;
  std::size_t t_now_ = SIZE_MAX;
  Row row_;
};

}  // namespace

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
  // z and bias exact, sigma within bounds.md §4: an fp32 implementation's
  // order agrees with the exact one except within the bounds of each
  // score's rounding; proofs/router.md §1a.
  SigmoidRanking ranking(z, bias, p.groups, p.topk_group);
  auto rank = [&](std::size_t t, std::int32_t a, std::int32_t b) { return ranking.rank(t, a, b); };
  auto score = [&](std::size_t t, std::int32_t i) { return ranking.score(t, i); };
  if (!judge::current().slots_any_order) {
    MOECERT_CONTRACT(c, k::kSgSorted) {
      order_rows_by(c, k::kSgSorted, nullptr, idx, e, rank, score, [](auto, auto) { return true; });
    }
  }
  MOECERT_CONTRACT(c, k::kSgTopk) {
    [&] {  // a failure ends this clause, not the others (observe goes on)
      // Kept groups by definition: group score = sum of the top two selection
      // scores; the topk_group best groups (score desc, index asc).
      for (std::size_t t = 0; t < idx.rows && !c.stop(); ++t)
        for (std::size_t j = 0; row_in_range(idx, t, e) && j < valid_slots(idx, t); ++j)
          if (!ranking.may_be_kept(t, static_cast<std::size_t>(idx(t, j)))) {
            c.fail(k::kSgTopk, fmt::format("t={} j={}", t, j),
                   fmt::format("expert {} of group {}, which {} groups outrank", idx(t, j),
                               idx(t, j) / static_cast<std::int32_t>(size), p.topk_group),
                   fmt::format("experts of the {} best groups", p.topk_group));
            return;
          }
      order_rows_by(c, k::kSgSorted, &k::kSgTopk, idx, e, rank, score,
                    [&](std::size_t t, std::size_t i) { return ranking.surely_kept(t, i); });
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
    weight_rows(c, k::kSgWeights, idx, e, w, p.scaling * (1 + rel) + eta, 0,
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

router::SigmoidTopkParams sigmoid_params(const Params& m) {
  return {count_param(m, "groups", 1), count_param(m, "topk_group", 1),
          static_cast<float>(number_param(m, "scaling", 1.0))};
}

// sigmoid_topk in the layer: R = E logits, a per-expert selection bias,
// dz T x R.
namespace {

std::size_t sigmoid_topk_width(std::size_t experts) { return experts; }

void sigmoid_topk_validate(detail::Checker& chk, const MoeConfig& cfg) {
  namespace c = clauses::config;
  MOECERT_CONTRACT(chk, c::kGroupsDivide) {
    if (cfg.groups < 1 || cfg.experts % cfg.groups != 0)
      chk.fail(c::kGroupsDivide, "", fmt::format("G={} E={}", cfg.groups, cfg.experts),
               "G >= 1 dividing E");
  }
  MOECERT_CONTRACT(chk, c::kTopkGroupRange) {
    const std::int64_t per_group = cfg.groups >= 1 ? cfg.experts / cfg.groups : 0;
    if (cfg.topk_group < 1 || cfg.topk_group > cfg.groups || cfg.topk > cfg.topk_group * per_group)
      chk.fail(c::kTopkGroupRange, "",
               fmt::format("topk_group={} G={} K={}", cfg.topk_group, cfg.groups, cfg.topk),
               fmt::format("1 <= topk_group <= G and K <= topk_group * E / G = {}",
                           cfg.topk_group * per_group));
  }
  MOECERT_CONTRACT(chk, c::kScalingFinite) {
    if (!std::isfinite(cfg.scaling) || !(cfg.scaling > 0))
      chk.fail(c::kScalingFinite, "", fmt::format("c={}", cfg.scaling), "finite c > 0");
  }
}

constexpr std::string_view kSigmoidTopkParams[] = {"groups", "topk_group", "scaling"};

RouterSettings sigmoid_topk_judge_settings(const Params& p) {
  RouterSettings s;
  s.sigmoid = sigmoid_params(p);
  s.scaling = s.sigmoid.scaling;
  return s;
}

void sigmoid_topk_forward_clauses(detail::Checker& c, MatView<const float> z,
                                  View<const float> bias, const RouterSettings& s,
                                  MatView<const std::int32_t> idx, MatView<const float> w) {
  sigmoid_topk_pre(c, z, z.bytes(), bias, s.sigmoid, writable(idx), writable(w));
  if (!c.stop()) sigmoid_topk_post(c, z, bias, s.sigmoid, idx, w);
}

void sigmoid_topk_backward_clauses(detail::Checker& c, MatView<const float> z,
                                   MatView<const std::int32_t> idx, MatView<const float> g,
                                   const RouterSettings& s, MatView<const float> dz) {
  sigmoid_topk_backward_pre(c, z, idx, g, writable(dz));
  if (!c.stop()) sigmoid_topk_backward_post(c, z, idx, g, s.sigmoid, dz);
}

std::vector<double> sigmoid_topk_dz_rounding(const float* z, std::size_t R, const std::int32_t* idx,
                                             const float* g, std::size_t v,
                                             const RouterSettings& s) {
  return bounds::sigmoid_topk_grad_row(z, R, idx, g, v, s.scaling);
}

std::size_t sigmoid_topk_experts(std::size_t width) { return width; }

RouterSettings sigmoid_topk_abi_settings(double param) {
  RouterSettings s;
  s.sigmoid.scaling = static_cast<float>(param);
  s.scaling = param;
  return s;
}

bounds::WeightsRow sigmoid_topk_weights_row(const float* z, std::size_t, const std::int32_t* idx,
                                            std::size_t k, const RouterSettings& s) {
  return bounds::sigmoid_topk_weights_row(z, idx, k, s.scaling);
}

std::vector<double> sigmoid_topk_dz_reference(const float* z, std::size_t R,
                                              const std::int32_t* idx, const float* g,
                                              std::size_t k, const RouterSettings& s) {
  return ref::sigmoid_topk_grad<double>(z, R, idx, g, k, s.scaling);
}

}  // namespace

extern const RouterKindInfo kSigmoidTopkKind = {
    .kind = RouterKind::sigmoid_topk,
    .name = "sigmoid_topk",
    .width = sigmoid_topk_width,
    .experts_of = sigmoid_topk_experts,
    .expert_bias = true,
    .split_dz = false,
    .validate = sigmoid_topk_validate,
    .judge_settings = sigmoid_topk_judge_settings,
    .judge_params = kSigmoidTopkParams,
    .abi_settings = sigmoid_topk_abi_settings,
    .forward_clauses = sigmoid_topk_forward_clauses,
    .backward_clauses = sigmoid_topk_backward_clauses,
    .dz_rounding = sigmoid_topk_dz_rounding,
    .weights_row = sigmoid_topk_weights_row,
    .dz_reference = sigmoid_topk_dz_reference,
};

}  // namespace moecert::contracts
