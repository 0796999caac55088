// The arithmetic an implementation declares (`moecert check --precision`):
// where it rounds and to which format. The judge's model references mark
// those points; each mark adds the rounding's error bound (proofs/experts.md
// §4). Every GEMM accumulates in fp32, in any order and summation tree.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <string_view>

#include "contracts/numeric/tracked.hpp"
#include "moecert/types.hpp"

namespace moecert::bounds {

struct Precision {
  std::string_view name;
  double mid_unit;     // unit roundoff of an intermediate's storage
  bool bf16_operands;  // what a GEMM reads (inputs, activations) is rounded to bf16
  double lambda = 0;   // > 0: the probabilistic model (probable(), probable.hpp)
};

/// The judge's probabilistic bounds (proofs/bounds.md §12): lambda = 10
/// makes a value's bound fail with probability at most 2 exp(-lambda^2 / 2)
/// < 2^-71 under the model of independent, mean-zero rounding errors, so a
/// model of fewer than 2^40 values fails with probability below 2^-31.
inline constexpr double kProbableLambda = 10;
/// A projection of an output on its exact value is one combination of the
/// roundings: lambda = 7 bounds it but with probability 2 exp(-24.5) <
/// 2^-34 under the model (beside its values' 2^-31 above).
inline constexpr double kProjectionLambda = 7;

/// The declaration p with its errors bounded probabilistically.
constexpr Precision probable(Precision p) {
  p.lambda = kProbableLambda;
  return p;
}

/// fp32: intermediates and GEMM operands in fp32.
inline constexpr Precision kFp32{"fp32", kU32, false};
/// mixed: GEMM operands in bf16, other intermediates in fp32 (moecert's
/// kernels; AMX and AVX-512 BF16 GEMMs read bf16).
inline constexpr Precision kMixed{"mixed", kU32, true};
/// bf16: every intermediate stored in bf16, GEMM operands bf16 (PyTorch
/// eager on bf16 tensors: each op rounds its result).
inline constexpr Precision kBf16{"bf16", kUbf16, true};

/// The declaration named `name`, if it is one of the three.
inline std::optional<Precision> precision_named(std::string_view name) {
  for (const Precision& p : {kFp32, kMixed, kBf16})
    if (p.name == name) return p;
  return std::nullopt;
}

/// An intermediate stored: relative mid_unit, plus the flush of a result
/// below the normal fp32 range (which also covers a bf16 denormal's half ulp).
inline Tracked mid(Tracked a, const Precision& p) {
  return {a.v, a.e + p.mid_unit * a.mag() + kMinNormal32};
}

/// An activation a GEMM reads (§2 when rounded to bf16).
inline Tracked operand(Tracked a, const Precision& p) {
  return p.bf16_operands ? Tracked{a.v, bf16_store(std::fabs(a.v), a.e)} : a;
}

/// An input value as the implementation reads it: exact, unless it is
/// read as a GEMM operand in bf16 and is not a bf16 value.
inline Tracked input(float v, const Precision& p) {
  if (!p.bf16_operands || bf16(v).to_float() == v) return {v, 0};
  return {v, bf16_store(std::fabs(v), 0)};
}

/// Whether the terms of a sum have disjoint random parts (roundings
/// independent across the terms: those parts add as a root of squares) or
/// may share roundings (they add by the triangle inequality). Only the
/// probabilistic model (contracts/numeric/probable.hpp) tells them apart.
enum class Terms { independent, shared };

/// The worst-case model has no random part to fold (probable.hpp's fold).
inline Tracked fold(Tracked a) { return a; }

/// An fp32-accumulated sum of n_terms products a(i) b(i), i < count, in
/// any order (bounds.md §1): the propagated
/// errors, the accumulation's, the flushes.
template <class A, class B>
Tracked dot_accumulated(std::size_t count, A a, B b, std::size_t n_terms, const Precision&,
                        Terms = Terms::shared) {
  const ref::DotTerms d = ref::dot_terms(count, a, b);
  const double n = static_cast<double>(n_terms);
  return {d.v, d.propagated + gamma(n) * d.mag + 3 * n * kMinNormal32 + d.flushed};
}

/// An fp32-accumulated sum of n_terms products, stored as an intermediate.
template <class A, class B>
Tracked dot_stored(std::size_t count, A a, B b, std::size_t n_terms, const Precision& p,
                   Terms = Terms::shared) {
  return mid(dot_accumulated(count, a, b, n_terms, p), p);
}

/// An fp32-accumulated sum of n_terms elementwise products that may each
/// be stored first (a reduction of a stored product tensor), then stored.
template <class A, class B>
Tracked dot_products_stored(std::size_t count, A a, B b, std::size_t n_terms, const Precision& p,
                            Terms = Terms::shared) {
  Tracked d = dot_accumulated(count, a, b, n_terms, p);
  double mag = 0;
  for (std::size_t i = 0; i < count; ++i) mag += a(i).mag() * b(i).mag();
  d.e += p.mid_unit * mag + static_cast<double>(count) * kMinNormal32;
  return mid(d, p);
}

/// A sum of n terms each a product rounded to the intermediate format, in
/// that format, in any order: gamma_n at mid_unit over sum |terms|, plus
/// the flush of each product and each sum.
inline Tracked sum_stored(Tracked exact_sum, double sum_abs_terms, std::size_t n,
                          const Precision& p) {
  return {exact_sum.v, exact_sum.e + gamma(static_cast<double>(n), p.mid_unit) * sum_abs_terms +
                           2 * static_cast<double>(n) * kMinNormal32};
}

}  // namespace moecert::bounds
