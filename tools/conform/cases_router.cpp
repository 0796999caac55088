// Conformance cases for the routers: selection against brute force under
// the total order, weights and gradients against the binary64 reference
// within the bounds of proofs/router.md, determinism.
#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>

#include "contracts/bounds/router.hpp"
#include "contracts/reference/router.hpp"
#include "moecert/router.hpp"
#include "ops/router/select.hpp"
#include "tools/conform/case.hpp"

namespace moecert::tools {
namespace {

struct Shape {
  const char* cls;
  std::size_t t, e, k;
  Suite suite;
};

// normal: N(0, 2); ties: five values, so exact ties are common; extreme:
// the range the preconditions allow, far outside exp's (differences beyond
// the underflow shift, magnitudes up to 1e30), no lower than `lowest`.
enum class Data { normal, ties, extreme };
constexpr const char* kDataNames[] = {"normal", "ties", "extreme"};

std::vector<float> scores(std::mt19937_64& rng, std::size_t n, Data d, float lowest = -INFINITY) {
  std::normal_distribution<float> nd(0, 2);
  std::uniform_real_distribution<float> decade(0, 30);
  const float few[] = {-1.0f, -0.25f, 0.0f, 0.5f, 1.0f};
  std::vector<float> v(n);
  for (auto& x : v) {
    switch (d) {
      case Data::normal:
        x = nd(rng);
        break;
      case Data::ties:
        x = few[rng() % 5];
        break;
      case Data::extreme: {
        const float big = std::pow(10.0f, decade(rng));  // 1 .. 1e30
        const std::uint64_t kind = rng() % 4;
        x = kind == 0 ? nd(rng) : kind == 1 ? big : kind == 2 ? -big : nd(rng) * 100;
        x = std::max(x, lowest);
        break;
      }
    }
  }
  return v;
}

// Tracks the worst |err| / bound over a case. The references run in
// binary64: `slack` |want| (a few E 2^-52) covers their own rounding.
struct Tally {
  CaseResult r;
  double slack = 0;
  void add(double got, double want, double bound, const std::string& where) {
    bound += slack * std::fabs(want);
    const double err = std::fabs(got - want),
                 util = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0);
    r.histogram.add(util);
    r.max_abs_err = std::max(r.max_abs_err, err);
    if (want != 0) r.max_rel_err = std::max(r.max_rel_err, err / std::fabs(want));
    if (util > r.max_bound_utilization) {
      r.max_bound_utilization = util;
      r.worst = fmt::format("{}: got {:.9g}, ref {:.17g}, bound {:.3g}", where, got, want, bound);
    }
    if (!(util <= 1) && r.verdict != Verdict::fail) {
      r.verdict = Verdict::fail;
      r.detail = "beyond bound at " + r.worst;
    }
  }
  void fail(const std::string& why) {
    if (r.verdict != Verdict::fail) r.fail(why);
  }
};

template <class F>
auto threads(int n, F f) {
  oneapi::tbb::global_control gc(oneapi::tbb::global_control::max_allowed_parallelism,
                                 static_cast<std::size_t>(n));
  return f();
}

CaseResult softmax_case(const Shape& s, Data data, bool renorm, bool backward,
                        const RunContext& ctx) {
  std::mt19937_64 rng(ctx.seed ^ (s.t * 31 + s.e));
  const auto z = scores(rng, s.t * s.e, data), g = scores(rng, s.t * s.k, Data::normal);
  MatView<const float> zv(z.data(), s.t, s.e);
  auto fwd = [&] {
    std::pair<std::vector<std::int32_t>, std::vector<float>> out{
        std::vector<std::int32_t>(s.t * s.k), std::vector<float>(s.t * s.k)};
    router::softmax_topk_forward(zv, MatView<std::int32_t>(out.first.data(), s.t, s.k),
                                 MatView<float>(out.second.data(), s.t, s.k), renorm);
    return out;
  };
  const auto [idx, w] = threads(ctx.threads, fwd);
  Tally tl;
  tl.slack = static_cast<double>(4 * s.e + 16) * 0x1p-52;
  tl.r.deterministic = threads(1, fwd).second == w;
  for (std::size_t t = 0; t < s.t; ++t) {
    const float* zr = &z[t * s.e];
    const std::int32_t* ir = &idx[t * s.k];
    std::vector<std::int32_t> all(s.e);
    for (std::size_t i = 0; i < s.e; ++i) all[i] = static_cast<std::int32_t>(i);
    std::stable_sort(all.begin(), all.end(),
                     [&](auto a, auto b) { return router::detail::outranks(zr[a], a, zr[b], b); });
    if (!std::equal(ir, ir + s.k, all.begin())) {
      tl.fail(fmt::format("row {}: selection differs from brute force under the total order", t));
      break;
    }
    if (!backward) {
      const auto [wr, b] = bounds::softmax_topk_weights_row(zr, s.e, ir, s.k, renorm);
      for (std::size_t j = 0; j < s.k; ++j)
        tl.add(w[t * s.k + j], wr[j], b[j], fmt::format("t={} j={}", t, j));
      continue;
    }
  }
  if (backward && tl.r.verdict != Verdict::fail) {
    auto idx2 = idx;
    for (std::size_t t = 0; t < s.t; t += 3)
      idx2[t * s.k + s.k - 1] = -1;  // replayed rows with an empty tail slot
    auto bwd = [&] {
      std::vector<float> dz(s.t * s.e);
      router::softmax_topk_backward(zv, MatView<const std::int32_t>(idx2.data(), s.t, s.k),
                                    MatView<const float>(g.data(), s.t, s.k),
                                    MatView<float>(dz.data(), s.t, s.e), renorm);
      return dz;
    };
    const auto dz = threads(ctx.threads, bwd);
    tl.r.deterministic = threads(1, bwd) == dz;
    for (std::size_t t = 0; t < s.t; ++t) {
      const float* zr = &z[t * s.e];
      const std::int32_t* ir = &idx2[t * s.k];
      const auto dref = ref::softmax_topk_grad<double>(zr, s.e, ir, &g[t * s.k], s.k, renorm);
      const auto b = bounds::softmax_topk_grad_row(zr, s.e, ir, &g[t * s.k], s.k, renorm);
      for (std::size_t i = 0; i < s.e; ++i)
        tl.add(dz[t * s.e + i], ref::to_double(dref[i]), b[i], fmt::format("t={} e={}", t, i));
    }
  }
  if (!tl.r.deterministic) tl.fail("results differ between 1 and N threads");
  if (tl.r.verdict == Verdict::pass)
    tl.r.detail =
        backward
            ? "every dz within proofs/router.md §4.1; unselected exactly 0 where the math says so"
            : "selection = brute force; weights within proofs/bounds.md §6";
  return tl.r;
}

CaseResult product_key_case(const Shape& s, Data data, bool backward, const RunContext& ctx) {
  const std::size_t n = static_cast<std::size_t>(std::lround(std::sqrt(double(s.e))));
  std::mt19937_64 rng(ctx.seed ^ (s.t * 37 + n));
  const auto sx = scores(rng, s.t * n, data), sy = scores(rng, s.t * n, data),
             g = scores(rng, s.t * s.k, Data::normal);
  MatView<const float> xv(sx.data(), s.t, n), yv(sy.data(), s.t, n);
  auto fwd = [&] {
    std::pair<std::vector<std::int32_t>, std::vector<float>> out{
        std::vector<std::int32_t>(s.t * s.k), std::vector<float>(s.t * s.k)};
    router::product_key_forward(xv, yv, router::KeyWeights::raw,
                                MatView<std::int32_t>(out.first.data(), s.t, s.k),
                                MatView<float>(out.second.data(), s.t, s.k));
    return out;
  };
  auto routed = threads(ctx.threads, fwd);  // named, not bound: lambdas below capture idx
  auto& idx = std::get<0>(routed);
  const auto& w = std::get<1>(routed);
  Tally tl;
  tl.slack = static_cast<double>(4 * s.k + 16) * 0x1p-52;
  tl.r.deterministic = threads(1, fwd) == std::pair(idx, w);
  const auto ni = static_cast<std::int32_t>(n);
  for (std::size_t t = 0; t < s.t && tl.r.verdict != Verdict::fail; ++t) {
    std::vector<std::int32_t> all(n * n);
    for (std::size_t e = 0; e < n * n; ++e) all[e] = static_cast<std::int32_t>(e);
    std::stable_sort(all.begin(), all.end(), [&](auto a, auto b) {
      const auto ka = router::detail::exact_sum(sx[t * n + a / ni], sy[t * n + a % ni]);
      const auto kb = router::detail::exact_sum(sx[t * n + b / ni], sy[t * n + b % ni]);
      return ka > kb || (ka == kb && a < b);
    });
    if (!std::equal(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(s.k), &idx[t * s.k]))
      tl.fail(fmt::format("row {}: two-stage selection differs from brute force", t));
    if (backward) continue;
    const auto [wr, b] = bounds::product_key_weights_row(&sx[t * n], &sy[t * n], n, &idx[t * s.k],
                                                         s.k, router::KeyWeights::raw);
    for (std::size_t j = 0; j < s.k; ++j)
      tl.add(w[t * s.k + j], wr[j], b[j], fmt::format("t={} j={}", t, j));
  }
  if (backward && tl.r.verdict != Verdict::fail) {
    for (std::size_t t = 0; t < s.t; ++t)
      for (std::size_t j = 1 + t % s.k; j < s.k; ++j)
        idx[t * s.k + j] = -1;  // -1 tails of every length
    auto bwd = [&] {
      std::vector<float> dsx(s.t * n), dsy(s.t * n);
      router::product_key_backward(xv, yv, MatView<const std::int32_t>(idx.data(), s.t, s.k),
                                   MatView<const float>(g.data(), s.t, s.k),
                                   router::KeyWeights::raw, MatView<float>(dsx.data(), s.t, n),
                                   MatView<float>(dsy.data(), s.t, n));
      dsx.insert(dsx.end(), dsy.begin(), dsy.end());
      return dsx;
    };
    const auto d = threads(ctx.threads, bwd);
    tl.r.deterministic = tl.r.deterministic && threads(1, bwd) == d;
    for (std::size_t t = 0; t < s.t; ++t) {
      std::vector<double> rx, ry;
      ref::product_key_grad<double>(&sx[t * n], &sy[t * n], n, &idx[t * s.k], &g[t * s.k], s.k,
                                    router::KeyWeights::raw, rx, ry);
      // Never-selected keys must be exactly 0 (failure mode 1): a zero bound.
      const auto b = bounds::product_key_grad_row(&sx[t * n], &sy[t * n], n, &idx[t * s.k],
                                                  &g[t * s.k], s.k, router::KeyWeights::raw);
      for (std::size_t i = 0; i < n; ++i)
        for (int half = 0; half < 2; ++half) {
          const double got = half ? d[s.t * n + t * n + i] : d[t * n + i];
          tl.add(got, half ? ry[i] : rx[i], b[half * n + i],
                 fmt::format("t={} {}[{}]", t, half ? "dsy" : "dsx", i));
        }
    }
  }
  if (!tl.r.deterministic) tl.fail("results differ between 1 and N threads");
  if (tl.r.verdict == Verdict::pass)
    tl.r.detail = backward
                      ? "-1 slots add nothing; unselected keys exactly 0; others within §4.3"
                      : "two-stage top-K = brute force (proofs/router.md §2); weights within §3";
  return tl.r;
}

CaseResult sigmoid_case(const Shape& s, Data data, bool backward, std::size_t topk_group,
                        const RunContext& ctx) {
  std::mt19937_64 rng(ctx.seed ^ (s.t * 41 + s.e));
  const router::SigmoidTopkParams p{8, topk_group, 2.5f};
  const std::size_t size = s.e / p.groups;
  // sigma(z) normal: z >= -87 (router.sigmoid_topk.scores_finite).
  const auto z = scores(rng, s.t * s.e, data, -87.0f), g = scores(rng, s.t * s.k, Data::normal);
  std::vector<float> bias = scores(rng, s.e, Data::normal);
  for (auto& b : bias) b *= 0.05f;
  MatView<const float> zv(z.data(), s.t, s.e);
  auto fwd = [&] {
    std::pair<std::vector<std::int32_t>, std::vector<float>> o{std::vector<std::int32_t>(s.t * s.k),
                                                               std::vector<float>(s.t * s.k)};
    router::sigmoid_topk_forward(zv, View<const float>{bias.data(), s.e}, p,
                                 MatView<std::int32_t>(o.first.data(), s.t, s.k),
                                 MatView<float>(o.second.data(), s.t, s.k));
    return o;
  };
  const auto routed = threads(ctx.threads, fwd);  // named, not bound: lambdas below capture idx
  const auto& idx = std::get<0>(routed);
  const auto& w = std::get<1>(routed);
  Tally tl;
  tl.slack = 64 * 0x1p-52;
  tl.r.deterministic = threads(1, fwd).second == w;
  for (std::size_t t = 0; t < s.t && tl.r.verdict != Verdict::fail; ++t) {
    // Brute force: groups by the sum of their top two selection scores, then experts.
    std::vector<float> sel(s.e), gs(p.groups);
    for (std::size_t i = 0; i < s.e; ++i)
      sel[i] = router::detail::sigmoid(z[t * s.e + i]) + bias[i];
    for (std::size_t q = 0; q < p.groups; ++q) {
      std::vector<float> v(sel.begin() + q * size, sel.begin() + (q + 1) * size);
      std::sort(v.rbegin(), v.rend());
      gs[q] = v[0] + v[1];
    }
    std::vector<std::int32_t> order(p.groups), all(s.e);
    for (std::size_t q = 0; q < p.groups; ++q) order[q] = static_cast<std::int32_t>(q);
    std::stable_sort(order.begin(), order.end(),
                     [&](auto a, auto b) { return router::detail::outranks(gs[a], a, gs[b], b); });
    for (std::size_t i = 0; i < s.e; ++i) all[i] = static_cast<std::int32_t>(i);
    std::stable_sort(all.begin(), all.end(), [&](auto a, auto b) {
      return router::detail::outranks(sel[a], a, sel[b], b);
    });
    std::erase_if(all, [&](std::int32_t i) {
      return std::find(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(p.topk_group),
                       i / static_cast<std::int32_t>(size)) ==
             order.begin() + static_cast<std::ptrdiff_t>(p.topk_group);
    });
    all.resize(s.k, -1);  // fewer eligible than K: -1 tail
    if (!std::equal(all.begin(), all.end(), &idx[t * s.k])) {
      tl.fail(fmt::format("row {}: selection differs from brute force", t));
      break;
    }
    const std::int32_t* ir = &idx[t * s.k];
    if (!backward) {
      const auto [wr, b] = bounds::sigmoid_topk_weights_row(&z[t * s.e], ir, s.k, p.scaling);
      for (std::size_t j = 0; j < s.k; ++j)
        tl.add(w[t * s.k + j], wr[j], b[j], fmt::format("t={} j={}", t, j));
    }
  }
  if (backward && tl.r.verdict != Verdict::fail) {
    auto bwd = [&] {
      std::vector<float> dz(s.t * s.e);
      router::sigmoid_topk_backward(zv, MatView<const std::int32_t>(idx.data(), s.t, s.k),
                                    MatView<const float>(g.data(), s.t, s.k), p,
                                    MatView<float>(dz.data(), s.t, s.e));
      return dz;
    };
    const auto dz = threads(ctx.threads, bwd);
    tl.r.deterministic = threads(1, bwd) == dz;
    for (std::size_t t = 0; t < s.t; ++t) {
      const std::int32_t* ir = &idx[t * s.k];
      const auto dref =
          ref::sigmoid_topk_grad<double>(&z[t * s.e], s.e, ir, &g[t * s.k], s.k, p.scaling);
      const auto b =
          bounds::sigmoid_topk_grad_row(&z[t * s.e], s.e, ir, &g[t * s.k], s.k, p.scaling);
      for (std::size_t i = 0; i < s.e; ++i)
        tl.add(dz[t * s.e + i], dref[i], b[i], fmt::format("t={} e={}", t, i));
    }
  }
  if (!tl.r.deterministic) tl.fail("results differ between 1 and N threads");
  if (tl.r.verdict == Verdict::pass)
    tl.r.detail = backward ? "within proofs/router.md §4.2; unselected exactly 0"
                           : "group-limited selection = brute force; weights within §7";
  return tl.r;
}

}  // namespace

void add_router_cases(std::vector<CaseDef>& out) {
  const Shape shapes[] = {{"one_token", 1, 16, 3, Suite::smoke},
                          {"tiny", 2, 16, 1, Suite::smoke},
                          {"odd", 37, 64, 9, Suite::smoke},
                          {"realistic", 256, 4096, 16, Suite::def}};
  for (const auto& s : shapes)
    for (Data dc : {Data::normal, Data::ties, Data::extreme}) {
      if (dc == Data::extreme && s.suite != Suite::smoke) continue;
      const std::string shape = fmt::format("{}:T{}_E{}_K{}", s.cls, s.t, s.e, s.k);
      const char* data = kDataNames[static_cast<int>(dc)];
      const Level level = s.suite == Suite::smoke ? Level::full : Level::check;
      for (bool renorm : {true, false})
        for (bool bwd : {false, true})
          out.push_back(
              {bwd ? "router.softmax_topk.backward" : "router.softmax_topk.forward",
               renorm ? "renormalized" : "dense", "any", shape,
               bwd ? std::string(data) + ",minus1_slots" : data, s.suite, level,
               [=](const RunContext& ctx) { return softmax_case(s, dc, renorm, bwd, ctx); }});
      for (bool bwd : {false, true})
        for (std::size_t kept :
             {4u, 1u}) {  // kept = 1 with 8 groups: fewer than K eligible when K > E/8
          if (kept == 1 && s.k <= s.e / 8) continue;
          out.push_back(
              {bwd ? "router.sigmoid_topk.backward" : "router.sigmoid_topk.forward",
               fmt::format("G8_keep{}", kept), "any", shape,
               kept == 1 ? std::string(data) + ",minus1_slots" : data, s.suite, level,
               [=](const RunContext& ctx) { return sigmoid_case(s, dc, bwd, kept, ctx); }});
        }
      for (bool bwd : {false, true})
        out.push_back({bwd ? "router.product_key.backward" : "router.product_key.forward", "raw",
                       "any", shape, bwd ? std::string(data) + ",minus1_slots" : data, s.suite,
                       level,
                       [=](const RunContext& ctx) { return product_key_case(s, dc, bwd, ctx); }});
    }
}

}  // namespace moecert::tools
