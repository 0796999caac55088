// softmax_topk forward and backward.
#include <oneapi/tbb/parallel_for.h>

#include <cmath>
#include <vector>

#include "contracts/router/clauses.hpp"
#include "moecert/router.hpp"
#include "ops/core/task.hpp"
#include "ops/router/kinds.hpp"
#include "ops/router/select.hpp"

namespace moecert::router {
namespace {

using gemm::exp_poly::exp;

// Row kernel of the forward: select on z, then the weights.
void forward_row(const float* z, std::size_t e, std::size_t k, bool renormalize, std::int32_t* idx,
                 float* w, std::vector<std::int32_t>& ids) {
  detail::top_k(
      e, k, [&](std::int32_t a, std::int32_t b) { return detail::outranks(z[a], a, z[b], b); }, idx,
      ids);
  const float m = z[idx[0]];  // the row maximum
  if (renormalize) {          // softmax over the selected logits, summed in slot order
    float sum = 0;
    for (std::size_t j = 0; j < k; ++j) sum += w[j] = exp(z[idx[j]] - m);
    for (std::size_t j = 0; j < k; ++j) w[j] = w[j] / sum;
  } else {  // p over all E, summed in index order
    float sum = 0;
    for (std::size_t i = 0; i < e; ++i) sum += exp(z[i] - m);
    for (std::size_t j = 0; j < k; ++j) w[j] = exp(z[idx[j]] - m) / sum;
  }
}

// z_bytes: the caller's z (bf16 or fp32), for the alias clause.
void forward_impl(MatView<const float> z, ByteRange z_bytes, MatView<std::int32_t> idx,
                  MatView<float> w, bool renormalize) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  moecert::detail::Checker c{"router.softmax_topk.forward"};
  contracts::softmax_topk_pre(c, z, z_bytes, idx, w);
  if (c.stop()) return;
  const std::size_t e = z.cols, k = idx.cols;
  oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, z.rows, 16),
                            moecert::detail::task([&](const auto& r) {
                              std::vector<std::int32_t> ids;
                              for (std::size_t t = r.begin(); t < r.end(); ++t)
                                forward_row(z.row(t), e, k, renormalize, idx.row(t), w.row(t), ids);
                            }));
  contracts::softmax_topk_post(c, z, idx, w, renormalize);
}

}  // namespace

void softmax_topk_forward(MatView<const float> z, MatView<std::int32_t> idx, MatView<float> w,
                          bool renormalize) {
  forward_impl(z, z.bytes(), idx, w, renormalize);
}
void softmax_topk_forward(MatView<const bf16> z, MatView<std::int32_t> idx, MatView<float> w,
                          bool renormalize) {
  const std::vector<float> zf = detail::widen(z);  // exact
  forward_impl(MatView<const float>(zf.data(), z.rows, z.cols), z.bytes(), idx, w, renormalize);
}

void softmax_topk_backward(MatView<const float> z, MatView<const std::int32_t> idx,
                           MatView<const float> g, MatView<float> dz, bool renormalize) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  moecert::detail::Checker c{"router.softmax_topk.backward"};
  contracts::softmax_topk_backward_pre(c, z, idx, g, dz);
  if (c.stop()) return;
  const std::size_t e = z.cols, k = idx.cols;
  oneapi::tbb::parallel_for(
      std::size_t{0}, z.rows, moecert::detail::task([&](std::size_t t) {
        const float* zt = z.row(t);
        const std::int32_t* it = idx.row(t);
        const float* gt = g.row(t);
        float* dt = dz.row(t);
        const std::size_t valid =
            detail::valid_slots(it, k);  // -1 slots, only at the tail, add nothing
        std::fill(dt, dt + e, 0.0f);
        if (valid == 0) return;
        float m = zt[it[0]];
        for (std::size_t j = 1; j < valid; ++j) m = std::max(m, zt[it[j]]);
        if (renormalize) {  // w = softmax over the selected; dz_i = w_i (g_i - sum_S w g) on S
          std::vector<float> wv(valid);
          float sum = 0, dot = 0;
          for (std::size_t j = 0; j < valid; ++j) sum += wv[j] = exp(zt[it[j]] - m);
          for (std::size_t j = 0; j < valid; ++j) dot += (wv[j] = wv[j] / sum) * gt[j];
          for (std::size_t j = 0; j < valid; ++j) dt[it[j]] = wv[j] * (gt[j] - dot);
        } else {  // p over all E; dz_j = p_j (g^_j - sum_S p g) everywhere
          for (std::size_t i = 0; i < e; ++i) m = std::max(m, zt[i]);
          float sum = 0, dot = 0;
          for (std::size_t i = 0; i < e; ++i) sum += exp(zt[i] - m);
          for (std::size_t j = 0; j < valid; ++j) dot += (exp(zt[it[j]] - m) / sum) * gt[j];
          for (std::size_t i = 0; i < e; ++i) dt[i] = (exp(zt[i] - m) / sum) * (0.0f - dot);
          for (std::size_t j = 0; j < valid; ++j)
            dt[it[j]] = (exp(zt[it[j]] - m) / sum) * (gt[j] - dot);
        }
      }));
  contracts::softmax_topk_backward_post(c, z, idx, g, dz, renormalize);
}

namespace {

void softmax_topk_layer_forward(const contracts::RouterSettings& s, MatView<const float> z,
                                View<const float>, MatView<std::int32_t> idx, MatView<float> w) {
  softmax_topk_forward(z, idx, w, s.renormalize);
}

void softmax_topk_layer_backward(const contracts::RouterSettings& s, MatView<const float> z,
                                 MatView<const std::int32_t> idx, MatView<const float> g,
                                 float* dz) {
  softmax_topk_backward(z, idx, g, MatView<float>(dz, z.rows, z.cols, z.cols), s.renormalize);
}

}  // namespace

extern const RouterOps kSoftmaxTopkOps = {RouterKind::softmax_topk, softmax_topk_layer_forward,
                                          softmax_topk_layer_backward};

}  // namespace moecert::router
