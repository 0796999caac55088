// Property, for each router (softmax_topk, sigmoid_topk, product_key) with
// fuzzed shapes, scores (NaN, Inf, denormals included), parameters and, for
// the backward, fuzzed slot indices (-1, out of range, duplicates): invalid
// input raises exactly a precondition violation with every output byte
// untouched; valid input raises nothing at level full (so every
// postcondition holds: order, top-k property, weight ranges, zero gradients
// off the selection) but a backward's finite postcondition where fp32
// overflows; every weight agrees with its slot's binary64 reference within
// proofs/router.md §3, and every finite gradient within §4.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "contracts/bounds/router.hpp"
#include "contracts/reference/router.hpp"
#include "fuzz/decode.hpp"
#include "moecert/contracts.hpp"
#include "moecert/router.hpp"

using namespace moecert;

namespace {

constexpr const char* kName = "router_fuzzer";

bool all_finite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

// The backwards' g_finite clauses: finite and |g| <= 2^126.
bool grads_ok(const std::vector<float>& v) {
  for (float x : v)
    if (!(std::fabs(x) <= 0x1p126f)) return false;
  return true;
}

// Rows of idx valid for a backward: in [0, e) or -1, -1 only at the tail, no repeats.
bool rows_valid(const std::vector<std::int32_t>& idx, std::size_t t, std::size_t k, std::size_t e) {
  for (std::size_t r = 0; r < t; ++r) {
    bool tail = false;
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t x = idx[r * k + j];
      if (x < -1 || x >= static_cast<std::int64_t>(e) || (tail && x != -1)) return false;
      tail = tail || x == -1;
      for (std::size_t l = 0; l < j; ++l)
        if (x >= 0 && idx[r * k + l] == x) return false;
    }
  }
  return true;
}

// Runs op under full/enforce. Invalid input must give a precondition
// violation and leave `outputs` bytes as they were; valid input none, or
// the op's finite postcondition `overflow` (valid input can exceed fp32).
// True when op ran without a violation.
bool expect(bool valid, const std::function<void()>& op,
            std::initializer_list<std::pair<const void*, std::size_t>> outputs, const char* what,
            const char* overflow = nullptr) {
  std::vector<std::vector<std::uint8_t>> before;
  for (const auto& [p, n] : outputs)
    before.emplace_back(static_cast<const std::uint8_t*>(p),
                        static_cast<const std::uint8_t*>(p) + n);
  try {
    ContractScope s{Level::full, Semantic::enforce};
    op();
  } catch (const ContractViolation& v) {
    if (valid && overflow && v.clause() == overflow) return false;
    if (valid || v.violation().kind != ClauseKind::pre)
      fuzz::finding(kName, fmt::format("{}: {}", what, v.what()));
    std::size_t i = 0;
    for (const auto& [p, n] : outputs)
      if (std::memcmp(p, before[i++].data(), n) != 0)
        fuzz::finding(kName, fmt::format("{}: output written before {}", what, v.clause()));
    return false;
  }
  if (!valid) fuzz::finding(kName, fmt::format("{}: invalid input accepted", what));
  return true;
}

// Every finite result is compared, however large: where fp32 overflowed,
// the op raised its finite postcondition instead (expect).
void check(double got, double want, double bound, const char* what) {
  if (!(std::fabs(got - want) <=
        bound + bounds::gamma(64, bounds::kU64) *
                    std::fabs(want)))  // + the binary64 reference's rounding
    fuzz::finding(kName, fmt::format("{}: got {:.9g}, reference {:.17g}, bound {:.3g}", what, got,
                                     want, bound));
}

// The decoded case every router shares: t rows, e experts (n x n for
// product_key), k slots; scores z and gradients g (any bits); idx and w
// prefilled with garbage the forward must overwrite (or keep, if invalid).
struct Case {
  std::size_t t, n, e, k;
  std::vector<float> z, g, w;
  std::vector<std::int32_t> idx;
  bool scores_ok, k_ok;
  MatView<std::int32_t> iv;  // views of idx and w
  MatView<float> wv;
  // The forward's outputs, whose bytes a rejected call must leave as they were.
  std::pair<const void*, std::size_t> outs[2];

  void softmax_topk(fuzz::Decoder& d);
  void sigmoid_topk(fuzz::Decoder& d);
  void product_key(fuzz::Decoder& d);
};

Case decode_case(fuzz::Decoder& d, int kind) {
  Case c;
  c.t = d.range(1, 5);
  c.n = d.range(1, 6);                           // product key halves
  c.e = kind == 2 ? c.n * c.n : d.range(1, 24);  // experts
  c.k = d.range(0, std::min<std::size_t>(c.e + 1, 8));
  c.z.resize(c.t * (kind == 2 ? 2 * c.n : c.e));
  for (auto& v : c.z) v = d.value_f32();
  c.g.resize(c.t * std::max<std::size_t>(c.k, 1));
  for (auto& v : c.g) v = d.value_f32();
  c.idx.assign(c.t * std::max<std::size_t>(c.k, 1), 0x5a5a5a5a);
  c.w.assign(c.idx.size(), 7.0f);
  c.scores_ok = all_finite(c.z), c.k_ok = c.k >= 1 && c.k <= c.e;
  c.iv = {c.idx.data(), c.t, c.k}, c.wv = {c.w.data(), c.t, c.k};
  c.outs[0] = {c.idx.data(), c.idx.size() * 4}, c.outs[1] = {c.w.data(), c.w.size() * 4};
  return c;
}

// softmax_topk forward, then the backward on its selection or on fuzzed
// indices.
void Case::softmax_topk(fuzz::Decoder& d) {
  const bool renorm = d.flag();
  MatView<const float> zv(z.data(), t, e);
  expect(
      scores_ok && k_ok, [&] { router::softmax_topk_forward(zv, iv, wv, renorm); },
      {outs[0], outs[1]}, "softmax_topk.forward");
  if (!(scores_ok && k_ok)) return;
  for (std::size_t r = 0; r < t; ++r) {  // every weight against its own slot's reference (§3)
    const auto [wr, b] = bounds::softmax_topk_weights_row(&z[r * e], e, &idx[r * k], k, renorm);
    for (std::size_t j = 0; j < k; ++j) check(w[r * k + j], wr[j], b[j], "softmax_topk.forward");
  }
  std::vector<std::int32_t> bidx = idx;
  if (d.flag())
    for (auto& x : bidx) x = d.index(e);
  std::vector<float> dz(t * e, 3.0f);
  const bool ok = rows_valid(bidx, t, k, e) && grads_ok(g);
  if (!expect(
          ok,
          [&] {
            router::softmax_topk_backward(zv, MatView<const std::int32_t>(bidx.data(), t, k),
                                          MatView<const float>(g.data(), t, k),
                                          MatView<float>(dz.data(), t, e), renorm);
          },
          {{dz.data(), dz.size() * 4}}, "softmax_topk.backward"))
    return;
  for (std::size_t r = 0; r < t;
       ++r) {  // every expert: selected within §4.1, the others exactly 0 or within it (dense)
    const std::int32_t* ir = &bidx[r * k];
    const auto dref = ref::softmax_topk_grad<double>(&z[r * e], e, ir, &g[r * k], k, renorm);
    const auto b = bounds::softmax_topk_grad_row(&z[r * e], e, ir, &g[r * k], k, renorm);
    for (std::size_t i = 0; i < e; ++i)
      check(dz[r * e + i], dref[i], b[i], "softmax_topk.backward");
  }
}

// sigmoid_topk forward (fuzzed groups, scaling and bias), then the backward
// on its selection.
void Case::sigmoid_topk(fuzz::Decoder& d) {
  const router::SigmoidTopkParams p{d.range(1, 6), d.range(1, 6), d.flag() ? 1.0f : d.value_f32()};
  std::vector<float> bias(d.flag() ? e : d.range(0, 30));
  for (auto& b : bias) b = d.value_f32() * 0.01f;
  MatView<const float> zv(z.data(), t, e);
  bool logits_ok = true;  // sigma(z) normal: z >= -87
  for (float v : z) logits_ok = logits_ok && v >= -87.0f;
  const bool ok = scores_ok && logits_ok && k_ok && all_finite(bias) && bias.size() == e &&
                  e % p.groups == 0 && p.topk_group <= p.groups && std::isfinite(p.scaling) &&
                  p.scaling > 0;
  expect(
      ok,
      [&] {
        router::sigmoid_topk_forward(zv, View<const float>{bias.data(), bias.size()}, p, iv, wv);
      },
      {outs[0], outs[1]}, "sigmoid_topk.forward");
  if (!ok) return;
  for (std::size_t r = 0; r < t; ++r) {
    const auto [wr, b] = bounds::sigmoid_topk_weights_row(&z[r * e], &idx[r * k], k, p.scaling);
    for (std::size_t j = 0; j < k; ++j) check(w[r * k + j], wr[j], b[j], "sigmoid_topk.forward");
  }
  std::vector<float> dz(t * e, 3.0f);
  const bool bok = grads_ok(g);
  if (!expect(
          bok,
          [&] {
            router::sigmoid_topk_backward(zv, MatView<const std::int32_t>(idx.data(), t, k),
                                          MatView<const float>(g.data(), t, k), p,
                                          MatView<float>(dz.data(), t, e));
          },
          {{dz.data(), dz.size() * 4}}, "sigmoid_topk.backward",
          "router.sigmoid_topk_backward.dz_finite"))
    return;
  for (std::size_t r = 0; r < t; ++r) {
    const std::int32_t* ir = &idx[r * k];
    const auto dref = ref::sigmoid_topk_grad<double>(&z[r * e], e, ir, &g[r * k], k, p.scaling);
    const auto b = bounds::sigmoid_topk_grad_row(&z[r * e], e, ir, &g[r * k], k, p.scaling);
    for (std::size_t i = 0; i < e; ++i)
      check(dz[r * e + i], dref[i], b[i], "sigmoid_topk.backward");
  }
}

// product_key forward (three weight modes), then the backward on its
// selection or on fuzzed indices.
void Case::product_key(fuzz::Decoder& d) {
  MatView<const float> xv(z.data(), t, n, 2 * n), yv(z.data() + n, t, n, 2 * n);
  const auto mode = static_cast<router::KeyWeights>(d.u8() % 3);
  bool small = true;  // the clause's range: every sum, and for exp weights its exp, stays finite
  for (float v : z) small = small && std::fabs(v) <= 0x1p126f;
  for (std::size_t r = 0; r < t && mode == router::KeyWeights::exp; ++r) {
    float mx = -INFINITY, my = -INFINITY;
    for (std::size_t i = 0; i < n; ++i) mx = std::max(mx, xv(r, i)), my = std::max(my, yv(r, i));
    small = small && double(mx) + my <= 88.0;
  }
  expect(
      scores_ok && small && k_ok, [&] { router::product_key_forward(xv, yv, mode, iv, wv); },
      {outs[0], outs[1]}, "product_key.forward");
  if (!(scores_ok && small && k_ok)) return;
  std::vector<float> sx(t * n), sy(t * n);
  for (std::size_t r = 0; r < t; ++r)
    for (std::size_t i = 0; i < n; ++i) sx[r * n + i] = xv(r, i), sy[r * n + i] = yv(r, i);
  for (std::size_t r = 0; r < t; ++r) {
    const auto [wr, b] =
        bounds::product_key_weights_row(&sx[r * n], &sy[r * n], n, &idx[r * k], k, mode);
    for (std::size_t j = 0; j < k; ++j) check(w[r * k + j], wr[j], b[j], "product_key.forward");
  }
  std::vector<std::int32_t> bidx = idx;
  if (d.flag())
    for (auto& x : bidx) x = d.index(e);
  std::vector<float> dsx(t * n, 3.0f), dsy(t * n, 3.0f);
  const bool ok = rows_valid(bidx, t, k, e) && grads_ok(g);
  if (!expect(
          ok,
          [&] {
            router::product_key_backward(xv, yv, MatView<const std::int32_t>(bidx.data(), t, k),
                                         MatView<const float>(g.data(), t, k), mode,
                                         MatView<float>(dsx.data(), t, n),
                                         MatView<float>(dsy.data(), t, n));
          },
          {{dsx.data(), dsx.size() * 4}, {dsy.data(), dsy.size() * 4}}, "product_key.backward",
          "router.product_key_backward.grad_finite"))
    return;
  for (std::size_t r = 0; r < t; ++r) {
    std::vector<double> rx, ry;
    ref::product_key_grad<double>(&sx[r * n], &sy[r * n], n, &bidx[r * k], &g[r * k], k, mode, rx,
                                  ry);
    const auto b =
        bounds::product_key_grad_row(&sx[r * n], &sy[r * n], n, &bidx[r * k], &g[r * k], k, mode);
    for (std::size_t i = 0; i < n; ++i)
      for (int half = 0; half < 2; ++half)
        check(half ? dsy[r * n + i] : dsx[r * n + i], half ? ry[i] : rx[i], b[half * n + i],
              "product_key.backward");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  const int kind = d.u8() % 3;
  Case c = decode_case(d, kind);
  if (kind == 0)
    c.softmax_topk(d);
  else if (kind == 1)
    c.sigmoid_topk(d);
  else
    c.product_key(d);
  return 0;
}
