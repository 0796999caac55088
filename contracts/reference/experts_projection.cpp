// The experts model's Probable extras (proofs/bounds.md §12): lb's errors
// in o through their exact coefficients, and the projection of y's error on
// the exact y, an adjoint pass over each pair's roundings.
#include <algorithm>
#include <cmath>

#include "contracts/reference/experts_pair.hpp"

namespace moecert::contracts::pair {

// The errors of lb (s x A^T as the B GEMMs read it) in o, each through its
// linear coefficient: o_m depends on lb_k through c_mk = sum_i W_eff[m, i]
// dh_i/dlb_k, W_eff = W_d + s B_d A_d, dh_i/dlb_k = silu'(g_i) u^_i B_g[i, k]
// (gate: u^ the computed u, within hp(u) of u, as h's product reads it) or
// silu(g_i) B_u[i, k] (up). lb_k's roundings are its own (independent across
// k): its random part joins o_m's with coefficient at most |c_mk| + the
// perturbation u^ - u makes, its worst-case part adds that times d_k, and
// o_m's x (lb's error carried coherently, Probable::x) is dropped.
void add_lb_errors(const Expert<Probable>& w, PairForward<Probable>& f,
                   const std::vector<Probable>& lb, double s) {
  const ExpertsTensors& in = w.in;
  const std::size_t H = in.H, I = in.I, r = in.r, e = w.e, R = 2 * r;
  // J [I x 2r] and its perturbation Jr, Q = A_d J and Qr = |A_d| Jr [r x 2r].
  std::vector<double> J(I * R), Jr(I * R, 0.0), Q(r * R, 0.0), Qr(r * R, 0.0);
  for (std::size_t i = 0; i < I; ++i) {
    const double g = f.g[i].v, sg = f.sg[i].v, u = f.u[i].v, dsilu = sg + g * sg * (1 - sg);
    const double dg = dsilu * u, du = g * sg, dgr = std::fabs(dsilu) * f.u[i].hp();
    for (std::size_t k = 0; k < r; ++k) {
      J[i * R + k] = dg * in.b_gate(e * I + i, k);
      Jr[i * R + k] = dgr * std::fabs(in.b_gate(e * I + i, k));
      J[i * R + r + k] = du * in.b_up(e * I + i, k);
    }
  }
  for (std::size_t q = 0; q < r; ++q)
    for (std::size_t i = 0; i < I; ++i) {
      const double a = in.a_down(e * r + q, i);
      for (std::size_t k = 0; k < R; ++k)
        Q[q * R + k] += a * J[i * R + k], Qr[q * R + k] += std::fabs(a) * Jr[i * R + k];
    }
  std::vector<double> c(R), cr(R);
  for (std::size_t m = 0; m < H; ++m) {
    std::fill(c.begin(), c.end(), 0.0);
    std::fill(cr.begin(), cr.end(), 0.0);
    for (std::size_t i = 0; i < I; ++i) {
      const double wd = in.w_down(e * H + m, i);
      for (std::size_t k = 0; k < R; ++k)
        c[k] += wd * J[i * R + k], cr[k] += std::fabs(wd) * Jr[i * R + k];
    }
    double det = 0, rnd = 0;
    for (std::size_t k = 0; k < R; ++k) {
      for (std::size_t q = 0; q < r; ++q) {
        const double bd = s * in.b_down(e * H + m, q);
        c[k] += bd * Q[q * R + k], cr[k] += std::fabs(bd) * Qr[q * R + k];
      }
      const double ck = std::fabs(c[k]) + cr[k];
      det += ck * lb[k].d, rnd += ck * ck * lb[k].s * lb[k].s;
    }
    f.o[m] = bounds::accounted(f.o[m]);
    f.o[m].d += det, f.o[m].s = std::hypot(f.o[m].s, std::sqrt(rnd));
  }
}

namespace {

// An fp32 dot of Probable operands a(q) and exact weights b(q): its exact
// value and its roundings' squared coefficients per unit of adjoint and u
// (rounded_sum's, n_terms terms: bounds::rounding_coefficients).
struct DotExact {
  double v = 0, q2 = 0;
};
template <class A, class B>
DotExact dot_exact(std::size_t count, A a, B b, std::size_t n_terms) {
  double v = 0, sq = 0, pos = 0, neg = 0, hp = 0, hp2 = 0, abs = 0;
  for (std::size_t q = 0; q < count; ++q) {
    const Probable x = a(q);
    const double w = std::fabs(b(q)), t = x.v * b(q), h = x.hp() * w;
    v += t, sq += t * t, (t >= 0 ? pos : neg) += std::fabs(t);
    hp += h, hp2 += h * h, abs += x.mag() * w;
  }
  const double worst = bounds::gamma(static_cast<double>(n_terms), bounds::kU32) * abs;
  return {v, bounds::rounding_coefficients(sq, hp2, std::max(pos, neg), hp, worst, n_terms, true)};
}

// A GEMM output as gemm_out stores it (base, LoRA term, their sum), read
// with adjoint of magnitude a: its roundings' squared coefficients, each
// stored value's within hp of the exact one (hp: the output's, which bounds
// each stage's).
double gemm_out_roundings(double a, const DotExact& base, const DotExact* lora, double hp,
                          const Precision& p) {
  const double um2 = p.mid_unit * p.mid_unit, a2 = bounds::kU32 * bounds::kU32;
  auto c2 = [hp](double v) { return (std::fabs(v) + hp) * (std::fabs(v) + hp); };
  double q = um2 * c2(base.v) + a2 * base.q2;
  if (lora) q += um2 * (c2(lora->v) + c2(base.v + lora->v)) + a2 * lora->q2;
  return a * a * q;
}

// An adjoint with its perturbation: |coefficient| <= |c| + r. A rounding's
// coefficient through h_i = silu_i u_i reads the computed u_i (the product's
// cross term, bounds::mul_disjoint with u's roundings first): r = |ah| hp(u).
struct Adjoint {
  double c = 0, r = 0;
  double mag() const { return std::fabs(c) + r; }
};

// One pair's forward with the units its roundings take.
struct PairRoundings {
  const Expert<Probable>& w;
  const PairForward<Probable>& f;
  const std::vector<Probable>& x;
  double s, um2, ub2, a2;
  std::size_t n1, n2;
  PairRoundings(const Expert<Probable>& w_, const PairForward<Probable>& f_,
                const std::vector<Probable>& x_, double s_)
      : w(w_), f(f_), x(x_), s(s_) {
    const Precision& p = w.p;
    const double ub = p.bf16_operands ? bounds::kUbf16 : 0;
    um2 = p.mid_unit * p.mid_unit, ub2 = ub * ub, a2 = bounds::kU32 * bounds::kU32;
    n1 = kpad(w.in.H) + (w.in.r ? kpad(2 * w.in.r) : 0);
    n2 = kpad(w.in.I) + (w.in.r ? kpad(w.in.r) : 0);
  }
  // Row i of expert e's block of m, as a function of the column.
  auto at(MatView<const float> m, std::size_t rows, std::size_t i) const {
    return [m, rows, i, e = w.e](std::size_t k) { return static_cast<double>(m(e * rows + i, k)); };
  }
  // A rounding's squared coefficient per unit of adjoint and u: the computed value's.
  static double c2(const Probable& v) {
    return (std::fabs(v.v) + v.hp()) * (std::fabs(v.v) + v.hp());
  }
  // A value stored as operand(mid(s mid(dot))), dot = sum_q a(q) b(q):
  // its roundings per unit of adjoint (hp(dot) <= hp(value) / s).
  double scaled_store(const Probable& value, const DotExact& dot) const {
    const double hd = std::fabs(dot.v) + value.hp() / s;
    return (ub2 + um2) * c2(value) + s * s * (um2 * hd * hd + a2 * dot.q2);
  }

  // o_m = h W_d^T (+ lbd B_d^T) and lbd_k = s h A_d^T, for o's adjoint ao:
  // their roundings, and h's adjoint into ah.
  double down(const std::vector<double>& ao, std::vector<double>& ah) const {
    const ExpertsTensors& in = w.in;
    const std::size_t H = in.H, I = in.I, r = in.r, e = w.e;
    auto h = [&](std::size_t i) { return f.h[i]; };
    std::vector<double> albd(r, 0.0);
    double q = 0;
    for (std::size_t m = 0; m < H; ++m) {
      const DotExact base = dot_exact(I, h, at(in.w_down, H, m), n2);
      const DotExact lora =
          r ? dot_exact(
                  r, [&](std::size_t k) { return f.lbd[k]; }, at(in.b_down, H, m), n2)
            : DotExact{};
      q += gemm_out_roundings(ao[m], base, r ? &lora : nullptr, f.o_hp[m], w.p);
      for (std::size_t i = 0; i < I; ++i) ah[i] += ao[m] * in.w_down(e * H + m, i);
      for (std::size_t k = 0; k < r; ++k) albd[k] += ao[m] * in.b_down(e * H + m, k);
    }
    for (std::size_t k = 0; k < r; ++k) {
      q +=
          albd[k] * albd[k] * scaled_store(f.lbd[k], dot_exact(I, h, at(in.a_down, r, k), kpad(I)));
      for (std::size_t i = 0; i < I; ++i) ah[i] += s * albd[k] * in.a_down(e * r + k, i);
    }
    return q;
  }

  // h_i = operand(mid(silu_i u^_i)), silu_i = mid(r32(g_i sigma_i)), g_i and
  // u_i as gemm_out stores them, for h's adjoint ah: their roundings, and
  // lb's adjoint into alb.
  double swiglu(const std::vector<double>& ah, std::vector<Adjoint>& alb) const {
    const ExpertsTensors& in = w.in;
    const std::size_t H = in.H, I = in.I, r = in.r, e = w.e;
    auto xq = [&](std::size_t k) { return x[k]; };
    auto lbq = [&](std::size_t o) { return [&, o](std::size_t k) { return f.lb[o + k]; }; };
    double q = 0;
    for (std::size_t i = 0; i < I; ++i) {
      const double g = f.g[i].v, sg = f.sg[i].v, sl = g * sg, dsilu = sg + g * sg * (1 - sg);
      const Adjoint asl{ah[i] * f.u[i].v, std::fabs(ah[i]) * f.u[i].hp()};
      const Adjoint ag{asl.c * dsilu, asl.r * std::fabs(dsilu)};
      const double au = ah[i] * sl;
      q += ah[i] * ah[i] * (um2 + ub2) * c2(f.h[i]) +
           asl.mag() * asl.mag() * (a2 + um2) * c2(f.silu[i]);
      const DotExact lg = r ? dot_exact(r, lbq(0), at(in.b_gate, I, i), n1) : DotExact{};
      const DotExact lu = r ? dot_exact(r, lbq(r), at(in.b_up, I, i), n1) : DotExact{};
      q += gemm_out_roundings(ag.mag(), dot_exact(H, xq, at(in.w_gate, I, i), n1),
                              r ? &lg : nullptr, f.g[i].hp(), w.p);
      q += gemm_out_roundings(au, dot_exact(H, xq, at(in.w_up, I, i), n1), r ? &lu : nullptr,
                              f.u[i].hp(), w.p);
      for (std::size_t k = 0; k < r; ++k) {
        const double bg = in.b_gate(e * I + i, k);
        alb[k].c += ag.c * bg, alb[k].r += ag.r * std::fabs(bg);
        alb[r + k].c += au * in.b_up(e * I + i, k);
      }
    }
    return q;
  }

  // lb_k = operand(mid(s mid(xa_k))), xa_k = x A^T, for lb's adjoint alb.
  double lora_in(const std::vector<Adjoint>& alb) const {
    const ExpertsTensors& in = w.in;
    const std::size_t H = in.H, r = in.r;
    auto xq = [&](std::size_t k) { return x[k]; };
    double q = 0;
    for (std::size_t k = 0; k < 2 * r; ++k) {
      const DotExact xa =
          dot_exact(H, xq, k < r ? at(in.a_gate, r, k) : at(in.a_up, r, k - r), kpad(H));
      q += alb[k].mag() * alb[k].mag() * scaled_store(f.lb[k], xa);
    }
    return q;
  }
};

// One pair's share of the squared norm of the coefficients of <y_ref, y> on
// the model's roundings, for ao_m = w y_ref_m (the adjoint of o_m): each
// rounding's coefficient is the adjoint of the value it rounds times its
// unit times the computed value, |v| + hp() (proofs/bounds.md §12), the
// roundings the Probable model counts (pair_forward's, in reverse).
double pair_projection(const Expert<Probable>& w, const PairForward<Probable>& f,
                       const std::vector<Probable>& x, double s, const std::vector<double>& ao) {
  const PairRoundings pr(w, f, x, s);
  std::vector<double> ah(w.in.I, 0.0);
  std::vector<Adjoint> alb(2 * w.in.r);
  const double down = pr.down(ao, ah);
  const double swiglu = pr.swiglu(ah, alb);
  return down + swiglu + pr.lora_in(alb);
}

}  // namespace

TokenProjection token_projection(const ExpertsTensors& in, const Precision& p,
                                 const std::vector<Probable>& x, double s,
                                 const std::vector<std::pair<std::size_t, double>>& slots,
                                 const std::vector<PairForward<Probable>>& pairs,
                                 const std::vector<RowSum<Probable>>& sum, const Probable* y) {
  const std::size_t H = in.H, K = in.idx.cols;
  TokenProjection tp;
  const double um2 = p.mid_unit * p.mid_unit;
  for (std::size_t m = 0; m < H; ++m) {
    const auto& t = sum[m].sum;
    const double v = y[m].v, worst = bounds::gamma(static_cast<double>(K), p.mid_unit) * t.abs;
    tp.det += std::fabs(v) * y[m].d, tp.norm2 += v * v;
    tp.q +=
        v * v * um2 *
        bounds::rounding_coefficients(t.sq, t.hp2, std::max(t.pos, t.neg), t.hp, worst, K, true);
  }
  std::vector<double> ao(H);
  for (std::size_t j = 0; j < pairs.size(); ++j) {
    for (std::size_t m = 0; m < H; ++m) ao[m] = slots[j].second * y[m].v;
    tp.q += pair_projection({in, slots[j].first, p}, pairs[j], x, s, ao);
  }
  return tp;
}

Probable pair_dweight(const Expert<Probable>& w, const PairForward<Probable>& f,
                      const std::vector<Probable>& x, double s, const std::vector<Probable>& dy,
                      const Probable& stored) {
  const Precision& p = w.p;
  const std::size_t H = w.in.H;
  std::vector<double> ao(H);
  for (std::size_t m = 0; m < H; ++m) ao[m] = dy[m].v;
  // dy^ o^ - dy o = dy (o^ - o) + o^ (dy^ - dy): o's roundings drawn first.
  double d = 0, q = pair_projection(w, f, x, s, ao);
  double sq = 0, hp = 0, hp2 = 0, pos = 0, neg = 0, abs = 0;
  const double um2 = p.mid_unit * p.mid_unit;
  for (std::size_t m = 0; m < H; ++m) {
    const Probable &a = dy[m], &o = f.o[m];
    const double oc = std::fabs(o.v) + o.hp(), ac = std::fabs(a.v) + a.hp();
    d += std::fabs(a.v) * o.d + oc * a.d;
    d += (bounds::may_flush(a) ? bounds::kMinNormal32 * o.mag() : 0) +
         (bounds::may_flush(o) ? bounds::kMinNormal32 * a.mag() : 0) + bounds::kMinNormal32;
    q += oc * oc * a.s * a.s + um2 * (ac * oc) * (ac * oc);  // dy's roundings, the product's store
    const double t = a.v * o.v, h = std::fabs(a.v) * o.hp() + oc * a.hp();
    sq += t * t, hp += h, hp2 += h * h, abs += a.mag() * o.mag();
    (t >= 0 ? pos : neg) += std::fabs(t);
  }
  const double worst = bounds::gamma(static_cast<double>(H), bounds::kU32) * abs;
  q += bounds::kU32 * bounds::kU32 *
       bounds::rounding_coefficients(sq, hp2, std::max(pos, neg), hp, worst, H, true);
  d += 3 * static_cast<double>(H) * bounds::kMinNormal32;
  const double rnd = std::sqrt(q), before = d + p.lambda * rnd;
  return Probable{stored.v, stored.e, d + bounds::kMinNormal32,
                  std::hypot(rnd, p.mid_unit * (std::fabs(stored.v) + before)), p.lambda};
}

DoAlong do_along(const Expert<Probable>& w, const PairForward<Probable>& f,
                 const std::vector<Probable>& d, double s, const std::vector<double>& a) {
  const ExpertsTensors& in = w.in;
  const std::size_t H = in.H, I = in.I, r = in.r, e = w.e;
  // dx row = dg W_g + du W_u + s (dg B_g) A_g + s (du B_u) A_u: the adjoints
  // of dg and du; s read within u32 of its value.
  std::vector<double> aag(r, 0.0), aau(r, 0.0);
  for (std::size_t q = 0; q < r; ++q)
    for (std::size_t m = 0; m < H; ++m)
      aag[q] += in.a_gate(e * r + q, m) * a[m], aau[q] += in.a_up(e * r + q, m) * a[m];
  // dg = (dh u^) silu'^, du = dh silu^: dh's adjoint at the exact values,
  // with the radius of the computed ones.
  std::vector<Adjoint> adh(I);
  for (std::size_t i = 0; i < I; ++i) {
    double adg = 0, adu = 0, lora = 0;
    for (std::size_t m = 0; m < H; ++m)
      adg += in.w_gate(e * I + i, m) * a[m], adu += in.w_up(e * I + i, m) * a[m];
    for (std::size_t q = 0; q < r; ++q) {
      const double g = s * in.b_gate(e * I + i, q) * aag[q], u = s * in.b_up(e * I + i, q) * aau[q];
      adg += g, adu += u, lora += std::fabs(g) + std::fabs(u);
    }
    const Probable ds = dsilu_of(f, i);
    const double u = f.u[i].v, hu = f.u[i].hp(), hd = ds.hp(), sl = f.silu[i].v;
    const double rg = std::fabs(adg) + bounds::kU32 * lora,
                 ru = std::fabs(adu) + bounds::kU32 * lora;
    adh[i].c = adg * u * ds.v + adu * sl;
    adh[i].r = rg * (hu * std::fabs(ds.v) + std::fabs(u) * hd + hu * hd) + ru * f.silu[i].hp() +
               bounds::kU32 * lora * (std::fabs(u * ds.v) + std::fabs(sl));
  }
  // dh = do W_d (+ q_d A_d, q_d folded: do's errors through it are in its
  // worst-case part).
  DoAlong out;
  double rnd2 = 0;
  for (std::size_t m = 0; m < H; ++m) {
    double c = 0, cr = 0;
    for (std::size_t i = 0; i < I; ++i) {
      const double wd = in.w_down(e * H + m, i);
      c += wd * adh[i].c, cr += std::fabs(wd) * adh[i].r;
    }
    const double k = std::fabs(c) + cr;
    out.det += k * d[m].d, rnd2 += k * k * d[m].s * d[m].s;
  }
  out.rnd = std::sqrt(rnd2);
  return out;
}

}  // namespace moecert::contracts::pair
