// oneDNN peers: a single bf16 matmul, and the expert forward looping over
// experts. Weights are reordered into oneDNN's preferred layout once.
#include "bench/onednn_peer.hpp"

#include <fmt/format.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <dnnl.hpp>

#include "bench/onednn_engine.hpp"

namespace moecert::bench {
namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

// C [m x n] f32 = A [m x k] bf16 * W^T, W given [n x k] row-major (that is,
// the k x n weights in tag ba); weights reordered into the primitive's layout.
struct Mm {
  dnnl::matmul prim;
  memory src, wei, dst;
  Mm(std::size_t m, std::size_t n, std::size_t k, const bf16* w) {
    const memory::dims sd = {memory::dim(m), memory::dim(k)}, wd = {memory::dim(k), memory::dim(n)},
                       dd = {memory::dim(m), memory::dim(n)};
    memory::desc src_md(sd, dt::bf16, tag::ab), wei_any(wd, dt::bf16, tag::any),
        dst_md(dd, dt::f32, tag::ab);
    const dnnl::matmul::primitive_desc pd = matmul_pd(dnnl::matmul::desc(src_md, wei_any, dst_md));
    prim = dnnl::matmul(pd);
    memory wei_user({wd, dt::bf16, tag::ba}, onednn_engine(), const_cast<bf16*>(w));
    wei = memory(pd.weights_desc(), onednn_engine());
    dnnl::stream s(onednn_engine());
    dnnl::reorder(wei_user, wei).execute(s, wei_user, wei);
    s.wait();
    src = memory(src_md, onednn_engine(), DNNL_MEMORY_NONE);
    dst = memory(dst_md, onednn_engine(), DNNL_MEMORY_NONE);
    impl = pd.impl_info_str();
  }
  void run(const void* a, float* c) {
    src.set_data_handle(const_cast<void*>(a));
    dst.set_data_handle(c);
    dnnl::stream s(onednn_engine());
    prim.execute(s, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
    s.wait();
  }
  std::string impl;
};

}  // namespace

struct OnednnMatmul::Impl {
  Mm mm;
};

OnednnMatmul::OnednnMatmul(std::size_t m, std::size_t n, std::size_t k, const std::vector<bf16>& w)
    : impl_(new Impl{Mm(m, n, k, w.data())}) {}
OnednnMatmul::~OnednnMatmul() = default;
void OnednnMatmul::run(const bf16* a, float* c) { impl_->mm.run(a, c); }
std::string OnednnMatmul::impl_name() const { return impl_->mm.impl; }

struct OnednnExperts::Impl {
  std::size_t e, h, i, t, k;
  std::vector<std::vector<std::int32_t>> slots;  // per expert: slot t*K + j, token order
  std::vector<std::unique_ptr<Mm>> gate_up, down;
  std::vector<bf16> xs, hs;
  std::vector<float> gus, os;
  std::vector<std::size_t> offset;  // per expert row offset into the scratch
};

OnednnExperts::OnednnExperts(std::size_t e, std::size_t h, std::size_t i,
                             const std::vector<bf16>& w_gate, const std::vector<bf16>& w_up,
                             const std::vector<bf16>& w_down, MatView<const std::int32_t> idx)
    : impl_(new Impl) {
  Impl& p = *impl_;
  p.e = e;
  p.h = h;
  p.i = i;
  p.t = idx.rows;
  p.k = idx.cols;
  p.slots.resize(e);
  for (std::size_t t = 0; t < idx.rows; ++t)
    for (std::size_t j = 0; j < idx.cols; ++j)
      if (idx(t, j) >= 0)
        p.slots[static_cast<std::size_t>(idx(t, j))].push_back(
            static_cast<std::int32_t>(t * idx.cols + j));
  p.gate_up.resize(e);
  p.down.resize(e);
  std::vector<bf16> w_gu(2 * i * h);
  p.offset.assign(e + 1, 0);
  for (std::size_t x = 0; x < e; ++x) {
    p.offset[x + 1] = p.offset[x] + p.slots[x].size();
    const std::size_t m = p.slots[x].size();
    if (m == 0) continue;
    // Gate and up as one matmul of N = 2I (rows of W_g, then of W_u).
    std::memcpy(w_gu.data(), w_gate.data() + x * i * h, i * h * sizeof(bf16));
    std::memcpy(w_gu.data() + i * h, w_up.data() + x * i * h, i * h * sizeof(bf16));
    p.gate_up[x] = std::make_unique<Mm>(m, 2 * i, h, w_gu.data());
    p.down[x] = std::make_unique<Mm>(m, h, i, w_down.data() + x * h * i);
  }
  const std::size_t rows = p.offset[e];
  p.xs.resize(rows * h);
  p.hs.resize(rows * i);
  p.gus.resize(rows * 2 * i);
  p.os.resize(rows * h);
}

OnednnExperts::~OnednnExperts() = default;

void OnednnExperts::forward(MatView<const bf16> x, MatView<const float> weights, MatView<float> y) {
  Impl& p = *impl_;
  const long rows = static_cast<long>(p.offset[p.e]);
  std::vector<std::int64_t> row_of(p.t * p.k, -1);
  for (std::size_t e = 0; e < p.e; ++e)
    for (std::size_t r = 0; r < p.slots[e].size(); ++r)
      row_of[static_cast<std::size_t>(p.slots[e][r])] = static_cast<std::int64_t>(p.offset[e] + r);
#pragma omp parallel for
  for (long r = 0; r < rows; ++r) {
    std::size_t e = 0;
    while (p.offset[e + 1] <= static_cast<std::size_t>(r)) ++e;
    const std::size_t token =
        static_cast<std::size_t>(p.slots[e][static_cast<std::size_t>(r) - p.offset[e]]) / p.k;
    std::memcpy(p.xs.data() + r * p.h, x.row(token), p.h * sizeof(bf16));
  }
  for (std::size_t e = 0; e < p.e; ++e)
    if (p.gate_up[e])
      p.gate_up[e]->run(p.xs.data() + p.offset[e] * p.h, p.gus.data() + p.offset[e] * 2 * p.i);
  const long hn = rows * static_cast<long>(p.i);
#pragma omp parallel for
  for (long q = 0; q < hn; ++q) {
    const long r = q / static_cast<long>(p.i), c = q % static_cast<long>(p.i);
    const float g = p.gus[r * 2 * p.i + c], u = p.gus[r * 2 * p.i + p.i + c];
    p.hs[q] = bf16((g * (1.0f / (1.0f + std::exp(-g)))) * u);
  }
  for (std::size_t e = 0; e < p.e; ++e)
    if (p.down[e]) p.down[e]->run(p.hs.data() + p.offset[e] * p.i, p.os.data() + p.offset[e] * p.h);
#pragma omp parallel for
  for (long t = 0; t < static_cast<long>(p.t); ++t) {
    float* yt = y.row(static_cast<std::size_t>(t));
    std::fill(yt, yt + p.h, 0.0f);
    for (std::size_t j = 0; j < p.k; ++j) {
      const std::int64_t r = row_of[static_cast<std::size_t>(t) * p.k + j];
      if (r < 0) continue;
      const float w = weights(static_cast<std::size_t>(t), j);
      const float* o = p.os.data() + r * static_cast<std::int64_t>(p.h);
      for (std::size_t m = 0; m < p.h; ++m) yt[m] += w * o[m];
    }
  }
}

std::string OnednnExperts::version() {
  const dnnl_version_t* v = dnnl_version();
  return fmt::format("{}.{}.{} ({})", v->major, v->minor, v->patch,
                     v->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : "other");
}

void OnednnExperts::set_threads(int n) { omp_set_num_threads(n); }

}  // namespace moecert::bench
