// Scalars for the reference evaluators: double, double-double and 50-digit
// Boost.Multiprecision, with one set of free functions over all three.
// Transcendentals at high precision come from Boost.Multiprecision.
#pragma once

#include <boost/multiprecision/cpp_bin_float.hpp>
#include <cmath>

namespace moecert::ref {

/// 50 decimal digits (about 166-bit significand); expression templates off so
/// that every operation yields a plain number.
using Hp = boost::multiprecision::number<boost::multiprecision::cpp_bin_float<50>,
                                         boost::multiprecision::et_off>;

/// Unevaluated sum hi + lo with |lo| <= ulp(hi)/2: about 106 bits.
/// Arithmetic from error-free transformations (Knuth TwoSum, FMA TwoProd);
/// relies on IEEE double with round-to-nearest and no contraction
/// (-ffp-contract=off, set for the whole project).
struct DoubleDouble {
  double hi = 0, lo = 0;

  constexpr DoubleDouble() = default;
  constexpr DoubleDouble(double x) : hi(x), lo(0) {}  // NOLINT: exact widening
  constexpr DoubleDouble(double h, double l) : hi(h), lo(l) {}

  static DoubleDouble two_sum(double a, double b) {
    const double s = a + b, bb = s - a;
    return {s, (a - (s - bb)) + (b - bb)};
  }
  static DoubleDouble quick_two_sum(double a, double b) {  // needs |a| >= |b|
    const double s = a + b;
    return {s, b - (s - a)};
  }
  static DoubleDouble two_prod(double a, double b) {
    const double p = a * b;
    return {p, std::fma(a, b, -p)};
  }

  friend DoubleDouble operator+(DoubleDouble x, DoubleDouble y) {  // accurate (IEEE-style) add
    DoubleDouble s = two_sum(x.hi, y.hi), t = two_sum(x.lo, y.lo);
    s.lo += t.hi;
    s = quick_two_sum(s.hi, s.lo);
    s.lo += t.lo;
    return quick_two_sum(s.hi, s.lo);
  }
  friend DoubleDouble operator-(DoubleDouble x) { return {-x.hi, -x.lo}; }
  friend DoubleDouble operator-(DoubleDouble x, DoubleDouble y) { return x + (-y); }
  friend DoubleDouble operator*(DoubleDouble x, DoubleDouble y) {
    DoubleDouble p = two_prod(x.hi, y.hi);
    p.lo += x.hi * y.lo + x.lo * y.hi;
    return quick_two_sum(p.hi, p.lo);
  }
  friend DoubleDouble operator/(DoubleDouble x, DoubleDouble y) {
    const double q1 = x.hi / y.hi;
    DoubleDouble r = x - y * DoubleDouble(q1);
    const double q2 = r.hi / y.hi;
    r = r - y * DoubleDouble(q2);
    const double q3 = r.hi / y.hi;
    return quick_two_sum(q1, q2) + DoubleDouble(q3);
  }
  DoubleDouble& operator+=(DoubleDouble y) { return *this = *this + y; }
  DoubleDouble& operator-=(DoubleDouble y) { return *this = *this - y; }
  DoubleDouble& operator*=(DoubleDouble y) { return *this = *this * y; }
  DoubleDouble& operator/=(DoubleDouble y) { return *this = *this / y; }
  friend bool operator<(DoubleDouble x, DoubleDouble y) {
    return x.hi < y.hi || (x.hi == y.hi && x.lo < y.lo);
  }
  friend bool operator>(DoubleDouble x, DoubleDouble y) { return y < x; }
  friend bool operator==(DoubleDouble x, DoubleDouble y) { return x.hi == y.hi && x.lo == y.lo; }
};

// ---- one interface over double, DoubleDouble and Hp ---------------------

inline double to_double(double x) { return x; }
inline double to_double(DoubleDouble x) { return x.hi + x.lo; }
inline double to_double(const Hp& x) { return x.convert_to<double>(); }

inline Hp to_hp(double x) { return Hp(x); }
inline Hp to_hp(DoubleDouble x) { return Hp(x.hi) + Hp(x.lo); }
inline Hp to_hp(const Hp& x) { return x; }

template <class T>
T from_hp(const Hp& x);
template <>
inline double from_hp<double>(const Hp& x) {
  return x.convert_to<double>();
}
template <>
inline DoubleDouble from_hp<DoubleDouble>(const Hp& x) {
  const double hi = x.convert_to<double>();
  return {hi, Hp(x - hi).convert_to<double>()};
}
template <>
inline Hp from_hp<Hp>(const Hp& x) {
  return x;
}

inline double abs(double x) { return std::fabs(x); }
inline DoubleDouble abs(DoubleDouble x) { return x.hi < 0 ? -x : x; }
inline Hp abs(const Hp& x) { return boost::multiprecision::abs(x); }

// exp and log: libm for double; Boost.Multiprecision at 50 digits for the others.
inline double exp(double x) { return std::exp(x); }
inline double log(double x) { return std::log(x); }
inline Hp exp(const Hp& x) { return boost::multiprecision::exp(x); }
inline Hp log(const Hp& x) { return boost::multiprecision::log(x); }
inline DoubleDouble exp(DoubleDouble x) { return from_hp<DoubleDouble>(exp(to_hp(x))); }
inline DoubleDouble log(DoubleDouble x) { return from_hp<DoubleDouble>(log(to_hp(x))); }

}  // namespace moecert::ref
