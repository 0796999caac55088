// GEMM: every usable ISA against the reference within bounds over odd
// shapes; bit-exact models of the AMX and AVX-512 accumulation orders;
// determinism across thread counts; every gemm clause.
#include "contracts/gemm/gemm.hpp"

#include <oneapi/tbb/global_control.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "contracts/engine/checks.hpp"
#include "contracts/engine/compare.hpp"
#include "contracts/gemm/pack_audit.hpp"
#include "contracts/numeric/functions.hpp"
#include "contracts/numeric/rounding.hpp"
#include "moecert/gemm.hpp"
#include "moecert/isa.hpp"
#include "moecert/memory.hpp"
#include "ops/core/aligned.hpp"
#include "ops/gemm/amx_tile_model.hpp"
#include "ops/gemm/exp_poly.hpp"
#include "ops/gemm/loops.hpp"
#include "ops/gemm/ukernel.hpp"
#include "test_util.hpp"

using namespace moecert;

namespace {

std::vector<bf16> random_bf16(std::mt19937_64& rng, std::size_t n, float scale = 1) {
  std::normal_distribution<float> nd(0, scale);
  std::vector<bf16> v(n);
  for (auto& x : v) {
    x = bf16(nd(rng));
    if (!detail::bf16_in_range(x)) x = bf16(0.0f);
  }
  return v;
}

std::vector<float> run(Isa isa, const std::vector<bf16>& a, std::size_t m, std::size_t k,
                       const gemm::PackedWeights& w, float fill = NAN) {
  std::vector<float> c(m * w.n(), fill);
  gemm::matmul(MatView<const bf16>(a.data(), m, k), w, MatView<float>(c.data(), m, w.n()), isa);
  return c;
}

// Plain models of two accumulation orders (docs/DESIGN.md, Kernels).
float model_amx(const bf16* a, const bf16* b, std::size_t k) {
  using gemm::amx_model::ftz;
  float c = 0;
  for (std::size_t k0 = 0; k0 < k; k0 += 32) {
    float even = 0, odd = 0;
    for (std::size_t kk = k0; kk < k0 + 32; kk += 2) {
      const float a0 = kk < k ? a[kk].to_float() : 0, b0 = kk < k ? b[kk].to_float() : 0;
      const float a1 = kk + 1 < k ? a[kk + 1].to_float() : 0,
                  b1 = kk + 1 < k ? b[kk + 1].to_float() : 0;
      even = ftz(std::fma(ftz(a0), ftz(b0), even));
      odd = ftz(std::fma(ftz(a1), ftz(b1), odd));
    }
    c = ftz(c + ftz(even + odd));
  }
  return c;
}
float model_avx512(const bf16* a, const bf16* b, std::size_t k) {
  using gemm::amx_model::ftz;
  float acc = 0;
  for (std::size_t kk = 0; kk < k; kk += 2) {
    const float a1 = kk + 1 < k ? a[kk + 1].to_float() : 0,
                b1 = kk + 1 < k ? b[kk + 1].to_float() : 0;
    acc = ftz(std::fma(ftz(a1), ftz(b1), acc));
    acc = ftz(std::fma(ftz(a[kk].to_float()), ftz(b[kk].to_float()), acc));
  }
  return acc;
}

struct Shape {
  std::size_t m, n, k;
};
const Shape kShapes[] = {{0, 16, 32},  {1, 1, 1},     {1, 17, 3},   {7, 31, 33},    {33, 50, 100},
                         {65, 64, 64}, {40, 96, 257}, {3, 200, 31}, {100, 33, 500}, {40, 40, 1100}};

// One MR-row block of A (av, k columns) packed for kernel, and the
// microkernel arguments that multiply it by all of w into a C of row stride
// ldc (args.a points into the block: keep both alive; set c before a call).
struct OneBlock {
  std::vector<bf16> ap;
  gemm::UkernelArgs args{};
};
OneBlock one_block(const gemm::KernelInfo& kernel, const std::vector<bf16>& av, std::size_t k,
                   const gemm::PackedWeights& w, std::size_t ldc) {
  OneBlock b;
  b.ap.resize(gemm::a_size(kernel.a_layout, kernel.mr, w.kp()));
  gemm::pack_a(kernel.a_layout, MatView<const bf16>(av.data(), kernel.mr, k), nullptr, kernel.mr,
               kernel.mr, w.kp(), b.ap.data());
  b.args.a = b.ap.data(), b.args.lda = gemm::a_stride(kernel.a_layout, w.kp());
  b.args.b = w.data(), b.args.panel_stride = w.kp() * gemm::kPanel, b.args.kp = w.kp(),
  b.args.ldc = ldc;
  return b;
}

}  // namespace

TEST_CASE("gemm.matmul: every usable ISA within bounds of the reference over odd shapes",
          "[gemm][matmul][numeric]") {
  std::mt19937_64 rng(31);
  for (Isa isa : usable_isas()) {
    DYNAMIC_SECTION(isa_name(isa)) {
      for (const auto& s : kShapes) {
        INFO("M=" << s.m << " N=" << s.n << " K=" << s.k);
        const auto a = random_bf16(rng, s.m * s.k), wv = random_bf16(rng, s.n * s.k);
        const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), s.n, s.k));
        std::vector<float> c;
        {
          ContractScope full{Level::full, Semantic::enforce};  // the within_bound clause runs too
          c = run(isa, a, s.m, s.k, w);
        }
        std::vector<double> ref, bound;
        for (std::size_t i = 0; i < s.m; ++i)
          for (std::size_t j = 0; j < s.n; ++j) {
            ref.push_back(
                ref::to_double(ref::dot<ref::DoubleDouble>(&a[i * s.k], &wv[j * s.k], s.k)));
            double sa = 0;
            for (std::size_t kk = 0; kk < s.k; ++kk)
              sa += std::fabs(double(a[i * s.k + kk].to_float()) * wv[j * s.k + kk].to_float());
            bound.push_back(bounds::dot(s.k, sa));
          }
        const auto cmp = compare::bounded(c, ref, bound);
        CHECK(cmp.pass());
        CHECK(cmp.max_utilization <= 1);
      }
    }
  }
}

namespace {
// Every element of `isa`'s result over kShapes equals `model` bit for bit.
template <class Model>
void expect_bit_exact(Isa isa, Model model, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (const auto& s : kShapes) {
    const auto a = random_bf16(rng, s.m * s.k, 3), wv = random_bf16(rng, s.n * s.k, 3);
    const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), s.n, s.k));
    const auto c = run(isa, a, s.m, s.k, w);
    for (std::size_t i = 0; i < s.m; ++i)
      for (std::size_t j = 0; j < s.n; ++j) {
        const float want = model(&a[i * s.k], &wv[j * s.k], s.k);
        REQUIRE(std::memcmp(&c[i * s.n + j], &want, 4) == 0);
      }
  }
}
}  // namespace

TEST_CASE("gemm.matmul: amx_emu equals a plain model of TDPBF16PS bit for bit",
          "[gemm][matmul][amx_emu]") {
  expect_bit_exact(Isa::amx_emu, model_amx, 32);
}

TEST_CASE("gemm.matmul: avx512_bf16 equals a plain model of VDPBF16PS bit for bit",
          "[gemm][matmul][avx512_bf16]") {
  if (!isa_usable(Isa::avx512_bf16)) {
    WARN("avx512_bf16 not usable here: nothing to compare");
    return;
  }
  expect_bit_exact(Isa::avx512_bf16, model_avx512, 33);
}

TEST_CASE("gemm.matmul: avx2 equals scalar bit for bit", "[gemm][matmul][avx2]") {
  if (!isa_usable(Isa::avx2)) {
    WARN("avx2 not usable here: nothing to compare");
    return;
  }
  std::mt19937_64 rng(35);
  for (const auto& s : kShapes) {
    INFO("M=" << s.m << " N=" << s.n << " K=" << s.k);
    const auto a = random_bf16(rng, s.m * s.k, 3), wv = random_bf16(rng, s.n * s.k, 3);
    const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), s.n, s.k));
    const auto c = run(Isa::avx2, a, s.m, s.k, w), want = run(Isa::scalar, a, s.m, s.k, w);
    REQUIRE(c.size() == want.size());
    if (!c.empty()) REQUIRE(std::memcmp(c.data(), want.data(), c.size() * 4) == 0);
  }
  ContractScope off{Level::off};  // products below 2^-126 too (the range clauses refuse them)
  const std::vector<bf16> a = {bf16(0x1p-70f), bf16(-0x1p-60f)},
                          wv = {bf16(0x1p-70f), bf16(0x1p-67f)};
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), 1, 2));
  const float got = run(Isa::avx2, a, 1, 2, w)[0], want = run(Isa::scalar, a, 1, 2, w)[0];
  CHECK(std::memcmp(&got, &want, 4) == 0);
}

TEST_CASE("gemm.matmul: denormal flushing in the AMX model", "[gemm][amx_emu]") {
  // A product below 2^-126 is flushed by TDPBF16PS; the model must flush it.
  ContractScope off{Level::off};  // the range clauses would refuse these inputs
  const std::vector<bf16> a = {bf16(0x1p-70f)}, wv = {bf16(0x1p-70f)};
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), 1, 1));
  CHECK(run(Isa::amx_emu, a, 1, 1, w)[0] == 0.0f);
  CHECK(run(Isa::scalar, a, 1, 1, w)[0] == 0x1p-140f);
}

TEST_CASE("gemm.matmul: results are bitwise identical for 1, 2 and 7 threads", "[gemm][matmul]") {
  std::mt19937_64 rng(34);
  const std::size_t m = 150, n = 300, k = 200;
  const auto a = random_bf16(rng, m * k), wv = random_bf16(rng, n * k);
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));
  for (Isa isa : usable_isas()) {
    std::vector<std::vector<float>> out;
    for (int threads : {1, 2, 7}) {
      oneapi::tbb::global_control gc(oneapi::tbb::global_control::max_allowed_parallelism, threads);
      out.push_back(run(isa, a, m, k, w));
    }
    INFO(isa_name(isa));
    CHECK(std::memcmp(out[0].data(), out[1].data(), out[0].size() * 4) == 0);
    CHECK(std::memcmp(out[0].data(), out[2].data(), out[0].size() * 4) == 0);
  }
}

TEST_CASE("gemm.matmul: an ISA this machine cannot run is refused", "[gemm][isa]") {
  for (Isa isa : kAllIsas)
    if (!isa_usable(isa)) CHECK_THROWS_AS(gemm::kernel_info(isa), std::invalid_argument);
  CHECK(std::string(gemm::kernel_info(Isa::amx_emu).name) == "ukernel_amx_emu_32x32");
  CHECK(gemm::kernel_info(Isa::scalar).isa == Isa::scalar);
}

TEST_CASE("gemm.pack: packed layout reads back and pads with zeros", "[gemm][pack]") {
  std::mt19937_64 rng(35);
  const auto g = random_bf16(rng, 20 * 45), u = random_bf16(rng, 20 * 45);
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(g.data(), 20, 45));
  CHECK(w.np() == 32);
  CHECK(w.kp() == 64);
  for (std::size_t n = 0; n < w.np(); ++n)
    for (std::size_t k = 0; k < w.kp(); ++k)
      REQUIRE(w.at(n, k) == ((n < 20 && k < 45) ? g[n * 45 + k] : bf16(0.0f)));
  const auto gu = gemm::PackedWeights::pack(MatView<const bf16>(g.data(), 20, 45),
                                            MatView<const bf16>(u.data(), 20, 45));
  CHECK(gu.n() == 64);  // two panels of each, interleaved
  CHECK(gu.at(16 + 3, 7) == u[3 * 45 + 7]);
  CHECK(gu.at(32 + 2, 7) == g[(16 + 2) * 45 + 7]);
  CHECK(gu.at(48 + 2, 7) == u[(16 + 2) * 45 + 7]);
  CHECK(gu.at(48 + 5, 7) == bf16(0.0f));
  CHECK(w.checksum() == w.compute_checksum());
}

TEST_CASE("gemm.pack: a narrow probe read from its panel is make_probe's, bit for bit",
          "[gemm][pack][probe]") {
  // Odd and even K; widths 4 and, at the last columns of N = 42, 2 and 1;
  // a third of the weights +-0 (a probe entry of zeros is +0).
  std::mt19937_64 rng(36);
  for (const std::size_t k : {45, 64}) {
    auto g = random_bf16(rng, 42 * k);
    for (std::size_t i = 0; i < g.size(); i += 3)
      g[i] = bf16(i % 2 ? -0.0f : 0.0f);  // signed zeros
    const auto w = gemm::PackedWeights::pack(MatView<const bf16>(g.data(), 42, k));
    auto b = [&w](std::size_t j, std::size_t kk) { return w.at(j, kk); };
    for (std::size_t j0 = 0; j0 < w.n(); j0 += 4)
      for (const std::size_t width : {std::size_t{4}, std::size_t{1}}) {
        const std::size_t wd = std::min(width, w.n() - j0);
        const auto want = verify::make_probe(w.k(), b, j0, wd, 99 + j0);
        const auto got = contracts::panel_probe(w, j0, wd, 99 + j0);
        INFO("k " << k << " j0 " << j0 << " width " << wd);
        REQUIRE(got.r == want.r);
        REQUIRE(std::memcmp(got.br.data(), want.br.data(), want.br.size() * sizeof(float)) == 0);
        REQUIRE(std::memcmp(got.babs.data(), want.babs.data(), want.babs.size() * sizeof(float)) ==
                0);
      }
  }
}

TEST_CASE("gemm.matmul: shape clause, output untouched", "[gemm][matmul][shape]") {
  std::vector<bf16> a(4 * 8, bf16(1.0f)), wv(3 * 8, bf16(1.0f));
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), 3, 8));
  std::vector<float> c(4 * 3, 5.0f);
  test::expect_violation(
      [&] {
        gemm::matmul(MatView<const bf16>(a.data(), 4, 7), w, MatView<float>(c.data(), 4, 3),
                     Isa::scalar);
      },
      "gemm.matmul.shape");
  CHECK(c == std::vector<float>(12, 5.0f));
}

TEST_CASE("gemm.matmul: a_finite and a_range clauses", "[gemm][matmul][finite]") {
  std::vector<bf16> a(2 * 4, bf16(1.0f)), wv(2 * 4, bf16(1.0f));
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), 2, 4));
  std::vector<float> c(4, 5.0f);
  a[5] = bf16(NAN);
  auto v = test::expect_violation(
      [&] {
        gemm::matmul(MatView<const bf16>(a.data(), 2, 4), w, MatView<float>(c.data(), 2, 2),
                     Isa::scalar);
      },
      "gemm.matmul.a_finite");
  CHECK(v.location == "a[1, 1]");
  a[5] = bf16::from_bits(0x0001);  // a bf16 denormal: flushed by AMX, so out of range
  test::expect_violation(
      [&] {
        gemm::matmul(MatView<const bf16>(a.data(), 2, 4), w, MatView<float>(c.data(), 2, 2),
                     Isa::scalar);
      },
      "gemm.matmul.a_range");
  CHECK(c == std::vector<float>(4, 5.0f));
}

TEST_CASE("gemm.matmul: no_alias clause", "[gemm][matmul][alias]") {
  std::vector<bf16> wv(2 * 4, bf16(1.0f));
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), 2, 4));
  std::vector<float> buf(64, 0.0f);
  // A (bf16) viewed over the same bytes as C.
  MatView<const bf16> a(reinterpret_cast<const bf16*>(buf.data()), 2, 4);
  test::expect_violation(
      [&] { gemm::matmul(a, w, MatView<float>(buf.data() + 1, 2, 2), Isa::scalar); },
      "gemm.matmul.no_alias");
}

TEST_CASE("gemm.matmul: c_finite fires when in-range products overflow", "[gemm][matmul][finite]") {
  std::vector<bf16> a(300, bf16(0x1p60f)), wv(300, bf16(0x1p60f));
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), 1, 300));
  std::vector<float> c(1);
  test::expect_violation(
      [&] {
        gemm::matmul(MatView<const bf16>(a.data(), 1, 300), w, MatView<float>(c.data(), 1, 1),
                     Isa::scalar);
      },
      "gemm.matmul.c_finite", Level::check);
}

TEST_CASE("gemm.matmul: probe and within_bound clauses catch a wrong result",
          "[gemm][matmul][numeric]") {
  std::mt19937_64 rng(36);
  const std::size_t m = 5, n = 9, k = 64;
  const auto a = random_bf16(rng, m * k), wv = random_bf16(rng, n * k);
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));
  auto c = run(Isa::scalar, a, m, k, w, 0);
  c[2 * n + 4] += 1.0f;  // a wrong element, as a buggy kernel would leave it
  MatView<const bf16> av(a.data(), m, k);
  MatView<const float> cv(c.data(), m, n);
  test::expect_violation(
      [&] {
        detail::Checker chk{"gemm.matmul"};
        contracts::gemm_matmul_post(chk, av, w, cv);
      },
      "gemm.matmul.probe", Level::audit);
  // Under observe both numeric clauses run; within_bound names the element.
  ContractSettings no_probe{Level::full, Semantic::observe};
  static int fired = 0;
  auto prev = set_violation_handler(
      [](const Violation& x) { fired += x.clause == "gemm.matmul.within_bound"; });
  {
    ContractScope scope{no_probe};
    detail::Checker chk{"gemm.matmul"};
    contracts::gemm_matmul_post(chk, av, w, cv);
  }
  set_violation_handler(prev);
  CHECK(fired == 1);
  CHECK(violation_count("gemm.matmul.within_bound") >= 1);
}

TEST_CASE("gemm.pack: roundtrip catches a packed element that is not the input's", "[gemm][pack]") {
  std::vector<bf16> g(20 * 40), u(20 * 40);
  for (std::size_t i = 0; i < g.size(); ++i)
    g[i] = bf16(float(i % 13) - 6), u[i] = bf16(float(i % 7) + 1);
  const MatView<const bf16> gv(g.data(), 20, 40), uv(u.data(), 20, 40);
  ContractScope s{Level::check, Semantic::enforce};
  auto w = gemm::PackedWeights::pack(gv, uv);  // interleaved: a correct pack passes
  // Swap one VNNI pair of up-row 17 (column 16 + 16 + 1 of the packed W).
  const std::size_t n = 2 * gemm::kPanel + gemm::kPanel + 1, k = 6;
  std::swap(detail::PackAccess::data(w)[(n / gemm::kPanel) * w.kp() * gemm::kPanel +
                                        (k / 2) * 2 * gemm::kPanel + (n % gemm::kPanel) * 2],
            detail::PackAccess::data(w)[(n / gemm::kPanel) * w.kp() * gemm::kPanel +
                                        (k / 2) * 2 * gemm::kPanel + (n % gemm::kPanel) * 2 + 1]);
  auto v = test::expect_violation(
      [&] {
        detail::Checker c{"gemm.pack"};
        contracts::gemm_pack_post(c, gv, uv, w);
      },
      "gemm.pack.roundtrip", Level::check);
  CHECK(v.location == "w[17, 6]");
}

TEST_CASE("gemm.pack: w_finite, w_range and shape clauses", "[gemm][pack][finite]") {
  std::vector<bf16> wv(2 * 4, bf16(1.0f));
  wv[6] = bf16(INFINITY);
  test::expect_violation([&] { gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), 2, 4)); },
                         "gemm.pack.w_finite");
  wv[6] = bf16(0x1p100f);
  test::expect_violation([&] { gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), 2, 4)); },
                         "gemm.pack.w_range");
  wv[6] = bf16(1.0f);
  test::expect_violation(
      [&] {
        gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), 2, 4),
                                  MatView<const bf16>(wv.data(), 1, 4));
      },
      "gemm.pack.shape");
}

TEST_CASE("gemm.pack: pack_transposed(wt) is pack(wt^T) bit for bit", "[gemm][pack]") {
  // The LoRA backward's operands are packed from the stored factors' transposes.
  std::mt19937_64 rng(36);
  gemm::PackedWeights storage;
  const std::size_t shapes[][3] = {
      {1, 1, 1},    {2, 17, 19}, {8, 2048, 2048}, {45, 20, 20}, {16, 2 * 1408, 2 * 1408},
      {33, 16, 40}, {7, 31, 31}};  // wt rows, cols, stride
  for (const auto& [rows, cols, stride] : shapes) {
    const auto wtv = random_bf16(rng, rows * stride);
    const MatView<const bf16> wt(wtv.data(), rows, cols, stride);
    std::vector<bf16> w(cols * rows);  // W = wt^T, dense
    for (std::size_t k = 0; k < rows; ++k)
      for (std::size_t n = 0; n < cols; ++n) w[n * rows + k] = wt(k, n);
    const auto plain = gemm::PackedWeights::pack(MatView<const bf16>(w.data(), cols, rows));
    ContractScope full{Level::full, Semantic::enforce};  // the roundtrip clause runs too
    storage = gemm::PackedWeights::pack_transposed(wt, std::move(storage));
    INFO("wt " << rows << " x " << cols << " stride " << stride);
    REQUIRE(storage.n() == plain.n());
    REQUIRE(storage.k() == plain.k());
    REQUIRE(storage.np() == plain.np());
    REQUIRE(storage.kp() == plain.kp());
    CHECK(std::memcmp(storage.data(), plain.data(), plain.size() * sizeof(bf16)) == 0);
    CHECK(storage.checksum() == plain.checksum());
  }
}

TEST_CASE("gemm.pack: pack_transposed's clauses", "[gemm][pack][finite]") {
  std::vector<bf16> wv(3 * 5, bf16(1.0f));
  wv[7] = bf16(NAN);
  test::expect_violation(
      [&] { gemm::PackedWeights::pack_transposed(MatView<const bf16>(wv.data(), 3, 5), {}); },
      "gemm.pack.w_finite");
  wv[7] = bf16(0x1p-100f);
  test::expect_violation(
      [&] { gemm::PackedWeights::pack_transposed(MatView<const bf16>(wv.data(), 3, 5), {}); },
      "gemm.pack.w_range");
  wv[7] = bf16(1.0f);
  test::expect_violation(
      [&] { gemm::PackedWeights::pack_transposed(MatView<const bf16>(wv.data(), 3, 5, 4), {}); },
      "gemm.pack.shape");
  // Roundtrip: one VNNI pair of the packed W swapped; wt[2, 3] (W[3, 2]) no longer reads back.
  for (std::size_t i = 0; i < wv.size(); ++i) wv[i] = bf16(float(i) + 1);
  const MatView<const bf16> wt(wv.data(), 3, 5);
  ContractScope s{Level::check, Semantic::enforce};
  auto w = gemm::PackedWeights::pack_transposed(wt, {});
  const std::size_t n = 3, k = 2, at = (k / 2) * 2 * gemm::kPanel + n * 2;
  std::swap(detail::PackAccess::data(w)[at], detail::PackAccess::data(w)[at + 1]);
  auto r = test::expect_violation(
      [&] {
        detail::Checker c{"gemm.pack"};
        contracts::gemm_pack_transposed_post(c, wt, w);
      },
      "gemm.pack.roundtrip", Level::check);
  CHECK(r.location == "wt[2, 3]");
}

TEST_CASE("gemm.pack: checksum clause catches packed weights changed after packing",
          "[gemm][pack][memory]") {
  std::vector<bf16> a(4, bf16(1.0f)), wv(2 * 4, bf16(1.0f));
  auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), 2, 4));
  std::vector<float> c(2, 7.0f);
  detail::PackAccess::data(w)[1] = bf16(2.0f);  // a stale or overwritten packed copy
  test::expect_violation(
      [&] {
        gemm::matmul(MatView<const bf16>(a.data(), 1, 4), w, MatView<float>(c.data(), 1, 2),
                     Isa::scalar);
      },
      "gemm.pack.checksum", Level::audit);
  CHECK(c == std::vector<float>(2, 7.0f));
}

TEST_CASE("gemm.pack: at audit the checksum verifies one part per call in rotation",
          "[gemm][pack][memory]") {
  // 1024 columns: 64 panels, one per part; the change sits in the last one.
  const std::size_t n = 16 * gemm::PackedWeights::kChecksumParts, k = 32;
  std::vector<bf16> a(k, bf16(1.0f)), wv(n * k, bf16(0.5f));
  auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));
  REQUIRE(w.checksum_parts() == gemm::PackedWeights::kChecksumParts);
  detail::PackAccess::data(w)[w.size() - 1] = bf16(2.0f);  // a weight in the last panel
  std::vector<float> c(n);
  auto call = [&] {
    gemm::matmul(MatView<const bf16>(a.data(), 1, k), w, MatView<float>(c.data(), 1, n),
                 Isa::scalar);
  };
  {
    ContractScope audit{Level::audit, Semantic::enforce};
    for (std::size_t i = 0; i + 1 < gemm::PackedWeights::kChecksumParts; ++i)
      REQUIRE_NOTHROW(call());  // parts 0 .. 62
  }
  auto v = test::expect_violation(call, "gemm.pack.checksum", Level::audit);  // part 63
  CHECK(v.location == "w part 63 of 64");
  w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));  // a fresh rotation
  detail::PackAccess::data(w)[w.size() - 1] = bf16(2.0f);
  test::expect_violation(call, "gemm.pack.checksum", Level::full);  // every part, first call
}

TEST_CASE("gemm.matmul: the probe's narrow blocks see what the dense probe cannot",
          "[gemm][matmul][numeric]") {
  // Positive products: each element's bound is gamma_64 sum|p|, the dense
  // probe's the sum over all 256 columns, a narrow probe's over 4.
  std::mt19937_64 rng(37);
  std::uniform_real_distribution<float> u(0.5f, 1.0f);
  const std::size_t m = 3, n = 256, k = 64;
  std::vector<bf16> a(m * k), wv(n * k);
  for (auto& v : a) v = bf16(u(rng));
  for (auto& v : wv) v = bf16(u(rng));
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));
  auto c = [&] {
    ContractScope off{Level::off, Semantic::enforce};  // leaves the pack's rotation at call 0
    return run(Isa::scalar, a, m, k, w, 0);
  }();
  // Over one element's bound (~1.4e-4 here) and a 4-column block's sum,
  // under the dense probe's allowance (~0.04).
  c[1 * n + 101] += 0.004f;
  MatView<const bf16> av(a.data(), m, k);
  MatView<const float> cv(c.data(), m, n);
  auto post = [&] {
    detail::Checker chk{"gemm.matmul"};
    contracts::gemm_matmul_post(chk, av, w, cv);
  };
  // Call q probes the 4-column block q: column 101 is in block 25.
  static_assert(contracts::PackProbes::kNarrow == 1 && contracts::PackProbes::kNarrowWidth == 4);
  {
    ContractScope audit{Level::audit, Semantic::enforce};
    for (int q = 0; q < 25; ++q) REQUIRE_NOTHROW(post());
  }
  auto v = test::expect_violation(post, "gemm.matmul.probe", Level::audit);
  CHECK(v.location == "row 1 columns [100, 104)");
}

TEST_CASE("gemm.epilogue: exp_poly is within bounds::kExpUlps of exp",
          "[gemm][epilogue][numeric]") {
  // A sweep of the normal range (every 1021st float of [-87.3, 88.7]) and
  // 10^6 random points, against binary64 exp rounded to nearest.
  double worst = 0;
  auto check = [&](float x) {
    const double exact = std::exp(double(x));
    const double ulp = std::ldexp(1.0, std::ilogb(exact) - 23);  // binary32 ulp at exact
    const double err = std::fabs(double(gemm::exp_poly::exp(x)) - exact) / ulp;
    worst = std::max(worst, err);
    REQUIRE(err <= bounds::kExpUlps);
  };
  for (std::uint32_t u = std::bit_cast<std::uint32_t>(0.0f);
       u < std::bit_cast<std::uint32_t>(88.7f); u += 1021) {
    check(std::bit_cast<float>(u));
    if (std::bit_cast<float>(u) < 87.3f) check(-std::bit_cast<float>(u));
  }
  std::mt19937_64 rng(37);
  std::uniform_real_distribution<float> d(-87.3f, 88.7f);
  for (int i = 0; i < 1000000; ++i) check(d(rng));
  INFO("worst error " << worst << " ulp");
  CHECK(worst <= 1.0);  // measured: 1 ulp (the bound assumes 2)
  CHECK(gemm::exp_poly::exp(89.0f) == INFINITY);
  CHECK(gemm::exp_poly::exp(-104.0f) == 0.0f);
  CHECK(std::isnan(gemm::exp_poly::exp(NAN)));
  CHECK(gemm::exp_poly::exp(-100.0f) == std::exp(-100.0f));  // a correctly rounded denormal
}

// Inputs at exp_poly's edges (not tolerances): zeros, around its overflow and
// underflow thresholds, +-Inf, NaN, fp32 extremes, a denormal, the smallest normal.
const float kExpEdges[] = {0.0f,     -0.0f,     88.7f, -88.7f, 89.0f,  -89.0f, 103.0f,   -104.0f,
                           INFINITY, -INFINITY, NAN,   3e38f,  -3e38f, 1e-40f, 0x1p-126f};

TEST_CASE("gemm.epilogue: scalar and AVX-512 SwiGLU agree bit for bit",
          "[gemm][epilogue][avx512_bf16]") {
  if (!isa_usable(Isa::avx512_bf16)) {
    WARN("avx512_bf16 not usable here: nothing to compare");
    return;
  }
  std::mt19937_64 rng(38);
  std::vector<float> g(100003), u(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) {
    const float scale = (i % 7 == 0) ? 200.0f : 8.0f;
    g[i] = std::uniform_real_distribution<float>(-scale, scale)(rng);
    u[i] = std::uniform_real_distribution<float>(-4, 4)(rng);
  }
  for (std::size_t i = 0; i < std::size(kExpEdges); ++i) {
    g[i] = kExpEdges[i];
    u[i + 20] = kExpEdges[i];
    g[i + 20] = 1.5f;
  }
  std::vector<bf16> hs(g.size()), hv(g.size());
  gemm::swiglu_scalar(g.data(), u.data(), hs.data(), g.size());
  gemm::swiglu_avx512(g.data(), u.data(), hv.data(), g.size());
  for (std::size_t i = 0; i < g.size(); ++i) {
    INFO("g=" << g[i] << " u=" << u[i]);
    if (hs[i].is_nan())
      REQUIRE(hv[i].is_nan());  // NaN payloads may differ by operand order
    else
      REQUIRE(hs[i].bits == hv[i].bits);
  }
}

TEST_CASE("gemm.epilogue: scalar and AVX-512 SwiGLU backward agree bit for bit",
          "[gemm][epilogue][avx512_bf16]") {
  if (!isa_usable(Isa::avx512_bf16)) {
    WARN("avx512_bf16 not usable here: nothing to compare");
    return;
  }
  std::mt19937_64 rng(40);
  const std::size_t n = 100003;
  std::vector<float> g(n), u(n), dh(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float scale = (i % 7 == 0) ? 200.0f : 8.0f;
    g[i] = std::uniform_real_distribution<float>(-scale, scale)(rng);
    u[i] = std::uniform_real_distribution<float>(-4, 4)(rng);
    // Inputs, not tolerances: every 11th dh tiny, so products land near the denormals.
    dh[i] = std::uniform_real_distribution<float>(-1, 1)(rng) * (i % 11 == 0 ? 1e-30f : 1.0f);
  }
  for (std::size_t i = 0; i < std::size(kExpEdges); ++i)
    g[i] = u[i + 20] = dh[i + 40] = kExpEdges[i];
  for (const float w : {0.37f, 0.0f, -1.5f}) {
    // Odd lengths and offsets exercise the scalar tail of the vector kernel.
    for (const std::size_t len : {n, std::size_t{15}, std::size_t{17}}) {
      std::vector<bf16> gs(len), us(len), gv(len), uv(len);
      gemm::swiglu_backward_scalar(g.data(), u.data(), dh.data(), w, gs.data(), us.data(), len);
      gemm::swiglu_backward_avx512(g.data(), u.data(), dh.data(), w, gv.data(), uv.data(), len);
      for (std::size_t i = 0; i < len; ++i) {
        INFO("g=" << g[i] << " u=" << u[i] << " dh=" << dh[i] << " w=" << w);
        if (gs[i].is_nan())
          REQUIRE(gv[i].is_nan());
        else
          REQUIRE(gs[i].bits == gv[i].bits);
        if (us[i].is_nan())
          REQUIRE(uv[i].is_nan());
        else
          REQUIRE(us[i].bits == uv[i].bits);
      }
    }
  }
  // Against the formula written out here (proofs/layer.md §2) for one element.
  float a, b;
  gemm::exp_poly::swiglu_backward(1.25f, -0.5f, 2.0f, 0.5f, a, b);
  const float s = 1.0f / (1.0f + gemm::exp_poly::exp(-1.25f));
  CHECK(a == (1.0f * -0.5f) * (s * (1.0f + 1.25f * (1.0f - s))));
  CHECK(b == 1.0f * (1.25f * s));
}

TEST_CASE("gemm.epilogue: scaled rounding to bf16 is bf16(scale * x) in every implementation",
          "[gemm][epilogue]") {
  std::mt19937_64 rng(42);
  std::vector<float> x(4099);
  for (auto& v : x)
    v = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));  // every class: NaN, Inf, denormal
  const float special[] = {0.0f,  -0.0f,  INFINITY,    -INFINITY,   NAN,
                           3e38f, 1e-40f, 1.00390625f, 1.01171875f, -1.00390625f};
  std::copy(std::begin(special), std::end(special), x.begin());
  for (const float scale : {1.0f, 2.0f, 0.3f, -1e30f})
    for (const std::size_t n : {x.size(), std::size_t{1}, std::size_t{17}}) {
      std::vector<gemm::ScaleToBf16Fn> impls = {gemm::scale_to_bf16_scalar};
      if (isa_usable(Isa::avx512_bf16)) impls.push_back(gemm::scale_to_bf16_avx512);
      for (const auto f : impls) {
        std::vector<bf16> out(n + 1, bf16(7.0f));
        f(x.data(), scale, out.data(), n);
        for (std::size_t i = 0; i < n; ++i) {
          const bf16 want(scale * x[i]);
          INFO("x=" << x[i] << " scale=" << scale);
          if (want.is_nan())
            REQUIRE(out[i].is_nan());
          else
            REQUIRE(out[i].bits == want.bits);
        }
        CHECK(out[n].bits == bf16(7.0f).bits);  // nothing written past n
      }
    }
}

TEST_CASE("gemm.dot16: 16 partial sums and the fixed tree in every implementation",
          "[gemm][epilogue]") {
  // Every product of a block (nx rows of x, nw rows of w; sizes around the
  // AVX-512 4 x 4 register block) against the loop written out, bit for bit.
  std::mt19937_64 rng(43);
  std::uniform_real_distribution<float> d(-3, 3);
  std::vector<gemm::Dot16Fn> impls = {gemm::dot16_scalar};
  if (isa_usable(Isa::avx512_bf16)) impls.push_back(gemm::dot16_avx512);
  for (const std::size_t n : {0, 1, 15, 16, 17, 40, 2048, 2049})
    for (const std::size_t nx : {1, 4, 7})
      for (const std::size_t nw : {1, 4, 9}) {
        const std::size_t ldw = n + 3, ldo = nw + 2;
        std::vector<float> x(nx * n), w(nw * ldw, NAN);
        for (std::size_t i = 0; i < x.size(); ++i) x[i] = d(rng);
        for (std::size_t e = 0; e < nw; ++e)
          // Every fifth w element 1e-3 smaller (an input mix of magnitudes, so
          // that a changed summation order shows in the bits; not a tolerance:
          // the check below is bit for bit).
          for (std::size_t h = 0; h < n; ++h) w[e * ldw + h] = d(rng) * (h % 5 == 0 ? 1e-3f : 1.0f);
        if (n > 3) x[1] = -0.0f, w[1] = 1.0f;
        std::vector<const float*> rows(nx);
        for (std::size_t i = 0; i < nx; ++i) rows[i] = x.data() + i * n;
        std::vector<float> want(nx * ldo, 7.0f);
        for (std::size_t i = 0; i < nx; ++i)
          for (std::size_t e = 0; e < nw; ++e) {
            float acc[16] = {};
            for (std::size_t h = 0; h < n; ++h)
              acc[h % 16] = acc[h % 16] + x[i * n + h] * w[e * ldw + h];
            for (int width = 8; width >= 1; width /= 2)
              for (int l = 0; l < width; ++l) acc[l] = acc[l] + acc[l + width];
            want[i * ldo + e] = acc[0];
          }
        for (const auto f : impls) {
          std::vector<float> got(nx * ldo, 7.0f);
          f(rows.data(), nx, w.data(), ldw, nw, n, got.data(), ldo);
          INFO("n=" << n << " nx=" << nx << " nw=" << nw
                    << (f == gemm::dot16_scalar ? " scalar" : " avx512"));
          CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) ==
                0);  // nothing written past nw either
        }
      }
}

TEST_CASE("gemm.rank_sums: every implementation is the row-order fp32 sum", "[gemm][epilogue]") {
  // acc[k][j] += s[q][k] * (vscale[q] * v[q][j]) over q in order: compare
  // each implementation with that loop written out, bit for bit, for bf16
  // and fp32 rows, with and without vscale, ranks 1..19 (register groups of
  // 8 and their remainders) and widths across the 16-lane masks.
  std::mt19937_64 rng(41);
  std::vector<gemm::RankSumFn> impls = {gemm::rank_sums_scalar};
  if (isa_usable(Isa::avx512_bf16)) impls.push_back(gemm::rank_sums_avx512);
  for (const std::size_t r : {1, 3, 8, 9, 19})
    for (const std::size_t n : {1, 15, 16, 33, 64, 70})
      for (const bool bf : {false, true})
        for (const bool scaled : {false, true}) {
          const std::size_t m = 23, ldv = n + 5, lds = r + 2, ldacc = n + 3;
          std::vector<float> vf(m * ldv), s(m * lds), vs(m), acc0(r * ldacc);
          std::vector<bf16> vb(m * ldv);
          std::uniform_real_distribution<float> d(-2, 2);
          for (auto& x : vf) x = d(rng);
          for (std::size_t i = 0; i < vf.size(); ++i) vb[i] = bf16(vf[i]);
          for (auto& x : s) x = d(rng);
          for (auto& x : vs) x = d(rng);
          for (auto& x : acc0) x = d(rng);
          std::vector<const void*> rows(m);
          for (std::size_t q = 0; q < m; ++q)
            rows[q] = bf ? static_cast<const void*>(vb.data() + q * ldv) : vf.data() + q * ldv;
          std::vector<float> want = acc0;
          for (std::size_t q = 0; q < m; ++q)
            for (std::size_t k = 0; k < r; ++k)
              for (std::size_t j = 0; j < n; ++j) {
                float v = bf ? vb[q * ldv + j].to_float() : vf[q * ldv + j];
                if (scaled) v = vs[q] * v;
                want[k * ldacc + j] = want[k * ldacc + j] + s[q * lds + k] * v;
              }
          for (const auto f : impls) {
            std::vector<float> acc = acc0;
            gemm::RankSumArgs a;
            a.m = m, a.r = r, a.n = n, a.v = rows.data(), a.v_bf16 = bf,
            a.vscale = scaled ? vs.data() : nullptr;
            a.s = s.data(), a.lds = lds, a.acc = acc.data(), a.ldacc = ldacc;
            f(a);
            INFO("r=" << r << " n=" << n << " bf16=" << bf << " scaled=" << scaled
                      << (f == gemm::rank_sums_scalar ? " scalar" : " avx512"));
            CHECK(std::memcmp(acc.data(), want.data(), acc.size() * 4) ==
                  0);  // columns past n untouched too
          }
        }
}

TEST_CASE("gemm.loops: K blocking and the row-block order leave every bit unchanged",
          "[gemm][loops]") {
  // The loops accumulate C in fp32 across K blocks (an exact spill and
  // reload), and each element is one call's whatever the order of the row
  // and column blocks; for every kernel the result must equal that of all
  // of K, all rows inside each column block.
  std::mt19937_64 rng(39);
  const std::size_t m = 45, n = 70, k = 300;
  const auto a = random_bf16(rng, m * k), wv = random_bf16(rng, n * k);
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));
  for (Isa isa : usable_isas()) {
    gemm::KernelInfo whole = gemm::kernel_info(isa);
    whole.kc = 0;
    whole.mc = 0;
    const std::size_t mp = gemm::round_up(m, whole.mr);
    std::vector<bf16> ap(gemm::a_size(whole.a_layout, mp, w.kp()));
    gemm::pack_a(whole.a_layout, MatView<const bf16>(a.data(), m, k), nullptr, m, mp, w.kp(),
                 ap.data());
    std::vector<float> c1(m * n, NAN);
    gemm::gemm_block(whole, ap.data(), m, w, 0, w.np(), n, c1.data(), n);
    for (std::size_t kc : {std::size_t{0}, std::size_t{64}})
      for (std::size_t mc : {std::size_t{0}, whole.mr, 2 * whole.mr}) {
        if (kc == 0 && mc == 0) continue;  // the reference itself
        gemm::KernelInfo blocked = whole;
        blocked.kc = kc;
        blocked.mc = mc;
        std::vector<float> c2(m * n, NAN);
        gemm::gemm_block(blocked, ap.data(), m, w, 0, w.np(), n, c2.data(), n);
        INFO(isa_name(isa) << " kc=" << kc << " mc=" << mc);
        CHECK(std::memcmp(c1.data(), c2.data(), c1.size() * 4) == 0);
      }
  }
}

TEST_CASE(
    "gemm.ukernel: the edge kernel gives the full kernel's first rows bit for bit, for every row "
    "count",
    "[gemm][ukernel]") {
  // Edge blocks of rows < MR run on ukernel_edge (AVX-512 and scalar: those
  // rows only; AMX: 16 rows where rows <= 16); each element of its first
  // rows must be the full kernel's, with and without C's values and a
  // second product, and it must compute no more rows than it claims.
  std::mt19937_64 rng(43);
  const std::size_t k = 300, k2 = 40, n = 32;
  const auto wv = random_bf16(rng, n * k), av = random_bf16(rng, 32 * k),
             cv = random_bf16(rng, 32 * n);
  const auto w2v = random_bf16(rng, n * k2), a2v = random_bf16(rng, 32 * k2);
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));
  const auto w2 = gemm::PackedWeights::pack(MatView<const bf16>(w2v.data(), n, k2));
  std::size_t checked = 0;
  for (Isa isa : usable_isas()) {
    const gemm::KernelInfo& kernel = gemm::kernel_info(isa);
    REQUIRE(kernel.ukernel_edge);
    const std::size_t step = kernel.a_layout == gemm::ALayout::tiles ? gemm::kTileRows : 1;
    OneBlock blk = one_block(kernel, av, k, w, n);
    OneBlock second = one_block(kernel, a2v, k2, w2, n);
    for (std::size_t rows = 1; rows < kernel.mr; ++rows)
      for (bool acc : {false, true})
        for (bool two : {false, true}) {
          std::vector<float> full(kernel.mr * n), edge(kernel.mr * n, NAN);
          for (std::size_t i = 0; i < full.size(); ++i) full[i] = cv[i].to_float();
          for (std::size_t i = 0; i < rows * n; ++i) edge[i] = full[i];
          gemm::UkernelArgs a = blk.args;
          a.accumulate = acc;
          if (two) {
            a.a2 = second.args.a, a.lda2 = second.args.lda, a.b2 = second.args.b;
            a.panel_stride2 = second.args.panel_stride, a.kp2 = second.args.kp;
          }
          kernel.thread_begin();
          a.c = full.data();
          kernel.ukernel(a);
          a.c = edge.data();
          a.rows = rows;
          kernel.ukernel_edge(a);
          kernel.thread_end();
          INFO(isa_name(isa) << " rows=" << rows << " accumulate=" << acc
                             << " second product=" << two);
          CHECK(std::memcmp(full.data(), edge.data(), rows * n * 4) == 0);
          for (std::size_t i = gemm::round_up(rows, step) * n; i < edge.size(); ++i)
            REQUIRE(std::isnan(edge[i]));  // rows past its step untouched
          ++checked;
        }
  }
  CHECK(checked >= (7 + 31) * 4);  // scalar and amx_emu are usable everywhere
}

TEST_CASE("gemm.ukernel: side work runs once per item, in order, and leaves C's bits alone",
          "[gemm][amx]") {
  // Kernels with side_steps (AMX) run UkernelArgs::side between their k
  // steps: fewer items than steps, and more (the rest after the stores).
  std::mt19937_64 rng(47);
  const std::size_t k = 100, n = 32;
  const auto wv = random_bf16(rng, n * k), av = random_bf16(rng, 32 * k);
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));
  std::size_t checked = 0;
  for (Isa isa : usable_isas()) {
    const gemm::KernelInfo& kernel = gemm::kernel_info(isa);
    if (!kernel.side_steps) continue;
    OneBlock blk = one_block(kernel, av, k, w, n);
    for (std::size_t items : {std::size_t{2}, w.kp() / gemm::kKStep + 5}) {
      std::vector<float> plain(kernel.mr * n, NAN), with(kernel.mr * n, NAN);
      std::vector<std::size_t> ran;
      gemm::UkernelArgs a = blk.args;
      kernel.thread_begin();
      a.c = plain.data();
      kernel.ukernel(a);
      a.c = with.data();
      a.side = [](const void* ctx, std::size_t i) {
        static_cast<std::vector<std::size_t>*>(const_cast<void*>(ctx))->push_back(i);
      };
      a.side_ctx = &ran, a.side_n = items;
      kernel.ukernel(a);
      kernel.thread_end();
      INFO(isa_name(isa) << " items=" << items);
      CHECK(std::memcmp(plain.data(), with.data(), plain.size() * 4) == 0);
      REQUIRE(ran.size() == items);
      for (std::size_t i = 0; i < items; ++i) CHECK(ran[i] == i);
      ++checked;
    }
  }
  CHECK(checked >= 2);  // amx_emu is usable everywhere
}

TEST_CASE("storage: 64-byte aligned; 2 MiB and more aligned to 2 MiB", "[gemm][memory]") {
  // Ordinary storage, whatever MOECERT_GUARD_PAGES says (guarded blocks are
  // 64-byte aligned against their guard page; memory_test).
  const GuardPages mode = guard_pages();
  set_guard_pages(GuardPages::off);
  for (std::size_t bytes :
       {std::size_t{1}, std::size_t{100}, std::size_t{2} << 20, (std::size_t{5} << 20) + 3}) {
    void* p = moecert::detail::allocate(bytes);
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    INFO("bytes=" << bytes);
    CHECK(addr % 64 == 0);
    if (bytes >= (std::size_t{2} << 20)) CHECK(addr % (std::size_t{2} << 20) == 0);
    std::memset(p, 0xA5, bytes);  // every byte writable (ASan: in bounds)
    moecert::detail::deallocate(p);
  }
  set_guard_pages(mode);
}

TEST_CASE("gemm.loops: row blocks outside the column blocks only while the item's B fits L2",
          "[gemm][loops]") {
  // With KernelInfo::mc (the AMX kernels), each mc-row block passes all
  // the item's column blocks before the next, unless the item's B exceeds
  // kItemBBytes; the epilogue (after each call on the scalar kernel) sees
  // the order. item_cols gives items of 128 columns where their B fits.
  CHECK(gemm::item_cols(2816) == 128);  // 704 KiB
  CHECK(gemm::item_cols(4096) == 128);  // 1 MiB: still fits
  CHECK(gemm::item_cols(4128) == 256);  // 128 columns would not fit: wider items read A less often
  std::mt19937_64 rng(47);
  gemm::KernelInfo kernel = gemm::kernel_info(Isa::scalar);
  kernel.mc = kernel.mr;
  const std::size_t m = 2 * kernel.mr;
  for (const std::size_t n : {std::size_t{64}, std::size_t{512}}) {
    const std::size_t k = 1056;  // 512 columns: 1056 KiB of B
    const bool fits = n * k * sizeof(bf16) <= gemm::kItemBBytes;
    const auto a = random_bf16(rng, m * k), wv = random_bf16(rng, n * k);
    const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));
    std::vector<bf16> ap(gemm::a_size(kernel.a_layout, m, w.kp()));
    gemm::pack_a(kernel.a_layout, MatView<const bf16>(a.data(), m, k), nullptr, m, m, w.kp(),
                 ap.data());
    std::vector<float> c(m * n);
    std::vector<std::pair<std::size_t, std::size_t>> seen, want;
    auto epilogue = [&](std::size_t i0, std::size_t, std::size_t j0, std::size_t) {
      seen.emplace_back(i0, j0);
    };
    gemm::gemm_block(kernel, ap.data(), m, w, 0, n, n, c.data(), n, {.epilogue = epilogue});
    for (std::size_t x = 0; x < m * n / (kernel.mr * kernel.nr); ++x) {
      const std::size_t blocks = fits ? n / kernel.nr : m / kernel.mr;  // of the inner loop
      const std::size_t outer = x / blocks, inner = x % blocks;
      want.emplace_back(fits ? std::pair{outer * kernel.mr, inner * kernel.nr}
                             : std::pair{inner * kernel.mr, outer * kernel.nr});
    }
    INFO("n=" << n);
    CHECK(seen == want);
  }
}

TEST_CASE("gemm.loops: a fused second product and the block epilogue", "[gemm][loops]") {
  // One gemm_block with a second product must give every bit of two calls
  // (the second with accumulate), and its epilogue must see each finished
  // block of C exactly once, holding its final values, for K in one block
  // and in several, column blocks inside or outside the row blocks (on AMX
  // kernels, row by row under the next block's products); block_done sees
  // each whole block once, after the epilogue saw its rows.
  std::mt19937_64 rng(41);
  const std::size_t m = 45, n = 70, k = 300, k2 = 40, n0 = 32;
  const auto a = random_bf16(rng, m * k), wv = random_bf16(rng, n * k);
  const auto a2 = random_bf16(rng, m * k2), w2v = random_bf16(rng, n * k2);
  const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), n, k));
  const auto w2 = gemm::PackedWeights::pack(MatView<const bf16>(w2v.data(), n, k2));
  for (Isa isa : usable_isas())
    for (std::size_t kc : {std::size_t{0}, std::size_t{64}})
      for (bool rows_outside :
           {false, true}) {  // column blocks inside each MR-row block, or outside all
        gemm::KernelInfo kernel = gemm::kernel_info(isa);
        kernel.kc = kc;
        kernel.mc = rows_outside ? kernel.mr : 0;
        const std::size_t mp = gemm::round_up(m, kernel.mr);
        std::vector<bf16> ap(gemm::a_size(kernel.a_layout, mp, w.kp())),
            ap2(gemm::a_size(kernel.a_layout, mp, w2.kp()));
        gemm::pack_a(kernel.a_layout, MatView<const bf16>(a.data(), m, k), nullptr, m, mp, w.kp(),
                     ap.data());
        gemm::pack_a(kernel.a_layout, MatView<const bf16>(a2.data(), m, k2), nullptr, m, mp,
                     w2.kp(), ap2.data());
        std::vector<float> want(m * n, NAN), got(m * n, NAN), seen(m * n, NAN);
        gemm::gemm_block(kernel, ap.data(), m, w, n0, w.np(), n, want.data(), n);
        gemm::gemm_block(kernel, ap2.data(), m, w2, n0, w2.np(), n, want.data(), n,
                         {.accumulate = true});
        std::vector<int> calls(m * n, 0), done(m * n, 0);
        bool aligned = true, whole = true, after = true;
        auto epilogue = [&](std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1) {
          aligned = aligned && j0 % kernel.nr == 0 && j1 <= n && i1 <= m;
          for (std::size_t i = i0; i < i1; ++i)
            for (std::size_t j = j0; j < j1; ++j) {
              ++calls[i * n + j];
              seen[i * n + j] = got[i * n + j];
            }
        };
        auto block_done = [&](std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1) {
          whole = whole && i0 % kernel.mr == 0 && i1 == std::min(m, i0 + kernel.mr) &&
                  j0 % kernel.nr == 0 && j1 == std::min(n, j0 + kernel.nr);
          for (std::size_t i = i0; i < i1; ++i)
            for (std::size_t j = j0; j < j1; ++j) {
              ++done[i * n + j];
              after = after && calls[i * n + j] == 1 &&
                      std::memcmp(&got[i * n + j], &want[i * n + j], 4) == 0;
            }
        };
        gemm::gemm_block(
            kernel, ap.data(), m, w, n0, w.np(), n, got.data(), n,
            {.a2 = ap2.data(), .w2 = &w2, .epilogue = epilogue, .block_done = block_done});
        INFO(isa_name(isa) << " kc=" << kc << " mc=" << kernel.mc);
        CHECK(std::memcmp(want.data(), got.data(), got.size() * 4) ==
              0);  // columns before n0 untouched too
        CHECK(aligned);
        std::size_t once = 0, wrong = 0;
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < n; ++j) {
            once += calls[i * n + j] == (j >= n0 ? 1 : 0);
            if (j >= n0) wrong += std::memcmp(&seen[i * n + j], &want[i * n + j], 4) != 0;
          }
        CHECK(once == m * n);
        CHECK(wrong == 0);
        CHECK(whole);
        CHECK(after);
        CHECK(std::equal(calls.begin(), calls.end(), done.begin()));
      }
}

TEST_CASE("gemm.pack_a: both A layouts hold the same matrix, padding zero", "[gemm][pack]") {
  std::mt19937_64 rng(40);
  const std::size_t m = 37, k = 70, kp = 96, mp = 64;
  const auto a = random_bf16(rng, m * k);
  for (gemm::ALayout l : {gemm::ALayout::rows, gemm::ALayout::tiles}) {
    std::vector<bf16> ap(gemm::a_size(l, mp, kp), bf16(NAN));
    gemm::pack_a(l, MatView<const bf16>(a.data(), m, k), nullptr, m, mp, kp, ap.data());
    const std::size_t lda = gemm::a_stride(l, kp);
    for (std::size_t r = 0; r < mp; ++r)
      for (std::size_t c = 0; c < kp; ++c)
        REQUIRE(ap[gemm::a_offset(l, lda, r, c)] == ((r < m && c < k) ? a[r * k + c] : bf16(0.0f)));
  }
}

namespace {

// A buffer of n elements from moecert's allocator (guarded under guard
// pages, in any build).
template <class T>
struct Exact {
  explicit Exact(std::size_t n) : p(static_cast<T*>(detail::allocate(n * sizeof(T)))), n(n) {}
  ~Exact() { detail::deallocate(p); }
  Exact(const Exact&) = delete;
  Exact& operator=(const Exact&) = delete;
  T* p;
  std::size_t n;
};

}  // namespace

TEST_CASE("gemm.loops: every kernel reads and writes only inside A, W and C (guard pages)",
          "[gemm][loops][memory]") {
  // A packed to exactly its padded rows, C exactly m x n: under guard pages
  // (its end against an inaccessible page, then its start) a kernel that
  // reads past either faults. (The scalar kernel once read the row after
  // an 8-row block's last one: the Release layer backward's segfault.) The
  // results must equal those on ordinary buffers bit for bit.
  std::mt19937_64 rng(41);
  const Shape shapes[] = {{8, 48, 96}, {32, 32, 32},  {24, 40, 75},
                          {5, 16, 64}, {33, 80, 200}, {1, 32, 1}};
  for (const Shape& s : shapes)
    for (Isa isa : usable_isas()) {
      const gemm::KernelInfo& kernel = gemm::kernel_info(isa);
      const auto a = random_bf16(rng, s.m * s.k), wv = random_bf16(rng, s.n * s.k),
                 c0 = random_bf16(rng, s.m * s.n);
      const std::size_t mp = gemm::round_up(s.m, kernel.mr);
      auto product = [&](bool accumulate) {
        const auto w = gemm::PackedWeights::pack(MatView<const bf16>(wv.data(), s.n, s.k));
        Exact<bf16> ap(gemm::a_size(kernel.a_layout, mp, w.kp()));
        gemm::pack_a(kernel.a_layout, MatView<const bf16>(a.data(), s.m, s.k), nullptr, s.m, mp,
                     w.kp(), ap.p);
        Exact<float> c(s.m * s.n);
        for (std::size_t i = 0; i < c.n; ++i) c.p[i] = c0[i].to_float();
        gemm::gemm_block(kernel, ap.p, s.m, w, 0, w.np(), s.n, c.p, s.n,
                         {.accumulate = accumulate});
        return std::vector<float>(c.p, c.p + c.n);
      };
      for (bool accumulate : {false, true}) {
        INFO(isa_name(isa) << " m=" << s.m << " n=" << s.n << " k=" << s.k
                           << " accumulate=" << accumulate);
        const std::vector<float> plain = product(accumulate);
        for (GuardPages mode : {GuardPages::end, GuardPages::start}) {
          set_guard_pages(mode);
          const std::vector<float> guarded = product(accumulate);
          set_guard_pages(GuardPages::off);
          CHECK(std::memcmp(plain.data(), guarded.data(), plain.size() * sizeof(float)) == 0);
        }
      }
    }
}
