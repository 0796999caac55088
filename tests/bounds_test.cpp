// The a-priori bounds hold for plain fp32 kernels over random and
// adversarial data (proofs/bounds.md); the observed utilisation is printed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "contracts/numeric/functions.hpp"
#include "contracts/numeric/probable.hpp"
#include "contracts/numeric/rounding.hpp"
#include "test_util.hpp"

using namespace moecert;
using ref::DoubleDouble;

namespace {

float ftz(float x) { return std::fabs(x) < 0x1p-126f ? std::copysign(0.0f, x) : x; }

// Four summation orders a kernel may use (products of bf16 are exact).
float dot_sequential(const float* p, std::size_t n) {
  float s = 0;
  for (std::size_t i = 0; i < n; ++i) s += p[i];
  return s;
}
float dot_pairwise(const float* p, std::size_t n) {
  if (n <= 2) return n == 0 ? 0.0f : n == 1 ? p[0] : p[0] + p[1];
  return dot_pairwise(p, n / 2) + dot_pairwise(p + n / 2, n - n / 2);
}
// AMX TDPBF16PS per 32-term block: even and odd FMA chains from zero with
// flushing, then C + (even + odd) (docs/DESIGN.md, Kernels).
float dot_amx(const float* a, const float* b, std::size_t n) {
  float c = 0;
  for (std::size_t k0 = 0; k0 < n; k0 += 32) {
    float even = 0, odd = 0;
    for (std::size_t k = k0; k < std::min(n, k0 + 32); k += 2) {
      even = ftz(std::fma(ftz(a[k]), ftz(b[k]), even));
      if (k + 1 < n) odd = ftz(std::fma(ftz(a[k + 1]), ftz(b[k + 1]), odd));
    }
    c = ftz(c + ftz(even + odd));
  }
  return c;
}

struct Stats {
  std::size_t cases = 0;
  double max_util = 0;
  void add(double err, double bound) {
    ++cases;
    if (!(err <= bound)) FAIL_CHECK("case " << cases << ": err " << err << " > bound " << bound);
    REQUIRE(err <= bound);
    max_util = std::max(max_util, err / bound);
  }
};

enum class Data { random, cancel, wide, equal, growing };

template <class In>
void fill(std::mt19937_64& rng, Data d, std::vector<In>& a, std::vector<In>& b) {
  const std::size_t n = a.size();
  std::uniform_real_distribution<float> u(-1, 1);
  std::uniform_int_distribution<int> ex(-58, 58);
  for (std::size_t i = 0; i < n; ++i) {
    float x = u(rng), y = u(rng);
    switch (d) {
      case Data::random:
        break;
      case Data::cancel:  // pairs that cancel up to a rounding residue
        if (i % 2 == 1) {
          x = -static_cast<float>(a[i - 1]) * (1 + 0x1p-7f * u(rng));
          y = static_cast<float>(b[i - 1]);
        }
        break;
      case Data::wide:  // magnitudes 2^-58..2^58, products stay normal
        x = std::ldexp(0.5f + std::fabs(x), ex(rng));
        y = std::ldexp(0.5f + std::fabs(y), ex(rng)) * (y < 0 ? -1 : 1);
        break;
      case Data::equal:
        x = 0.1f;
        y = 0.3f;
        break;  // all terms equal
      case Data::growing:
        x = i == 0 ? 1e4f : std::fabs(x);
        y = i == 0 ? 1.0f : 3e-4f;
        break;  // 1 big + many below half an ulp
    }
    a[i] = In(x);
    b[i] = In(y);
  }
}

template <class In>
void check_dots(std::size_t trials, std::size_t max_n, std::uint64_t seed, Stats& st) {
  std::mt19937_64 rng(seed);
  std::vector<In> a, b;
  std::vector<float> af, bf, p;
  for (std::size_t t = 0; t < trials; ++t) {
    const std::size_t n = 1 + rng() % max_n;
    const Data d = static_cast<Data>(t % 5);
    a.resize(n);
    b.resize(n);
    fill(rng, d, a, b);
    af.resize(n);
    bf.resize(n);
    p.resize(n);
    double sum_abs = 0;
    for (std::size_t i = 0; i < n; ++i) {
      af[i] = static_cast<float>(a[i]);
      bf[i] = static_cast<float>(b[i]);
      p[i] = af[i] * bf[i];  // exact for bf16 inputs, rounded for fp32
      sum_abs += std::fabs(double(af[i]) * double(bf[i]));
    }
    const double exact = ref::to_double(ref::dot<DoubleDouble>(a.data(), b.data(), n));
    const double bound =
        bounds::dot(n, sum_abs) + 0x1p-52 * std::fabs(exact);  // + the reference's rounding
    st.add(std::fabs(dot_sequential(p.data(), n) - exact), bound);
    st.add(std::fabs(dot_pairwise(p.data(), n) - exact), bound);
    if constexpr (std::is_same_v<In, bf16>)
      st.add(std::fabs(dot_amx(af.data(), bf.data(), n) - exact), bound);
    float fma_chain = 0;
    for (std::size_t i = 0; i < n; ++i) fma_chain = std::fma(af[i], bf[i], fma_chain);
    st.add(std::fabs(fma_chain - exact), bound);
  }
}

}  // namespace

TEST_CASE("bounds: fp32 dot products of bf16 never exceed gamma_n sum|ab|", "[bounds]") {
  Stats st;
  check_dots<bf16>(240000, 64, 11, st);
  check_dots<bf16>(1000, 4096, 12, st);
  std::printf("bounds.dot bf16: %zu cases, max utilisation %.4g\n", st.cases, st.max_util);
  CHECK(st.cases >= 960000);
  CHECK(st.max_util > 0.01);  // the bound is not vacuous on adversarial data
}

TEST_CASE("bounds: fp32 dot products of fp32 never exceed gamma_n sum|ab|", "[bounds]") {
  Stats st;
  check_dots<float>(60000, 64, 13, st);
  std::printf("bounds.dot fp32: %zu cases, max utilisation %.4g\n", st.cases, st.max_util);
  CHECK(st.cases >= 180000);
}

TEST_CASE("bounds: bf16 rounding of a computed result", "[bounds]") {
  std::mt19937_64 rng(14);
  std::uniform_real_distribution<double> u(-100, 100);
  Stats st;
  for (int i = 0; i < 200000; ++i) {
    const double x = u(rng) * std::ldexp(1.0, static_cast<int>(rng() % 200) - 100);
    const float xf = static_cast<float>(x);  // a computed value, error <= u32 |x|
    const double e = std::fabs(double(xf) - x);
    st.add(std::fabs(double(bf16(xf).to_float()) - x), bounds::bf16_store(std::fabs(x), e));
  }
  std::printf("bounds.bf16_store: %zu cases, max utilisation %.4g\n", st.cases, st.max_util);
}

TEST_CASE("bounds: sigmoid, silu(g)*u, exp in fp32", "[bounds]") {
  std::mt19937_64 rng(15);
  std::uniform_real_distribution<float> u(-1, 1);
  Stats sig, sm, ex;
  for (int i = 0; i < 200000; ++i) {
    const float g = u(rng) * (i % 3 == 0 ? 100.0f : 8.0f), v = u(rng) * 4;
    const double gd = g, vd = v;
    // Double references: their own error (a few 2^-53 relative) is covered
    // by the 2^-50 |exact| slack added to each bound.
    const double s_exact = ref::sigmoid(gd);
    const float s = 1.0f / (1.0f + std::exp(-g));
    sig.add(std::fabs(s - s_exact), bounds::sigmoid(s_exact) + 0x1p-50 * s_exact);
    const double silu_exact = ref::silu(gd);
    const float h = (g * (1.0f / (1.0f + std::exp(-g)))) * v;
    sm.add(std::fabs(h - silu_exact * vd), bounds::silu_mul(std::fabs(silu_exact), std::fabs(vd)) +
                                               0x1p-50 * std::fabs(silu_exact * vd));
    if (std::fabs(g) < 80) {
      const double e_exact = std::exp(gd);
      ex.add(std::fabs(std::exp(g) - e_exact), bounds::exp(e_exact) + 0x1p-50 * e_exact);
    }
  }
  std::printf("bounds.sigmoid %.4g, bounds.silu_mul %.4g, bounds.exp %.4g (max utilisation)\n",
              sig.max_util, sm.max_util, ex.max_util);
}

TEST_CASE("bounds: silu(g)*u with perturbed inputs", "[bounds]") {
  std::mt19937_64 rng(16);
  std::uniform_real_distribution<double> u(-1, 1);
  Stats st;
  for (int i = 0; i < 100000; ++i) {
    const double g = u(rng) * 10, v = u(rng) * 3;
    // Input perturbation sizes (not tolerances): errors of up to 1e-3 in g and u.
    const double eg = std::fabs(u(rng)) * 1e-3, ev = std::fabs(u(rng)) * 1e-3;
    const float gh = static_cast<float>(g + eg * u(rng)), vh = static_cast<float>(v + ev * u(rng));
    const double eg_real = std::fabs(double(gh) - g), ev_real = std::fabs(double(vh) - v);
    const double exact = ref::silu(g) * v;
    const float h = (gh * (1.0f / (1.0f + std::exp(-gh)))) * vh;
    st.add(std::fabs(h - exact),
           bounds::silu_mul(std::fabs(ref::silu(g)), std::fabs(v), eg_real, ev_real) +
               0x1p-50 * std::fabs(exact));
  }
  std::printf("bounds.silu_mul perturbed: max utilisation %.4g\n", st.max_util);
}

TEST_CASE("bounds: softmax, renormalised top-k weights, log-sum-exp in fp32", "[bounds]") {
  std::mt19937_64 rng(17);
  std::normal_distribution<float> nd(0, 1);
  Stats sp, rn, ls;
  for (int t = 0; t < 20000; ++t) {
    const std::size_t n = 2 + rng() % 200;
    const float scale = (t % 4 == 0) ? 30.0f : 3.0f;
    std::vector<float> z(n);
    for (auto& v : z) v = nd(rng) * scale;
    if (t % 5 == 0)
      for (std::size_t i = 1; i < n; i += 2) z[i] = z[i - 1];  // ties
    float m = z[0];
    for (float v : z) m = std::max(m, v);
    std::vector<float> e(n);
    float s = 0;
    double max_shift = 0;
    for (std::size_t i = 0; i < n; ++i) {
      e[i] = std::exp(z[i] - m);
      s += e[i];
      max_shift = std::max(max_shift, std::fabs(double(z[i]) - m));
    }
    const auto p = ref::softmax<double>(z.data(), n);  // its error: n 2^-52 relative, in the slack
    for (std::size_t i = 0; i < n; ++i) {
      const double pe = ref::to_double(p[i]);
      sp.add(std::fabs(e[i] / s - pe), bounds::softmax(pe, n, max_shift) + n * 0x1p-50 * pe);
    }
    // Renormalise the k largest computed probabilities (a router's top-k:
    // never in the denormal range, where §6's relative bound does not hold).
    const std::size_t k = 1 + rng() % std::min<std::size_t>(n, 8);
    std::vector<std::size_t> top(n);
    for (std::size_t i = 0; i < n; ++i) top[i] = i;
    std::partial_sort(top.begin(), top.begin() + k, top.end(),
                      [&](auto x, auto y) { return z[x] > z[y]; });
    float sk = 0;
    double pk = 0;
    for (std::size_t i = 0; i < k; ++i) {
      sk += e[top[i]] / s;
      pk += ref::to_double(p[top[i]]);
    }
    const double eps = bounds::softmax_rel(n, max_shift);
    for (std::size_t i = 0; i < k; ++i) {
      const double w = ref::to_double(p[top[i]]) / pk;
      rn.add(std::fabs((e[top[i]] / s) / sk - w),
             bounds::renormalized(w, k, eps, 2 * bounds::kMinNormal32, pk) + n * 0x1p-48 * w);
    }
    const double lse = ref::logsumexp<double>(z.data(), n);
    const float lse32 = m + std::log(s);
    ls.add(std::fabs(lse32 - lse),
           bounds::logsumexp(std::fabs(lse), std::fabs(lse - m), n, max_shift) +
               n * 0x1p-50 * std::fabs(lse));
  }
  std::printf(
      "bounds.softmax %.4g, bounds.renormalized %.4g, bounds.logsumexp %.4g (max utilisation over "
      "%zu, %zu, %zu)\n",
      sp.max_util, rn.max_util, ls.max_util, sp.cases, rn.cases, ls.cases);
}

TEST_CASE("bounds: gamma_n", "[bounds]") {
  CHECK(bounds::gamma(1) == Approx(0x1p-24).epsilon(1e-6));  // literal: gamma_1 = u / (1 - u)
  CHECK(bounds::gamma(1024) > 1024 * 0x1p-24);
  CHECK(std::isinf(bounds::gamma(double(1 << 24))));
}

TEST_CASE("bounds: the probabilistic model holds where the worst case is loose", "[bounds]") {
  // o = sum_i w_i h_i, h_i = bf16(g_i u_i) of bf16 g, u, w, summed in fp32
  // in two orders (the bf16 declaration's down GEMM): every result within
  // the Probable model's bound, which sits well below the worst case at
  // n = 2048 (proofs/bounds.md §12).
  using bounds::Probable;
  using bounds::Tracked;
  const auto p = bounds::probable(bounds::kBf16);
  const std::size_t n = 2048;
  std::mt19937_64 rng(16);
  std::normal_distribution<float> nd(0, 1);
  Stats worst, prob;
  double ratio = 0;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> g(n), u(n), w(n), prod(n);
    std::vector<Probable> h(n);
    std::vector<Tracked> ht(n);
    for (std::size_t i = 0; i < n; ++i) {
      g[i] = bf16(nd(rng)).to_float(), u[i] = bf16(nd(rng)).to_float();
      w[i] = bf16(nd(rng) * 0.02f).to_float();
      // The product of two bf16 is exact in fp32, and so is h w.
      prod[i] = bf16(g[i] * u[i]).to_float() * w[i];
      h[i] = bounds::mid(Probable(Tracked(g[i]), p.lambda) * Probable(Tracked(u[i]), p.lambda), p);
      ht[i] = bounds::mid(Tracked(g[i]) * Tracked(u[i]), p);
    }
    auto wp = [&](std::size_t i) { return Probable(Tracked(w[i]), p.lambda); };
    const Tracked model = bounds::collapse(bounds::dot_accumulated(
        n, [&](std::size_t i) { return h[i]; }, wp, n, p, bounds::Terms::independent));
    const Tracked wc = bounds::dot_accumulated(
        n, [&](std::size_t i) { return ht[i]; }, [&](std::size_t i) { return Tracked(w[i]); }, n,
        p);
    for (const float sum : {dot_sequential(prod.data(), n), dot_pairwise(prod.data(), n)}) {
      const double err = std::fabs(double(sum) - model.v);
      worst.add(err, wc.e), prob.add(err, model.e);
    }
    ratio = std::max(ratio, model.e / wc.e);
  }
  std::printf("bounds.probable bf16: %zu cases, max utilisation %.4g (worst case %.4g)\n",
              prob.cases, prob.max_util, worst.max_util);
  CHECK(prob.max_util <= 1);
  CHECK(ratio < 0.5);
}
