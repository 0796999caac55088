// Comparison: bound utilisation, ULP distance, tie-aware top-k.
#include "contracts/engine/compare.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "test_util.hpp"

using namespace moecert;

TEST_CASE("compare: bounded reports utilisation and the worst element", "[compare]") {
  const std::vector<float> got = {1.0f, 2.5f, 3.0f};
  const std::vector<double> ref = {1.0, 2.0, 3.25};
  const std::vector<double> bound = {0.1, 1.0, 0.2};
  auto r = compare::bounded(got, ref, bound);
  CHECK_FALSE(r.pass());
  CHECK(r.exceeded == 1);
  CHECK(r.worst == 2);
  CHECK(r.max_utilization == Approx(1.25));  // 0.25 / 0.2, as computed exactly in binary
  CHECK(r.max_abs_err == 0.5);
  CHECK(r.worst_got == 3.0f);
  auto ok = compare::bounded(std::vector<float>{1.0f, 2.5f}, std::vector<double>{1.0, 2.0},
                             std::vector<double>{0.1, 1.0});
  CHECK(ok.pass());
  CHECK(ok.max_utilization == Approx(0.5));  // 0.5 / (1 + 2^-52)
}

TEST_CASE("compare: a non-finite result never passes", "[compare][finite]") {
  const std::vector<double> ref = {1.0}, bound = {1e30};
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    auto r = compare::bounded(std::vector<float>{bad}, ref, bound);
    CHECK_FALSE(r.pass());
    CHECK(std::isinf(r.max_utilization));
  }
  // A zero bound admits only an exact result.
  CHECK(
      compare::bounded(std::vector<float>{0.0f}, std::vector<double>{0.0}, std::vector<double>{0.0})
          .pass());
  // ... and refuses any nonzero error, however small (1e-30 is an input here).
  CHECK_FALSE(compare::bounded(std::vector<float>{1e-30f}, std::vector<double>{0.0},
                               std::vector<double>{0.0})
                  .pass());
}

TEST_CASE("compare: ULP distance", "[compare]") {
  CHECK(compare::ulp_distance(1.0f, 1.0f) == 0);
  CHECK(compare::ulp_distance(1.0f, std::nextafter(1.0f, 2.0f)) == 1);
  CHECK(compare::ulp_distance(0.0f, -0.0f) == 0);
  CHECK(compare::ulp_distance(-std::numeric_limits<float>::denorm_min(),
                              std::numeric_limits<float>::denorm_min()) == 2);
  CHECK(compare::ulp_distance(bf16(1.0f), bf16::from_bits(0x3f81)) == 1);
  CHECK(compare::ulp_distance(1.0f, NAN) == std::numeric_limits<std::uint64_t>::max());
}

TEST_CASE("compare: tie-aware top-k accepts other tie breaks, rejects lower scores",
          "[compare][index]") {
  // One token, 6 experts; experts 1, 2 and 4 tie at 0.5 around the k = 3 boundary.
  const std::vector<float> s = {0.9f, 0.5f, 0.5f, 0.1f, 0.5f, 0.2f};
  MatView<const float> scores(s.data(), 1, 6);
  const std::vector<std::int32_t> ref = {0, 1, 2};        // total order: ties by index
  const std::vector<std::int32_t> other_tie = {0, 4, 1};  // another tie break
  const std::vector<std::int32_t> lower = {0, 1, 5};      // 0.2 < 0.5
  const std::vector<std::int32_t> twice = {0, 1, 1};
  const std::vector<std::int32_t> out_of_range = {0, 1, 6};
  auto cmp = [&](const std::vector<std::int32_t>& c) {
    return compare::topk_tie_aware(scores, MatView<const std::int32_t>(c.data(), 1, 3),
                                   MatView<const std::int32_t>(ref.data(), 1, 3));
  };
  CHECK(cmp(ref).ok);
  CHECK(cmp(other_tie).ok);
  auto r = cmp(lower);
  CHECK_FALSE(r.ok);
  CHECK(r.j == 2);
  CHECK(r.reason.find("score 0.2") != std::string::npos);
  CHECK_FALSE(cmp(twice).ok);
  CHECK_FALSE(cmp(out_of_range).ok);
}

TEST_CASE("compare: tie-aware top-k and -1 tail slots", "[compare][index]") {
  const std::vector<float> s = {0.9f, 0.5f, 0.4f};
  MatView<const float> scores(s.data(), 1, 3);
  const std::vector<std::int32_t> ref = {0, 1, -1};
  const std::vector<std::int32_t> same = {0, 1, -1};
  const std::vector<std::int32_t> filled = {0, 1, 2};
  const std::vector<std::int32_t> hole = {0, -1, 1};
  auto cmp = [&](const std::vector<std::int32_t>& c) {
    return compare::topk_tie_aware(scores, MatView<const std::int32_t>(c.data(), 1, 3),
                                   MatView<const std::int32_t>(ref.data(), 1, 3));
  };
  CHECK(cmp(same).ok);
  CHECK_FALSE(cmp(filled).ok);
  CHECK_FALSE(cmp(hole).ok);
}

TEST_CASE("compare.rounding_audit: truncation is flagged, round to nearest is not",
          "[compare][audit]") {
  std::mt19937_64 rng(5);
  std::normal_distribution<double> nd(0, 1);
  std::vector<double> ref(2000);
  for (auto& v : ref) v = nd(rng);
  std::vector<float> nearest(ref.size()), truncated(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) {
    nearest[i] = bf16(static_cast<float>(ref[i])).to_float();  // round to nearest even
    const auto bits = std::bit_cast<std::uint32_t>(static_cast<float>(ref[i])) & 0xffff0000u;
    truncated[i] = std::bit_cast<float>(bits);  // toward zero
  }
  const auto a = compare::rounding_audit(nearest, ref);
  CHECK(a.audited > 1900);
  CHECK_FALSE(a.biased());
  const auto b = compare::rounding_audit(truncated, ref);
  CHECK(b.toward_zero == b.audited);
  CHECK(b.biased());
  // Too few elements: never flagged.
  const auto c = compare::rounding_audit(std::span(truncated).first(40), std::span(ref).first(40));
  CHECK_FALSE(c.biased());
  // A lean within kLean (58% toward zero, a bf16 SwiGLU's) passes; 75% fails.
  auto leaning = [&](std::size_t every) {  // truncate 1 in `every`, else nearest
    std::vector<float> v(ref.size());
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = i % every ? nearest[i] : truncated[i];
    return compare::rounding_audit(v, ref);
  };
  const auto lean = leaning(6), heavy = leaning(2);
  CHECK(double(lean.toward_zero) / double(lean.audited) > 0.55);
  CHECK_FALSE(lean.biased());
  CHECK(double(heavy.toward_zero) / double(heavy.audited) > 0.7);
  CHECK(heavy.biased());
}
