// Routers: selection against brute force under the total order, weights and
// gradients against the high-precision reference within derived bounds,
// finite-difference checks of the reference, the field regressions, the
// bounded-exhaustive product-key proof check, and every clause.
#include "contracts/bounds/router.hpp"

#include <oneapi/tbb/global_control.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "contracts/engine/compare.hpp"
#include "contracts/engine/judging.hpp"
#include "contracts/judge/ops.hpp"
#include "contracts/reference/router.hpp"
#include "contracts/router/clauses.hpp"
#include "moecert/router.hpp"
#include "ops/router/select.hpp"
#include "test_util.hpp"

using namespace moecert;
using router::KeyWeights;

namespace moecert::router::detail {
void product_key_select_row(const float* sx, const float* sy, std::size_t n, std::size_t k,
                            std::int32_t* idx, std::vector<std::int32_t>& ids);
}

namespace {

std::vector<float> normal(std::mt19937_64& rng, std::size_t n, float scale) {
  std::normal_distribution<float> nd(0, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Brute force: all candidates sorted by (score desc, index asc).
template <class Better>
std::vector<std::int32_t> brute(std::size_t n, std::size_t k, Better better) {
  std::vector<std::int32_t> ids(n);
  for (std::size_t i = 0; i < n; ++i) ids[i] = static_cast<std::int32_t>(i);
  std::stable_sort(ids.begin(), ids.end(), better);
  ids.resize(k);
  return ids;
}

std::vector<std::int32_t> brute_product_key(const float* sx, const float* sy, std::size_t n,
                                            std::size_t k) {
  const auto ni = static_cast<std::int32_t>(n);
  return brute(n * n, k, [&](std::int32_t a, std::int32_t b) {
    const auto ka = router::detail::exact_sum(sx[a / ni], sy[a % ni]),
               kb = router::detail::exact_sum(sx[b / ni], sy[b % ni]);
    return ka > kb || (ka == kb && a < b);
  });
}

double max_shift(const float* z, const std::int32_t* idx, std::size_t v, std::size_t e,
                 bool over_all) {
  double m = -INFINITY, lo = INFINITY;
  for (std::size_t i = 0; i < (over_all ? e : v); ++i) {
    const double x = z[over_all ? i : static_cast<std::size_t>(idx[i])];
    m = std::max(m, x);
    lo = std::min(lo, x);
  }
  return m - lo;
}

}  // namespace

TEST_CASE("router.softmax_topk.forward: exact selection, weights within bound",
          "[router][softmax_topk][numeric]") {
  std::mt19937_64 rng(71);
  const std::size_t t = 64, e = 37, k = 5;
  auto z = normal(rng, t * e, 3);
  for (std::size_t i = 0; i < t * e; i += 7) z[i] = z[i / 7 % (t * e)];  // some ties
  for (bool renorm : {true, false}) {
    std::vector<std::int32_t> idx(t * k);
    std::vector<float> w(t * k);
    {
      ContractScope full{Level::full, Semantic::enforce};
      router::softmax_topk_forward(MatView<const float>(z.data(), t, e),
                                   MatView<std::int32_t>(idx.data(), t, k),
                                   MatView<float>(w.data(), t, k), renorm);
    }
    for (std::size_t r = 0; r < t; ++r) {
      const float* zr = &z[r * e];
      const auto want = brute(e, k, [&](std::int32_t a, std::int32_t b) {
        return router::detail::outranks(zr[a], a, zr[b], b);
      });
      REQUIRE(std::equal(want.begin(), want.end(), &idx[r * k]));
      const auto ref = ref::softmax_topk_weights<ref::DoubleDouble>(zr, e, &idx[r * k], k, renorm);
      const auto b = bounds::softmax_topk_weights_row(zr, e, &idx[r * k], k, renorm).bound;
      for (std::size_t j = 0; j < k; ++j)
        REQUIRE(std::fabs(w[r * k + j] - ref::to_double(ref[j])) <= b[j]);
    }
  }
}

TEST_CASE("router.softmax_topk.backward: within bound of the reference",
          "[router][softmax_topk][numeric]") {
  std::mt19937_64 rng(72);
  const std::size_t t = 40, e = 23, k = 4;
  const auto z = normal(rng, t * e, 2), g = normal(rng, t * k, 1);
  for (bool renorm : {true, false}) {
    std::vector<std::int32_t> idx(t * k);
    std::vector<float> w(t * k), dz(t * e, NAN);
    router::softmax_topk_forward(MatView<const float>(z.data(), t, e),
                                 MatView<std::int32_t>(idx.data(), t, k),
                                 MatView<float>(w.data(), t, k), renorm);
    for (std::size_t r = 0; r < t; r += 5)
      idx[r * k + k - 1] = -1;  // replayed rows with an empty tail slot
    {
      ContractScope full{Level::full, Semantic::enforce};
      router::softmax_topk_backward(
          MatView<const float>(z.data(), t, e), MatView<const std::int32_t>(idx.data(), t, k),
          MatView<const float>(g.data(), t, k), MatView<float>(dz.data(), t, e), renorm);
    }
    double worst = 0;
    for (std::size_t r = 0; r < t; ++r) {
      const float* zr = &z[r * e];
      const std::int32_t* ir = &idx[r * k];
      const std::size_t v = ref::valid_prefix(ir, k);
      const auto dref = ref::softmax_topk_grad<ref::DoubleDouble>(zr, e, ir, &g[r * k], k, renorm);
      const auto wsel = ref::softmax_topk_weights<ref::DoubleDouble>(zr, e, ir, k, renorm);
      const auto p = ref::softmax<ref::DoubleDouble>(zr, e);
      double d = 0, swg = 0, sg = 0;
      for (std::size_t j = 0; j < v; ++j) {
        d += ref::to_double(wsel[j]) * g[r * k + j];
        swg += ref::to_double(wsel[j]) * std::fabs(g[r * k + j]);
        sg += std::fabs(g[r * k + j]);
      }
      const double eps = bounds::softmax_rel(renorm ? v : e, max_shift(zr, ir, v, e, !renorm));
      for (std::size_t i = 0; i < e; ++i) {
        double gi = 0, wi = renorm ? 0 : ref::to_double(p[i]);
        for (std::size_t j = 0; j < v; ++j)
          if (ir[j] == static_cast<std::int32_t>(i))
            gi = g[r * k + j], wi = ref::to_double(wsel[j]);
        const bool selected = std::find(ir, ir + v, static_cast<std::int32_t>(i)) != ir + v;
        if (renorm && !selected) {
          REQUIRE(dz[r * e + i] == 0.0f);  // exactly: the math says 0
          continue;
        }
        const double bound = bounds::weighted_diff(wi, gi, d, swg, sg, v, eps);
        const double err = std::fabs(dz[r * e + i] - ref::to_double(dref[i]));
        REQUIRE(err <= bound);
        worst = std::max(worst, err / bound);
      }
    }
    INFO("max utilisation " << worst);
    CHECK(worst > 0);
  }
}

TEST_CASE("router.sigmoid_topk.forward: group-limited selection and weights",
          "[router][sigmoid_topk][numeric]") {
  std::mt19937_64 rng(73);
  const std::size_t t = 50, e = 32, k = 6;
  const router::SigmoidTopkParams p{8, 3, 2.5f};
  const auto z = normal(rng, t * e, 2), bias = normal(rng, e, 0.1f);
  std::vector<std::int32_t> idx(t * k);
  std::vector<float> w(t * k);
  {
    ContractScope full{Level::full, Semantic::enforce};
    router::sigmoid_topk_forward(
        MatView<const float>(z.data(), t, e), View<const float>{bias.data(), e}, p,
        MatView<std::int32_t>(idx.data(), t, k), MatView<float>(w.data(), t, k));
  }
  for (std::size_t r = 0; r < t; ++r) {
    // Brute force: every expert ranked; groups ranked by their top-two sums.
    std::vector<float> sel(e);
    for (std::size_t i = 0; i < e; ++i) sel[i] = router::detail::sigmoid(z[r * e + i]) + bias[i];
    std::vector<float> gs(p.groups);
    for (std::size_t q = 0; q < p.groups; ++q) {
      std::vector<float> v(sel.begin() + q * 4, sel.begin() + q * 4 + 4);
      std::sort(v.rbegin(), v.rend());
      gs[q] = v[0] + v[1];
    }
    const auto groups = brute(p.groups, p.topk_group, [&](std::int32_t a, std::int32_t b) {
      return router::detail::outranks(gs[a], a, gs[b], b);
    });
    auto all = brute(e, e, [&](std::int32_t a, std::int32_t b) {
      return router::detail::outranks(sel[a], a, sel[b], b);
    });
    std::erase_if(all, [&](std::int32_t i) {
      return std::find(groups.begin(), groups.end(), i / 4) == groups.end();
    });
    all.resize(k);
    REQUIRE(std::equal(all.begin(), all.end(), &idx[r * k]));
    const auto ref =
        ref::sigmoid_topk_weights<ref::DoubleDouble>(&z[r * e], &idx[r * k], k, p.scaling);
    const auto b = bounds::sigmoid_topk_weights_row(&z[r * e], &idx[r * k], k, p.scaling).bound;
    for (std::size_t j = 0; j < k; ++j)
      REQUIRE(std::fabs(w[r * k + j] - ref::to_double(ref[j])) <= b[j]);
  }
}

TEST_CASE(
    "router.sigmoid_topk.forward: -1 tail slots when the kept groups hold fewer than K experts",
    "[router][sigmoid_topk][index]") {
  std::mt19937_64 rng(74);
  const std::size_t t = 10, e = 16, k = 6;
  const router::SigmoidTopkParams p{4, 1, 1.0f};  // one group of 4 kept, K = 6
  const auto z = normal(rng, t * e, 1);
  const std::vector<float> bias(e, 0.0f);
  std::vector<std::int32_t> idx(t * k);
  std::vector<float> w(t * k);
  ContractScope full{Level::full, Semantic::enforce};
  router::sigmoid_topk_forward(
      MatView<const float>(z.data(), t, e), View<const float>{bias.data(), e}, p,
      MatView<std::int32_t>(idx.data(), t, k), MatView<float>(w.data(), t, k));
  for (std::size_t r = 0; r < t; ++r) {
    double sum = 0;
    for (std::size_t j = 0; j < k; ++j) {
      REQUIRE((j < 4) == (idx[r * k + j] >= 0));
      if (j >= 4) REQUIRE(w[r * k + j] == 0.0f);
      sum += w[r * k + j];
    }
    CHECK(std::fabs(sum - 1) < 1e-6);  // c = 1 spread over the 4 valid slots
  }
}

TEST_CASE("router.sigmoid_topk.backward: within bound, zero off the selection",
          "[router][sigmoid_topk][numeric]") {
  std::mt19937_64 rng(75);
  const std::size_t t = 30, e = 24, k = 5;
  const router::SigmoidTopkParams p{4, 2, 2.0f};
  const auto z = normal(rng, t * e, 2), g = normal(rng, t * k, 1);
  const std::vector<float> bias(e, 0.0f);
  std::vector<std::int32_t> idx(t * k);
  std::vector<float> w(t * k), dz(t * e, NAN);
  router::sigmoid_topk_forward(
      MatView<const float>(z.data(), t, e), View<const float>{bias.data(), e}, p,
      MatView<std::int32_t>(idx.data(), t, k), MatView<float>(w.data(), t, k));
  {
    ContractScope full{Level::full, Semantic::enforce};
    router::sigmoid_topk_backward(
        MatView<const float>(z.data(), t, e), MatView<const std::int32_t>(idx.data(), t, k),
        MatView<const float>(g.data(), t, k), p, MatView<float>(dz.data(), t, e));
  }
  for (std::size_t r = 0; r < t; ++r) {
    const std::int32_t* ir = &idx[r * k];
    const auto dref =
        ref::sigmoid_topk_grad<ref::DoubleDouble>(&z[r * e], e, ir, &g[r * k], k, p.scaling);
    const std::vector<double> b =
        bounds::sigmoid_topk_grad_row(&z[r * e], e, ir, &g[r * k], k, p.scaling);
    for (std::size_t j = 0; j < k; ++j) {
      const auto i = static_cast<std::size_t>(ir[j]);
      // + the rounding of the binary64 inputs of the bound (sum_s, d: gamma_64 of 2^-53)
      const double bound =
          b[i] + bounds::gamma(64, bounds::kU64) * std::fabs(ref::to_double(dref[i]));
      REQUIRE(std::fabs(dz[r * e + i] - ref::to_double(dref[i])) <= bound);
    }
  }
}

TEST_CASE(
    "router.sigmoid_topk.backward: finite and within bound where c / S exceeds the fp32 range",
    "[router][sigmoid_topk][numeric]") {
  // Logits near the clause's floor (-87: sigma about 1.6e-38) and a scaling
  // c of 1e6..3e38: c / sum_S sigma is far beyond fp32, but each exact
  // dz = c (g - D) (s / S)(1 - s) is at most c |g - D|. Computed as
  // (c / S)(g - D) s (1 - s) it came out infinite (proofs/router.md §4.2).
  const std::size_t e = 4, k = 2;
  const std::vector<float> z = {-87.0f, -86.5f, -86.0f, 3.0f};
  const std::vector<std::int32_t> idx = {0, 2};
  for (const float c : {1e6f, 1e30f, 3e38f})
    for (const float g0 :
         {1.0f, 1e-30f}) {  // gradient inputs, not tolerances: the bound is sigmoid_topk_grad_row
      const std::vector<float> g = {g0, -g0};
      std::vector<float> dz(e, NAN);
      {
        ContractScope full{Level::full, Semantic::enforce};
        router::sigmoid_topk_backward(
            MatView<const float>(z.data(), 1, e), MatView<const std::int32_t>(idx.data(), 1, k),
            MatView<const float>(g.data(), 1, k), {1, 1, c}, MatView<float>(dz.data(), 1, e));
      }
      const auto dref =
          ref::sigmoid_topk_grad<ref::DoubleDouble>(z.data(), e, idx.data(), g.data(), k, c);
      const std::vector<double> b =
          bounds::sigmoid_topk_grad_row(z.data(), e, idx.data(), g.data(), k, c);
      for (std::size_t j = 0; j < k; ++j) {
        const auto i = static_cast<std::size_t>(idx[j]);
        const double want = ref::to_double(dref[i]);
        INFO("c=" << c << " g0=" << g0 << " j=" << j << " dz=" << dz[i] << " ref=" << want);
        REQUIRE(std::isfinite(dz[i]));
        CHECK(want != 0);
        CHECK(std::fabs(dz[i] - want) <= b[i] + bounds::gamma(64, bounds::kU64) * std::fabs(want));
      }
      CHECK(dz[1] == 0.0f);
      CHECK(dz[3] == 0.0f);
    }
}

TEST_CASE("router.product_key.forward: two-stage selection equals brute force",
          "[router][product_key][index]") {
  std::mt19937_64 rng(76);
  const std::size_t t = 40, n = 12;
  for (std::size_t k : {1u, 5u, 12u, 20u}) {
    const auto sx = normal(rng, t * n, 1), sy = normal(rng, t * n, 1);
    std::vector<std::int32_t> idx(t * k);
    std::vector<float> w(t * k);
    ContractScope full{Level::full, Semantic::enforce};
    router::product_key_forward(MatView<const float>(sx.data(), t, n),
                                MatView<const float>(sy.data(), t, n), KeyWeights::softmax,
                                MatView<std::int32_t>(idx.data(), t, k),
                                MatView<float>(w.data(), t, k));
    for (std::size_t r = 0; r < t; ++r) {
      const auto want = brute_product_key(&sx[r * n], &sy[r * n], n, k);
      REQUIRE(std::equal(want.begin(), want.end(), &idx[r * k]));
    }
  }
}

TEST_CASE(
    "router.product_key.forward: every weight mode within bound of the reference, slot by slot",
    "[router][product_key][numeric]") {
  // The clauses check softmax weights' range and sum and the others'
  // finiteness; this holds every weight to its own slot's reference value
  // (a weight written to the wrong slot passes the clauses).
  std::mt19937_64 rng(82);
  const std::size_t t = 48, n = 7, k = 5;
  for (const float offset : {0.0f, -40.0f, 3000.0f}) {  // exp weights need max sx + max sy <= 88
    auto sx = normal(rng, t * n, 2), sy = normal(rng, t * n, 2);
    for (auto* v : {&sx, &sy})
      for (float& q : *v) q += offset / 2;
    for (KeyWeights mode : {KeyWeights::raw, KeyWeights::exp, KeyWeights::softmax}) {
      if (mode == KeyWeights::exp && offset > 0) continue;
      INFO("offset " << offset << " mode " << int(mode));
      std::vector<std::int32_t> idx(t * k);
      std::vector<float> w(t * k);
      {
        ContractScope full{Level::full, Semantic::enforce};
        router::product_key_forward(
            MatView<const float>(sx.data(), t, n), MatView<const float>(sy.data(), t, n), mode,
            MatView<std::int32_t>(idx.data(), t, k), MatView<float>(w.data(), t, k));
      }
      for (std::size_t r = 0; r < t; ++r) {
        const auto ref = ref::product_key_weights<ref::DoubleDouble>(&sx[r * n], &sy[r * n], n,
                                                                     &idx[r * k], k, mode);
        const auto b =
            bounds::product_key_weights_row(&sx[r * n], &sy[r * n], n, &idx[r * k], k, mode).bound;
        for (std::size_t j = 0; j < k; ++j)
          REQUIRE(std::fabs(w[r * k + j] - ref::to_double(ref[j])) <= b[j]);
        // The same weights in another slot order miss the bound (a test that can fail).
        CHECK(std::fabs(w[r * k + 1] - ref::to_double(ref[0])) > b[0]);
      }
    }
  }
}

TEST_CASE("router.product_key.forward: 1024 tokens x 4096 experts with ties everywhere",
          "[router][product_key][index]") {
  // failure mode 2: scores drawn from a few values, so ties are everywhere.
  std::mt19937_64 rng(77);
  const std::size_t t = 1024, n = 64, k = 16;
  const float values[] = {-1.0f, -0.5f, 0.0f, 0.25f, 0.5f, 1.0f};
  std::vector<float> sx(t * n), sy(t * n);
  for (auto& v : sx) v = values[rng() % 6];
  for (auto& v : sy) v = values[rng() % 6];
  std::vector<std::int32_t> idx(t * k);
  std::vector<float> w(t * k);
  router::product_key_forward(
      MatView<const float>(sx.data(), t, n), MatView<const float>(sy.data(), t, n), KeyWeights::raw,
      MatView<std::int32_t>(idx.data(), t, k), MatView<float>(w.data(), t, k));
  std::vector<float> scores(t * n * n);
  for (std::size_t r = 0; r < t; ++r) {
    const auto want = brute_product_key(&sx[r * n], &sy[r * n], n, k);
    REQUIRE(std::equal(want.begin(), want.end(), &idx[r * k]));
    for (std::size_t e = 0; e < n * n; ++e)
      scores[r * n * n + e] = sx[r * n + e / n] + sy[r * n + e % n];
  }
  // The tie-aware comparison accepts another correct tie break (the last tie
  // group at the boundary broken by index descending) and rejects a selection
  // that trades one expert for one of lower score.
  std::vector<std::int32_t> other = idx, lower = idx;
  int swapped = 0;
  for (std::size_t r = 0; r < t; ++r) {
    const float kth = scores[r * n * n + idx[r * k + k - 1]];
    std::vector<std::int32_t> ties;  // all experts scoring the k-th score
    for (std::size_t e = 0; e < n * n; ++e)
      if (scores[r * n * n + e] == kth) ties.push_back(static_cast<std::int32_t>(e));
    std::size_t first = k;
    while (first > 0 && scores[r * n * n + idx[r * k + first - 1]] == kth) --first;
    std::sort(ties.rbegin(), ties.rend());
    for (std::size_t j = first; j < k; ++j) other[r * k + j] = ties[j - first];
    swapped += ties.size() > k - first;
    for (std::size_t e = 0; e < n * n; ++e)  // the best expert strictly below the k-th score
      if (scores[r * n * n + e] < kth &&
          (lower[r * k + k - 1] == idx[r * k + k - 1] ||
           scores[r * n * n + e] > scores[r * n * n + lower[r * k + k - 1]]))
        lower[r * k + k - 1] = static_cast<std::int32_t>(e);
  }
  CHECK(swapped > 500);  // most rows really have a tie at the boundary
  MatView<const float> sv(scores.data(), t, n * n);
  MatView<const std::int32_t> ref(idx.data(), t, k);
  CHECK(compare::topk_tie_aware(sv, MatView<const std::int32_t>(other.data(), t, k), ref).ok);
  const auto bad =
      compare::topk_tie_aware(sv, MatView<const std::int32_t>(lower.data(), t, k), ref);
  CHECK_FALSE(bad.ok);
  CHECK(bad.j == k - 1);
}

TEST_CASE(
    "router.product_key: two-stage equals brute force for every score vector over a small alphabet "
    "(proofs/router.md §2)",
    "[router][product_key][proof]") {
  const float alphabet[] = {-1.0f, 0.0f, 0.5f};
  std::vector<std::int32_t> ids, got(16);
  std::size_t checked = 0;
  for (std::size_t n = 1; n <= 4; ++n) {
    std::size_t combos = 1;
    for (std::size_t i = 0; i < 2 * n; ++i) combos *= 3;
    std::vector<float> sx(n), sy(n);
    for (std::size_t c = 0; c < combos; ++c) {
      std::size_t x = c;
      for (std::size_t i = 0; i < n; ++i, x /= 3) sx[i] = alphabet[x % 3];
      for (std::size_t i = 0; i < n; ++i, x /= 3) sy[i] = alphabet[x % 3];
      for (std::size_t k = 1; k <= std::min<std::size_t>(4, n * n); ++k) {
        router::detail::product_key_select_row(sx.data(), sy.data(), n, k, got.data(), ids);
        const auto want = brute_product_key(sx.data(), sy.data(), n, k);
        REQUIRE(std::equal(want.begin(), want.end(), got.begin()));
        ++checked;
      }
    }
  }
  CHECK(checked == 9 * 1 + 81 * 4 + 729 * 4 + 6561 * 4);
}

TEST_CASE("router.product_key.backward: -1 slots add nothing; never-selected keys get exactly 0",
          "[router][product_key][index]") {
  // failure mode 1: with idx = -1, a truncating ix = idx / n, iy = idx - ix n
  // lands the gradient on expert (0, -1). Here every row has -1 tail slots.
  std::mt19937_64 rng(78);
  const std::size_t t = 64, n = 8, k = 6;
  const auto sx = normal(rng, t * n, 1), sy = normal(rng, t * n, 1), g = normal(rng, t * k, 1);
  for (KeyWeights mode : {KeyWeights::raw, KeyWeights::exp, KeyWeights::softmax}) {
    std::vector<std::int32_t> idx(t * k);
    std::vector<float> w(t * k);
    router::product_key_forward(
        MatView<const float>(sx.data(), t, n), MatView<const float>(sy.data(), t, n), mode,
        MatView<std::int32_t>(idx.data(), t, k), MatView<float>(w.data(), t, k));
    for (std::size_t r = 0; r < t; ++r)  // row 0: every slot -1
      for (std::size_t j = r == 0 ? 0 : 1 + r % (k - 1); j < k; ++j) idx[r * k + j] = -1;
    std::vector<float> dsx(t * n, NAN), dsy(t * n, NAN);
    {
      ContractScope full{Level::full, Semantic::enforce};
      router::product_key_backward(
          MatView<const float>(sx.data(), t, n), MatView<const float>(sy.data(), t, n),
          MatView<const std::int32_t>(idx.data(), t, k), MatView<const float>(g.data(), t, k), mode,
          MatView<float>(dsx.data(), t, n), MatView<float>(dsy.data(), t, n));
    }
    for (std::size_t r = 0; r < t; ++r) {
      std::vector<double> rx, ry;
      ref::product_key_grad<double>(&sx[r * n], &sy[r * n], n, &idx[r * k], &g[r * k], k, mode, rx,
                                    ry);
      const auto b =
          bounds::product_key_grad_row(&sx[r * n], &sy[r * n], n, &idx[r * k], &g[r * k], k, mode);
      for (std::size_t i = 0; i < n; ++i)
        for (int half = 0; half < 2; ++half) {
          const float got = half ? dsy[r * n + i] : dsx[r * n + i];
          const double want = half ? ry[i] : rx[i], bound = b[half * n + i];
          if (bound == 0)
            REQUIRE(got == 0.0f);  // never selected: exactly zero
          else
            REQUIRE(std::fabs(got - want) <= bound);
        }
    }
  }
}

TEST_CASE(
    "router.product_key.backward: scores far from zero round, and the weights' error is part of "
    "the bound",
    "[router][product_key][numeric]") {
  // fl(sx + sy) near 1e4 is off by up to 2^-11; softmax weights over the
  // selected scores inherit that (§4.3's e_j from weighted_diff). The layer's
  // router bound once kept only the fp32 sums' term of §4.3 for product keys:
  // here the kernel's error exceeds that term alone, and stays within the
  // whole bound.
  std::mt19937_64 rng(81);
  const std::size_t t = 64, n = 8, k = 4;
  auto sx = normal(rng, t * n, 1), sy = normal(rng, t * n, 1);
  const auto g = normal(rng, t * k, 1);
  for (auto* v : {&sx, &sy})
    for (float& q : *v) q += 5000.0f;
  std::vector<std::int32_t> idx(t * k);
  std::vector<float> w(t * k), dsx(t * n), dsy(t * n);
  const MatView<const float> xv(sx.data(), t, n), yv(sy.data(), t, n);
  router::product_key_forward(xv, yv, KeyWeights::softmax, MatView<std::int32_t>(idx.data(), t, k),
                              MatView<float>(w.data(), t, k));
  router::product_key_backward(xv, yv, MatView<const std::int32_t>(idx.data(), t, k),
                               MatView<const float>(g.data(), t, k), KeyWeights::softmax,
                               MatView<float>(dsx.data(), t, n), MatView<float>(dsy.data(), t, n));
  double beyond_sums = 0;  // max over keys of error / (the fp32 sums' term alone)
  for (std::size_t r = 0; r < t; ++r) {
    const std::int32_t* ir = &idx[r * k];
    std::vector<double> rx, ry;
    ref::product_key_grad<double>(&sx[r * n], &sy[r * n], n, ir, &g[r * k], k, KeyWeights::softmax,
                                  rx, ry);
    const auto b = bounds::product_key_grad_row(&sx[r * n], &sy[r * n], n, ir, &g[r * k], k,
                                                KeyWeights::softmax);
    const auto wr =
        ref::product_key_weights<double>(&sx[r * n], &sy[r * n], n, ir, k, KeyWeights::softmax);
    double dot = 0;
    for (std::size_t j = 0; j < k; ++j) dot += wr[j] * g[r * k + j];
    std::vector<double> terms(2 * n, 0);
    std::vector<std::size_t> count(2 * n, 0);
    for (std::size_t j = 0; j < k; ++j) {
      const auto e = static_cast<std::size_t>(ir[j]);
      for (const std::size_t key : {e / n, n + e % n})
        terms[key] += wr[j] * std::fabs(g[r * k + j] - dot), ++count[key];
    }
    for (std::size_t i = 0; i < 2 * n; ++i) {
      const double err =
          std::fabs((i < n ? dsx[r * n + i] : dsy[r * n + i - n]) - (i < n ? rx[i] : ry[i - n]));
      REQUIRE(err <= b[i]);
      if (count[i])
        beyond_sums = std::max(
            beyond_sums, err / (bounds::accumulated(terms[i], 0, count[i]) + 0x1p-52 * terms[i]));
    }
  }
  CHECK(beyond_sums > 10);
}

TEST_CASE("router: reference gradients agree with 50-digit central differences",
          "[router][reference]") {
  using ref::Hp;
  std::mt19937_64 rng(79);
  const std::size_t e = 7, k = 3, n = 3;
  const auto z = normal(rng, e, 1.5f), g = normal(rng, k, 1);
  const auto sx = normal(rng, n, 1), sy = normal(rng, n, 1);
  const std::int32_t idx[k] = {4, 1, 6};
  const Hp h("1e-20");
  double worst = 0;
  auto agree = [&](const Hp& fd, const Hp& an) {
    // Relative, with a floor of 1e-20 for gradients that are exactly 0
    // (the 50-digit difference quotient is noise of order 1e-50 / h there).
    const Hp scale = ref::abs(an) + Hp("1e-20");
    const double rel = ref::to_double(ref::abs(fd - an) / scale);
    worst = std::max(worst, rel);
    INFO("fd " << ref::to_double(fd) << " analytic " << ref::to_double(an));
    REQUIRE(rel <= 1e-10);  // the agreement issue 4 asks of finite differences
  };
  // L = sum_j g_j w_j; dL/dz_i by central differences of the reference forward
  // (the selection held fixed, as the backward assumes).
  for (bool renorm : {true, false}) {
    const auto an = ref::softmax_topk_grad<Hp>(z.data(), e, idx, g.data(), k, renorm);
    for (std::size_t i = 0; i < e; ++i) {
      std::vector<Hp> zp(z.begin(), z.end()), zm(z.begin(), z.end());
      zp[i] += h;
      zm[i] -= h;
      auto loss = [&](const std::vector<Hp>& zz) {  // softmax in Hp over the perturbed logits
        Hp m = zz[0], sum(0), l(0);
        for (const auto& v : zz)
          if (v > m) m = v;
        if (renorm) {
          for (std::size_t j = 0; j < k; ++j) sum += ref::exp(zz[idx[j]] - m);
          for (std::size_t j = 0; j < k; ++j) l += Hp(g[j]) * ref::exp(zz[idx[j]] - m) / sum;
        } else {
          for (const auto& v : zz) sum += ref::exp(v - m);
          for (std::size_t j = 0; j < k; ++j) l += Hp(g[j]) * ref::exp(zz[idx[j]] - m) / sum;
        }
        return l;
      };
      agree((loss(zp) - loss(zm)) / (Hp(2) * h), an[i]);
    }
  }
  {  // sigmoid: L = sum_j g_j c s_j / sum s
    const double c = 2.5;
    const auto an = ref::sigmoid_topk_grad<Hp>(z.data(), e, idx, g.data(), k, c);
    for (std::size_t i = 0; i < e; ++i) {
      auto loss = [&](const Hp& dzi) {
        Hp sum(0), l(0);
        auto zz = [&](std::int32_t q) {
          return Hp(z[q]) + (q == static_cast<std::int32_t>(i) ? dzi : Hp(0));
        };
        for (std::size_t j = 0; j < k; ++j) sum += ref::sigmoid(zz(idx[j]));
        for (std::size_t j = 0; j < k; ++j) l += Hp(g[j]) * Hp(c) * ref::sigmoid(zz(idx[j])) / sum;
        return l;
      };
      agree((loss(h) - loss(-h)) / (Hp(2) * h), an[i]);
    }
  }
  for (KeyWeights mode :
       {KeyWeights::raw, KeyWeights::exp, KeyWeights::softmax}) {  // product key: dsx
    const std::int32_t pidx[k] = {5, 0, 7};
    std::vector<Hp> ax, ay;
    ref::product_key_grad<Hp>(sx.data(), sy.data(), n, pidx, g.data(), k, mode, ax, ay);
    for (std::size_t i = 0; i < n; ++i) {
      auto loss = [&](const Hp& d) {
        std::vector<Hp> s(k);
        for (std::size_t j = 0; j < k; ++j)
          s[j] = Hp(sx[pidx[j] / 3]) + (pidx[j] / 3 == static_cast<std::int32_t>(i) ? d : Hp(0)) +
                 Hp(sy[pidx[j] % 3]);
        Hp l(0), m = s[0], sum(0);
        for (const auto& v : s)
          if (v > m) m = v;
        for (const auto& v : s) sum += ref::exp(v - m);
        for (std::size_t j = 0; j < k; ++j)
          l += Hp(g[j]) * (mode == KeyWeights::raw   ? s[j]
                           : mode == KeyWeights::exp ? ref::exp(s[j])
                                                     : ref::exp(s[j] - m) / sum);
        return l;
      };
      agree((loss(h) - loss(-h)) / (Hp(2) * h), ax[i]);
    }
  }
  INFO("worst relative disagreement " << worst);
  CHECK(worst <= 1e-10);
}

TEST_CASE("router: bitwise identical for 1, 2 and 7 threads", "[router]") {
  std::mt19937_64 rng(80);
  const std::size_t t = 300, e = 64, k = 6;
  const auto z = normal(rng, t * e, 2);
  std::vector<std::vector<float>> outs;
  for (int threads : {1, 2, 7}) {
    oneapi::tbb::global_control gc(oneapi::tbb::global_control::max_allowed_parallelism, threads);
    std::vector<std::int32_t> idx(t * k);
    std::vector<float> w(t * k);
    router::softmax_topk_forward(MatView<const float>(z.data(), t, e),
                                 MatView<std::int32_t>(idx.data(), t, k),
                                 MatView<float>(w.data(), t, k), true);
    outs.push_back(w);
  }
  CHECK(std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * 4) == 0);
  CHECK(std::memcmp(outs[0].data(), outs[2].data(), outs[0].size() * 4) == 0);
}

// ---- clauses: every precondition through the op (outputs untouched), every
// postcondition through its contract on a corrupted result ----------------

namespace {

struct SmRun {
  std::size_t t = 3, e = 6, k = 2;
  std::vector<float> z = std::vector<float>(18, 0.0f);
  std::vector<std::int32_t> idx = std::vector<std::int32_t>(6, 99);
  std::vector<float> w = std::vector<float>(6, 9.0f);
  SmRun() {
    for (std::size_t i = 0; i < z.size(); ++i) z[i] = static_cast<float>((i * 7) % 11) * 0.25f;
  }
  void forward() {
    router::softmax_topk_forward(MatView<const float>(z.data(), t, e),
                                 MatView<std::int32_t>(idx.data(), t, k),
                                 MatView<float>(w.data(), t, k), true);
  }
  void untouched() const {
    for (auto v : idx) REQUIRE(v == 99);
    for (auto v : w) REQUIRE(v == 9.0f);
  }
};

// A forward's weights w with the first two slots' values exchanged: every
// range and sum as before, so weights_range passes and only the full-level
// within_bound clause (each weight against its own slot's reference) can
// see it. post(weights) runs the forward's postconditions; bound is row 0's
// from the router's bounds::*_weights_row, which the exchange must exceed
// for both slots (else there is nothing to catch).
template <class Post>
void expect_exchanged_weights_caught(const std::vector<float>& w, const std::vector<double>& bound,
                                     Post post, const char* clause) {
  auto wb = w;
  std::swap(wb[0], wb[1]);
  REQUIRE(std::fabs(double(wb[0]) - wb[1]) > std::max(bound[0], bound[1]));
  post(wb);  // below full: not checked
  ContractScope full{Level::full, Semantic::enforce};
  test::expect_violation([&] { post(wb); }, clause);
  post(w);
}

}  // namespace

TEST_CASE("router.softmax_topk: precondition clauses", "[router][softmax_topk][shape]") {
  {
    SmRun r;
    r.k = 7;  // K > E
    r.idx.resize(21, 99);
    r.w.resize(21, 9.0f);
    test::expect_violation([&] { r.forward(); }, "router.softmax_topk.shape");
    r.untouched();
  }
  {
    SmRun r;
    r.z[4] = INFINITY;
    auto v = test::expect_violation([&] { r.forward(); }, "router.softmax_topk.scores_finite");
    CHECK(v.location == "z[0, 4]");
    r.untouched();
  }
  {
    SmRun r;
    test::expect_violation(
        [&] {
          router::softmax_topk_forward(MatView<const float>(r.z.data(), r.t, r.e),
                                       MatView<std::int32_t>(r.idx.data(), r.t, r.k),
                                       MatView<float>(r.z.data() + 2, r.t, r.k), true);
        },
        "router.softmax_topk.no_alias");
  }
}

TEST_CASE("router.softmax_topk.forward: logits within an fp32 softmax's rounding are near ties",
          "[router][softmax_topk][order]") {
  // One row of e experts, K slots given as `idx`: the clauses' verdict
  // (weights of the exact renormalised softmax over the selection).
  auto judged = [](std::vector<float> z, std::vector<std::int32_t> idx,
                   std::vector<contracts::judge::Tie>* ties) {
    const std::size_t e = z.size(), k = idx.size();
    std::vector<float> w(k);
    double sum = 0;
    for (std::size_t j = 0; j < k; ++j) sum += std::exp(double(z[idx[j]]));
    for (std::size_t j = 0; j < k; ++j)
      w[j] = static_cast<float>(std::exp(double(z[idx[j]])) / sum);
    const contracts::judge::Scope judging{{.ties_any_order = false, .ties = ties}};
    detail::Checker c{"router.softmax_topk.forward"};
    contracts::softmax_topk_post(c, MatView<const float>(z.data(), 1, e),
                                 MatView<const std::int32_t>(idx.data(), 1, k),
                                 MatView<const float>(w.data(), 1, k), true);
  };
  const ContractScope full{Level::full, Semantic::enforce};
  const float a = 2.5f,
              b = std::nextafter(2.5f, 0.0f);  // adjacent: a softmax may tie or invert them
  std::vector<contracts::judge::Tie> ties;
  // The lower of the two placed first, or selected instead of the higher
  // (an implementation that takes the top K of its fp32 probabilities).
  CHECK_NOTHROW(judged({a, b, -3.0f, -4.0f}, {1, 0}, &ties));
  CHECK_NOTHROW(judged({a, b, 3.0f, -4.0f}, {2, 1}, &ties));
  REQUIRE(ties.size() == 2);
  CHECK((ties[0].near && ties[0].a == 1 && ties[0].b == 0));
  // Apart by more than that rounding: the order and the selection are forced.
  test::expect_violation(
      [&] {
        judged({a, 2.4f, -3.0f, -4.0f}, {1, 0}, nullptr);
      },
      "router.softmax_topk.sorted");
  test::expect_violation(
      [&] {
        judged({a, 2.4f, 3.0f, -4.0f}, {2, 1}, nullptr);
      },
      "router.softmax_topk.topk_property");
  // Equal logits: equal probabilities in any implementation; index order.
  test::expect_violation(
      [&] {
        judged({a, a, -3.0f, -4.0f}, {1, 0}, nullptr);
      },
      "router.softmax_topk.sorted");
  // Far below the row's maximum both probabilities may underflow in fp32:
  // any choice among them.
  CHECK_NOTHROW(judged({0.0f, -200.0f, -150.0f, -300.0f}, {0, 1}, nullptr));
  test::expect_violation(
      [&] {
        judged({0.0f, -20.0f, -15.0f, -300.0f}, {0, 1}, nullptr);
      },
      "router.softmax_topk.topk_property");
}

TEST_CASE("router.softmax_topk: postcondition clauses catch corrupted selections and weights",
          "[router][softmax_topk][index]") {
  SmRun r;
  r.forward();
  MatView<const float> z(r.z.data(), r.t, r.e);
  auto post = [&](std::vector<std::int32_t> idx, std::vector<float> w) {
    detail::Checker c{"router.softmax_topk.forward"};
    contracts::softmax_topk_post(c, z, MatView<const std::int32_t>(idx.data(), r.t, r.k),
                                 MatView<const float>(w.data(), r.t, r.k), true);
  };
  auto bad = r.idx;
  bad[1] = 6;
  test::expect_violation([&] { post(bad, r.w); }, "router.softmax_topk.idx_valid");
  bad = r.idx;
  bad[1] = bad[0];
  test::expect_violation([&] { post(bad, r.w); }, "router.softmax_topk.idx_unique");
  bad = r.idx;
  std::swap(bad[0], bad[1]);
  test::expect_violation([&] { post(bad, r.w); }, "router.softmax_topk.sorted");
  bad = r.idx;  // a valid, sorted, but not top-k selection: the worst expert in slot 1
  {
    std::int32_t worst = 0;
    for (std::int32_t i = 0; i < 6; ++i)
      if (router::detail::outranks(r.z[worst], worst, r.z[i], i)) worst = i;
    bad[1] = worst;
  }
  test::expect_violation([&] { post(bad, r.w); }, "router.softmax_topk.topk_property");
  auto wb = r.w;
  wb[0] += 0.01f;  // sum != 1
  test::expect_violation([&] { post(r.idx, wb); }, "router.softmax_topk.weights_range");
  expect_exchanged_weights_caught(
      r.w, bounds::softmax_topk_weights_row(r.z.data(), r.e, r.idx.data(), r.k, true).bound,
      [&](const std::vector<float>& ww) { post(r.idx, ww); }, "router.softmax_topk.within_bound");
}

TEST_CASE("router.softmax_topk.backward: clauses", "[router][softmax_topk][index]") {
  SmRun r;
  r.forward();
  std::vector<float> g(r.t * r.k, 1.0f), dz(r.t * r.e, 5.0f);
  auto run = [&](std::vector<std::int32_t> idx, std::vector<float> gg, MatView<float> out) {
    router::softmax_topk_backward(MatView<const float>(r.z.data(), r.t, r.e),
                                  MatView<const std::int32_t>(idx.data(), r.t, r.k),
                                  MatView<const float>(gg.data(), r.t, r.k), out, true);
  };
  MatView<float> dzv(dz.data(), r.t, r.e);
  test::expect_violation([&] { run(r.idx, g, MatView<float>(dz.data(), r.t, r.e - 1)); },
                         "router.softmax_topk_backward.shape");
  auto bad = r.idx;
  bad[0] = -1;  // -1 before a valid slot
  test::expect_violation([&] { run(bad, g, dzv); }, "router.softmax_topk_backward.idx_valid");
  auto gb = g;
  gb[3] = NAN;
  test::expect_violation([&] { run(r.idx, gb, dzv); }, "router.softmax_topk_backward.g_finite");
  // |g| > 2^126: g - sum_S w g could leave the fp32 range (router_fuzzer finding 7).
  gb[3] = -0x1.000002p126f;
  test::expect_violation([&] { run(r.idx, gb, dzv); }, "router.softmax_topk_backward.g_finite");
  {
    gb[3] = -0x1p126f;  // the largest accepted, every output finite
    std::vector<float> ok(r.t * r.e, 5.0f);
    ContractScope full{Level::full, Semantic::enforce};
    run(r.idx, gb, MatView<float>(ok.data(), r.t, r.e));
    for (float v : ok) REQUIRE(std::isfinite(v));
  }
  for (float v : dz) REQUIRE(v == 5.0f);
  test::expect_violation([&] { run(r.idx, g, MatView<float>(g.data(), 1, r.e)); },
                         "router.softmax_topk_backward.shape");
  test::expect_violation(
      [&] {
        router::softmax_topk_backward(MatView<const float>(r.z.data(), r.t, r.e),
                                      MatView<const std::int32_t>(r.idx.data(), r.t, r.k),
                                      MatView<const float>(g.data(), r.t, r.k),
                                      MatView<float>(r.z.data(), r.t, r.e), true);
      },
      "router.softmax_topk_backward.no_alias");
  // Post: a gradient on an expert no slot selected.
  run(r.idx, g, dzv);
  std::int32_t unselected = 0;
  while (unselected == r.idx[0] || unselected == r.idx[1]) ++unselected;
  dz[static_cast<std::size_t>(unselected)] = 1e-3f;
  test::expect_violation(
      [&] {
        detail::Checker c{"router.softmax_topk.backward"};
        contracts::softmax_topk_backward_post(c, MatView<const float>(r.z.data(), r.t, r.e),
                                              MatView<const std::int32_t>(r.idx.data(), r.t, r.k),
                                              MatView<const float>(g.data(), r.t, r.k),
                                              MatView<const float>(dz.data(), r.t, r.e), true);
      },
      "router.softmax_topk_backward.unselected_grad");
  // Post (full): a selected expert's gradient off by 1% of its value.
  auto g2 = g;
  g2[0] = 3.0f;  // unequal g: dz = w (g - D) is not 0
  run(r.idx, g2, dzv);
  const auto sel = static_cast<std::size_t>(r.idx[0]);
  REQUIRE(dz[sel] != 0.0f);
  dz[sel] *= 1.01f;
  auto check_dz = [&] {
    detail::Checker c{"router.softmax_topk.backward"};
    contracts::softmax_topk_backward_post(c, MatView<const float>(r.z.data(), r.t, r.e),
                                          MatView<const std::int32_t>(r.idx.data(), r.t, r.k),
                                          MatView<const float>(g2.data(), r.t, r.k),
                                          MatView<const float>(dz.data(), r.t, r.e), true);
  };
  check_dz();  // below full: not checked
  ContractScope full{Level::full, Semantic::enforce};
  test::expect_violation(check_dz, "router.softmax_topk_backward.within_bound");
}

TEST_CASE("router.sigmoid_topk: clauses", "[router][sigmoid_topk][shape]") {
  std::mt19937_64 rng(81);
  const std::size_t t = 4, e = 8, k = 2;
  auto z = normal(rng, t * e, 1);
  std::vector<float> bias(e, 0.0f), w(t * k, 9.0f), g(t * k, 1.0f), dz(t * e, 5.0f);
  std::vector<std::int32_t> idx(t * k, 99);
  router::SigmoidTopkParams p{4, 2, 1.0f};
  auto fwd = [&](View<const float> b, const router::SigmoidTopkParams& pp) {
    router::sigmoid_topk_forward(MatView<const float>(z.data(), t, e), b, pp,
                                 MatView<std::int32_t>(idx.data(), t, k),
                                 MatView<float>(w.data(), t, k));
  };
  test::expect_violation(
      [&] {
        fwd(View<const float>{bias.data(), e - 1}, p);
      },
      "router.sigmoid_topk.shape");  // bias length
  test::expect_violation(
      [&] {
        fwd(View<const float>{bias.data(), e}, {3, 1, 1.0f});
      },
      "router.sigmoid_topk.shape");  // G does not divide E
  test::expect_violation(
      [&] {
        fwd(View<const float>{bias.data(), e}, {4, 5, 1.0f});
      },
      "router.sigmoid_topk.shape");  // topk_group > G
  bias[2] = NAN;
  test::expect_violation(
      [&] {
        fwd(View<const float>{bias.data(), e}, p);
      },
      "router.sigmoid_topk.scores_finite");
  bias[2] = 0;
  test::expect_violation(
      [&] {
        fwd(View<const float>{reinterpret_cast<const float*>(idx.data()), e}, p);
      },
      "router.sigmoid_topk.no_alias");
  for (auto v : idx) REQUIRE(v == 99);
  for (auto v : w) REQUIRE(v == 9.0f);
  fwd(View<const float>{bias.data(), e}, p);
  auto post = [&](std::vector<std::int32_t> ii, std::vector<float> ww) {
    detail::Checker c{"router.sigmoid_topk.forward"};
    contracts::sigmoid_topk_post(
        c, MatView<const float>(z.data(), t, e), View<const float>{bias.data(), e}, p,
        MatView<const std::int32_t>(ii.data(), t, k), MatView<const float>(ww.data(), t, k));
  };
  auto bad = idx;
  bad[0] = -2;
  test::expect_violation([&] { post(bad, w); }, "router.sigmoid_topk.idx_valid");
  bad = idx;
  bad[1] = bad[0];
  test::expect_violation([&] { post(bad, w); }, "router.sigmoid_topk.idx_unique");
  bad = idx;
  std::swap(bad[0], bad[1]);
  test::expect_violation([&] { post(bad, w); }, "router.sigmoid_topk.sorted");
  bad = idx;  // an expert from a group that was not kept, ranked last
  {
    std::vector<float> sel(e);
    for (std::size_t i = 0; i < e; ++i) sel[i] = router::detail::sigmoid(z[i]);
    std::int32_t pick = -1;
    for (std::int32_t i = 0; i < static_cast<std::int32_t>(e); ++i)
      if (i / 2 != idx[0] / 2 && i / 2 != idx[1] / 2 &&
          router::detail::outranks(sel[idx[0]], idx[0], sel[i], i) &&
          (pick < 0 || router::detail::outranks(sel[i], i, sel[pick], pick)))
        pick = i;
    if (pick >= 0 && router::detail::outranks(sel[idx[0]], idx[0], sel[pick], pick)) bad[1] = pick;
  }
  REQUIRE(bad[1] != idx[1]);  // the data has such an expert
  test::expect_violation([&] { post(bad, w); }, "router.sigmoid_topk.topk_property");
  auto wb = w;
  wb[0] = 1.5f;  // above c
  test::expect_violation([&] { post(idx, wb); }, "router.sigmoid_topk.weights_range");
  expect_exchanged_weights_caught(
      w, bounds::sigmoid_topk_weights_row(z.data(), idx.data(), k, p.scaling).bound,
      [&](const std::vector<float>& ww) { post(idx, ww); }, "router.sigmoid_topk.within_bound");
  // Backward.
  auto bwd = [&](std::vector<std::int32_t> ii, std::vector<float> gg, MatView<float> out) {
    router::sigmoid_topk_backward(MatView<const float>(z.data(), t, e),
                                  MatView<const std::int32_t>(ii.data(), t, k),
                                  MatView<const float>(gg.data(), t, k), p, out);
  };
  test::expect_violation([&] { bwd(idx, g, MatView<float>(dz.data(), t - 1, e)); },
                         "router.sigmoid_topk_backward.shape");
  bad = idx;
  bad[2] = 8;
  test::expect_violation([&] { bwd(bad, g, MatView<float>(dz.data(), t, e)); },
                         "router.sigmoid_topk_backward.idx_valid");
  auto gb = g;
  gb[0] = INFINITY;
  test::expect_violation([&] { bwd(idx, gb, MatView<float>(dz.data(), t, e)); },
                         "router.sigmoid_topk_backward.g_finite");
  gb[0] = 0x1.000002p126f;
  test::expect_violation([&] { bwd(idx, gb, MatView<float>(dz.data(), t, e)); },
                         "router.sigmoid_topk_backward.g_finite");
  test::expect_violation([&] { bwd(idx, g, MatView<float>(z.data(), t, e)); },
                         "router.sigmoid_topk_backward.no_alias");
  for (auto v : dz) REQUIRE(v == 5.0f);
  bwd(idx, g, MatView<float>(dz.data(), t, e));
  std::int32_t off = 0;
  while (off == idx[0] || off == idx[1]) ++off;
  dz[static_cast<std::size_t>(off)] = 1e-7f;
  auto g2 = g;
  auto sg_post = [&] {
    detail::Checker c{"router.sigmoid_topk.backward"};
    contracts::sigmoid_topk_backward_post(
        c, MatView<const float>(z.data(), t, e), MatView<const std::int32_t>(idx.data(), t, k),
        MatView<const float>(g2.data(), t, k), p, MatView<const float>(dz.data(), t, e));
  };
  test::expect_violation(sg_post, "router.sigmoid_topk_backward.unselected_grad");
  // Post (full): a selected expert's gradient off by 1% of its value.
  g2[0] = 3.0f;  // unequal g: dz is not 0
  bwd(idx, g2, MatView<float>(dz.data(), t, e));
  REQUIRE(dz[static_cast<std::size_t>(idx[0])] != 0.0f);
  dz[static_cast<std::size_t>(idx[0])] *= 1.01f;
  {
    ContractScope full{Level::full, Semantic::enforce};
    test::expect_violation(sg_post, "router.sigmoid_topk_backward.within_bound");
  }
  // Valid input whose exact dz is beyond fp32: c = 3e38, g = +-2^126.
  gb = g;
  gb[0] = 0x1p126f, gb[1] = -0x1p126f;
  test::expect_violation(
      [&] {
        router::sigmoid_topk_backward(
            MatView<const float>(z.data(), t, e), MatView<const std::int32_t>(idx.data(), t, k),
            MatView<const float>(gb.data(), t, k), {4, 2, 3e38f}, MatView<float>(dz.data(), t, e));
      },
      "router.sigmoid_topk_backward.dz_finite");
}

TEST_CASE("router.product_key: clauses", "[router][product_key][index]") {
  std::mt19937_64 rng(82);
  const std::size_t t = 3, n = 4, k = 3;
  auto sx = normal(rng, t * n, 1), sy = normal(rng, t * n, 1);
  std::vector<float> w(t * k, 9.0f), g(t * k, 1.0f), dsx(t * n, 5.0f), dsy(t * n, 5.0f);
  std::vector<std::int32_t> idx(t * k, 99);
  auto fwd = [&](std::size_t kk, MatView<float> out) {
    router::product_key_forward(MatView<const float>(sx.data(), t, n),
                                MatView<const float>(sy.data(), t, n), KeyWeights::softmax,
                                MatView<std::int32_t>(idx.data(), t, kk), out);
  };
  test::expect_violation([&] { fwd(17, MatView<float>(w.data(), t, 17)); },
                         "router.product_key.shape");  // K > n^2
  sx[5] = NAN;
  test::expect_violation([&] { fwd(k, MatView<float>(w.data(), t, k)); },
                         "router.product_key.scores_finite");
  sx[5] = 0.5f;
  test::expect_violation([&] { fwd(k, MatView<float>(sy.data(), t, k)); },
                         "router.product_key.no_alias");
  for (auto v : idx) REQUIRE(v == 99);
  fwd(k, MatView<float>(w.data(), t, k));
  auto post = [&](std::vector<std::int32_t> ii, std::vector<float> ww) {
    detail::Checker c{"router.product_key.forward"};
    contracts::product_key_post(c, MatView<const float>(sx.data(), t, n),
                                MatView<const float>(sy.data(), t, n), KeyWeights::softmax,
                                MatView<const std::int32_t>(ii.data(), t, k),
                                MatView<const float>(ww.data(), t, k));
  };
  auto bad = idx;
  bad[2] = -1;
  test::expect_violation([&] { post(bad, w); }, "router.product_key.idx_valid");
  bad = idx;
  bad[2] = bad[0];
  test::expect_violation([&] { post(bad, w); }, "router.product_key.idx_unique");
  bad = idx;
  std::swap(bad[0], bad[2]);
  test::expect_violation([&] { post(bad, w); }, "router.product_key.sorted");
  bad = idx;  // a valid, sorted, but not top-k selection: row 0's worst expert in its last slot
  {
    std::int32_t worst = 0;
    for (std::int32_t i = 0; i < std::int32_t(n * n); ++i)
      if (double(sx[i / n]) + sy[i % n] < double(sx[worst / n]) + sy[worst % n]) worst = i;
    bad[k - 1] = worst;
  }
  {
    ContractScope audit{Level::audit, Semantic::enforce};
    test::expect_violation([&] { post(bad, w); }, "router.product_key.topk_property");
  }
  auto wb = w;
  wb[1] = -0.1f;
  test::expect_violation([&] { post(idx, wb); }, "router.product_key.weights_range");
  expect_exchanged_weights_caught(
      w,
      bounds::product_key_weights_row(sx.data(), sy.data(), n, idx.data(), k, KeyWeights::softmax)
          .bound,
      [&](const std::vector<float>& ww) { post(idx, ww); }, "router.product_key.within_bound");
  auto bwd = [&](std::vector<std::int32_t> ii, std::vector<float> gg, MatView<float> ox,
                 MatView<float> oy) {
    router::product_key_backward(MatView<const float>(sx.data(), t, n),
                                 MatView<const float>(sy.data(), t, n),
                                 MatView<const std::int32_t>(ii.data(), t, k),
                                 MatView<const float>(gg.data(), t, k), KeyWeights::raw, ox, oy);
  };
  MatView<float> ox(dsx.data(), t, n), oy(dsy.data(), t, n);
  test::expect_violation([&] { bwd(idx, g, MatView<float>(dsx.data(), t, n - 1), oy); },
                         "router.product_key_backward.shape");
  bad = idx;
  bad[4] = 16;
  test::expect_violation([&] { bwd(bad, g, ox, oy); }, "router.product_key_backward.idx_in_range");
  auto gb = g;
  gb[8] = NAN;
  test::expect_violation([&] { bwd(idx, gb, ox, oy); }, "router.product_key_backward.g_finite");
  gb[8] = -0x1.000002p126f;
  test::expect_violation([&] { bwd(idx, gb, ox, oy); }, "router.product_key_backward.g_finite");
  test::expect_violation([&] { bwd(idx, g, ox, ox); }, "router.product_key_backward.no_alias");
  for (auto v : dsx) REQUIRE(v == 5.0f);
  // Post: the field bug. With idx = -1 decoded as ix = 0, iy = -1 the
  // gradient lands on key 0 of sx (and a neighbour of sy): never selected.
  bad = idx;
  bad[k - 1] = -1;
  bwd(bad, g, ox, oy);
  std::size_t unused = 0;
  while (unused < n && (bad[0] / 4 == static_cast<std::int32_t>(unused) ||
                        bad[1] / 4 == static_cast<std::int32_t>(unused)))
    ++unused;
  REQUIRE(unused < n);
  REQUIRE(dsx[unused] == 0.0f);
  dsx[unused] += g[k - 1];  // what the truncating decode would have added
  auto pk_post = [&](const std::vector<std::int32_t>& ii) {
    detail::Checker c{"router.product_key.backward"};
    contracts::product_key_backward_post(
        c, MatView<const float>(sx.data(), t, n), MatView<const float>(sy.data(), t, n),
        MatView<const std::int32_t>(ii.data(), t, k), MatView<const float>(g.data(), t, k),
        KeyWeights::raw, MatView<const float>(dsx.data(), t, n),
        MatView<const float>(dsy.data(), t, n));
  };
  test::expect_violation([&] { pk_post(bad); }, "router.product_key_backward.unused_zero");
  // Post (full): a selected key's gradient off by 1% of its value.
  bwd(idx, g, ox, oy);
  const auto key = static_cast<std::size_t>(idx[0]) / n;
  REQUIRE(dsx[key] != 0.0f);
  dsx[key] *= 1.01f;
  {
    ContractScope full{Level::full, Semantic::enforce};
    test::expect_violation([&] { pk_post(idx); }, "router.product_key_backward.within_bound");
  }
  // Valid input whose exact sum is beyond fp32: four slots on key 0 of sx
  // (experts 0..3, n = 4), each g = 2^126, raw weights: dsx[0] = 2^128.
  const std::vector<std::int32_t> same_x = {0, 1, 2, 3};
  const std::vector<float> big(4, 0x1p126f);
  test::expect_violation(
      [&] {
        router::product_key_backward(
            MatView<const float>(sx.data(), 1, n), MatView<const float>(sy.data(), 1, n),
            MatView<const std::int32_t>(same_x.data(), 1, 4),
            MatView<const float>(big.data(), 1, 4), KeyWeights::raw,
            MatView<float>(dsx.data(), 1, n), MatView<float>(dsy.data(), 1, n));
      },
      "router.product_key_backward.grad_finite");
}

TEST_CASE("router: bf16 scores give the results of their exact fp32 values", "[router]") {
  std::mt19937_64 rng(83);
  const std::size_t t = 20, e = 16, k = 3, n = 4;
  auto zf = normal(rng, t * e, 2);
  std::vector<bf16> zb(zf.size());
  for (std::size_t i = 0; i < zf.size(); ++i) zf[i] = (zb[i] = bf16(zf[i])).to_float();
  std::vector<std::int32_t> i1(t * k), i2(t * k);
  std::vector<float> w1(t * k), w2(t * k);
  router::softmax_topk_forward(MatView<const float>(zf.data(), t, e),
                               MatView<std::int32_t>(i1.data(), t, k),
                               MatView<float>(w1.data(), t, k), true);
  router::softmax_topk_forward(MatView<const bf16>(zb.data(), t, e),
                               MatView<std::int32_t>(i2.data(), t, k),
                               MatView<float>(w2.data(), t, k), true);
  CHECK(i1 == i2);
  CHECK(w1 == w2);
  const std::vector<float> bias(e, 0.0f);
  router::sigmoid_topk_forward(
      MatView<const float>(zf.data(), t, e), View<const float>{bias.data(), e}, {4, 2, 1.0f},
      MatView<std::int32_t>(i1.data(), t, k), MatView<float>(w1.data(), t, k));
  router::sigmoid_topk_forward(
      MatView<const bf16>(zb.data(), t, e), View<const float>{bias.data(), e}, {4, 2, 1.0f},
      MatView<std::int32_t>(i2.data(), t, k), MatView<float>(w2.data(), t, k));
  CHECK(i1 == i2);
  CHECK(w1 == w2);
  router::product_key_forward(
      MatView<const float>(zf.data(), t, n), MatView<const float>(zf.data() + t * n, t, n),
      KeyWeights::exp, MatView<std::int32_t>(i1.data(), t, k), MatView<float>(w1.data(), t, k));
  router::product_key_forward(
      MatView<const bf16>(zb.data(), t, n), MatView<const bf16>(zb.data() + t * n, t, n),
      KeyWeights::exp, MatView<std::int32_t>(i2.data(), t, k), MatView<float>(w2.data(), t, k));
  CHECK(i1 == i2);
  CHECK(w1 == w2);
}

TEST_CASE("router.sigmoid_topk.forward: the order is judged on exact scores within fp32 rounding",
          "[router][sigmoid_topk][order]") {
  // One row of four experts, one group, K = 2: experts 0 and 1 lead, the
  // others far behind. Returns the op's selection and the clauses' verdict
  // on it with slots 0 and 1 swapped (weights with them).
  const std::size_t e = 4, k = 2;
  const router::SigmoidTopkParams p{1, 1, 1.0f};
  const std::vector<float> bias(e, 0.0f);
  auto swapped_passes = [&](float z0, float z1, std::vector<contracts::judge::Tie>* ties) {
    const std::vector<float> z{z0, z1, -3.0f, -4.0f};
    std::vector<std::int32_t> idx(k);
    std::vector<float> w(k);
    router::sigmoid_topk_forward(MatView<const float>(z.data(), 1, e), {bias.data(), e}, p,
                                 MatView<std::int32_t>(idx.data(), 1, k),
                                 MatView<float>(w.data(), 1, k));
    std::swap(idx[0], idx[1]), std::swap(w[0], w[1]);
    const contracts::judge::Scope judging{{.ties_any_order = false, .ties = ties}};
    detail::Checker c{"router.sigmoid_topk.forward"};
    contracts::sigmoid_topk_post(c, MatView<const float>(z.data(), 1, e), {bias.data(), e}, p,
                                 MatView<const std::int32_t>(idx.data(), 1, k),
                                 MatView<const float>(w.data(), 1, k));
  };
  const ContractScope full{Level::full, Semantic::enforce};
  // sigma of two adjacent floats: exact scores closer than the bounds on
  // their fp32 values (bounds::sigmoid_selection): either order is an fp32
  // implementation's.
  std::vector<contracts::judge::Tie> ties;
  CHECK_NOTHROW(swapped_passes(0.5f, std::nextafter(0.5f, 1.0f), &ties));
  CHECK_NOTHROW(swapped_passes(std::nextafter(0.5f, 1.0f), 0.5f, &ties));
  REQUIRE(ties.size() == 1);  // the choice against the exact order (the second), named
  CHECK(ties[0].near);
  CHECK(ties[0].a == 1);  // placed before expert 0, whose exact score is higher
  CHECK(ties[0].b == 0);
  // Equal inputs: equal fp32 scores in any implementation; index order.
  test::expect_violation([&] { swapped_passes(0.5f, 0.5f, nullptr); },
                         "router.sigmoid_topk.sorted");
  // Scores far apart.
  test::expect_violation([&] { swapped_passes(0.5f, 0.75f, nullptr); },
                         "router.sigmoid_topk.sorted");
}

TEST_CASE("router.sigmoid_topk.forward: groups within fp32 rounding of each other may be kept",
          "[router][sigmoid_topk][order]") {
  // Three groups of one expert, two kept, K = 2: expert 0 leads, experts 1
  // and 2 compete for the second kept group. Returns whether the clauses
  // pass the selection {0, second}.
  const std::size_t e = 3, k = 2;
  const router::SigmoidTopkParams p{3, 2, 1.0f};
  const std::vector<float> bias(e, 0.0f);
  auto selection_passes = [&](float z1, float z2, std::int32_t second) {
    const std::vector<float> z{2.0f, z1, z2};
    const std::vector<std::int32_t> idx{0, second};
    std::vector<float> w(k);
    const auto [wr, b] = bounds::sigmoid_topk_weights_row(z.data(), idx.data(), k, p.scaling);
    for (std::size_t j = 0; j < k; ++j) w[j] = static_cast<float>(wr[j]);
    const contracts::judge::Scope judging{{.ties_any_order = false}};
    detail::Checker c{"router.sigmoid_topk.forward"};
    contracts::sigmoid_topk_post(c, MatView<const float>(z.data(), 1, e), {bias.data(), e}, p,
                                 MatView<const std::int32_t>(idx.data(), 1, k),
                                 MatView<const float>(w.data(), 1, k));
  };
  const ContractScope full{Level::full, Semantic::enforce};
  const float above = std::nextafter(0.5f, 1.0f);
  // Group 2's exact score is higher, by less than the bounds on both groups'
  // fp32 scores: either group is an fp32 implementation's (found by
  // router_fuzzer: group 1 had been counted as surely outranked).
  CHECK_NOTHROW(selection_passes(0.5f, above, 2));
  CHECK_NOTHROW(selection_passes(0.5f, above, 1));
  // Identical groups: equal fp32 scores in any implementation; index order.
  CHECK_NOTHROW(selection_passes(0.5f, 0.5f, 1));
  test::expect_violation([&] { selection_passes(0.5f, 0.5f, 2); },
                         "router.sigmoid_topk.topk_property");
  // Group 1 clearly behind.
  test::expect_violation([&] { selection_passes(0.0f, 0.5f, 1); },
                         "router.sigmoid_topk.topk_property");
}

namespace {

// A renormalised softmax top-k's backward as autograd computes it through a
// dense softmax, in fp32 (transformers' Qwen2/3-MoE and Mixtral routers):
// p = softmax(z) over all E, w = p_S / P, P = sum_S p; dp_S = g / P - <g, p_S>
// / P^2, 0 elsewhere; dz = p (dp - <p, dp>). drop_renorm: dp_S = g (the
// renormalisation's own gradient left out, a real bug).
std::vector<float> dense_softmax_backward(const std::vector<float>& z, std::size_t T, std::size_t E,
                                          const std::vector<std::int32_t>& idx,
                                          const std::vector<float>& g, std::size_t K,
                                          bool drop_renorm = false) {
  std::vector<float> dz(T * E), p(E), dp(E);
  for (std::size_t t = 0; t < T; ++t) {
    const float* zt = &z[t * E];
    const float m = *std::max_element(zt, zt + E);
    float sum = 0;
    for (std::size_t i = 0; i < E; ++i) sum += p[i] = std::exp(zt[i] - m);
    for (std::size_t i = 0; i < E; ++i) p[i] /= sum;
    float P = 0, gp = 0;
    for (std::size_t j = 0; j < K; ++j) P += p[idx[t * K + j]];
    for (std::size_t j = 0; j < K; ++j) gp += g[t * K + j] * p[idx[t * K + j]];
    std::fill(dp.begin(), dp.end(), 0.0f);
    for (std::size_t j = 0; j < K; ++j)
      dp[idx[t * K + j]] = drop_renorm ? g[t * K + j] : g[t * K + j] / P - gp / (P * P);
    float c = 0;
    for (std::size_t i = 0; i < E; ++i) c += p[i] * dp[i];
    for (std::size_t i = 0; i < E; ++i) dz[t * E + i] = p[i] * (dp[i] - c);
  }
  return dz;
}

}  // namespace

TEST_CASE("router.softmax_topk.backward: a dense softmax's gradient passes as backward=dense",
          "[router][softmax_topk][judge]") {
  std::mt19937_64 rng(17);
  for (const auto& shape : {std::tuple{8, 2, 1.0f}, std::tuple{64, 8, 3.0f},
                            std::tuple{256, 8, 2.0f}, std::tuple{64, 1, 8.0f}}) {
    const std::size_t E = std::get<0>(shape), K = std::get<1>(shape);  // lambdas capture them
    const float spread = std::get<2>(shape);
    INFO("E=" << E << " K=" << K);
    const std::size_t T = 24;
    std::normal_distribution<float> nd(0, 1);
    std::vector<float> z(T * E), g(T * K);
    for (auto& v : z) v = spread * nd(rng);
    for (auto& v : g) v = nd(rng);
    std::vector<std::int32_t> idx(T * K);
    std::vector<float> w(T * K);
    router::softmax_topk_forward(MatView<const float>(z.data(), T, E),
                                 MatView<std::int32_t>(idx.data(), T, K),
                                 MatView<float>(w.data(), T, K), true);
    const contracts::judge::Tensors in{{"z", {.f = z, .rows = T, .cols = E}},
                                       {"idx", {.i = idx, .rows = T, .cols = K}},
                                       {"g", {.f = g, .rows = T, .cols = K}}};
    auto verdict = [&](const std::vector<float>& dz, const char* backward) {
      return contracts::judge::judge_op("router.softmax_topk.backward", in,
                                        {{"dz", {.f = dz, .rows = T, .cols = E}}},
                                        {{"renormalize", "true"}, {"backward", backward}});
    };
    auto failed = [](const contracts::judge::Verdict& v, std::string_view id) {
      for (const auto& c : v.clauses)
        if (c.info.id == id) return !c.passed;
      return false;
    };
    const auto dz = dense_softmax_backward(z, T, E, idx, g, K);
    const auto ok = verdict(dz, "dense");
    CHECK(ok.passed());
    bool noise = false;  // the masked clause fails wherever autograd left noise
    for (std::size_t i = 0; i < dz.size(); ++i) noise = noise || (dz[i] != 0.0f && E > K);
    if (noise) CHECK(failed(verdict(dz, "masked"), "router.softmax_topk_backward.unselected_grad"));
    // The renormalisation's gradient left out: the unselected experts get
    // -p_i sum_S p g, far beyond the noise.
    CHECK(failed(verdict(dense_softmax_backward(z, T, E, idx, g, K, true), "dense"),
                 "router.softmax_topk_backward.unselected_grad"));
  }
  CHECK_THROWS_WITH(
      contracts::judge::judge_op("router.softmax_topk.backward", {}, {}, {{"backward", "sparse"}}),
      Catch::Contains("backward=sparse: expected masked or dense"));
}
