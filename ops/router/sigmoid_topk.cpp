// sigmoid_topk (DeepSeek-V3 group-limited routing) forward and backward.
#include <oneapi/tbb/parallel_for.h>

#include <vector>

#include "contracts/router/clauses.hpp"
#include "moecert/router.hpp"
#include "ops/core/task.hpp"
#include "ops/router/kinds.hpp"
#include "ops/router/select.hpp"

namespace moecert::router {
namespace detail {

void sigmoid_select_row(const float* z, const float* bias, std::size_t e,
                        const SigmoidTopkParams& p, std::size_t k, std::int32_t* idx,
                        std::vector<float>& s, std::vector<float>& sel,
                        std::vector<std::int32_t>& ids) {
  s.resize(e);
  sel.resize(e);
  for (std::size_t i = 0; i < e; ++i) {
    s[i] = sigmoid(z[i]);
    sel[i] = s[i] + bias[i];  // selection score: the bias steers selection only
  }
  // Group scores: the sum of each group's top two selection scores.
  const std::size_t groups = p.groups, size = e / groups;
  std::vector<float> gscore(groups);
  for (std::size_t q = 0; q < groups; ++q) {
    std::int32_t best[2];
    top_k(
        size, std::min<std::size_t>(2, size),
        [&](std::int32_t a, std::int32_t b) {
          return outranks(sel[q * size + a], a, sel[q * size + b], b);
        },
        best, ids);
    gscore[q] =
        size >= 2 ? sel[q * size + best[0]] + sel[q * size + best[1]] : sel[q * size + best[0]];
  }
  std::vector<std::int32_t> kept(p.topk_group);
  top_k(
      groups, p.topk_group,
      [&](std::int32_t a, std::int32_t b) { return outranks(gscore[a], a, gscore[b], b); },
      kept.data(), ids);
  // Eligible experts: those of the kept groups (masked groups are excluded, not zeroed).
  std::vector<std::int32_t> eligible;
  std::sort(kept.begin(), kept.end());
  for (std::int32_t q : kept)
    for (std::size_t i = 0; i < size; ++i)
      eligible.push_back(static_cast<std::int32_t>(q * size + i));
  const std::size_t take = std::min(k, eligible.size());
  std::partial_sort(eligible.begin(), eligible.begin() + static_cast<std::ptrdiff_t>(take),
                    eligible.end(),
                    [&](std::int32_t a, std::int32_t b) { return outranks(sel[a], a, sel[b], b); });
  for (std::size_t j = 0; j < k; ++j) idx[j] = j < take ? eligible[j] : -1;
}

}  // namespace detail

namespace {

void forward_impl(MatView<const float> z, ByteRange z_bytes, View<const float> bias,
                  const SigmoidTopkParams& p, MatView<std::int32_t> idx, MatView<float> w) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  moecert::detail::Checker c{"router.sigmoid_topk.forward"};
  contracts::sigmoid_topk_pre(c, z, z_bytes, bias, p, idx, w);
  if (c.stop()) return;
  const std::size_t e = z.cols, k = idx.cols;
  oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, z.rows, 16),
                            moecert::detail::task([&](const auto& r) {
                              std::vector<float> s, sel;
                              std::vector<std::int32_t> ids;
                              for (std::size_t t = r.begin(); t < r.end(); ++t) {
                                std::int32_t* it = idx.row(t);
                                float* wt = w.row(t);
                                detail::sigmoid_select_row(z.row(t), bias.data, e, p, k, it, s, sel,
                                                           ids);
                                float sum = 0;  // slot order
                                for (std::size_t j = 0; j < k && it[j] >= 0; ++j) sum += s[it[j]];
                                for (std::size_t j = 0; j < k; ++j)
                                  wt[j] = it[j] >= 0 ? (s[it[j]] / sum) * p.scaling : 0.0f;
                              }
                            }));
  contracts::sigmoid_topk_post(c, z, bias, p, idx, w);
}

}  // namespace

void sigmoid_topk_forward(MatView<const float> z, View<const float> bias,
                          const SigmoidTopkParams& p, MatView<std::int32_t> idx, MatView<float> w) {
  forward_impl(z, z.bytes(), bias, p, idx, w);
}
void sigmoid_topk_forward(MatView<const bf16> z, View<const float> bias, const SigmoidTopkParams& p,
                          MatView<std::int32_t> idx, MatView<float> w) {
  const std::vector<float> zf = detail::widen(z);
  forward_impl(MatView<const float>(zf.data(), z.rows, z.cols), z.bytes(), bias, p, idx, w);
}

void sigmoid_topk_backward(MatView<const float> z, MatView<const std::int32_t> idx,
                           MatView<const float> g, const SigmoidTopkParams& p, MatView<float> dz) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  moecert::detail::Checker c{"router.sigmoid_topk.backward"};
  contracts::sigmoid_topk_backward_pre(c, z, idx, g, dz);
  if (c.stop()) return;
  const std::size_t e = z.cols, k = idx.cols;
  oneapi::tbb::parallel_for(std::size_t{0}, z.rows, moecert::detail::task([&](std::size_t t) {
                              const float* zt = z.row(t);
                              const std::int32_t* it = idx.row(t);
                              const float* gt = g.row(t);
                              float* dt = dz.row(t);
                              std::fill(dt, dt + e, 0.0f);
                              const std::size_t valid = detail::valid_slots(it, k);
                              float sum = 0, dot = 0;  // sum_S s; sum_S g s / sum_S s
                              for (std::size_t j = 0; j < valid; ++j)
                                sum += detail::sigmoid(zt[it[j]]);
                              for (std::size_t j = 0; j < valid; ++j)
                                dot += gt[j] * (detail::sigmoid(zt[it[j]]) / sum);
                              // dz_j = (c / S)(g_j - D) s_j (1 - s_j) = c ((g_j - D) r_j)(1 - s_j),
                              // r_j = s_j / S <= 1, in that order: |g_j - D| < 2^127 (g_finite), so
                              // only the last product can overflow (the dz_finite postcondition
                              // reports it); c / S first overflowed for c > 2 and tiny S.
                              for (std::size_t j = 0; j < valid; ++j) {
                                const float s = detail::sigmoid(zt[it[j]]);
                                dt[it[j]] = p.scaling * (((gt[j] - dot) * (s / sum)) * (1.0f - s));
                              }
                            }));
  contracts::sigmoid_topk_backward_post(c, z, idx, g, p, dz);
}

namespace {

void sigmoid_topk_layer_forward(const contracts::RouterSettings& s, MatView<const float> z,
                                View<const float> bias, MatView<std::int32_t> idx,
                                MatView<float> w) {
  sigmoid_topk_forward(z, bias, s.sigmoid, idx, w);
}

void sigmoid_topk_layer_backward(const contracts::RouterSettings& s, MatView<const float> z,
                                 MatView<const std::int32_t> idx, MatView<const float> g,
                                 float* dz) {
  sigmoid_topk_backward(z, idx, g, s.sigmoid, MatView<float>(dz, z.rows, z.cols, z.cols));
}

}  // namespace

extern const RouterOps kSigmoidTopkOps = {RouterKind::sigmoid_topk, sigmoid_topk_layer_forward,
                                          sigmoid_topk_layer_backward};

}  // namespace moecert::router
