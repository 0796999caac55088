// The experts op's judge model (contracts/reference/experts_model.hpp):
// per routed pair (t, e), proofs/experts.md §4's rounding points over
// bounds::Tracked, rows on the caller's threads.
#include "contracts/reference/experts_model.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <cmath>

#include "contracts/tbb_sync.hpp"

namespace moecert::contracts {

namespace {

using bounds::Precision;
using bounds::Tracked;

std::size_t kpad(std::size_t n) { return (n + 31) / 32 * 32; }

// One expert's weights and LoRA factors as the implementation reads them.
struct Expert {
  const ExpertsTensors& in;
  std::size_t e;
  const Precision& p;
  Tracked at(MatView<const float> m, std::size_t rows, std::size_t i, std::size_t k) const {
    return bounds::input(m(e * rows + i, k), p);
  }
};

// base + lora of one GEMM output: each term an fp32-accumulated sum over
// n terms (the fused length, so a fused kernel is covered too) stored, then
// their sum stored; the base term alone without LoRA.
template <class A, class WB, class AL, class WL>
Tracked gemm_out(std::size_t k_base, A a, WB wb, std::size_t k_lora, AL al, WL wl, std::size_t n,
                 const Precision& p) {
  const Tracked base = bounds::dot_stored(k_base, a, wb, n, p);
  if (k_lora == 0) return base;
  return bounds::mid(base + bounds::dot_stored(k_lora, al, wl, n, p), p);
}

// o = expert e's output for one token row x (H inputs, as read).
std::vector<Tracked> expert_output(const Expert& w, const std::vector<Tracked>& x,
                                   const Tracked& s) {
  const ExpertsTensors& in = w.in;
  const Precision& p = w.p;
  const std::size_t H = in.H, I = in.I, r = in.r;
  // xa = x [A_g; A_u]^T, lb = s xa as the second GEMM reads it.
  std::vector<Tracked> lb(2 * r);
  for (std::size_t k = 0; k < 2 * r; ++k) {
    const Tracked xa = bounds::dot_stored(
        H, [&](std::size_t q) { return x[q]; },
        [&](std::size_t q) {
          return k < r ? w.at(in.a_gate, r, k, q) : w.at(in.a_up, r, k - r, q);
        },
        kpad(H), p);
    lb[k] = bounds::operand(bounds::mid(s * xa, p), p);
  }
  const std::size_t n1 = kpad(H) + (r ? kpad(2 * r) : 0);
  std::vector<Tracked> h(I);
  for (std::size_t i = 0; i < I; ++i) {
    auto xq = [&](std::size_t q) { return x[q]; };
    const Tracked g = gemm_out(
        H, xq, [&](std::size_t q) { return w.at(in.w_gate, I, i, q); }, r,
        [&](std::size_t q) { return lb[q]; },
        [&](std::size_t q) { return w.at(in.b_gate, I, i, q); }, n1, p);
    const Tracked u = gemm_out(
        H, xq, [&](std::size_t q) { return w.at(in.w_up, I, i, q); }, r,
        [&](std::size_t q) { return lb[r + q]; },
        [&](std::size_t q) { return w.at(in.b_up, I, i, q); }, n1, p);
    // silu(g) in fp32 (sigma with exp within 2 ulps), stored; times u, stored.
    const Tracked silu = bounds::mid(bounds::r32(g * bounds::sig(g)), p);
    h[i] = bounds::operand(bounds::mid(silu * u, p), p);
  }
  std::vector<Tracked> lbd(r);
  for (std::size_t k = 0; k < r; ++k) {
    const Tracked ha = bounds::dot_stored(
        I, [&](std::size_t q) { return h[q]; },
        [&](std::size_t q) { return w.at(in.a_down, r, k, q); }, kpad(I), p);
    lbd[k] = bounds::operand(bounds::mid(s * ha, p), p);
  }
  const std::size_t n2 = kpad(I) + (r ? kpad(r) : 0);
  std::vector<Tracked> o(H);
  for (std::size_t m = 0; m < H; ++m)
    o[m] = gemm_out(
        I, [&](std::size_t q) { return h[q]; },
        [&](std::size_t q) { return w.at(in.w_down, H, m, q); }, r,
        [&](std::size_t q) { return lbd[q]; },
        [&](std::size_t q) { return w.at(in.b_down, H, m, q); }, n2, p);
  return o;
}

}  // namespace

std::vector<Tracked> experts_model_forward(const ExpertsTensors& in, const Precision& p) {
  const std::size_t T = in.x.rows, K = in.idx.cols, H = in.H;
  // s = alpha / r as the implementation holds it: in fp32 at best.
  const double s_exact = in.r ? in.alpha / static_cast<double>(in.r) : 0.0;
  const Tracked s{s_exact, bounds::kU32 * std::fabs(s_exact)};
  std::vector<Tracked> y(T * H);
  oneapi::tbb::parallel_for(
      std::size_t{0}, T, detail::TbbBody([&](std::size_t t) {
        std::vector<Tracked> x(H);
        for (std::size_t q = 0; q < H; ++q) x[q] = bounds::input(in.x(t, q), p);
        std::vector<Tracked> sum(H, Tracked{0, 0});
        std::vector<double> sum_abs(H, 0.0);
        for (std::size_t j = 0; j < K; ++j) {
          const std::int32_t e = in.idx(t, j);
          if (e < 0) continue;
          const auto o = expert_output({in, static_cast<std::size_t>(e), p}, x, s);
          const Tracked wt{in.weights(t, j), 0};
          for (std::size_t m = 0; m < H; ++m) {
            const Tracked term = wt * o[m];
            sum[m] += term;
            sum_abs[m] += term.mag();
          }
        }
        // y = sum_j w_j o_j: products and sums in the intermediate format.
        for (std::size_t m = 0; m < H; ++m)
          y[t * H + m] = bounds::sum_stored(sum[m], sum_abs[m], K, p);
      }));
  return y;
}

}  // namespace moecert::contracts
