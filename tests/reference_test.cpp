// Reference evaluators: double-double against 50 digits, and the
// transcendentals against Boost.Multiprecision.
#include <cmath>
#include <random>
#include <vector>

#include "contracts/numeric/functions.hpp"
#include "contracts/reference/gemm.hpp"
#include "test_util.hpp"

using namespace moecert;
using ref::DoubleDouble;
using ref::Hp;

namespace {

// Relative disagreement of two high-precision values (absolute when the
// 50-digit value is 0).
double rel_diff(DoubleDouble dd, const Hp& hp) {
  const Hp d = ref::abs(ref::to_hp(dd) - hp);
  return ref::to_double(hp == 0 ? d : d / ref::abs(hp));
}

// Random values of a limited exponent range, as bf16 or float.
template <class In>
In draw(std::mt19937_64& rng, int min_exp, int max_exp) {
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> ex(min_exp, max_exp);
  const double v = std::ldexp(mant(rng), ex(rng)) * ((rng() & 1) ? 1 : -1);
  if constexpr (std::is_same_v<In, bf16>)
    return bf16(static_cast<float>(v));
  else
    return static_cast<float>(v);
}

template <class In>
void agree_on_dots(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  double worst_random = 0, worst_cancel = 0;
  for (std::size_t n : {1u, 7u, 64u, 1000u, 4096u, 16384u}) {
    for (int rep = 0; rep < 3; ++rep) {
      std::vector<In> a(n), b(n);
      for (std::size_t i = 0; i < n; ++i) {
        a[i] = draw<In>(rng, -20, 20);
        b[i] = draw<In>(rng, -20, 20);
      }
      worst_random = std::max(worst_random, rel_diff(ref::dot<DoubleDouble>(a.data(), b.data(), n),
                                                     ref::dot<Hp>(a.data(), b.data(), n)));
      // Cancelling: the second half negates the first half's products
      // (with the partner swapped), then one small term survives.
      std::vector<In> c(2 * n + 1), d(2 * n + 1);
      for (std::size_t i = 0; i < n; ++i) {
        c[i] = a[i];
        d[i] = b[i];
        c[n + i] = b[i];
        if constexpr (std::is_same_v<In, bf16>)
          d[n + i] = bf16::from_bits(a[i].bits ^ 0x8000u);
        else
          d[n + i] = -a[i];
      }
      c[2 * n] = draw<In>(rng, -30, -25);
      d[2 * n] = draw<In>(rng, -30, -25);
      const Hp exact = ref::dot<Hp>(c.data(), d.data(), 2 * n + 1);
      REQUIRE(ref::abs(exact) < Hp(1e-12));  // it did cancel
      // Double-double is accurate to ~2^-104 of its largest partial sum, not
      // of a cancelled result, so a cancelling sum is measured normwise:
      // |dd - hp| / sum |c_i d_i|. (bf16 products are also exact here.)
      const DoubleDouble dd = ref::dot<DoubleDouble>(c.data(), d.data(), 2 * n + 1);
      Hp sum_abs(0);
      for (std::size_t i = 0; i < 2 * n + 1; ++i)
        sum_abs += ref::abs(Hp(ref::widen(c[i])) * Hp(ref::widen(d[i])));
      worst_cancel =
          std::max(worst_cancel, ref::to_double(ref::abs(ref::to_hp(dd) - exact) / sum_abs));
      if constexpr (std::is_same_v<In, bf16>) REQUIRE(rel_diff(dd, exact) <= 1e-28);
    }
  }
  INFO("worst relative disagreement: random " << worst_random << ", cancelling " << worst_cancel);
  CHECK(worst_random <= 1e-28);
  CHECK(worst_cancel <= 1e-28);
}

}  // namespace

TEST_CASE("reference: double-double agrees with 50 digits on bf16 dot products", "[reference]") {
  agree_on_dots<bf16>(1);
}

TEST_CASE("reference: double-double agrees with 50 digits on fp32 dot products", "[reference]") {
  agree_on_dots<float>(2);
}

TEST_CASE("reference: double-double arithmetic is accurate to 2^-100", "[reference]") {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> u(-1e3, 1e3);
  for (int i = 0; i < 20000; ++i) {
    const DoubleDouble x = DoubleDouble::two_sum(u(rng), u(rng) * 1e-17);
    const DoubleDouble y = DoubleDouble::two_sum(u(rng), u(rng) * 1e-17);
    const Hp hx = ref::to_hp(x), hy = ref::to_hp(y);
    REQUIRE(rel_diff(x + y, hx + hy) <=
            0x1p-100 * ref::to_double((ref::abs(hx) + ref::abs(hy)) / ref::abs(hx + hy)));
    REQUIRE(rel_diff(x * y, hx * hy) <= 0x1p-100);
    REQUIRE(rel_diff(x / y, hx / hy) <= 0x1p-100);
  }
}

TEST_CASE("reference: transcendentals at 50 digits", "[reference]") {
  // Identities that hold exactly, evaluated at 50 digits.
  const Hp one(1), two(2);
  CHECK(ref::to_double(ref::abs(ref::log(ref::exp(two)) - two)) < 1e-45);
  CHECK(ref::to_double(ref::abs(ref::sigmoid(Hp(0)) - Hp(0.5))) == 0);
  for (double z : {-30.0, -3.5, -0.25, 0.0, 0.7, 4.0, 40.0}) {
    const Hp hz(z);
    // sigma(z) + sigma(-z) = 1, and silu(z) = z sigma(z).
    CHECK(ref::to_double(ref::abs(ref::sigmoid(hz) + ref::sigmoid(-hz) - one)) < 1e-45);
    CHECK(ref::to_double(ref::abs(ref::silu(hz) - hz * ref::sigmoid(hz))) < 1e-45);
    // silu' against a central difference at 50 digits: step 1e-15 leaves
    // truncation ~1e-30 |silu'''| and rounding ~1e-50 / 1e-15.
    const Hp h("1e-15");
    const Hp fd = (ref::silu(hz + h) - ref::silu(hz - h)) / (two * h);
    CHECK(ref::to_double(ref::abs(fd - ref::silu_grad(hz))) < 1e-28);
    // The double evaluator agrees to double precision.
    // libm exp is within 1 ulp; silu's few operations add a few more (binary64).
    CHECK(std::fabs(ref::silu(z) - ref::to_double(ref::silu(hz))) <=
          8 * 0x1p-53 * (1 + std::fabs(z)));
  }
  // Double-double transcendentals go through 50 digits.
  const DoubleDouble e1 = ref::exp(DoubleDouble(1.0));
  CHECK(rel_diff(e1, ref::exp(Hp(1))) <= 0x1p-104);
}

TEST_CASE("reference: softmax and log-sum-exp", "[reference]") {
  std::mt19937_64 rng(4);
  std::normal_distribution<float> nd(0, 5);
  std::vector<float> z(300);
  for (auto& v : z) v = nd(rng);
  z[17] = z[18];  // a tie
  const auto p = ref::softmax<Hp>(z.data(), z.size());
  Hp sum(0);
  for (const auto& v : p) sum += v;
  CHECK(ref::to_double(ref::abs(sum - Hp(1))) < 1e-45);
  CHECK(p[17] == p[18]);
  const Hp lse = ref::logsumexp<Hp>(z.data(), z.size());
  for (std::size_t i = 0; i < z.size(); i += 37)
    CHECK(ref::to_double(ref::abs(ref::exp(Hp(z[i]) - lse) - p[i])) < 1e-45);
  // Large scores do not overflow: shifted by the maximum.
  std::vector<float> big = {1e4f, 1e4f - 1, -1e4f};
  const auto pb = ref::softmax<double>(big.data(), 3);
  CHECK(pb[0] == Approx(1 / (1 + std::exp(-1.0))).epsilon(1e-15));  // literal: double rounding
  CHECK(pb[2] == 0);
}

TEST_CASE("reference: GEMM A B^T equals row-by-row dots", "[reference]") {
  std::mt19937_64 rng(5);
  std::vector<bf16> a(5 * 33), b(7 * 33);
  for (auto& v : a) v = draw<bf16>(rng, -3, 3);
  for (auto& v : b) v = draw<bf16>(rng, -3, 3);
  MatView<const bf16> A(a.data(), 5, 33), B(b.data(), 7, 33);
  const auto c = ref::gemm_nt<Hp>(A, B);
  const auto cabs = ref::gemm_nt_abs(A, B);
  for (std::size_t i = 0; i < 5; ++i)
    for (std::size_t j = 0; j < 7; ++j) {
      CHECK(c[i * 7 + j] == ref::dot<Hp>(A.row(i), B.row(j), 33));
      CHECK(ref::to_double(ref::abs(c[i * 7 + j])) <= cabs[i * 7 + j]);
    }
}
