// The layer's eager peer (onednn_layer_peer.hpp). The forward, as a
// framework-level program would write it:
//
//   z = F.linear(x.float(), W_r, b); p = softmax(z, -1)
//   p_sel, idx = topk(p, K); w = p_sel / p_sel.sum(-1, keepdim=True)
//   y = zeros(T, H)
//   for e in experts:                                  # rows of e, token order
//     xe = x[tok]
//     g = F.linear(xe, W_g) + F.linear(F.linear(xe, A_g), B_g) * s   # 3 matmuls, mul, add
//     u = (likewise with W_u, A_u, B_u)
//     h = silu(g) * u
//     o = F.linear(h, W_d) + F.linear(F.linear(h, A_d), B_d) * s
//     y.index_add_(0, tok, o.float() * w[tok, slot, None])
//
// and its backward as autograd derives it, expert by expert in reverse, then
// the router. Where this is kinder to the peer than eager PyTorch: rows
// grouped once by a counting sort (not one `where` per expert), index_add
// over rows in parallel (rows of one expert are distinct tokens), no
// interpreter overhead.
#include "bench/onednn_layer_peer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <dnnl.hpp>
#include <map>
#include <numeric>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "bench/onednn_engine.hpp"

namespace moecert::bench {
namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

// PyTorch's at::internal::GRAIN_SIZE: element-wise ops on fewer elements
// run on one thread.
constexpr std::size_t kGrain = 32768;

// The loops compiled twice: for AVX-512 (PyTorch's element-wise kernels are
// vectorised for the CPU they run on) and for any x86-64; the lambdas are
// inlined into both.
#define MOECERT_PEER_LOOP(name, attr)                                                           \
  template <class F>                                                                            \
  attr void name(long count, bool parallel, const F& f) {                                       \
    _Pragma("omp parallel for schedule(static) if (parallel)") for (long q = 0; q < count; ++q) \
        f(static_cast<std::size_t>(q));                                                         \
  }
MOECERT_PEER_LOOP(loop_avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))))
MOECERT_PEER_LOOP(loop_plain, )
#undef MOECERT_PEER_LOOP

template <class F>
void loop(std::size_t count, bool parallel, const F& f) {
  static const bool wide = __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (wide)
    loop_avx512(static_cast<long>(count), parallel, f);
  else
    loop_plain(static_cast<long>(count), parallel, f);
}

// f(q) for q < n.
template <class F>
void each(std::size_t n, F f) {
  loop(n, n > kGrain, f);
}

// f(row) over `rows` rows of `cols` elements.
template <class F>
void each_row(std::size_t rows, std::size_t cols, F f) {
  loop(rows, rows * cols > kGrain, f);
}

// exp without branches or library calls, so that the loops vectorise as
// PyTorch's (Sleef) do; glibc's expf would not. About 2 ulp: argument
// clamped to +-87, n = round(x log2 e) by the 1.5 * 2^23 trick, e^r by a
// degree-6 Taylor polynomial, 2^n by the exponent bits.
float vexp(float x) {
  x = std::min(std::max(x, -87.0f), 87.0f);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const float n = (x * 1.44269504f + kRound) - kRound;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.0f / 720;
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = p * r + c;
  return p * std::bit_cast<float>((static_cast<std::int32_t>(n) + 127) << 23);
}

float sigmoid(float v) { return 1.0f / (1.0f + vexp(-v)); }

// C [m x n] = op(A) op(B), plain row-major operands: A stored [m x k], or
// [k x m] when ta; B stored [k x n], or [n x k] when tb (a weight as
// F.linear takes it). One primitive per shape, created on first use and
// kept (PyTorch's oneDNN path caches them likewise).
class Matmuls {
 public:
  void run(std::size_t m, std::size_t n, std::size_t k, bool ta, const void* a, bool tb,
           const void* b, void* c, dt in, dt out, const float* bias = nullptr) {
    if (m == 0 || n == 0) return;
    const auto key = std::make_tuple(m, n, k, ta, tb, in, out, bias != nullptr);
    auto it = cache_.find(key);
    if (it == cache_.end())
      it = cache_.emplace(key, make(m, n, k, ta, tb, in, out, bias != nullptr)).first;
    Entry& e = it->second;
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, memory(e.src, onednn_engine(), const_cast<void*>(a))},
        {DNNL_ARG_WEIGHTS, memory(e.wei, onednn_engine(), const_cast<void*>(b))},
        {DNNL_ARG_DST, memory(e.dst, onednn_engine(), c)}};
    if (bias)
      args.insert({DNNL_ARG_BIAS, memory(e.bias, onednn_engine(), const_cast<float*>(bias))});
    e.prim.execute(stream_, args);
    stream_.wait();
  }

  /// Implementation name -> primitives using it.
  std::map<std::string, int> impls() const {
    std::map<std::string, int> out;
    for (const auto& [key, e] : cache_) ++out[e.impl];
    return out;
  }

 private:
  struct Entry {
    dnnl::matmul prim;
    memory::desc src, wei, dst, bias;
    std::string impl;
  };
  static Entry make(std::size_t m, std::size_t n, std::size_t k, bool ta, bool tb, dt in, dt out,
                    bool bias) {
    const auto d = [](std::size_t v) { return static_cast<memory::dim>(v); };
    Entry e;
    e.src = memory::desc({d(m), d(k)}, in, ta ? tag::ba : tag::ab);
    e.wei = memory::desc({d(k), d(n)}, in, tb ? tag::ba : tag::ab);
    e.dst = memory::desc({d(m), d(n)}, out, tag::ab);
    e.bias = memory::desc({1, d(n)}, dt::f32, tag::ab);
    const auto desc = bias ? dnnl::matmul::desc(e.src, e.wei, e.bias, e.dst)
                           : dnnl::matmul::desc(e.src, e.wei, e.dst);
    const dnnl::matmul::primitive_desc pd = matmul_pd(desc);
    e.prim = dnnl::matmul(pd);
    e.impl = pd.impl_info_str();
    return e;
  }
  std::map<std::tuple<std::size_t, std::size_t, std::size_t, bool, bool, dt, dt, bool>, Entry>
      cache_;
  dnnl::stream stream_{onednn_engine()};
};

}  // namespace

struct OnednnEagerLayer::Impl {
  EagerLayerSpec s;
  Matmuls mm;
  std::size_t tokens = 0;
  // Router: x as f32 [T x H], logits and probabilities [T x E], the top-k
  // [T x K], the selected probabilities' sums [T], the weights [T x K].
  std::vector<float> xf, z, p, p_sel, p_sum, w;
  std::vector<std::int32_t> idx;
  // Rows grouped by expert (expert e: rows offset[e] .. offset[e+1]), token order.
  std::vector<std::size_t> offset;
  std::vector<std::size_t> row_token, row_slot;
  // Saved for the backward, stacked by row.
  std::vector<bf16> xe, xa_g, xa_u, g, u, sg, h, ha_d, o;
  // Per-expert temporaries (max rows x max(H, I)).
  std::vector<bf16> t1, t2, t3, t4, d_o, dh, dsg, du, dg, dxg, dxu;
  std::vector<float> f1, f2, w_sel;
  // Router backward.
  std::vector<float> dw, dp, dz, dxf;

  // Expert e's block of a stacked [E*rows x cols] array.
  static const bf16* block(const bf16* stacked, std::size_t e, std::size_t rows, std::size_t cols) {
    return stacked + e * rows * cols;
  }

  // out [m x n_out] = F.linear(in, W) + F.linear(F.linear(in, A), B) * s,
  // in [m x n_in]; keeps in A^T in xa [m x r].
  void lora_linear(std::size_t m, std::size_t n_in, std::size_t n_out, const bf16* in,
                   const bf16* wt, const bf16* a, const bf16* b, bf16* xa, bf16* out) {
    const std::size_t r = s.rank;
    mm.run(m, n_out, n_in, false, in, true, wt, t1.data(), dt::bf16, dt::bf16);
    mm.run(m, r, n_in, false, in, true, a, xa, dt::bf16, dt::bf16);
    mm.run(m, n_out, r, false, xa, true, b, t2.data(), dt::bf16, dt::bf16);
    each(m * n_out, [&](std::size_t q) { t2[q] = bf16(float(t2[q]) * s.scale); });
    each(m * n_out, [&](std::size_t q) { out[q] = bf16(float(t1[q]) + float(t2[q])); });
  }

  // The backward of lora_linear for d_out [m x n_out]: d_in [m x n_in]
  // (bf16), dA [r x n_in] and dB [n_out x r] (f32).
  void lora_linear_backward(std::size_t m, std::size_t n_in, std::size_t n_out, const bf16* in,
                            const bf16* xa, const bf16* d_out, const bf16* wt, const bf16* a,
                            const bf16* b, bf16* d_in, float* da, float* db) {
    const std::size_t r = s.rank;
    mm.run(m, n_in, n_out, false, d_out, false, wt, t1.data(), dt::bf16, dt::bf16);  // d_out W
    each(m * n_out,
         [&](std::size_t q) { t2[q] = bf16(float(d_out[q]) * s.scale); });           // through * s
    mm.run(m, r, n_out, false, t2.data(), false, b, t3.data(), dt::bf16, dt::bf16);  // d(in A^T)
    mm.run(n_out, r, m, true, t2.data(), false, xa, db, dt::bf16, dt::f32);          // dB
    mm.run(r, n_in, m, true, t3.data(), false, in, da, dt::bf16, dt::f32);           // dA
    mm.run(m, n_in, r, false, t3.data(), false, a, t4.data(), dt::bf16, dt::bf16);   // d(in) via A
    each(m * n_in, [&](std::size_t q) { d_in[q] = bf16(float(t1[q]) + float(t4[q])); });
  }
};

OnednnEagerLayer::OnednnEagerLayer(const EagerLayerSpec& spec) : impl_(new Impl) {
  impl_->s = spec;
}
OnednnEagerLayer::~OnednnEagerLayer() = default;

std::string OnednnEagerLayer::matmul_impls() const {
  std::string out;
  for (const auto& [name, n] : impl_->mm.impls())
    out += fmt::format("{}{} x{}", out.empty() ? "" : ", ", name, n);
  return out;
}

void OnednnEagerLayer::forward(MatView<const bf16> x, MatView<float> y) {
  Impl& p = *impl_;
  const EagerLayerSpec& s = p.s;
  const std::size_t T = x.rows, H = s.hidden, E = s.experts, K = s.topk;
  p.tokens = T;
  // Router.
  p.xf.resize(T * H);
  each_row(T, H, [&](std::size_t t) {
    for (std::size_t c = 0; c < H; ++c) p.xf[t * H + c] = float(x.row(t)[c]);
  });
  p.z.resize(T * E);
  p.mm.run(T, E, H, false, p.xf.data(), true, s.router_w, p.z.data(), dt::f32, dt::f32, s.router_b);
  p.p.resize(T * E);
  each_row(T, E, [&](std::size_t t) {
    const float* zt = p.z.data() + t * E;
    float* pt = p.p.data() + t * E;
    const float mx = *std::max_element(zt, zt + E);
    float sum = 0;
    for (std::size_t c = 0; c < E; ++c) sum += pt[c] = vexp(zt[c] - mx);
    for (std::size_t c = 0; c < E; ++c) pt[c] /= sum;
  });
  p.idx.resize(T * K);
  p.p_sel.resize(T * K);
  each_row(T, E, [&](std::size_t t) {
    const float* pt = p.p.data() + t * E;
    std::vector<std::int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(
        order.begin(), order.begin() + static_cast<long>(K), order.end(),
        [&](std::int32_t a, std::int32_t b) { return pt[a] > pt[b] || (pt[a] == pt[b] && a < b); });
    for (std::size_t j = 0; j < K; ++j) {
      p.idx[t * K + j] = order[j];
      p.p_sel[t * K + j] = pt[order[j]];
    }
  });
  p.p_sum.resize(T);
  each_row(T, K, [&](std::size_t t) {
    float sum = 0;
    for (std::size_t j = 0; j < K; ++j) sum += p.p_sel[t * K + j];
    p.p_sum[t] = sum;
  });
  p.w.resize(T * K);
  each(T * K, [&](std::size_t q) { p.w[q] = p.p_sel[q] / p.p_sum[q / K]; });
  run_experts(x, y);
}

void OnednnEagerLayer::forward_experts(MatView<const bf16> x, MatView<const std::int32_t> idx,
                                       MatView<const float> w, MatView<float> y) {
  Impl& p = *impl_;
  const std::size_t T = x.rows, K = p.s.topk;
  p.tokens = T;
  p.idx.resize(T * K), p.w.resize(T * K);
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t j = 0; j < K; ++j) p.idx[t * K + j] = idx(t, j), p.w[t * K + j] = w(t, j);
  run_experts(x, y);
}

// The experts on p.idx and p.w: rows grouped by expert, each expert's
// matmuls and element-wise passes, index_add_ into y.
void OnednnEagerLayer::run_experts(MatView<const bf16> x, MatView<float> y) {
  Impl& p = *impl_;
  const EagerLayerSpec& s = p.s;
  const std::size_t T = x.rows, H = s.hidden, I = s.inter, E = s.experts, K = s.topk, r = s.rank;

  // Rows grouped by expert.
  p.offset.assign(E + 1, 0);
  for (std::size_t q = 0; q < T * K; ++q) ++p.offset[static_cast<std::size_t>(p.idx[q]) + 1];
  std::partial_sum(p.offset.begin(), p.offset.end(), p.offset.begin());
  const std::size_t rows = p.offset[E];
  p.row_token.resize(rows);
  p.row_slot.resize(rows);
  std::vector<std::size_t> next(p.offset.begin(), p.offset.end() - 1);
  for (std::size_t q = 0; q < T * K; ++q) {
    const std::size_t at = next[static_cast<std::size_t>(p.idx[q])]++;
    p.row_token[at] = q / K;
    p.row_slot[at] = q % K;
  }
  std::size_t max_m = 0;
  for (std::size_t e = 0; e < E; ++e) max_m = std::max(max_m, p.offset[e + 1] - p.offset[e]);
  const std::size_t wide = std::max(H, I);
  p.xe.resize(rows * H), p.o.resize(rows * H);
  p.xa_g.resize(rows * r), p.xa_u.resize(rows * r), p.ha_d.resize(rows * r);
  p.g.resize(rows * I), p.u.resize(rows * I), p.sg.resize(rows * I), p.h.resize(rows * I);
  for (auto* v : {&p.t1, &p.t2, &p.t3, &p.t4, &p.d_o, &p.dh, &p.dsg, &p.du, &p.dg, &p.dxg, &p.dxu})
    v->resize(max_m * wide);
  p.f1.resize(max_m * H), p.f2.resize(max_m * H), p.w_sel.resize(max_m);

  each_row(T, H, [&](std::size_t t) { std::fill(y.row(t), y.row(t) + H, 0.0f); });
  for (std::size_t e = 0; e < E; ++e) {
    const std::size_t m = p.offset[e + 1] - p.offset[e], r0 = p.offset[e];
    if (m == 0) continue;
    bf16 *xe = p.xe.data() + r0 * H, *g = p.g.data() + r0 * I, *u = p.u.data() + r0 * I,
         *sg = p.sg.data() + r0 * I, *h = p.h.data() + r0 * I, *o = p.o.data() + r0 * H;
    each_row(m, H, [&](std::size_t i) { std::copy_n(x.row(p.row_token[r0 + i]), H, xe + i * H); });
    p.lora_linear(m, H, I, xe, p.block(s.w_gate, e, I, H), p.block(s.a_gate, e, r, H),
                  p.block(s.b_gate, e, I, r), p.xa_g.data() + r0 * r, g);
    p.lora_linear(m, H, I, xe, p.block(s.w_up, e, I, H), p.block(s.a_up, e, r, H),
                  p.block(s.b_up, e, I, r), p.xa_u.data() + r0 * r, u);
    each(m * I, [&](std::size_t q) { sg[q] = bf16(float(g[q]) * sigmoid(float(g[q]))); });
    each(m * I, [&](std::size_t q) { h[q] = bf16(float(sg[q]) * float(u[q])); });
    p.lora_linear(m, I, H, h, p.block(s.w_down, e, H, I), p.block(s.a_down, e, r, I),
                  p.block(s.b_down, e, H, r), p.ha_d.data() + r0 * r, o);
    each(m, [&](std::size_t i) { p.w_sel[i] = p.w[p.row_token[r0 + i] * K + p.row_slot[r0 + i]]; });
    each_row(m, H, [&](std::size_t i) {
      for (std::size_t c = 0; c < H; ++c) p.f1[i * H + c] = float(o[i * H + c]) * p.w_sel[i];
    });
    each_row(m, H, [&](std::size_t i) {
      float* yt = y.row(p.row_token[r0 + i]);
      const float* src = p.f1.data() + i * H;
      for (std::size_t c = 0; c < H; ++c) yt[c] += src[c];
    });
  }
}

void OnednnEagerLayer::backward(MatView<const float> dy, const EagerLayerGrads& gr) {
  backward_experts(dy, gr, nullptr);
  backward_router(gr);
}

void OnednnEagerLayer::backward_experts(MatView<const float> dy, const EagerLayerGrads& gr,
                                        float* dweights) {
  Impl& p = *impl_;
  if (p.offset.empty()) throw std::logic_error("OnednnEagerLayer: backward before forward");
  const EagerLayerSpec& s = p.s;
  const std::size_t T = p.tokens, H = s.hidden, I = s.inter, E = s.experts, K = s.topk, r = s.rank;
  each(T * H, [&](std::size_t q) { gr.dx[q] = 0.0f; });
  p.dw.assign(T * K, 0.0f);
  for (std::size_t e = E; e-- > 0;) {
    const std::size_t m = p.offset[e + 1] - p.offset[e], r0 = p.offset[e];
    float *da_g = gr.a_gate + e * r * H, *db_g = gr.b_gate + e * I * r, *da_u = gr.a_up + e * r * H,
          *db_u = gr.b_up + e * I * r, *da_d = gr.a_down + e * r * I, *db_d = gr.b_down + e * H * r;
    if (m == 0) {  // no rows, no gradient
      for (auto [ptr, n] : {std::pair{da_g, r * H},
                            {db_g, I * r},
                            {da_u, r * H},
                            {db_u, I * r},
                            {da_d, r * I},
                            {db_d, H * r}})
        std::fill(ptr, ptr + n, 0.0f);
      continue;
    }
    const bf16 *xe = p.xe.data() + r0 * H, *g = p.g.data() + r0 * I, *u = p.u.data() + r0 * I,
               *sg = p.sg.data() + r0 * I, *h = p.h.data() + r0 * I, *o = p.o.data() + r0 * H;
    // index_add_ backward: the rows' dy; then o.float() * w_sel.
    each_row(m, H, [&](std::size_t i) {
      std::copy_n(dy.row(p.row_token[r0 + i]), H, p.f1.data() + i * H);
    });
    each(m, [&](std::size_t i) { p.w_sel[i] = p.w[p.row_token[r0 + i] * K + p.row_slot[r0 + i]]; });
    bf16 *d_o = p.d_o.data(), *dh = p.dh.data(), *dsg = p.dsg.data(), *du = p.du.data(),
         *dg = p.dg.data(), *dxg = p.dxg.data(), *dxu = p.dxu.data();
    each_row(m, H, [&](std::size_t i) {
      for (std::size_t c = 0; c < H; ++c) d_o[i * H + c] = bf16(p.f1[i * H + c] * p.w_sel[i]);
    });
    each(m * H, [&](std::size_t q) { p.f2[q] = p.f1[q] * float(o[q]); });
    each_row(m, H, [&](std::size_t i) {  // d w_sel = row sums, into dw[tok, slot]
      float sum = 0;
      for (std::size_t c = 0; c < H; ++c) sum += p.f2[i * H + c];
      p.dw[p.row_token[r0 + i] * K + p.row_slot[r0 + i]] += sum;
    });
    // Down, SwiGLU, then gate and up; x[tok]'s two gradients summed.
    p.lora_linear_backward(m, I, H, h, p.ha_d.data() + r0 * r, d_o, p.block(s.w_down, e, H, I),
                           p.block(s.a_down, e, r, I), p.block(s.b_down, e, H, r), dh, da_d, db_d);
    each(m * I, [&](std::size_t q) { dsg[q] = bf16(float(dh[q]) * float(u[q])); });
    each(m * I, [&](std::size_t q) { du[q] = bf16(float(dh[q]) * float(sg[q])); });
    each(m * I, [&](std::size_t q) {
      const float v = float(g[q]), sig = sigmoid(v);
      dg[q] = bf16(float(dsg[q]) * sig * (1.0f + v * (1.0f - sig)));
    });
    p.lora_linear_backward(m, H, I, xe, p.xa_g.data() + r0 * r, dg, p.block(s.w_gate, e, I, H),
                           p.block(s.a_gate, e, r, H), p.block(s.b_gate, e, I, r), dxg, da_g, db_g);
    p.lora_linear_backward(m, H, I, xe, p.xa_u.data() + r0 * r, du, p.block(s.w_up, e, I, H),
                           p.block(s.a_up, e, r, H), p.block(s.b_up, e, I, r), dxu, da_u, db_u);
    each(m * H, [&](std::size_t q) { dxg[q] = bf16(float(dxg[q]) + float(dxu[q])); });
    each_row(m, H, [&](std::size_t i) {  // x[tok] backward: index_add_ into dx
      float* dxt = gr.dx + p.row_token[r0 + i] * H;
      for (std::size_t c = 0; c < H; ++c) dxt[c] += float(dxg[i * H + c]);
    });
  }
  if (dweights) std::copy(p.dw.begin(), p.dw.end(), dweights);
}

// Router: w = p_sel / p_sum, then topk, softmax and the linear backward.
void OnednnEagerLayer::backward_router(const EagerLayerGrads& gr) {
  Impl& p = *impl_;
  const EagerLayerSpec& s = p.s;
  const std::size_t T = p.tokens, H = s.hidden, E = s.experts, K = s.topk;
  p.dp.assign(T * E, 0.0f);
  each_row(T, K, [&](std::size_t t) {
    float dsum = 0;
    for (std::size_t j = 0; j < K; ++j)
      dsum -= p.dw[t * K + j] * p.p_sel[t * K + j] / (p.p_sum[t] * p.p_sum[t]);
    for (std::size_t j = 0; j < K; ++j)
      p.dp[t * E + static_cast<std::size_t>(p.idx[t * K + j])] =
          p.dw[t * K + j] / p.p_sum[t] + dsum;
  });
  p.dz.resize(T * E);
  each_row(T, E, [&](std::size_t t) {
    const float *pt = p.p.data() + t * E, *dpt = p.dp.data() + t * E;
    float dot = 0;
    for (std::size_t c = 0; c < E; ++c) dot += dpt[c] * pt[c];
    for (std::size_t c = 0; c < E; ++c) p.dz[t * E + c] = pt[c] * (dpt[c] - dot);
  });
  p.mm.run(E, H, T, true, p.dz.data(), false, p.xf.data(), gr.router_w, dt::f32, dt::f32);
  const long ecount = static_cast<long>(E);
#pragma omp parallel for schedule(static) if (T * E > kGrain)
  for (long c = 0; c < ecount; ++c) {
    float sum = 0;
    for (std::size_t t = 0; t < T; ++t) sum += p.dz[t * E + static_cast<std::size_t>(c)];
    gr.router_b[c] = sum;
  }
  p.dxf.resize(T * H);
  p.mm.run(T, H, E, false, p.dz.data(), false, s.router_w, p.dxf.data(), dt::f32, dt::f32);
  each(T * H, [&](std::size_t q) { gr.dx[q] += p.dxf[q]; });
}

}  // namespace moecert::bench
