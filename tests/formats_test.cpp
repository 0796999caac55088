// Weight formats: quantized packs read back as the judge dequantizes them,
// GEMMs over them within the bound of the exact weights on every usable ISA
// and bit for bit the bf16 GEMM of the dequantized weights, and every
// clause on codes and scales.
#include "contracts/gemm/formats.hpp"

#include <oneapi/tbb/global_control.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "contracts/engine/checks.hpp"
#include "contracts/engine/compare.hpp"
#include "contracts/gemm/gemm.hpp"
#include "contracts/gemm/pack_audit.hpp"
#include "contracts/numeric/rounding.hpp"
#include "moecert/formats.hpp"
#include "moecert/gemm.hpp"
#include "moecert/isa.hpp"
#include "ops/gemm/ukernel.hpp"
#include "support/quantized.hpp"
#include "test_util.hpp"

using namespace moecert;

namespace {

constexpr WeightFormat kQuantized[] = {WeightFormat::int8_channel, WeightFormat::int4_group,
                                       WeightFormat::fp8_e4m3_block128};

using Quant = fixture::QuantMatrix;

Quant make(WeightFormat f, std::size_t rows, std::size_t cols, std::mt19937_64& rng) {
  return fixture::random_quantized(f, rows, cols, rng);
}

std::vector<bf16> random_a(std::mt19937_64& rng, std::size_t n) {
  std::normal_distribution<float> nd(0, 1);
  std::vector<bf16> v(n);
  for (auto& x : v) x = bf16(nd(rng));
  return v;
}

struct Shape {
  std::size_t m, n, k;
};
const Shape kShapes[] = {{1, 1, 1}, {3, 17, 33}, {7, 130, 129}, {33, 40, 300}, {5, 257, 260}};

}  // namespace

TEST_CASE("formats: the table, names and parsing", "[formats]") {
  for (const FormatInfo& f : kFormatTable) {
    CHECK(parse_format(f.name) == f.format);
    CHECK(format_name(f.format) == f.name);
    CHECK(format_name_list().find(f.name) != std::string::npos);
  }
  CHECK(!parse_format("int3"));
  CHECK(format_name_list() == "bf16, int8_channel, int4_group or fp8_e4m3_block128");
}

TEST_CASE("formats: the judge's e4m3 values are the format's", "[formats]") {
  using contracts::code_value;
  const WeightFormat f = WeightFormat::fp8_e4m3_block128;
  CHECK(code_value(f, 0x7e) == 448);     // the largest
  CHECK(code_value(f, 0x01) == 0x1p-9);  // the least subnormal
  CHECK(code_value(f, 0x08) == 0x1p-6);  // the least normal
  CHECK(code_value(f, 0xb8) == -1);      // S.0111.000
  CHECK(std::isnan(code_value(f, 0xff)));
  CHECK(contracts::code_value(WeightFormat::int4_group, 9) == -7);
  CHECK(contracts::code_value(WeightFormat::int8_channel, 0x81) == -127);
}

TEST_CASE("gemm.pack: quantized packs read back as the judge dequantizes, padding zero",
          "[formats][pack]") {
  std::mt19937_64 rng(7);
  for (WeightFormat f : kQuantized) {
    DYNAMIC_SECTION(format_name(f)) {
      ContractScope full{Level::full, Semantic::enforce};  // roundtrip runs too
      for (const Shape& s : kShapes) {
        INFO("N=" << s.n << " K=" << s.k);
        const Quant w = make(f, s.n, s.k, rng), u = make(f, s.n, s.k, rng);
        const auto p = gemm::PackedWeights::pack(w.view);
        const auto pair = gemm::PackedWeights::pack(w.view, u.view);
        const auto t = gemm::PackedWeights::pack_transposed(w.view, u.view);
        REQUIRE((p.n() == s.n && p.k() == s.k && t.n() == s.k && t.k() == 2 * s.n));
        for (std::size_t n = 0; n < p.np(); ++n)
          for (std::size_t k = 0; k < p.kp(); ++k) {
            const bf16 want = n < s.n && k < s.k ? contracts::kernel_weight(w.view, n, k) : bf16{};
            REQUIRE(p.at(n, k).bits == want.bits);
          }
        for (std::size_t n = 0; n < s.n; ++n)  // row n of u is column 16 (2 (n / 16) + 1) + n % 16
          REQUIRE(pair.at(32 * (n / 16) + 16 + n % 16, s.k - 1).bits ==
                  contracts::kernel_weight(u.view, n, s.k - 1).bits);
        for (std::size_t k = 0; k < s.k; ++k)  // W = [w; u]^T: column k holds w's and u's column k
          REQUIRE((t.at(k, s.n - 1).bits == contracts::kernel_weight(w.view, s.n - 1, k).bits &&
                   t.at(k, 2 * s.n - 1).bits == contracts::kernel_weight(u.view, s.n - 1, k).bits));
        // Codes, the scale table (its columns over kp) and a table row per column.
        const std::size_t bc = format_info(f).block_cols, cols = bc ? (p.kp() + bc - 1) / bc : 1;
        CHECK(p.bytes() == p.np() * p.kp() * format_info(f).code_bits / 8 +
                               (w.view.scale_rows() * cols + p.np()) * sizeof(float));
      }
    }
  }
}

TEST_CASE(
    "gemm.matmul: quantized packs on every usable ISA, within the exact weights' bound and "
    "bit for bit the bf16 pack of the dequantized weights",
    "[formats][matmul][numeric]") {
  std::mt19937_64 rng(11);
  for (WeightFormat f : kQuantized)
    for (Isa isa : usable_isas()) {
      DYNAMIC_SECTION(format_name(f) << " " << isa_name(isa)) {
        for (const Shape& s : kShapes) {
          INFO("M=" << s.m << " N=" << s.n << " K=" << s.k);
          const Quant w = make(f, s.n, s.k, rng);
          const auto a = random_a(rng, s.m * s.k);
          const std::vector<bf16> dq = w.dequantized();
          for (std::size_t n = 0; n < s.n; ++n)  // §13 on every weight
            for (std::size_t k = 0; k < s.k; ++k) {
              const double wx = contracts::exact_weight(w.view, n, k);
              REQUIRE(std::fabs(dq[n * s.k + k].to_float() - wx) <=
                      bounds::dequantized(std::fabs(wx)));
            }
          std::vector<float> c(s.m * s.n, NAN), c16(s.m * s.n, NAN);
          {
            ContractScope full{Level::full, Semantic::enforce};  // probes, within_bound too
            gemm::matmul(MatView<const bf16>(a.data(), s.m, s.k), gemm::PackedWeights::pack(w.view),
                         MatView<float>(c.data(), s.m, s.n), isa);
            gemm::matmul(MatView<const bf16>(a.data(), s.m, s.k),
                         gemm::PackedWeights::pack(MatView<const bf16>(dq.data(), s.n, s.k)),
                         MatView<float>(c16.data(), s.m, s.n), isa);
          }
          REQUIRE(std::memcmp(c.data(), c16.data(), c.size() * sizeof(float)) == 0);
          const fixture::ExactGemm e = fixture::exact_gemm(a, s.m, s.k, w.view, dq);
          CHECK(compare::bounded(c, e.ref, e.bound).pass());
        }
      }
    }
}

TEST_CASE("gemm.matmul: a quantized pack's result is the same for 1 and 3 threads",
          "[formats][matmul]") {
  std::mt19937_64 rng(5);
  const Quant w = make(WeightFormat::int4_group, 300, 520, rng);
  const auto a = random_a(rng, 70 * 520);
  const auto p = gemm::PackedWeights::pack(w.view);
  std::vector<float> c1(70 * 300), c3(70 * 300);
  for (auto* c : {&c1, &c3}) {
    oneapi::tbb::global_control g(oneapi::tbb::global_control::max_allowed_parallelism,
                                  c == &c1 ? 1 : 3);
    gemm::matmul(MatView<const bf16>(a.data(), 70, 520), p, MatView<float>(c->data(), 70, 300),
                 default_isa());
  }
  CHECK(std::memcmp(c1.data(), c3.data(), c1.size() * sizeof(float)) == 0);
}

TEST_CASE("gemm.pack: q_shape, q_code, q_scale, w_finite and w_range on quantized weights",
          "[formats][pack][shape]") {
  std::mt19937_64 rng(3);
  const auto expect = [](const QuantView& v, std::string_view clause, std::string_view location,
                         Level level = Level::check) {
    const auto got =
        test::expect_violation([&] { (void)gemm::PackedWeights::pack(v); }, clause, level);
    CHECK(got.location == location);
  };
  Quant q8 = make(WeightFormat::int8_channel, 20, 40, rng);
  QuantView v = q8.view;
  v.stride = 39;
  expect(v, "gemm.pack.q_shape", "");
  v = q8.view, v.format = WeightFormat::bf16;
  expect(v, "gemm.pack.q_shape", "");
  Quant other = make(WeightFormat::int8_channel, 21, 40, rng);
  CHECK(test::expect_violation([&] { (void)gemm::PackedWeights::pack(q8.view, other.view); },
                               "gemm.pack.q_shape", Level::check)
            .clause == "gemm.pack.q_shape");
  q8.codes[3 * q8.view.stride + 5] = 0x80;  // -128: not a symmetric int8 code
  expect(q8.view, "gemm.pack.q_code", "w[3, 5]");
  Quant q4 = make(WeightFormat::int4_group, 20, 40, rng);
  q4.codes[2 * q4.view.stride + 3] =
      static_cast<std::uint8_t>((q4.codes[2 * q4.view.stride + 3] & 0x0f) | 0x80);
  expect(q4.view, "gemm.pack.q_code", "w[2, 7]");  // nibble 8 (-8): the high nibble of byte 3
  Quant f8 = make(WeightFormat::fp8_e4m3_block128, 20, 40, rng);
  f8.codes[19 * f8.view.stride + 39] = 0xff;  // NaN
  expect(f8.view, "gemm.pack.q_code", "w[19, 39]");
  Quant s = make(WeightFormat::int4_group, 20, 300, rng);
  for (float bad : {0.0f, -1.0f, NAN, INFINITY}) {
    Quant t = s;
    t.scales[4 * t.view.scale_stride + 2] = bad;
    expect(t.view, "gemm.pack.q_scale", "w scale[4, 2]");
  }
  Quant big = make(WeightFormat::int8_channel, 4, 8, rng);
  big.scales[2 * big.view.scale_stride] = 3e38f;  // code * scale overflows
  big.codes[2 * big.view.stride] = 100;
  expect(big.view, "gemm.pack.w_finite", "w[2, 0]");
  Quant tiny = make(WeightFormat::int8_channel, 4, 8, rng);
  // Input data, not a tolerance: code * 1e-30 lies below w_range's 2^-60.
  tiny.scales[1 * tiny.view.scale_stride] = 1e-30f;
  tiny.codes[1 * tiny.view.stride + 6] = 3;
  for (std::size_t k = 0; k < 6; ++k) tiny.codes[1 * tiny.view.stride + k] = 0;
  expect(tiny.view, "gemm.pack.w_range", "w[1, 6]", Level::audit);
}

TEST_CASE("gemm.pack: roundtrip and checksum catch a quantized pack's codes or scales changed",
          "[formats][pack][memory]") {
  std::mt19937_64 rng(9);
  const Quant w = make(WeightFormat::int8_channel, 40, 64, rng);
  auto p = gemm::PackedWeights::pack(w.view);
  // Packed element (n = 17, k = 6): panel 1, k pair 3, lane 1.
  auto* codes = reinterpret_cast<std::uint8_t*>(detail::PackAccess::data(p));
  const std::size_t e = 1 * p.kp() * 16 + 3 * 32 + 1 * 2;
  codes[e] = static_cast<std::uint8_t>(codes[e] + 1);
  auto v = test::expect_violation(
      [&] {
        detail::Checker c{"gemm.pack"};
        contracts::gemm_pack_quantized_post(c, w.view, {}, false, p);
      },
      "gemm.pack.roundtrip", Level::check);
  CHECK(v.location == "w[17, 6] of w");
  std::vector<bf16> a(3 * 64, bf16(1.0f));
  std::vector<float> c(3 * 40);
  test::expect_violation(
      [&] {
        gemm::matmul(MatView<const bf16>(a.data(), 3, 64), p, MatView<float>(c.data(), 3, 40),
                     default_isa());
      },
      "gemm.pack.checksum", Level::full);
  auto q = gemm::PackedWeights::pack(w.view);
  detail::PackAccess::scales(q)[5] *= 2;  // a scale changed after packing: the last part
  test::expect_violation(
      [&] {
        gemm::matmul(MatView<const bf16>(a.data(), 3, 64), q, MatView<float>(c.data(), 3, 40),
                     default_isa());
      },
      "gemm.pack.checksum", Level::full);
}

TEST_CASE("formats: the quantizer rounds to the nearest code of the block's scale",
          "[formats][quantize]") {
  std::mt19937_64 rng(13);
  std::normal_distribution<float> nd(0, 1);
  for (WeightFormat f : kQuantized) {
    DYNAMIC_SECTION(format_name(f)) {
      const std::size_t rows = 131, cols = 259;  // partial blocks at both edges
      std::vector<float> w(rows * cols);
      for (auto& v : w) v = nd(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 9) - 4);
      for (std::size_t k = 0; k < cols; ++k) w[7 * cols + k] = 0;  // an all-zero row
      fixture::QuantMatrix q;
      q.view.format = f, q.view.rows = rows, q.view.cols = cols;
      q.view.stride = q.view.row_bytes(), q.view.scale_stride = q.view.scale_cols();
      q.codes.assign(rows * q.view.stride, 0),
          q.scales.assign(q.view.scale_rows() * q.view.scale_stride, 0);
      q.rebind();
      quantize(f, MatView<const float>(w.data(), rows, cols), q.out());
      const FormatInfo& info = format_info(f);
      const double top = f == WeightFormat::fp8_e4m3_block128 ? 448 : info.code_max;
      const std::size_t br = info.block_rows ? info.block_rows : rows,
                        bc = info.block_cols ? info.block_cols : cols;
      for (std::size_t n = 0; n < rows; ++n)
        for (std::size_t k = 0; k < cols; ++k) {
          INFO("n=" << n << " k=" << k);
          REQUIRE(contracts::code_valid(f, q.view.code(n, k)));
          double amax = 0;
          for (std::size_t i = n / br * br; i < std::min(rows, n / br * br + br); ++i)
            for (std::size_t j = k / bc * bc; j < std::min(cols, k / bc * bc + bc); ++j)
              amax = std::max(amax, std::fabs(double(w[i * cols + j])));
          const float s = q.view.scale(n, k);
          REQUIRE(s == (amax > 0 ? static_cast<float>(amax / top) : 1.0f));
          // No valid code is nearer w / s than the chosen one.
          const double target = w[n * cols + k] / double(s),
                       got = std::fabs(contracts::code_value(f, q.view.code(n, k)) - target);
          for (unsigned c = 0; c < (info.code_bits == 4 ? 16u : 256u); ++c)
            if (contracts::code_valid(f, c))
              REQUIRE(got <= std::fabs(contracts::code_value(f, c) - target));
        }
      CHECK(gemm::PackedWeights::pack(q.view).n() == rows);  // every clause accepts it
    }
  }
}

TEST_CASE("gemm.decode: every decoder gives the scalar one's bits, every code and layout",
          "[formats][decode]") {
  if (!isa_usable(Isa::avx512_bf16)) {
    WARN("no AVX-512 here: only the scalar decoder runs");
    return;
  }
  std::mt19937_64 rng(41);
  for (WeightFormat f : kQuantized) {
    DYNAMIC_SECTION(format_name(f)) {
      // Shapes past one 128-block each way; every code value appears; u's
      // scales make denormal products (packed at check: w_range is audit's).
      // v's are the least that keep every product normal for e4m3 (2^-117
      // times its least code 2^-9), so its pack skips the per-step check.
      const Quant w = make(f, 300, 260, rng),
                  u = fixture::random_quantized(f, 300, 260, rng, -135, -118),
                  v = fixture::random_quantized(f, 300, 260, rng, -117, -116);
      ContractScope check{Level::check, Semantic::enforce};
      const gemm::PackedWeights packs[] = {gemm::PackedWeights::pack(w.view),
                                           gemm::PackedWeights::pack(w.view, u.view),
                                           gemm::PackedWeights::pack_transposed(w.view, u.view),
                                           gemm::PackedWeights::pack_transposed(v.view)};
      for (const auto& p : packs) {
        const std::size_t panels = p.np() / gemm::kPanel, n = panels * p.kp() * gemm::kPanel;
        std::vector<bf16> a(n), b(n);
        p.decode_panels(0, panels, a.data(), gemm::decode_scalar);
        p.decode_panels(0, panels, b.data(), gemm::decode_avx512);
        REQUIRE(std::memcmp(a.data(), b.data(), n * sizeof(bf16)) == 0);
        for (std::size_t q = 0; q < n; q += 97)  // the scalar decoder reads as at() does
          REQUIRE(a[q].bits ==
                  p.at(q / (p.kp() * gemm::kPanel) * gemm::kPanel + (q / 2) % gemm::kPanel,
                       (q % (p.kp() * gemm::kPanel)) / 32 * 2 + q % 2)
                      .bits);
      }
    }
  }
}
