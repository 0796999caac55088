// The experts model's pieces per routed pair (contracts/reference/
// experts_model.cpp), shared with the projection of its forward
// (experts_projection.cpp): an expert's weights as read, the forward a pair
// keeps, sums of rows, the GEMM outputs' stores.
#pragma once

#include <cstddef>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "contracts/numeric/probable.hpp"
#include "contracts/reference/experts_model.hpp"

namespace moecert::contracts::pair {

using bounds::Precision;
using bounds::Probable;
using bounds::Terms;
using bounds::Tracked;

// The model is written once over its scalar S: Tracked (worst-case bounds)
// or Probable (proofs/bounds.md §12). Where a sum's terms have independent
// roundings it says so (Terms::independent); a value that several such terms
// read is folded (its random part bounded in the worst case) first.

inline std::size_t kpad(std::size_t n) { return (n + 31) / 32 * 32; }

// One expert's weights and LoRA factors as the implementation reads them.
template <class S>
struct Expert {
  const ExpertsTensors& in;
  std::size_t e;
  const Precision& p;
  S at(MatView<const float> m, std::size_t rows, std::size_t i, std::size_t k) const {
    return bounds::lift<S>(bounds::input(m(e * rows + i, k), p), p);
  }
};

// A sum of rows (the slots' outputs, dx's terms) in the intermediate format.
template <class S>
struct RowSum;
template <>
struct RowSum<Tracked> {
  Tracked v{0, 0};
  double abs = 0;
  explicit RowSum(Terms) {}
  void add(const Tracked& t) { v += t, abs += t.mag(); }
  Tracked stored(std::size_t n, const Precision& p) const {
    return bounds::sum_stored(v, abs, n, p);
  }
};
inline Tracked row_exact(const RowSum<Tracked>& r) { return r.v; }
inline double row_abs(const RowSum<Tracked>& r) { return r.abs; }
template <>
struct RowSum<Probable> {
  bounds::ProbableSum sum;
  explicit RowSum(Terms t) : sum(t) {}
  void add(const Probable& t) { sum.add(t); }
  Probable stored(std::size_t n, const Precision& p) const {
    return bounds::rounded_sum(sum, n, p.mid_unit, true,
                               2 * static_cast<double>(n) * bounds::kMinNormal32);
  }
};
inline Probable row_exact(const RowSum<Probable>& r) {
  return Probable{r.sum.v, r.sum.e, r.sum.d, r.sum.random(), r.sum.lambda}.with_x(r.sum.x);
}
inline double row_abs(const RowSum<Probable>& r) { return r.sum.abs; }

// base + lora of one GEMM output: each term an fp32-accumulated sum over
// n terms (the fused length, so a fused kernel is covered too) stored, then
// their sum stored; the base term alone without LoRA.
template <class A, class WB, class AL, class WL>
auto gemm_out(std::size_t k_base, A a, WB wb, std::size_t k_lora, AL al, WL wl, std::size_t n,
              const Precision& p, Terms base_terms = Terms::shared) {
  const auto base = bounds::dot_stored(k_base, a, wb, n, p, base_terms);
  if (k_lora == 0) return base;
  return bounds::mid(base + bounds::dot_stored(k_lora, al, wl, n, p), p);
}

// a b for operands whose errors come from disjoint roundings: Probable's
// cross term random (bounds::mul_disjoint; b_first: b's roundings drawn
// first, the order the projection's adjoint assumes), Tracked's product.
template <class S>
S product_disjoint(const S& a, const S& b, std::optional<bool> b_first = {}) {
  if constexpr (std::is_same_v<S, Probable>)
    return b_first ? bounds::mul_disjoint(a, b, *b_first) : bounds::mul_disjoint(a, b);
  else
    return a * b;
}

// One routed pair's forward as the model keeps it for the backward.
template <class S>
struct PairForward {
  std::vector<S> g, u, sg, silu, h, o;
  std::vector<S> lb, lbd;    // s x A^T (gate, up), s h A_d^T as the B GEMMs read them
  std::vector<double> o_hp;  // o's hp() before lb's errors were accounted (Probable)
};

// The errors of lb (s x A^T as the B GEMMs read it) in o, each through its
// exact linear coefficient: o_m depends on lb_k through
// c_mk = sum_i W_eff[m, i] dh_i/dlb_k, W_eff = W_d + s B_d A_d, dh_i/dlb_k =
// silu'(g_i) u_i B_g[i, k] (gate) or silu(g_i) B_u[i, k] (up). lb_k's
// roundings are its own (independent across k): its random part joins o_m's
// with coefficient |c_mk|, its worst-case part adds |c_mk| d_k, and o_m's x
// (lb's error carried coherently, Probable::x) is dropped.
void add_lb_errors(const Expert<Probable>& w, PairForward<Probable>& f,
                   const std::vector<Probable>& lb, double s);

// silu'(g_i) = sigma (1 + g (1 - sigma)) in fp32, from the pair's forward.
template <class S>
S dsilu_of(const PairForward<S>& f, std::size_t i) {
  const S sg = f.sg[i], one{1};
  return bounds::r32(sg * bounds::r32(one + bounds::r32(f.g[i] * bounds::r32(one - sg))));
}

// do's errors in one pair's dx row along the adjoint a [H] (proofs/bounds.md
// §12): do (as read, `d`) reaches dx through dh, dg and du, which carry it
// as their external part; here through its exact coefficients c = J^T a
// (J the row's Jacobian in do, read at the computed u, silu and silu':
// |c| grows by the radius their errors make). det = sum |c_m| d_m, rnd the
// norm of do's random parts' coefficients (do_m's roundings are its own).
struct DoAlong {
  double det = 0, rnd = 0;
};
DoAlong do_along(const Expert<Probable>& w, const PairForward<Probable>& f,
                 const std::vector<Probable>& d, double s, const std::vector<double>& a);

// dL/dw = <dy, o> of one pair (dy as read; o of the pair's forward f over
// x): the worst case `stored` (dot_products_stored's) with its parts
// rebuilt (proofs/bounds.md §12): o's roundings through their coefficients
// for the adjoint dy (the projection's adjoint pass), dy's own read at the
// computed o (|o| + hp), the products' stores and the fp32 sum's roundings,
// then the store; o's and dy's worst-case parts and the flushes in d.
Probable pair_dweight(const Expert<Probable>& w, const PairForward<Probable>& f,
                      const std::vector<Probable>& x, double s, const std::vector<Probable>& dy,
                      const Probable& stored);

// Token t's share of the projection of y's error on the exact y (Projection):
// its pairs' roundings (pair_forward's, in reverse), y's own and sum |y| d.
struct TokenProjection {
  double det = 0, q = 0, norm2 = 0;
};
TokenProjection token_projection(const ExpertsTensors& in, const Precision& p,
                                 const std::vector<Probable>& x, double s,
                                 const std::vector<std::pair<std::size_t, double>>& slots,
                                 const std::vector<PairForward<Probable>>& pairs,
                                 const std::vector<RowSum<Probable>>& sum, const Probable* y);

}  // namespace moecert::contracts::pair
