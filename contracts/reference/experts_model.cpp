// The experts op's judge model (contracts/reference/experts_model.hpp):
// per routed pair (t, e), proofs/experts.md §4's rounding points over
// bounds::Tracked, rows on the caller's threads.
#include "contracts/reference/experts_model.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <cmath>

#include "contracts/engine/tbb_sync.hpp"
#include "contracts/numeric/probable.hpp"
#include "contracts/reference/experts_pair.hpp"

namespace moecert::contracts {

namespace {

using bounds::Precision;
using bounds::Probable;
using bounds::Terms;
using bounds::Tracked;
using namespace pair;

// lb = s x [A_g; A_u]^T as the B GEMMs read it (xa stored, then s xa).
template <class S>
std::vector<S> lora_lb(const Expert<S>& w, const std::vector<S>& x, const S& s) {
  const ExpertsTensors& in = w.in;
  const std::size_t H = in.H, r = in.r;
  std::vector<S> lb(2 * r);
  for (std::size_t k = 0; k < 2 * r; ++k) {
    const S xa = bounds::dot_stored(
        H, [&](std::size_t q) { return x[q]; },
        [&](std::size_t q) {
          return k < r ? w.at(in.a_gate, r, k, q) : w.at(in.a_up, r, k - r, q);
        },
        kpad(H), w.p);
    lb[k] = bounds::operand(bounds::mid(s * xa, w.p), w.p);
  }
  return lb;
}

// Expert e's forward for one token row x (H inputs, as read). lb's errors
// reach every g_i: folded, or (exact_lb, the Probable forward) kept out of
// g's parts and added to o's by add_lb_errors.
template <class S>
PairForward<S> pair_forward(const Expert<S>& w, const std::vector<S>& x, const S& s,
                            bool exact_lb = false) {
  const ExpertsTensors& in = w.in;
  const Precision& p = w.p;
  const std::size_t H = in.H, I = in.I, r = in.r;
  const std::vector<S> lb = lora_lb(w, x, s);
  std::vector<S> lb_read = lb;
  if constexpr (std::is_same_v<S, Probable>)
    for (std::size_t k = 0; k < 2 * r; ++k)
      lb_read[k] = exact_lb ? bounds::external(lb[k]) : bounds::fold(lb[k]);
  const std::size_t n1 = kpad(H) + (r ? kpad(2 * r) : 0);
  PairForward<S> f{std::vector<S>(I),
                   std::vector<S>(I),
                   std::vector<S>(I),
                   std::vector<S>(I),
                   std::vector<S>(I),
                   std::vector<S>(H),
                   lb,
                   {},
                   {}};
  for (std::size_t i = 0; i < I; ++i) {
    auto xq = [&](std::size_t q) { return x[q]; };
    f.g[i] = gemm_out(
        H, xq, [&](std::size_t q) { return w.at(in.w_gate, I, i, q); }, r,
        [&](std::size_t q) { return lb_read[q]; },
        [&](std::size_t q) { return w.at(in.b_gate, I, i, q); }, n1, p);
    f.u[i] = gemm_out(
        H, xq, [&](std::size_t q) { return w.at(in.w_up, I, i, q); }, r,
        [&](std::size_t q) { return lb_read[r + q]; },
        [&](std::size_t q) { return w.at(in.b_up, I, i, q); }, n1, p);
    // silu(g) in fp32 (sigma with exp within 2 ulps), stored; times u, stored.
    f.sg[i] = bounds::sig(f.g[i]);
    f.silu[i] = bounds::mid(bounds::r32(f.g[i] * f.sg[i]), p);
    f.h[i] = bounds::operand(bounds::mid(product_disjoint(f.silu[i], f.u[i], true), p), p);
  }
  // h's roundings are independent across i (x and lb_read carry none).
  std::vector<S> lbd(r);
  for (std::size_t k = 0; k < r; ++k) {
    const S ha = bounds::dot_stored(
        I, [&](std::size_t q) { return f.h[q]; },
        [&](std::size_t q) { return w.at(in.a_down, r, k, q); }, kpad(I), p, Terms::independent);
    lbd[k] = bounds::operand(bounds::mid(s * ha, p), p);
  }
  f.lbd = lbd;
  const std::size_t n2 = kpad(I) + (r ? kpad(r) : 0);
  for (std::size_t m = 0; m < H; ++m)
    f.o[m] = gemm_out(
        I, [&](std::size_t q) { return f.h[q]; },
        [&](std::size_t q) { return w.at(in.w_down, H, m, q); }, r,
        [&](std::size_t q) { return lbd[q]; },
        [&](std::size_t q) { return w.at(in.b_down, H, m, q); }, n2, p, Terms::independent);
  if constexpr (std::is_same_v<S, Probable>) {
    for (const S& o : f.o) f.o_hp.push_back(o.hp());
    if (exact_lb && r) add_lb_errors(w, f, lb, s.v);
  }
  return f;
}

// dg, du of one pair from do (as read): dh = do W_d + q_d A_d, then the
// SwiGLU backward, each stored as the next GEMMs read it.
template <class S>
struct PairDgu {
  std::vector<S> dg, du, qd;
};
template <class S>
PairDgu<S> pair_dgu(const Expert<S>& w, const PairForward<S>& f, const std::vector<S>& d,
                    const S& s) {
  const ExpertsTensors& in = w.in;
  const Precision& p = w.p;
  const std::size_t H = in.H, I = in.I, r = in.r;
  // q_d = s (do B_d): the scale applied to do before B_d and the result
  // stored again, so either order is covered. Every dh_i reads it: folded.
  std::vector<S> qd(r);
  for (std::size_t k = 0; k < r; ++k)
    qd[k] = bounds::fold(bounds::operand(
        bounds::mid(
            bounds::dot_stored(
                H, [&](std::size_t q) { return bounds::operand(bounds::mid(s * d[q], p), p); },
                [&](std::size_t q) { return w.at(in.b_down, H, q, k); }, kpad(H), p),
            p),
        p));
  const std::size_t nh = kpad(H) + (r ? kpad(r) : 0);
  PairDgu<S> o{std::vector<S>(I), std::vector<S>(I), qd};
  for (std::size_t i = 0; i < I; ++i) {
    const S dh = gemm_out(
        H, [&](std::size_t q) { return d[q]; },
        [&](std::size_t q) { return w.at(in.w_down, H, q, i); }, r,
        [&](std::size_t q) { return qd[q]; },
        [&](std::size_t q) { return w.at(in.a_down, r, q, i); }, nh, p);
    const S dsilu = dsilu_of(f, i);
    // dh's roundings (the backward's) and the forward's g and u are disjoint.
    const S dhu = bounds::mid(product_disjoint(dh, f.u[i]), p);
    o.dg[i] = bounds::operand(bounds::mid(bounds::r32(product_disjoint(dhu, dsilu)), p), p);
    o.du[i] = bounds::operand(bounds::mid(product_disjoint(dh, f.silu[i]), p), p);
  }
  return o;
}

// What one pair's backward leaves for the weight gradients: the GEMMs'
// operands (do, dg, du and q = s (d B) of gate, up, down), with the forward's.
template <class S>
struct PairGrads {
  std::vector<S> x, d, dg, du, qgu, qd;
  PairForward<S> f;
};

// do = wt dy (dy as read) as the GEMMs read it.
template <class S>
std::vector<S> do_read(const std::vector<S>& dy, const S& wt, const Precision& p) {
  std::vector<S> d(dy.size());
  for (std::size_t m = 0; m < dy.size(); ++m) d[m] = bounds::operand(bounds::mid(wt * dy[m], p), p);
  return d;
}

// The expert path of one pair: this pair's share of dx from do (do_read),
// proofs/experts.md §5; its operands kept in `keep` if given.
template <class S>
std::vector<S> pair_dx(const Expert<S>& w, const PairForward<S>& f, const std::vector<S>& dread,
                       const S& s, PairGrads<S>* keep) {
  const ExpertsTensors& in = w.in;
  const Precision& p = w.p;
  const std::size_t H = in.H, I = in.I, r = in.r;
  // Every dh_i reads do: its errors folded, or (Probable) left external,
  // for the projection along dx to take through their coefficients
  // (do_along).
  std::vector<S> d(H);
  for (std::size_t m = 0; m < H; ++m)
    if constexpr (std::is_same_v<S, Probable>)
      d[m] = bounds::external(dread[m]);
    else
      d[m] = bounds::fold(dread[m]);
  // (Named members, not a structured binding: clang 14 cannot capture one.)
  const PairDgu<S> dgu = pair_dgu(w, f, d, s);
  const std::vector<S>& dg = dgu.dg;
  const std::vector<S>& du = dgu.du;
  // q_g = s (dg B_g), q_u = s (du B_u): the scale applied to dg before B
  // and the result stored again, so either order is covered. dg's and du's
  // roundings are independent across i.
  std::vector<S> qgu(2 * r);
  for (std::size_t k = 0; k < 2 * r; ++k) {
    const auto& v = k < r ? dg : du;
    const S dgb = bounds::dot_stored(
        I, [&](std::size_t q) { return bounds::operand(bounds::mid(s * v[q], p), p); },
        [&](std::size_t q) {
          return k < r ? w.at(in.b_gate, I, q, k) : w.at(in.b_up, I, q, k - r);
        },
        kpad(2 * I), p, Terms::independent);
    qgu[k] = bounds::operand(bounds::mid(dgb, p), p);
  }
  // dx row = dg W_g + du W_u + q_g A_g + q_u A_u: four stored sums over the
  // fused length, added in any order (the four share dh's roundings).
  const std::size_t nx = kpad(2 * I) + (r ? kpad(2 * r) : 0);
  constexpr Terms kIndep = Terms::independent;
  std::vector<S> dxr(H);
  for (std::size_t m = 0; m < H; ++m) {
    const S terms[] = {bounds::dot_stored(
                           I, [&](std::size_t q) { return dg[q]; },
                           [&](std::size_t q) { return w.at(in.w_gate, I, q, m); }, nx, p, kIndep),
                       bounds::dot_stored(
                           I, [&](std::size_t q) { return du[q]; },
                           [&](std::size_t q) { return w.at(in.w_up, I, q, m); }, nx, p, kIndep),
                       bounds::dot_stored(
                           r, [&](std::size_t q) { return qgu[q]; },
                           [&](std::size_t q) { return w.at(in.a_gate, r, q, m); }, nx, p),
                       bounds::dot_stored(
                           r, [&](std::size_t q) { return qgu[r + q]; },
                           [&](std::size_t q) { return w.at(in.a_up, r, q, m); }, nx, p)};
    RowSum<S> sum(Terms::shared);
    for (const S& t : terms) sum.add(t);
    dxr[m] = sum.stored(r ? 4 : 2, p);
  }
  if (keep) keep->d = d, keep->dg = dg, keep->du = du, keep->qgu = qgu, keep->qd = dgu.qd;
  return dxr;
}

// Expert e's weight gradients over its pairs (token order): each element a
// sum over the pairs of one product of the GEMMs' operands, accumulated in
// fp32 in any order, stored (proofs/experts.md §6). Distinct pairs round
// independently. Order: grad_shapes'.
template <class S>
void expert_weight_grads(const ExpertsTensors& in, std::size_t e,
                         const std::vector<const PairGrads<S>*>& pairs, const Precision& p,
                         std::array<std::vector<S>, 9>& out) {
  using G = PairGrads<S>;
  const std::size_t H = in.H, I = in.I, r = in.r, n = pairs.size();
  // out[g] rows [e * rows, (e + 1) * rows) of cols: sum_pairs a(pair)[row] b(pair)[col].
  auto outer = [&](std::size_t g, std::size_t rows, std::size_t cols, auto a, auto b) {
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t k = 0; k < cols; ++k)
        out[g][(e * rows + i) * cols + k] = bounds::dot_stored(
            n, [&](std::size_t q) { return a(*pairs[q], i); },
            [&](std::size_t q) { return b(*pairs[q], k); }, n, p, Terms::independent);
  };
  auto x = [](const G& q, std::size_t k) { return q.x[k]; };
  auto h = [](const G& q, std::size_t k) { return q.f.h[k]; };
  auto dg = [](const G& q, std::size_t i) { return q.dg[i]; };
  auto du = [](const G& q, std::size_t i) { return q.du[i]; };
  auto d = [](const G& q, std::size_t m) { return q.d[m]; };
  if (r) {
    outer(
        0, r, H, [](const G& q, std::size_t k) { return q.qgu[k]; }, x);
    outer(1, I, r, dg, [](const G& q, std::size_t k) { return q.f.lb[k]; });
    outer(
        2, r, H, [r](const G& q, std::size_t k) { return q.qgu[r + k]; }, x);
    outer(3, I, r, du, [r](const G& q, std::size_t k) { return q.f.lb[r + k]; });
    outer(
        4, r, I, [](const G& q, std::size_t k) { return q.qd[k]; }, h);
    outer(5, H, r, d, [](const G& q, std::size_t k) { return q.f.lbd[k]; });
  }
  outer(6, I, H, dg, x);
  outer(7, I, H, du, x);
  outer(8, H, I, d, h);
}

// One token's rows x and dy as the implementation reads them.
template <class S>
std::vector<S> row_in(MatView<const float> m, std::size_t t, const Precision& p) {
  std::vector<S> v(m.cols);
  for (std::size_t q = 0; q < m.cols; ++q) v[q] = bounds::lift<S>(bounds::input(m(t, q), p), p);
  return v;
}

// s = alpha / r as the implementation holds it: in fp32 at best.
Tracked scale_of(const ExpertsTensors& in) {
  const double s = in.r ? in.alpha / static_cast<double>(in.r) : 0.0;
  return {s, bounds::kU32 * std::fabs(s)};
}

// The model's values as the judge compares them: Tracked as they are,
// Probable with their high-probability bounds.
std::vector<Tracked> tracked(std::vector<Tracked>&& v) { return std::move(v); }
std::vector<Tracked> tracked(const std::vector<Probable>& v) {
  std::vector<Tracked> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = bounds::collapse(v[i]);
  return out;
}

template <class S>
std::vector<S> model_forward(const ExpertsTensors& in, const Precision& p,
                             Projection* along_y = nullptr) {
  const std::size_t T = in.x.rows, K = in.idx.cols, H = in.H;
  const S s = bounds::lift<S>(scale_of(in), p);
  std::vector<S> y(T * H);
  std::vector<TokenProjection> proj(along_y ? T : 0);
  oneapi::tbb::parallel_for(
      std::size_t{0}, T, detail::TbbBody([&](std::size_t t) {
        const std::vector<S> x = row_in<S>(in.x, t, p);
        // y = sum_j w_j o_j: products and sums in the intermediate format;
        // distinct slots' pairs round independently.
        std::vector<RowSum<S>> sum(H, RowSum<S>(Terms::independent));
        std::vector<std::pair<std::size_t, double>> slots;  // expert, weight
        std::vector<PairForward<S>> pairs;
        for (std::size_t j = 0; j < K; ++j) {
          const std::int32_t e = in.idx(t, j);
          if (e < 0) continue;
          auto f = pair_forward(Expert<S>{in, static_cast<std::size_t>(e), p}, x, s, true);
          const S wt = bounds::lift<S>(bounds::input(in.weights(t, j), p), p);
          for (std::size_t m = 0; m < H; ++m) sum[m].add(wt * f.o[m]);
          if (!proj.empty()) slots.emplace_back(e, wt.v), pairs.push_back(std::move(f));
        }
        for (std::size_t m = 0; m < H; ++m) y[t * H + m] = sum[m].stored(K, p);
        if constexpr (std::is_same_v<S, Probable>)
          if (!proj.empty())
            proj[t] = token_projection(in, p, x, s.v, slots, pairs, sum, &y[t * H]);
      }));
  if (along_y) {
    *along_y = {};
    for (const TokenProjection& tp : proj)  // in token order: deterministic
      along_y->det += tp.det, along_y->rnd += tp.q, along_y->norm2 += tp.norm2;
    along_y->rnd = std::sqrt(along_y->rnd);
  }
  return y;
}

}  // namespace

ProbableForward experts_model_forward_probable(const ExpertsTensors& in, const Precision& p) {
  ProbableForward out;
  out.y = tracked(model_forward<Probable>(in, bounds::probable(p), &out.along_y));
  return out;
}

std::vector<Tracked> experts_model_forward(const ExpertsTensors& in, const Precision& p) {
  if (p.lambda > 0) return tracked(model_forward<Probable>(in, p));
  return model_forward<Tracked>(in, p);
}

namespace {

// ExpertsBackward over the model's scalar; under Probable, per token, do's
// errors along dx (DoAlong).
template <class S>
struct Backward {
  std::vector<S> dx, dweights, dx_rows;
  std::vector<double> dx_rows_abs;
  std::array<std::vector<S>, 9> weight_grads;
  std::vector<DoAlong> do_along;
};

// A routed pair as the projection on dx reads it: its expert, do and forward.
struct PairDo {
  std::size_t e;
  std::vector<Probable> d;
  PairForward<Probable> f;
};

// do's errors along a token's exact dx row (H values): each pair's own
// roundings, dy's shared by the token's pairs (their norms add).
DoAlong token_do_along(const ExpertsTensors& in, const Precision& p, double s, const Probable* dx,
                       const std::vector<PairDo>& pairs) {
  std::vector<double> a(in.H);
  for (std::size_t m = 0; m < in.H; ++m) a[m] = dx[m].v;
  DoAlong out;
  for (const PairDo& q : pairs) {
    const DoAlong one = do_along({in, q.e, p}, q.f, q.d, s, a);
    out.det += one.det, out.rnd += one.rnd;
  }
  return out;
}

// Token t's backward: dL/dw of its slots and its dx row into b; each pair's
// operands into keep[t * K + j] when keep is not empty.
template <class S>
void token_backward(const ExpertsTensors& in, MatView<const float> dy, const Precision& p,
                    const S& s, std::size_t t, Backward<S>& b, std::vector<PairGrads<S>>& keep) {
  const std::size_t K = in.idx.cols, H = in.H;
  const std::vector<S> x = row_in<S>(in.x, t, p);
  // dy as the GEMMs read it (bf16 operands: rounded).
  std::vector<S> dyr = row_in<S>(dy, t, p);
  for (auto& v : dyr) v = bounds::operand(v, p);
  // The slots' rows: distinct pairs round independently.
  std::vector<RowSum<S>> sum(H, RowSum<S>(Terms::independent));
  std::vector<PairDo> pairs;  // (Probable)
  for (std::size_t j = 0; j < K; ++j) {
    const std::int32_t e = in.idx(t, j);
    if (e < 0) continue;  // dL/dw exactly 0 there
    const Expert<S> w{in, static_cast<std::size_t>(e), p};
    auto f = pair_forward(w, x, s);
    // dL/dw = <dy, o>: products stored, an fp32 sum, stored.
    b.dweights[t * K + j] = bounds::dot_products_stored(
        H, [&](std::size_t m) { return dyr[m]; }, [&](std::size_t m) { return f.o[m]; }, H, p);
    if constexpr (std::is_same_v<S, Probable>)  // o with lb's errors through their coefficients
      b.dweights[t * K + j] = pair_dweight(w, in.r ? pair_forward(w, x, s, true) : f, x, s.v, dyr,
                                           b.dweights[t * K + j]);
    PairGrads<S>* k = keep.empty() ? nullptr : &keep[t * K + j];
    std::vector<S> d = do_read(dyr, bounds::lift<S>(bounds::input(in.weights(t, j), p), p), p);
    const auto dxr = pair_dx(w, f, d, s, k);
    if (k) k->x = x, k->f = f;
    for (std::size_t m = 0; m < H; ++m) sum[m].add(dxr[m]);
    if constexpr (std::is_same_v<S, Probable>)
      pairs.push_back({static_cast<std::size_t>(e), std::move(d), std::move(f)});
  }
  // dx = the slots' rows summed in the intermediate format.
  for (std::size_t m = 0; m < H; ++m) {
    b.dx[t * H + m] = sum[m].stored(K, p);
    b.dx_rows[t * H + m] = row_exact(sum[m]);
    b.dx_rows_abs[t * H + m] = row_abs(sum[m]);
  }
  if constexpr (std::is_same_v<S, Probable>)
    b.do_along[t] = token_do_along(in, p, s.v, &b.dx[t * H], pairs);
}

template <class S>
Backward<S> model_backward(const ExpertsTensors& in, MatView<const float> dy, const Precision& p,
                           bool weight_grads) {
  const std::size_t T = in.x.rows, K = in.idx.cols, H = in.H, E = in.E;
  const S s = bounds::lift<S>(scale_of(in), p);
  Backward<S> b{std::vector<S>(T * H),
                std::vector<S>(T * K, S{0}),
                std::vector<S>(T * H),
                std::vector<double>(T * H),
                {},
                std::vector<DoAlong>(T)};
  std::vector<PairGrads<S>> keep(weight_grads ? T * K : 0);
  oneapi::tbb::parallel_for(std::size_t{0}, T, detail::TbbBody([&](std::size_t t) {
                              token_backward(in, dy, p, s, t, b, keep);
                            }));
  if (!weight_grads) return b;
  const std::size_t sizes[9] = {in.r * H, in.I * in.r, in.r * H, in.I * in.r, in.r * in.I,
                                H * in.r, in.I * H,    in.I * H, H * in.I};
  for (std::size_t g = 0; g < 9; ++g) b.weight_grads[g].assign(E * sizes[g], S{0});
  oneapi::tbb::parallel_for(std::size_t{0}, E, detail::TbbBody([&](std::size_t e) {
                              std::vector<const PairGrads<S>*> pairs;  // in token order
                              for (std::size_t t = 0; t < T; ++t)
                                for (std::size_t j = 0; j < K; ++j)
                                  if (in.idx(t, j) == static_cast<std::int32_t>(e))
                                    pairs.push_back(&keep[t * K + j]);
                              if (!pairs.empty())
                                expert_weight_grads(in, e, pairs, p, b.weight_grads);
                            }));
  return b;
}

// A [T x cols] output's error along its exact value: within a token the
// elements share roundings (their random parts add by the triangle
// inequality), distinct tokens' roundings are disjoint (root of squares).
// Each element counts its worst case, or its worst-case part and its random
// part, whichever bounds it lower at kProjectionLambda (chosen from the
// exact values).
// With `external` (dx: per token, do's errors along the row, DoAlong), the
// elements' external parts are taken from there instead; do's roundings
// are not among the elements' random parts (root of squares with them).
Projection along_rows(const std::vector<Probable>& v, std::size_t cols,
                      const std::vector<DoAlong>* external = nullptr) {
  Projection pr;
  double rnd2 = 0;
  const bool ext = external != nullptr;
  for (std::size_t t = 0; cols && t < v.size() / cols; ++t) {
    double rnd = 0;
    for (std::size_t o = t * cols; o < (t + 1) * cols; ++o) {
      const double a = std::fabs(v[o].v), part = v[o].d + (ext ? 0.0 : v[o].x);
      if (v[o].e <= part + bounds::kProjectionLambda * v[o].s)
        pr.det += a * v[o].e;
      else
        pr.det += a * part, rnd += a * v[o].s;
      pr.norm2 += v[o].v * v[o].v;
    }
    if (ext) pr.det += (*external)[t].det, rnd = std::hypot(rnd, (*external)[t].rnd);
    rnd2 += rnd * rnd;
  }
  pr.rnd = std::sqrt(rnd2);
  return pr;
}

template <class S>
ExpertsBackward to_tracked(Backward<S>&& b, std::size_t H, std::size_t K) {
  ExpertsBackward out;
  if constexpr (std::is_same_v<S, Probable>)
    out.along_dx = along_rows(b.dx, H, &b.do_along), out.along_dweights = along_rows(b.dweights, K);
  out.dx = tracked(std::move(b.dx)), out.dweights = tracked(std::move(b.dweights));
  out.dx_rows = tracked(std::move(b.dx_rows)), out.dx_rows_abs = std::move(b.dx_rows_abs);
  for (std::size_t g = 0; g < 9; ++g) out.weight_grads[g] = tracked(std::move(b.weight_grads[g]));
  return out;
}

}  // namespace

ExpertsBackward experts_model_backward(const ExpertsTensors& in, MatView<const float> dy,
                                       const Precision& p, bool weight_grads) {
  const std::size_t H = in.H, K = in.idx.cols;
  if (p.lambda > 0) return to_tracked(model_backward<Probable>(in, dy, p, weight_grads), H, K);
  return to_tracked(model_backward<Tracked>(in, dy, p, weight_grads), H, K);
}

}  // namespace moecert::contracts
