// The experts op's judge model (contracts/reference/experts_model.hpp):
// per routed pair (t, e), proofs/experts.md §4's rounding points over
// bounds::Tracked, rows on the caller's threads.
#include "contracts/reference/experts_model.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <cmath>

#include "contracts/engine/tbb_sync.hpp"

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

// One routed pair's forward as the model keeps it for the backward.
struct PairForward {
  std::vector<Tracked> g, u, sg, silu, h, o;
  std::vector<Tracked> lb, lbd;  // s x A^T (gate, up), s h A_d^T as the B GEMMs read them
};

// Expert e's forward for one token row x (H inputs, as read).
PairForward pair_forward(const Expert& w, const std::vector<Tracked>& x, const Tracked& s) {
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
  PairForward f{std::vector<Tracked>(I),
                std::vector<Tracked>(I),
                std::vector<Tracked>(I),
                std::vector<Tracked>(I),
                std::vector<Tracked>(I),
                std::vector<Tracked>(H),
                lb,
                {}};
  for (std::size_t i = 0; i < I; ++i) {
    auto xq = [&](std::size_t q) { return x[q]; };
    f.g[i] = gemm_out(
        H, xq, [&](std::size_t q) { return w.at(in.w_gate, I, i, q); }, r,
        [&](std::size_t q) { return lb[q]; },
        [&](std::size_t q) { return w.at(in.b_gate, I, i, q); }, n1, p);
    f.u[i] = gemm_out(
        H, xq, [&](std::size_t q) { return w.at(in.w_up, I, i, q); }, r,
        [&](std::size_t q) { return lb[r + q]; },
        [&](std::size_t q) { return w.at(in.b_up, I, i, q); }, n1, p);
    // silu(g) in fp32 (sigma with exp within 2 ulps), stored; times u, stored.
    f.sg[i] = bounds::sig(f.g[i]);
    f.silu[i] = bounds::mid(bounds::r32(f.g[i] * f.sg[i]), p);
    f.h[i] = bounds::operand(bounds::mid(f.silu[i] * f.u[i], p), p);
  }
  std::vector<Tracked> lbd(r);
  for (std::size_t k = 0; k < r; ++k) {
    const Tracked ha = bounds::dot_stored(
        I, [&](std::size_t q) { return f.h[q]; },
        [&](std::size_t q) { return w.at(in.a_down, r, k, q); }, kpad(I), p);
    lbd[k] = bounds::operand(bounds::mid(s * ha, p), p);
  }
  f.lbd = lbd;
  const std::size_t n2 = kpad(I) + (r ? kpad(r) : 0);
  for (std::size_t m = 0; m < H; ++m)
    f.o[m] = gemm_out(
        I, [&](std::size_t q) { return f.h[q]; },
        [&](std::size_t q) { return w.at(in.w_down, H, m, q); }, r,
        [&](std::size_t q) { return lbd[q]; },
        [&](std::size_t q) { return w.at(in.b_down, H, m, q); }, n2, p);
  return f;
}

// dg, du of one pair from do (as read): dh = do W_d + q_d A_d, then the
// SwiGLU backward, each stored as the next GEMMs read it.
struct PairDgu {
  std::vector<Tracked> dg, du, qd;
};
PairDgu pair_dgu(const Expert& w, const PairForward& f, const std::vector<Tracked>& d,
                 const Tracked& s) {
  const ExpertsTensors& in = w.in;
  const Precision& p = w.p;
  const std::size_t H = in.H, I = in.I, r = in.r;
  // q_d = s (do B_d): the scale applied to do before B_d and the result
  // stored again, so either order is covered.
  std::vector<Tracked> qd(r);
  for (std::size_t k = 0; k < r; ++k)
    qd[k] = bounds::operand(
        bounds::mid(
            bounds::dot_stored(
                H, [&](std::size_t q) { return bounds::operand(bounds::mid(s * d[q], p), p); },
                [&](std::size_t q) { return w.at(in.b_down, H, q, k); }, kpad(H), p),
            p),
        p);
  const std::size_t nh = kpad(H) + (r ? kpad(r) : 0);
  PairDgu o{std::vector<Tracked>(I), std::vector<Tracked>(I), qd};
  for (std::size_t i = 0; i < I; ++i) {
    const Tracked dh = gemm_out(
        H, [&](std::size_t q) { return d[q]; },
        [&](std::size_t q) { return w.at(in.w_down, H, q, i); }, r,
        [&](std::size_t q) { return qd[q]; },
        [&](std::size_t q) { return w.at(in.a_down, r, q, i); }, nh, p);
    // silu'(g) = sigma (1 + g (1 - sigma)) in fp32.
    const Tracked sg = f.sg[i], one{1, 0};
    const Tracked dsilu =
        bounds::r32(sg * bounds::r32(one + bounds::r32(f.g[i] * bounds::r32(one - sg))));
    o.dg[i] = bounds::operand(bounds::mid(bounds::r32(bounds::mid(dh * f.u[i], p) * dsilu), p), p);
    o.du[i] = bounds::operand(bounds::mid(dh * f.silu[i], p), p);
  }
  return o;
}

// What one pair's backward leaves for the weight gradients: the GEMMs'
// operands (do, dg, du and q = s (d B) of gate, up, down), with the forward's.
struct PairGrads {
  std::vector<Tracked> x, d, dg, du, qgu, qd;
  PairForward f;
};

// The expert path of one pair: this pair's share of dx from do = wt dy
// (dy as read), proofs/experts.md §5; its operands kept in `keep` if given.
std::vector<Tracked> pair_dx(const Expert& w, const PairForward& f, const std::vector<Tracked>& dy,
                             const Tracked& wt, const Tracked& s, PairGrads* keep) {
  const ExpertsTensors& in = w.in;
  const Precision& p = w.p;
  const std::size_t H = in.H, I = in.I, r = in.r;
  std::vector<Tracked> d(H);  // do = wt dy, as the GEMMs read it
  for (std::size_t m = 0; m < H; ++m) d[m] = bounds::operand(bounds::mid(wt * dy[m], p), p);
  // (Named members, not a structured binding: clang 14 cannot capture one.)
  const PairDgu dgu = pair_dgu(w, f, d, s);
  const std::vector<Tracked>& dg = dgu.dg;
  const std::vector<Tracked>& du = dgu.du;
  // q_g = s (dg B_g), q_u = s (du B_u): the scale applied to dg before B
  // and the result stored again, so either order is covered.
  std::vector<Tracked> qgu(2 * r);
  for (std::size_t k = 0; k < 2 * r; ++k) {
    const auto& v = k < r ? dg : du;
    const Tracked dgb = bounds::dot_stored(
        I, [&](std::size_t q) { return bounds::operand(bounds::mid(s * v[q], p), p); },
        [&](std::size_t q) {
          return k < r ? w.at(in.b_gate, I, q, k) : w.at(in.b_up, I, q, k - r);
        },
        kpad(2 * I), p);
    qgu[k] = bounds::operand(bounds::mid(dgb, p), p);
  }
  // dx row = dg W_g + du W_u + q_g A_g + q_u A_u: four stored sums over the
  // fused length, added in any order.
  const std::size_t nx = kpad(2 * I) + (r ? kpad(2 * r) : 0);
  std::vector<Tracked> dxr(H);
  for (std::size_t m = 0; m < H; ++m) {
    const Tracked terms[] = {bounds::dot_stored(
                                 I, [&](std::size_t q) { return dg[q]; },
                                 [&](std::size_t q) { return w.at(in.w_gate, I, q, m); }, nx, p),
                             bounds::dot_stored(
                                 I, [&](std::size_t q) { return du[q]; },
                                 [&](std::size_t q) { return w.at(in.w_up, I, q, m); }, nx, p),
                             bounds::dot_stored(
                                 r, [&](std::size_t q) { return qgu[q]; },
                                 [&](std::size_t q) { return w.at(in.a_gate, r, q, m); }, nx, p),
                             bounds::dot_stored(
                                 r, [&](std::size_t q) { return qgu[r + q]; },
                                 [&](std::size_t q) { return w.at(in.a_up, r, q, m); }, nx, p)};
    Tracked sum{0, 0};
    double mag = 0;
    for (const Tracked& t : terms) sum += t, mag += t.mag();
    dxr[m] = bounds::sum_stored(sum, mag, r ? 4 : 2, p);
  }
  if (keep) keep->d = d, keep->dg = dg, keep->du = du, keep->qgu = qgu, keep->qd = dgu.qd;
  return dxr;
}

// Expert e's weight gradients over its pairs (token order): each element a
// sum over the pairs of one product of the GEMMs' operands, accumulated in
// fp32 in any order, stored (proofs/experts.md §6). Order: grad_shapes'.
void expert_weight_grads(const ExpertsTensors& in, std::size_t e,
                         const std::vector<const PairGrads*>& pairs, const Precision& p,
                         std::array<std::vector<Tracked>, 9>& out) {
  const std::size_t H = in.H, I = in.I, r = in.r, n = pairs.size();
  // out[g] rows [e * rows, (e + 1) * rows) of cols: sum_pairs a(pair)[row] b(pair)[col].
  auto outer = [&](std::size_t g, std::size_t rows, std::size_t cols, auto a, auto b) {
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t k = 0; k < cols; ++k)
        out[g][(e * rows + i) * cols + k] = bounds::dot_stored(
            n, [&](std::size_t q) { return a(*pairs[q], i); },
            [&](std::size_t q) { return b(*pairs[q], k); }, n, p);
  };
  auto x = [](const PairGrads& q, std::size_t k) { return q.x[k]; };
  auto h = [](const PairGrads& q, std::size_t k) { return q.f.h[k]; };
  auto dg = [](const PairGrads& q, std::size_t i) { return q.dg[i]; };
  auto du = [](const PairGrads& q, std::size_t i) { return q.du[i]; };
  auto d = [](const PairGrads& q, std::size_t m) { return q.d[m]; };
  if (r) {
    outer(
        0, r, H, [](const PairGrads& q, std::size_t k) { return q.qgu[k]; }, x);
    outer(1, I, r, dg, [](const PairGrads& q, std::size_t k) { return q.f.lb[k]; });
    outer(
        2, r, H, [r](const PairGrads& q, std::size_t k) { return q.qgu[r + k]; }, x);
    outer(3, I, r, du, [r](const PairGrads& q, std::size_t k) { return q.f.lb[r + k]; });
    outer(
        4, r, I, [](const PairGrads& q, std::size_t k) { return q.qd[k]; }, h);
    outer(5, H, r, d, [](const PairGrads& q, std::size_t k) { return q.f.lbd[k]; });
  }
  outer(6, I, H, dg, x);
  outer(7, I, H, du, x);
  outer(8, H, I, d, h);
}

// One token's rows x and dy as the implementation reads them.
std::vector<Tracked> row_in(MatView<const float> m, std::size_t t, const Precision& p) {
  std::vector<Tracked> v(m.cols);
  for (std::size_t q = 0; q < m.cols; ++q) v[q] = bounds::input(m(t, q), p);
  return v;
}

// s = alpha / r as the implementation holds it: in fp32 at best.
Tracked scale_of(const ExpertsTensors& in) {
  const double s = in.r ? in.alpha / static_cast<double>(in.r) : 0.0;
  return {s, bounds::kU32 * std::fabs(s)};
}

}  // namespace

std::vector<Tracked> experts_model_forward(const ExpertsTensors& in, const Precision& p) {
  const std::size_t T = in.x.rows, K = in.idx.cols, H = in.H;
  const Tracked s = scale_of(in);
  std::vector<Tracked> y(T * H);
  oneapi::tbb::parallel_for(
      std::size_t{0}, T, detail::TbbBody([&](std::size_t t) {
        const std::vector<Tracked> x = row_in(in.x, t, p);
        std::vector<Tracked> sum(H, Tracked{0, 0});
        std::vector<double> sum_abs(H, 0.0);
        for (std::size_t j = 0; j < K; ++j) {
          const std::int32_t e = in.idx(t, j);
          if (e < 0) continue;
          const auto f = pair_forward({in, static_cast<std::size_t>(e), p}, x, s);
          const Tracked wt = bounds::input(in.weights(t, j), p);
          for (std::size_t m = 0; m < H; ++m) {
            const Tracked term = wt * f.o[m];
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

namespace {

// Token t's backward: dL/dw of its slots and its dx row into b; each pair's
// operands into keep[t * K + j] when keep is not empty.
void token_backward(const ExpertsTensors& in, MatView<const float> dy, const Precision& p,
                    const Tracked& s, std::size_t t, ExpertsBackward& b,
                    std::vector<PairGrads>& keep) {
  const std::size_t K = in.idx.cols, H = in.H;
  const std::vector<Tracked> x = row_in(in.x, t, p);
  // dy as the GEMMs read it (bf16 operands: rounded).
  std::vector<Tracked> dyr = row_in(dy, t, p);
  for (auto& v : dyr) v = bounds::operand(v, p);
  std::vector<Tracked> sum(H, Tracked{0, 0});
  std::vector<double> sum_abs(H, 0.0);
  for (std::size_t j = 0; j < K; ++j) {
    const std::int32_t e = in.idx(t, j);
    if (e < 0) continue;  // dL/dw exactly 0 there
    const Expert w{in, static_cast<std::size_t>(e), p};
    const auto f = pair_forward(w, x, s);
    // dL/dw = <dy, o>: products stored, an fp32 sum, stored.
    b.dweights[t * K + j] = bounds::dot_products_stored(
        H, [&](std::size_t m) { return dyr[m]; }, [&](std::size_t m) { return f.o[m]; }, H, p);
    PairGrads* k = keep.empty() ? nullptr : &keep[t * K + j];
    const auto dxr = pair_dx(w, f, dyr, bounds::input(in.weights(t, j), p), s, k);
    if (k) k->x = x, k->f = f;
    for (std::size_t m = 0; m < H; ++m) sum[m] += dxr[m], sum_abs[m] += dxr[m].mag();
  }
  // dx = the slots' rows summed in the intermediate format.
  for (std::size_t m = 0; m < H; ++m) {
    b.dx[t * H + m] = bounds::sum_stored(sum[m], sum_abs[m], K, p);
    b.dx_rows[t * H + m] = sum[m];
    b.dx_rows_abs[t * H + m] = sum_abs[m];
  }
}

}  // namespace

ExpertsBackward experts_model_backward(const ExpertsTensors& in, MatView<const float> dy,
                                       const Precision& p, bool weight_grads) {
  const std::size_t T = in.x.rows, K = in.idx.cols, H = in.H, E = in.E;
  const Tracked s = scale_of(in);
  ExpertsBackward b{std::vector<Tracked>(T * H),
                    std::vector<Tracked>(T * K, Tracked{0, 0}),
                    std::vector<Tracked>(T * H),
                    std::vector<double>(T * H),
                    {}};
  std::vector<PairGrads> keep(weight_grads ? T * K : 0);
  oneapi::tbb::parallel_for(std::size_t{0}, T, detail::TbbBody([&](std::size_t t) {
                              token_backward(in, dy, p, s, t, b, keep);
                            }));
  if (!weight_grads) return b;
  const std::size_t sizes[9] = {in.r * H, in.I * in.r, in.r * H, in.I * in.r, in.r * in.I,
                                H * in.r, in.I * H,    in.I * H, H * in.I};
  for (std::size_t g = 0; g < 9; ++g) b.weight_grads[g].assign(E * sizes[g], Tracked{0, 0});
  oneapi::tbb::parallel_for(std::size_t{0}, E, detail::TbbBody([&](std::size_t e) {
                              std::vector<const PairGrads*> pairs;  // in token order
                              for (std::size_t t = 0; t < T; ++t)
                                for (std::size_t j = 0; j < K; ++j)
                                  if (in.idx(t, j) == static_cast<std::int32_t>(e))
                                    pairs.push_back(&keep[t * K + j]);
                              if (!pairs.empty())
                                expert_weight_grads(in, e, pairs, p, b.weight_grads);
                            }));
  return b;
}

}  // namespace moecert::contracts
