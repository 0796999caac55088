// product_key forward (exact two-stage top-k) and backward.
#include <oneapi/tbb/parallel_for.h>

#include <cmath>
#include <vector>

#include "contracts/router/clauses.hpp"
#include "moecert/router.hpp"
#include "ops/core/task.hpp"
#include "ops/router/kinds.hpp"
#include "ops/router/select.hpp"

namespace moecert::router {
namespace detail {

void product_key_select_row(const float* sx, const float* sy, std::size_t n, std::size_t k,
                            std::int32_t* idx, std::vector<std::int32_t>& ids) {
  // Stage 1: the top min(K, n) of each half (score desc, index asc).
  const std::size_t kh = std::min(k, n);
  std::vector<std::int32_t> ax(kh), ay(kh);
  top_k(
      n, kh, [&](std::int32_t a, std::int32_t b) { return outranks(sx[a], a, sx[b], b); },
      ax.data(), ids);
  top_k(
      n, kh, [&](std::int32_t a, std::int32_t b) { return outranks(sy[a], a, sy[b], b); },
      ay.data(), ids);
  // Stage 2: the top K of the kh * kh candidate sums, ranked by the exact sum
  // then expert index (proofs/router.md §2: equal to brute force).
  std::vector<std::int32_t> cand;
  cand.reserve(kh * kh);
  for (std::int32_t ix : ax)
    for (std::int32_t iy : ay) cand.push_back(ix * static_cast<std::int32_t>(n) + iy);
  const auto key = [&](std::int32_t e) {
    return exact_sum(sx[e / static_cast<std::int32_t>(n)], sy[e % static_cast<std::int32_t>(n)]);
  };
  std::partial_sort(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(k), cand.end(),
                    [&](std::int32_t a, std::int32_t b) {
                      const ExactSum ka = key(a), kb = key(b);
                      return ka > kb || (ka == kb && a < b);
                    });
  std::copy(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(k), idx);
}

// Weights of the valid slots from their fp32 scores s (in place).
void key_weights(KeyWeights mode, float* s, std::size_t valid) {
  if (mode == KeyWeights::exp) {
    for (std::size_t j = 0; j < valid; ++j) s[j] = gemm::exp_poly::exp(s[j]);
  } else if (mode == KeyWeights::softmax) {
    float m = s[0], sum = 0;
    for (std::size_t j = 1; j < valid; ++j) m = std::max(m, s[j]);
    for (std::size_t j = 0; j < valid; ++j) sum += s[j] = gemm::exp_poly::exp(s[j] - m);
    for (std::size_t j = 0; j < valid; ++j) s[j] = s[j] / sum;
  }
}

}  // namespace detail

namespace {

void forward_impl(MatView<const float> sx, MatView<const float> sy, ByteRange in_x, ByteRange in_y,
                  KeyWeights mode, MatView<std::int32_t> idx, MatView<float> w) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  moecert::detail::Checker c{"router.product_key.forward"};
  contracts::product_key_pre(c, sx, sy, in_x, in_y, mode, idx, w);
  if (c.stop()) return;
  const std::size_t n = sx.cols, k = idx.cols;
  oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, sx.rows, 16),
                            moecert::detail::task([&](const auto& r) {
                              std::vector<std::int32_t> ids;
                              for (std::size_t t = r.begin(); t < r.end(); ++t) {
                                std::int32_t* it = idx.row(t);
                                float* wt = w.row(t);
                                detail::product_key_select_row(sx.row(t), sy.row(t), n, k, it, ids);
                                for (std::size_t j = 0; j < k; ++j)
                                  wt[j] = sx(t, it[j] / static_cast<std::int32_t>(n)) +
                                          sy(t, it[j] % static_cast<std::int32_t>(n));
                                detail::key_weights(mode, wt, k);
                              }
                            }));
  contracts::product_key_post(c, sx, sy, mode, idx, w);
}

}  // namespace

void product_key_forward(MatView<const float> sx, MatView<const float> sy, KeyWeights mode,
                         MatView<std::int32_t> idx, MatView<float> w) {
  forward_impl(sx, sy, sx.bytes(), sy.bytes(), mode, idx, w);
}
void product_key_forward(MatView<const bf16> sx, MatView<const bf16> sy, KeyWeights mode,
                         MatView<std::int32_t> idx, MatView<float> w) {
  const std::vector<float> x = detail::widen(sx), y = detail::widen(sy);
  forward_impl(MatView<const float>(x.data(), sx.rows, sx.cols),
               MatView<const float>(y.data(), sy.rows, sy.cols), sx.bytes(), sy.bytes(), mode, idx,
               w);
}

void product_key_backward(MatView<const float> sx, MatView<const float> sy,
                          MatView<const std::int32_t> idx, MatView<const float> g, KeyWeights mode,
                          MatView<float> dsx, MatView<float> dsy) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  moecert::detail::Checker c{"router.product_key.backward"};
  contracts::product_key_backward_pre(c, sx, sy, idx, g, dsx, dsy);
  if (c.stop()) return;
  const std::size_t n = sx.cols, k = idx.cols;
  oneapi::tbb::parallel_for(
      std::size_t{0}, sx.rows, moecert::detail::task([&](std::size_t t) {
        const std::int32_t* it = idx.row(t);
        const float* gt = g.row(t);
        std::fill(dsx.row(t), dsx.row(t) + n, 0.0f);
        std::fill(dsy.row(t), dsy.row(t) + n, 0.0f);
        std::size_t valid = detail::valid_slots(it, k);  // -1 slots (only at the tail) add nothing
        if (valid == 0) return;
        std::vector<float> ws(valid), ds(valid);
        const auto ni = static_cast<std::int32_t>(n);
        // Key indices as signed offsets into the row: ix = idx / n, iy = idx - ix n.
        auto ix = [&](std::size_t j) { return static_cast<std::ptrdiff_t>(it[j] / ni); };
        auto iy = [&](std::size_t j) {
          return static_cast<std::ptrdiff_t>(it[j] - (it[j] / ni) * ni);
        };
        for (std::size_t j = 0; j < valid; ++j) ws[j] = sx.row(t)[ix(j)] + sy.row(t)[iy(j)];
        detail::key_weights(mode, ws.data(), valid);
        float dot = 0;
        if (mode == KeyWeights::softmax)
          for (std::size_t j = 0; j < valid; ++j) dot += ws[j] * gt[j];
        for (std::size_t j = 0; j < valid; ++j)
          ds[j] = mode == KeyWeights::raw   ? gt[j]
                  : mode == KeyWeights::exp ? gt[j] * ws[j]
                                            : ws[j] * (gt[j] - dot);
        // Accumulate in slot order: every element has one writer, no atomics.
        for (std::size_t j = 0; j < valid; ++j) {
          dsx.row(t)[ix(j)] += ds[j];
          dsy.row(t)[iy(j)] += ds[j];
        }
      }));
  contracts::product_key_backward_post(c, sx, sy, idx, g, mode, dsx, dsy);
}

namespace {

// z = [sx | sy]; dz: dsx's T x n block, then dsy's.
void product_key_layer_forward(const contracts::RouterSettings& s, MatView<const float> z,
                               View<const float>, MatView<std::int32_t> idx, MatView<float> w) {
  const std::size_t n = z.cols / 2;
  product_key_forward(MatView<const float>(z.data, z.rows, n, z.stride),
                      MatView<const float>(z.data + n, z.rows, n, z.stride), s.keys, idx, w);
}

void product_key_layer_backward(const contracts::RouterSettings& s, MatView<const float> z,
                                MatView<const std::int32_t> idx, MatView<const float> g,
                                float* dz) {
  const std::size_t T = z.rows, n = z.cols / 2;
  product_key_backward(MatView<const float>(z.data, T, n, z.stride),
                       MatView<const float>(z.data + n, T, n, z.stride), idx, g, s.keys,
                       MatView<float>(dz, T, n, n), MatView<float>(dz + T * n, T, n, n));
}

}  // namespace

extern const RouterOps kProductKeyOps = {RouterKind::product_key, product_key_layer_forward,
                                         product_key_layer_backward};

}  // namespace moecert::router
