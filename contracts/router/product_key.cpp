// Clauses of router.product_key, forward and backward (include/moecert/router.hpp).
#include "contracts/router/common.hpp"
#include "contracts/router/kind.hpp"

namespace moecert::contracts {

using namespace router_detail;

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
  // The exact score sx[ix] + sy[iy] of expert i of row t.
  const auto ni = static_cast<std::int32_t>(n);
  auto score = [&](std::size_t t, std::int32_t i) {
    return order::pair_sum(sx(t, i / ni), sy(t, i % ni));
  };
  if (!judge::current().slots_any_order) {
    MOECERT_CONTRACT(c, k::kPkSorted) {
      [&] {  // a failure ends this clause, not the others (observe goes on)
        // The total order on the exact sum (then the expert index).
        for (std::size_t t = 0; t < idx.rows; ++t)
          for (std::size_t j = 1; row_in_range(idx, t, e) && j < valid_slots(idx, t); ++j) {
            const std::int32_t a = idx(t, j - 1), b = idx(t, j);
            const int cmp = order::compare(score(t, a), score(t, b));
            if (!(cmp > 0 || (cmp == 0 && a < b)) &&
                !(cmp == 0 && judge::allow_tie(t, a, b, score(t, a).hi))) {
              c.fail(k::kPkSorted, fmt::format("t={} j={}", t, j),
                     fmt::format("expert {} before expert {}", a, b),
                     "exact score descending, then index ascending");
              return;
            }
          }
      }();
    }
  }
  MOECERT_CONTRACT(c, k::kPkTopk) {
    [&] {  // a failure ends this clause, not the others (observe goes on)
      // No unselected expert's exact score outranks the K-th's (brute force
      // over the n^2 experts; proofs/router.md §2).
      std::vector<char> chosen(e, 0);
      for (std::size_t t = 0; t < idx.rows; ++t) {
        const std::size_t valid = valid_slots(idx, t);
        if (!row_in_range(idx, t, e) || valid == 0) continue;
        for (std::size_t j = 0; j < valid; ++j) chosen[static_cast<std::size_t>(idx(t, j))] = 1;
        std::int32_t kth = idx(t, valid - 1);
        if (judge::current().slots_any_order)  // the lowest-ranked of the selected
          for (std::size_t j = 0; j < valid; ++j) {
            const int cmp = order::compare(score(t, kth), score(t, idx(t, j)));
            if (cmp > 0 || (cmp == 0 && kth < idx(t, j))) kth = idx(t, j);
          }
        for (std::size_t i = 0; i < e; ++i) {
          const auto ii = static_cast<std::int32_t>(i);
          const int cmp = order::compare(score(t, ii), score(t, kth));
          if (chosen[i] || cmp < 0 || (cmp == 0 && ii > kth)) continue;
          if (cmp == 0 && judge::allow_tie(t, kth, ii, score(t, kth).hi)) continue;
          c.fail(k::kPkTopk, fmt::format("t={}", t),
                 fmt::format("unselected expert {} score {:.9g} outranks the K-th, expert {} "
                             "score {:.9g}",
                             i, score(t, ii).hi, kth, score(t, kth).hi),
                 "no unselected expert outranks the K-th");
          return;
        }
        for (std::size_t j = 0; j < valid; ++j) chosen[static_cast<std::size_t>(idx(t, j))] = 0;
      }
    }();
  }
  // Softmax weights: range and sum within §6 over the selected scores
  // (bounds::softmax_rel); exp and raw weights: finite; proofs/router.md §3.
  MOECERT_CONTRACT(c, k::kPkWeights) {
    if (mode == router::KeyWeights::softmax) {
      double shift = 0;
      for (std::size_t t = 0; t < idx.rows; ++t) {
        if (!row_led_by_expert(idx, t, e) || valid_slots(idx, t) < idx.cols) continue;
        const std::int32_t ni = static_cast<std::int32_t>(n);
        double top = double(sx(t, idx(t, 0) / ni)) + sy(t, idx(t, 0) % ni);  // slot 0's when sorted
        for (std::size_t j = 1; j < idx.cols; ++j)
          top = std::max(top, double(sx(t, idx(t, j) / ni)) + sy(t, idx(t, j) % ni));
        for (std::size_t j = 0; j < idx.cols; ++j)
          shift = std::max(shift, top - (double(sx(t, idx(t, j) / ni)) + sy(t, idx(t, j) % ni)));
      }
      const double eps = bounds::softmax_rel(idx.cols, shift) + 2 * idx.cols * bounds::kMinNormal32;
      weight_rows(c, k::kPkWeights, idx, e, w, 1 + eps, 1 - eps, 1 + eps);
    } else {
      detail::scan_finite(c, k::kPkWeights, "w", w);
    }
  }
  // sx, sy exact, |s| <= 2^126; every weight within bounds::product_key_weights_row
  // of its own slot's binary64 reference; proofs/router.md §3.
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
    [&] {  // a failure ends this clause, not the others (observe goes on)
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
    }();
  }
  MOECERT_CONTRACT(c, k::kPkbGradFinite) {
    detail::scan_finite(c, k::kPkbGradFinite, "dsx", dsx) &&
        detail::scan_finite(c, k::kPkbGradFinite, "dsy", dsy);
  }
  // Scores and g exact, |g| <= 2^126; every finite dsx, dsy within
  // bounds::product_key_grad_row of the binary64 reference; proofs/router.md §4.
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

router::KeyWeights key_weights(const Params& m) {
  const auto it = m.find("weights");
  if (it == m.end() || it->second == "softmax") return router::KeyWeights::softmax;
  if (it->second == "exp") return router::KeyWeights::exp;
  if (it->second == "raw") return router::KeyWeights::raw;
  throw std::invalid_argument(fmt::format("weights={}: expected softmax, exp or raw", it->second));
}

// product_key in the layer: z = [sx | sy], R = 2n for E = n^2 experts;
// dz is stored as dsx's block then dsy's (T x n each). The judge's clauses
// take each half as its own contiguous array.
namespace {

std::size_t product_key_width(std::size_t experts) {
  const auto n = static_cast<std::size_t>(std::llround(std::sqrt(static_cast<double>(experts))));
  return n * n == experts ? 2 * n : 0;
}

void product_key_validate(detail::Checker& chk, const MoeConfig& cfg) {
  namespace c = clauses::config;
  MOECERT_CONTRACT(chk, c::kProductKeySquare) {
    const auto n = static_cast<std::int64_t>(
        std::llround(std::sqrt(static_cast<double>(std::max<std::int64_t>(cfg.experts, 0)))));
    if (cfg.experts < 1 || n * n != cfg.experts)
      chk.fail(c::kProductKeySquare, "", fmt::format("E={}", cfg.experts), "E = n*n");
  }
}

// z's (or dz's) two halves, each copied into its own contiguous T x n array.
struct Halves {
  std::vector<float> first, second;
  std::size_t rows, n;
  explicit Halves(MatView<const float> m) : rows(m.rows), n(m.cols / 2) {
    first.reserve(rows * n), second.reserve(rows * n);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < n; ++j) first.push_back(m(i, j)), second.push_back(m(i, n + j));
  }
  MatView<const float> x() const { return {first.data(), rows, n}; }
  MatView<const float> y() const { return {second.data(), rows, n}; }
};

constexpr std::string_view kProductKeyParams[] = {"weights"};

RouterSettings product_key_judge_settings(const Params& p) {
  RouterSettings s;
  s.keys = key_weights(p);
  return s;
}

void product_key_forward_clauses(detail::Checker& c, MatView<const float> z, View<const float>,
                                 const RouterSettings& s, MatView<const std::int32_t> idx,
                                 MatView<const float> w) {
  const Halves h(z);
  const auto sx = h.x(), sy = h.y();
  product_key_pre(c, sx, sy, sx.bytes(), sy.bytes(), s.keys, writable(idx), writable(w));
  if (!c.stop()) product_key_post(c, sx, sy, s.keys, idx, w);
}

void product_key_backward_clauses(detail::Checker& c, MatView<const float> z,
                                  MatView<const std::int32_t> idx, MatView<const float> g,
                                  const RouterSettings& s, MatView<const float> dz) {
  const Halves h(z), dh(dz);
  const auto sx = h.x(), sy = h.y(), dsx = dh.x(), dsy = dh.y();
  product_key_backward_pre(c, sx, sy, idx, g, writable(dsx), writable(dsy));
  if (!c.stop()) product_key_backward_post(c, sx, sy, idx, g, s.keys, dsx, dsy);
}

std::vector<double> product_key_dz_rounding(const float* z, std::size_t R, const std::int32_t* idx,
                                            const float* g, std::size_t v,
                                            const RouterSettings& s) {
  const std::size_t n = R / 2;
  return bounds::product_key_grad_row(z, z + n, n, idx, g, v, s.keys);
}

std::size_t product_key_experts(std::size_t width) { return (width / 2) * (width / 2); }

RouterSettings product_key_abi_settings(double param) {
  if (!(param == 0 || param == 1 || param == 2))
    throw std::invalid_argument(
        fmt::format("param {}: expected a key weights mode (0 raw, 1 exp, 2 softmax)", param));
  RouterSettings s;
  s.keys = static_cast<router::KeyWeights>(static_cast<int>(param));
  return s;
}

bounds::WeightsRow product_key_weights_row(const float* z, std::size_t R, const std::int32_t* idx,
                                           std::size_t k, const RouterSettings& s) {
  const std::size_t n = R / 2;
  return bounds::product_key_weights_row(z, z + n, n, idx, k, s.keys);
}

std::vector<double> product_key_dz_reference(const float* z, std::size_t R, const std::int32_t* idx,
                                             const float* g, std::size_t k,
                                             const RouterSettings& s) {
  const std::size_t n = R / 2;
  std::vector<double> rx, ry;
  ref::product_key_grad<double>(z, z + n, n, idx, g, k, s.keys, rx, ry);
  rx.insert(rx.end(), ry.begin(), ry.end());
  return rx;
}

}  // namespace

extern const RouterKindInfo kProductKeyKind = {
    .kind = RouterKind::product_key,
    .name = "product_key",
    .width = product_key_width,
    .experts_of = product_key_experts,
    .expert_bias = false,
    .split_dz = true,
    .validate = product_key_validate,
    .judge_settings = product_key_judge_settings,
    .judge_params = kProductKeyParams,
    .abi_settings = product_key_abi_settings,
    .forward_clauses = product_key_forward_clauses,
    .backward_clauses = product_key_backward_clauses,
    .dz_rounding = product_key_dz_rounding,
    .weights_row = product_key_weights_row,
    .dz_reference = product_key_dz_reference,
};

}  // namespace moecert::contracts
