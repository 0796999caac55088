// Probabilistic running error bounds (proofs/bounds.md §12): a value of the
// exact computation with its worst-case bound (Tracked's, the same
// arithmetic) and the same error split into a part bounded in the worst case
// and a random part, a linear combination of independent mean-zero roundings
// whose coefficients' Euclidean norm is bounded. Hoeffding's inequality
// bounds the random part by lambda times that norm, so roundings that are
// independent across the terms of a sum add as a root of squares.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <type_traits>
#include <utility>

#include "contracts/numeric/precision.hpp"

namespace moecert::bounds {

/// kernel value - exact value = D + R, |D + R| <= e (worst case), |D| <= d,
/// R = sum_k c_k delta_k with delta_k mean zero given the roundings before
/// them, |delta_k| <= 1, and sum_k c_k^2 <= s^2, each c_k bounded before
/// delta_k is drawn (a rounding's coefficient is the computed value it
/// rounds, |v| + hp() on the event that every earlier value is within its
/// hp(): §12, Azuma's inequality on the martingale stopped where a value
/// leaves its hp(), and a union over the values). Second-order terms that
/// are not such increments are bounded by the operands' hp() in d. x bounds
/// a further error whose linear part a caller accounts for itself (the
/// model's lb): it propagates linearly and enters hp(), not d or s.
struct Probable {
  double v = 0, e = 0, d = 0, s = 0;
  double lambda = 0;  // the declaration's Hoeffding multiplier (Precision::lambda)
  double x = 0;
  Probable() = default;
  Probable(double value, double err = 0) : v(value), e(err), d(err) {}
  Probable(Tracked t, double lam) : v(t.v), e(t.e), d(t.e), lambda(lam) {}
  Probable(double value, double err, double det, double rnd, double lam)
      : v(value), e(err), d(det), s(rnd), lambda(lam) {}
  /// |error| <= hp() but with probability at most 2 exp(-lambda^2 / 2).
  double hp() const { return std::min(e, d + lambda * s + x); }
  double mag() const { return std::fabs(v) + e; }  // bound on |kernel value|
  Probable with_x(double ext) const {
    Probable r = *this;
    r.x = ext;
    return r;
  }
};

/// A value of the worst-case model (an input, a constant) with no random
/// part, in the model of scalar S.
template <class S>
S lift(Tracked t, const Precision& p) {
  if constexpr (std::is_same_v<S, Probable>)
    return Probable(t, p.lambda);
  else
    return t;
}

/// The value with its high-probability bound as a Tracked error.
inline Tracked collapse(const Probable& a) { return {a.v, a.hp()}; }
/// The random part bounded in the worst case: for a value read by several
/// terms of a later sum whose other roundings are independent across terms.
inline Probable fold(const Probable& a) { return {a.v, a.e, a.e, 0, a.lambda}; }
/// The value with its errors' linear part left to the caller: x = hp().
inline Probable external(const Probable& a) {
  Probable r{a.v, a.e, 0, 0, a.lambda};
  r.x = a.hp();
  return r;
}
/// a with x's linear part accounted for by the caller.
inline Probable accounted(Probable a) {
  a.x = 0;
  return a;
}
/// A value the tile unit may flush (Lemma 1').
inline bool may_flush(const Probable& a) {
  return a.mag() > 0 && std::fabs(a.v) - a.e < kMinNormal32;
}

namespace detail {
inline double mul0(double p, double q) { return p == 0 || q == 0 ? 0.0 : p * q; }
inline double lam(const Probable& a, const Probable& b) { return std::max(a.lambda, b.lambda); }
}  // namespace detail

// Sums: random parts that may share roundings add by the triangle inequality.
inline Probable operator+(Probable a, Probable b) {
  Probable r{a.v + b.v, a.e + b.e, a.d + b.d, a.s + b.s, detail::lam(a, b)};
  r.x = a.x + b.x;
  return r;
}
inline Probable operator-(Probable a, Probable b) {
  return a + Probable{-b.v, b.e, b.d, b.s, b.lambda}.with_x(b.x);
}
inline Probable operator-(Probable a) {
  return Probable{-a.v, a.e, a.d, a.s, a.lambda}.with_x(a.x);
}
inline Probable& operator+=(Probable& a, Probable b) { return a = a + b; }
/// a b: the first-order terms |a| err_b + |b| err_a split as the errors are,
/// the product of the errors in the worst-case part.
inline Probable operator*(Probable a, Probable b) {
  using detail::mul0;
  const double A = std::fabs(a.v), B = std::fabs(b.v), second = mul0(a.hp(), b.hp());
  return Probable{a.v * b.v, propagate_safe(a.e, B, A, b.e), mul0(A, b.d) + mul0(B, a.d) + second,
                  mul0(A, b.s) + mul0(B, a.s), detail::lam(a, b)}
      .with_x(mul0(A, b.x) + mul0(B, a.x));
}

/// One rounding of unit u of a computed value (|relative error| <= u, plus a
/// flush of size `tiny`): its coefficient, the computed value, at most
/// |v| + hp() on the event, joins the random part; the flush the worst-case
/// part.
inline Probable rounded(Probable a, double u, double tiny) {
  return Probable{a.v, a.e + u * (std::fabs(a.v) + a.e) + tiny, a.d + tiny,
                  std::hypot(a.s, u * (std::fabs(a.v) + a.hp())), a.lambda}
      .with_x(a.x);
}
inline Probable r32(Probable a) { return rounded(a, kU32, kMinNormal32); }
inline Probable mid(Probable a, const Precision& p) { return rounded(a, p.mid_unit, kMinNormal32); }
inline Probable operand(Probable a, const Precision& p) {
  return p.bf16_operands ? rounded(a, kUbf16, kBf16HalfDenormal) : a;
}

/// a b for operands whose errors come from disjoint sets of roundings (the
/// gate's and the up projection's of one pair): with b's roundings drawn
/// first, the error a (b^ - b) + b^ (a^ - a) has b^ (|b^| <= |b| + hp_b) as
/// the coefficient of a's roundings, known before them, so b's error times
/// a's random part joins the random part (root of squares: disjoint
/// roundings), times a's worst-case part the worst-case part; times a's
/// external part x it is the caller's, whose coefficients for x read b^ as
/// its linear part's do (the model's add_lb_errors).
inline Probable mul_disjoint(Probable a, Probable b, bool b_first) {
  using detail::mul0;
  if (!b_first) std::swap(a, b);
  const double A = std::fabs(a.v), B = std::fabs(b.v), hb = b.hp();
  return Probable{a.v * b.v, propagate_safe(a.e, B, A, b.e),
                  mul0(A, b.d) + mul0(B, a.d) + mul0(hb, a.d),
                  std::hypot(mul0(A, b.s), mul0(B + hb, a.s)), detail::lam(a, b)}
      .with_x(mul0(A, b.x) + mul0(B, a.x));
}
/// mul_disjoint in the order with the smaller bound.
inline Probable mul_disjoint(const Probable& a, const Probable& b) {
  const Probable ab = mul_disjoint(a, b, true), ba = mul_disjoint(a, b, false);
  return ab.d + ab.lambda * ab.s <= ba.d + ba.lambda * ba.s ? ab : ba;
}

/// sigma(a) in fp32 (§4): the error through sigma'(v) = sigma (1 - sigma),
/// Taylor's remainder max|sigma''| / 2 hp^2 over [v - hp, v + hp] (|sigma''|
/// < 0.1, and |sigma''| <= sigma (1 - sigma) < e^-|t|: far from 0 the
/// remainder vanishes with the slope), and the evaluation's own error at the
/// computed input.
inline Probable sig(Probable a) {
  const double sv = 1 / (1 + std::exp(-a.v)), slope = sv * (1 - sv), h = a.hp();
  const double far = std::fabs(a.v) - h, curve = far > 0 ? std::min(0.1, std::exp(-far)) : 0.1;
  return Probable{sv, sigmoid(sv, a.e), slope * a.d + 0.5 * curve * h * h + sigmoid(sv + h / 4),
                  slope * a.s, a.lambda}
      .with_x(slope * a.x);
}

/// A running sum of Probable terms: their random parts by `terms`
/// (precision.hpp), magnitudes and signs kept for the sum's own roundings.
struct ProbableSum {
  Terms terms;
  double v = 0, e = 0, d = 0, s = 0, s2 = 0, abs = 0, pos = 0, neg = 0, sq = 0, lambda = 0, x = 0;
  double hp = 0, hp2 = 0;  // sum of the terms' hp() and of their squares
  explicit ProbableSum(Terms t) : terms(t) {}
  void add(const Probable& t) {
    v += t.v, e += t.e, d += t.d, s += t.s, s2 += t.s * t.s;
    abs += t.mag(), sq += t.v * t.v, lambda = std::max(lambda, t.lambda), x += t.x;
    const double h = t.hp();
    hp += h, hp2 += h * h;
    (t.v >= 0 ? pos : neg) += std::fabs(t.v);
  }
  double random() const { return terms == Terms::independent ? std::sqrt(s2) : s; }
};

/// The squared norm of the roundings' coefficients of a sum of n terms in
/// any order and summation tree, per unit u: one rounding per term (when
/// `per_term`; coefficient the computed term, |t_j| + hp_j on the event, so
/// the norm is at most sqrt(sum t^2) + sqrt(sum hp^2)) and one per addition
/// (coefficient a computed partial sum: at most max(sum t+, sum t-), plus
/// every term's hp, plus the earlier roundings, gamma_n sum |terms|).
/// rounded_sum and the projection's adjoint (experts_projection.cpp) count
/// the same roundings.
inline double rounding_coefficients(double sq, double hp2, double partial, double hp, double worst,
                                    std::size_t n, bool per_term) {
  const double adds = n > 1 ? static_cast<double>(n - 1) : 0;
  const double t = std::sqrt(sq) + std::sqrt(hp2), m = partial + hp + worst;
  return (per_term ? t * t : 0) + adds * m * m;
}
/// The roundings of a sum of n terms, each of unit u, random
/// (rounding_coefficients); Tracked's worst case in e.
inline Probable rounded_sum(const ProbableSum& sum, std::size_t n, double u, bool per_term,
                            double tiny) {
  const double worst = gamma(static_cast<double>(n), u) * sum.abs;
  const double rnd =
      u * std::sqrt(rounding_coefficients(sum.sq, sum.hp2, std::max(sum.pos, sum.neg), sum.hp,
                                          worst, n, per_term));
  return Probable{sum.v, sum.e + worst + tiny, sum.d + tiny, std::hypot(sum.random(), rnd),
                  sum.lambda}
      .with_x(sum.x);
}

template <class F>
concept ProbableTerms = std::same_as<std::invoke_result_t<F, std::size_t>, Probable>;

/// An fp32-accumulated sum of n_terms products a(i) b(i), i < count, in any
/// order (§1): the operands' errors propagated (random parts as `terms`
/// says), the accumulation's roundings random (rounded_sum), the flushes in
/// the worst-case part; e as Tracked's dot_accumulated without lambda.
template <ProbableTerms A, ProbableTerms B>
Probable dot_accumulated(std::size_t count, A a, B b, std::size_t n_terms, const Precision& p,
                         Terms terms = Terms::shared) {
  ProbableSum sum(terms);
  double flushed = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const Probable x = a(i), y = b(i);
    sum.add(x * y);
    // A flushed operand is below 2^-126: the product moves by less than
    // 2^-126 times the other operand (Lemma 1').
    flushed +=
        (may_flush(x) ? kMinNormal32 * y.mag() : 0) + (may_flush(y) ? kMinNormal32 * x.mag() : 0);
  }
  sum.lambda = std::max(sum.lambda, p.lambda);
  const double n = static_cast<double>(n_terms);
  return rounded_sum(sum, n_terms, kU32, true, 3 * n * kMinNormal32 + flushed);
}

/// An fp32-accumulated sum of n_terms products, stored as an intermediate.
template <ProbableTerms A, ProbableTerms B>
Probable dot_stored(std::size_t count, A a, B b, std::size_t n_terms, const Precision& p,
                    Terms terms = Terms::shared) {
  return mid(dot_accumulated(count, a, b, n_terms, p, terms), p);
}

/// An fp32-accumulated sum of n_terms elementwise products each stored
/// first (a rounding of its own, independent of the others), then stored.
template <ProbableTerms A, ProbableTerms B>
Probable dot_products_stored(std::size_t count, A a, B b, std::size_t n_terms, const Precision& p,
                             Terms terms = Terms::shared) {
  const Probable d = dot_accumulated(count, a, b, n_terms, p, terms);
  double sq = 0, mag = 0;  // each stored product's coefficient: at most |x| |y| computed
  for (std::size_t i = 0; i < count; ++i) {
    const Probable x = a(i), y = b(i);
    const double m = x.mag() * y.mag();
    sq += m * m, mag += m;
  }
  const double tiny = static_cast<double>(count) * kMinNormal32;
  return mid(Probable{d.v, d.e + p.mid_unit * mag + tiny, d.d + tiny,
                      std::hypot(d.s, p.mid_unit * std::sqrt(sq)), d.lambda}
                 .with_x(d.x),
             p);
}

}  // namespace moecert::bounds
