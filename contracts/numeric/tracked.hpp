// Running error bounds: a value of the exact computation (binary64) and a
// bound on how far the kernel's value of the same quantity can be from it.
// The layer reference (contracts/reference/layer.hpp) is written once over a
// scalar S and marks the kernel's rounding points (r32: one fp32 operation,
// rbf16: a store to bf16, kdot: an fp32 sum of products); with S = Tracked
// those marks add the error of proofs/bounds.md §1-§5 and arithmetic
// propagates the errors of its operands (§3); with S = double or the
// 50-digit type the marks do nothing and the code is the exact math.
#pragma once

#include <cmath>
#include <cstddef>
#include <type_traits>

#include "contracts/numeric/functions.hpp"
#include "contracts/numeric/rounding.hpp"
#include "contracts/numeric/scalar.hpp"

namespace moecert::bounds {

/// propagate() with 0 * inf = 0: an exactly zero operand contributes no
/// error however large the other's bound (a vacuous bound stays +inf, never NaN).
inline double propagate_safe(double ea, double abs_b, double abs_a, double eb) {
  auto mul = [](double p, double q) { return p == 0 || q == 0 ? 0.0 : p * q; };
  return mul(ea, abs_b) + mul(abs_a, eb) + mul(ea, eb);
}

struct Tracked {
  double v = 0;  // exact-math value (binary64)
  double e = 0;  // |kernel value - exact value| <= e
  Tracked() = default;
  Tracked(double value, double err = 0) : v(value), e(err) {}
  double mag() const { return std::fabs(v) + e; }  // bound on |kernel value|
};

inline Tracked operator+(Tracked a, Tracked b) { return {a.v + b.v, a.e + b.e}; }
inline Tracked operator-(Tracked a, Tracked b) { return {a.v - b.v, a.e + b.e}; }
inline Tracked operator-(Tracked a) { return {-a.v, a.e}; }
inline Tracked operator*(Tracked a, Tracked b) {
  return {a.v * b.v, propagate_safe(a.e, std::fabs(b.v), std::fabs(a.v), b.e)};
}
inline Tracked operator/(Tracked a, Tracked b) {
  // |a_hat / b_hat - a / b| <= (e_a + |a / b| e_b) / (|b| - e_b), for e_b < |b|.
  const double q = a.v / b.v, den = std::fabs(b.v) - b.e;
  return {q, den > 0 ? (a.e + std::fabs(q) * b.e) / den : INFINITY};
}
inline Tracked& operator+=(Tracked& a, Tracked b) { return a = a + b; }

/// One fp32 operation's rounding of a computed value (relative u, plus the
/// flush of a result below the normal range).
inline Tracked r32(Tracked a) { return {a.v, a.e + kU32 * a.mag() + kMinNormal32}; }
/// A store to bf16 (§2).
inline Tracked rbf16(Tracked a) { return {a.v, bf16_store(std::fabs(a.v), a.e)}; }
/// sigma(a) as the kernels compute it in fp32 (§4).
inline Tracked sig(Tracked a) {
  const double s = 1 / (1 + std::exp(-a.v));
  return {s, sigmoid(s, a.e)};
}
/// A binary64 sum of n terms rounded once to fp32: the binary64 error is
/// far below the final rounding (gamma_n at u = 2^-53).
inline Tracked r64to32(Tracked a, double sum_abs, std::size_t n) {
  return {a.v, a.e + gamma(static_cast<double>(n), kU64) * sum_abs +
                   kU32 * (a.mag() + gamma(static_cast<double>(n), kU64) * sum_abs) + kMinNormal32};
}

}  // namespace moecert::bounds

namespace moecert::ref {

inline double to_double(const bounds::Tracked& a) { return a.v; }
inline double to_double_abs(const bounds::Tracked& a) { return a.mag(); }
inline double to_double_abs(double a) { return std::fabs(a); }
inline double to_double_abs(const Hp& a) { return std::fabs(to_double(a)); }

// The same marks for the exact scalars: no rounding.
inline double r32(double a) { return a; }
inline double rbf16(double a) { return a; }
inline double sig(double a) { return 1 / (1 + std::exp(-a)); }
inline double r64to32(double a, double, std::size_t) { return a; }
inline Hp r32(const Hp& a) { return a; }
inline Hp rbf16(const Hp& a) { return a; }
inline Hp sig(const Hp& a) { return Hp(1) / (Hp(1) + exp(-a)); }
inline Hp r64to32(const Hp& a, double, std::size_t) { return a; }

/// A value the tile unit may flush: nonzero and possibly below the smallest
/// normal fp32 (Lemma 1').
inline bool may_flush(const bounds::Tracked& a) {
  return a.mag() > 0 && std::fabs(a.v) - a.e < bounds::kMinNormal32;
}

/// The parts of the bound on a sum of products a(i) * b(i), i < count, of
/// Tracked operands: the exact sum, the operands' errors propagated, the
/// sum of |a_i b_i| (as the kernel may hold them) and that part of it whose
/// inputs may be flushed.
struct DotTerms {
  double v = 0, propagated = 0, mag = 0, flushed = 0;
};
template <class A, class B>
DotTerms dot_terms(std::size_t count, A a, B b) {
  using bounds::Tracked;
  DotTerms d;
  for (std::size_t i = 0; i < count; ++i) {
    const Tracked x = a(i), y = b(i);
    d.v += x.v * y.v;
    d.propagated += bounds::propagate_safe(x.e, std::fabs(y.v), std::fabs(x.v), y.e);
    const double m = x.mag() == 0 || y.mag() == 0 ? 0.0 : x.mag() * y.mag();
    d.mag += m;
    if (may_flush(x) || may_flush(y)) d.flushed += m;
  }
  return d;
}

/// An fp32 sum of the products a(i) * b(i), i < count (any order, §1),
/// n_terms terms counted for gamma (zero padding included). With S =
/// Tracked: the propagated errors plus bounds::dot, inputs that may be
/// denormal counted as flushed (Lemma 1'). Otherwise the exact sum.
template <class S, class A, class B>
S kdot(std::size_t count, A a, B b, std::size_t n_terms) {
  if constexpr (std::is_same_v<S, bounds::Tracked>) {
    const DotTerms d = dot_terms(count, a, b);
    return {d.v, d.propagated + bounds::dot(n_terms, d.mag, d.flushed)};
  } else {
    S s = 0;
    for (std::size_t i = 0; i < count; ++i) s += S(a(i)) * S(b(i));
    return s;
  }
}

}  // namespace moecert::ref
