// Benchmark cases: the grouped expert forward and a single GEMM, each
// against oneDNN in the same process on the same data and threads.
#include <fmt/format.h>

#include <cmath>
#include <optional>
#include <random>

#include "bench/bench.hpp"
#include "bench/onednn_peer.hpp"
#include "moecert/experts.hpp"
#include "moecert/gemm.hpp"
#include "moecert/isa.hpp"

namespace moecert::bench {
namespace {

// Uniform top-K routing: K distinct experts per token, weights in [0, 1).
void route(std::size_t t, std::size_t k, std::size_t e, std::vector<std::int32_t>& idx,
           std::vector<float>& w) {
  std::mt19937_64 rng(7);
  idx.resize(t * k);
  w.resize(t * k);
  std::vector<std::int32_t> perm(e);
  for (std::size_t q = 0; q < e; ++q) perm[q] = static_cast<std::int32_t>(q);
  for (std::size_t r = 0; r < t; ++r) {
    for (std::size_t j = 0; j < k; ++j) std::swap(perm[j], perm[j + rng() % (e - j)]);
    for (std::size_t j = 0; j < k; ++j) {
      idx[r * k + j] = perm[j];
      w[r * k + j] = std::uniform_real_distribution<float>(0, 1)(rng);
    }
  }
}

Result experts_forward(const std::string& name, const Shape& s, const Options& opt) {
  Result r;
  r.name = name;
  r.op = "experts.forward";
  r.shape = s;
  r.threads = opt.threads;
  r.isa = std::string(isa_name(opt.isa));
  r.peer = "onednn";
  std::vector<bf16> wg(s.e * s.i * s.h), wu(s.e * s.i * s.h), wd(s.e * s.h * s.i), x(s.t * s.h);
  fill_uniform(wg, 1, 1.7f / std::sqrt(float(s.h)));
  fill_uniform(wu, 2, 1.7f / std::sqrt(float(s.h)));
  fill_uniform(wd, 3, 1.7f / std::sqrt(float(s.i)));
  fill_uniform(x, 4, 1.7f);
  std::vector<std::int32_t> idx;
  std::vector<float> w;
  route(s.t, s.k, s.e, idx, w);
  MatView<const bf16> xv(x.data(), s.t, s.h);
  MatView<const std::int32_t> iv(idx.data(), s.t, s.k);
  MatView<const float> wv(w.data(), s.t, s.k);
  std::vector<float> y(s.t * s.h), y_peer(s.t * s.h);
  const auto packed =
      experts::PackedExperts::pack(s.e, MatView<const bf16>(wg.data(), s.e * s.i, s.h),
                                   MatView<const bf16>(wu.data(), s.e * s.i, s.h),
                                   MatView<const bf16>(wd.data(), s.e * s.h, s.i));
  std::optional<OnednnExperts> peer;  // built only where it is timed (not under --contracts)
  if (opt.contracts.empty()) peer.emplace(s.e, s.h, s.i, wg, wu, wd, iv);
  experts::ForwardStats st;
  experts::Workspace ws;  // reused across calls, as a training loop would
  time_against_peer(
      opt,
      [&] {
        st = experts::forward(packed, xv, iv, wv, MatView<float>(y.data(), s.t, s.h),
                              {.isa = opt.isa, .workspace = &ws});
      },
      [&] { peer->forward(xv, wv, MatView<float>(y_peer.data(), s.t, s.h)); }, r);
  r.isa = std::string(isa_name(st.isa));
  r.flops = 6.0 * static_cast<double>(st.routed_rows) * static_cast<double>(s.h) *
            static_cast<double>(s.i);
  // The two results must agree to within bf16-level differences; report the largest.
  const Difference diff = difference(y, y_peer);
  r.note = fmt::format("max |y - y_onednn| = {:.3g} (max |y| {:.3g})", diff.max_diff, diff.max_abs);
  return r;
}

Result gemm_matmul(const std::string& name, std::size_t m, std::size_t n, std::size_t k,
                   const Options& opt) {
  Result r;
  r.name = name;
  r.op = "gemm.matmul";
  r.shape = {1, k, n, 1, 0, m};
  r.threads = opt.threads;
  r.isa = std::string(isa_name(opt.isa));
  r.peer = "onednn";
  std::vector<bf16> a(m * k), w(n * k);
  fill_uniform(a, 5, 1);
  fill_uniform(w, 6, 1);
  std::vector<float> c(m * n);
  const auto packed = gemm::PackedWeights::pack(MatView<const bf16>(w.data(), n, k));
  OnednnMatmul peer(m, n, k, w);
  std::vector<float> c_peer(m * n);
  time_against_peer(
      opt,
      [&] {
        gemm::matmul(MatView<const bf16>(a.data(), m, k), packed, MatView<float>(c.data(), m, n),
                     opt.isa);
      },
      [&] { peer.run(a.data(), c_peer.data()); }, r);
  r.note = "onednn " + peer.impl_name();
  r.flops = 2.0 * double(m) * double(n) * double(k);
  return r;
}

std::size_t experts_bytes(const Shape& s) {
  // Weights: the generated copy, moecert's packed copy, oneDNN's reordered
  // copy; activations are small beside them at these shapes.
  return 3 * 3 * s.e * s.h * s.i * 2 + s.t * s.k * (2 * s.i + s.h) * 8;
}

}  // namespace

std::vector<Case> all_cases() {
  std::vector<Case> out;
  auto add_experts = [&](Shape s) {
    const std::string name =
        fmt::format("experts.forward/E{}_H{}_I{}_K{}_T{}", s.e, s.h, s.i, s.k, s.t);
    out.push_back({name, "experts.forward", s, experts_bytes(s),
                   [name, s](const Options& o) { return experts_forward(name, s, o); }});
  };
  // Decode-sized batches: under one routed row per expert (T = 8) and three
  // (T = 32), where AMX's 16-row edge block is mostly padding (still faster
  // than AVX-512 there: docs/PERFORMANCE.md).
  add_experts({64, 2048, 1408, 6, 0, 8});
  add_experts({64, 2048, 1408, 6, 0, 32});
  add_experts({64, 2048, 1408, 6, 0, 48});
  add_experts({64, 2048, 1408, 6, 0, 1024});
  add_experts({64, 2048, 1408, 6, 0, 4096});
  add_experts({256, 7168, 2048, 8, 0, 1024});
  auto add_gemm = [&](std::size_t m, std::size_t n, std::size_t k) {
    const std::string name = fmt::format("gemm.matmul/M{}_N{}_K{}", m, n, k);
    out.push_back({name,
                   "gemm.matmul",
                   {1, k, n, 1, 0, m},
                   3 * n * k * 2 + 2 * m * n * 4,
                   [=](const Options& o) { return gemm_matmul(name, m, n, k, o); }});
  };
  add_gemm(48, 2816, 2048);
  add_gemm(1024, 2816, 2048);
  add_gemm(4096, 4096, 4096);
  add_layer_cases(out);
  add_format_cases(out);
  return out;
}

}  // namespace moecert::bench
