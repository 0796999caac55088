// What the router clauses share (contracts/router/*.cpp): shapes, aliasing,
// index rows, the total order and top-k property, weight ranges, and every
// value of a row against its binary64 reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "contracts/bounds/router.hpp"
#include "contracts/engine/checks.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/engine/judging.hpp"
#include "contracts/engine/order.hpp"
#include "contracts/numeric/rounding.hpp"
#include "contracts/router/clauses.hpp"

namespace moecert::contracts::router_detail {

namespace k = clauses::router;
using order::ranks_before;

inline std::string shape_of(const char* name, std::size_t r, std::size_t c) {
  return fmt::format("{} {}x{}", name, r, c);
}

// Fails `clause` unless all byte ranges are pairwise disjoint.
inline void disjoint(detail::Checker& c, const ClauseInfo& clause,
                     std::initializer_list<std::pair<const char*, ByteRange>> rs) {
  std::vector<std::pair<const char*, ByteRange>> v(rs);
  for (std::size_t a = 0; a < v.size(); ++a)
    for (std::size_t b = a + 1; b < v.size(); ++b)
      if (overlaps(v[a].second, v[b].second)) {
        c.fail(clause, "",
               fmt::format("{} {} overlaps {} {}", v[a].first, detail::format_range(v[a].second),
                           v[b].first, detail::format_range(v[b].second)),
               "disjoint");
        return;
      }
}

// Index clauses on rows of idx: each entry in [0, e) or -1; -1 only at the
// tail (and not at all unless `allow_empty`); no expert twice. One clause
// may cover both (backward preconditions) or two (forward postconditions).
inline void index_rows(detail::Checker& c, const ClauseInfo& valid, const ClauseInfo& unique,
                       MatView<const std::int32_t> idx, std::size_t e, bool allow_empty,
                       bool check_valid, bool check_unique) {
  if (idx.rows == 0) return;  // (e may be any size then: no row to read it for)
  std::vector<char> seen(e, 0);
  for (std::size_t t = 0; t < idx.rows; ++t) {
    bool tail = false;
    for (std::size_t j = 0; j < idx.cols; ++j) {
      const std::int32_t x = idx(t, j);
      const bool bad = x < -1 || x >= static_cast<std::int64_t>(e) || (x == -1 && !allow_empty) ||
                       (tail && x != -1);
      if (check_valid && bad) {
        c.fail(valid, fmt::format("t={} j={}", t, j), fmt::format("idx={}", x),
               tail          ? "-1 (after a -1 slot)"
               : allow_empty ? fmt::format("-1 <= idx < {}", e)
                             : fmt::format("0 <= idx < {}", e));
        return;
      }
      if (bad) return;  // unique is meaningless on invalid indices
      tail = tail || x == -1;
      if (x >= 0 && check_unique && seen[static_cast<std::size_t>(x)]) {
        c.fail(unique, fmt::format("t={} j={}", t, j), fmt::format("idx={} selected twice", x),
               "distinct experts");
        return;
      }
      if (x >= 0) seen[static_cast<std::size_t>(x)] = 1;
    }
    for (std::size_t j = 0; j < idx.cols; ++j)
      if (idx(t, j) >= 0) seen[static_cast<std::size_t>(idx(t, j))] = 0;
  }
}

inline std::size_t valid_slots(MatView<const std::int32_t> idx, std::size_t t) {
  return order::filled_slots(idx.row(t), idx.cols);
}

// Every index of row t in [-1, e): rows that are not are the index clauses'
// to report (under observe the other clauses still run, and skip them; with
// `record`, the judge's verdict lists the rows skipped).
inline bool row_in_range(MatView<const std::int32_t> idx, std::size_t t, std::size_t e,
                         bool record = true) {
  for (std::size_t j = 0; j < idx.cols; ++j)
    if (idx(t, j) < -1 || idx(t, j) >= static_cast<std::int64_t>(e)) {
      if (record) judge::skip_row(t);
      return false;
    }
  return true;
}

// Row t's first slot holds an expert (not -1) and every slot is in range:
// what a clause that reads the row's scores through its first id needs
// (`record` as row_in_range's; off on the op's worker threads).
inline bool row_led_by_expert(MatView<const std::int32_t> idx, std::size_t t, std::size_t e,
                              bool record = true) {
  if (idx.cols == 0 || idx(t, 0) < 0) return false;
  return row_in_range(idx, t, e, record);
}

// How expert a of a row ranks against expert b under the declared order:
// before or after it, exactly tied (equal scores: the order is by index, or
// any under judge::Options::ties_any_order), or within the bound of the
// implementation's own score rounding of each other (either order is right).
enum class Rank { before, after, tie, near };

// Whether a at a place before b is legal; with `record`, the judge's list
// names each tie and near tie it allows.
inline bool may_precede(Rank r, std::size_t t, std::int32_t a, std::int32_t b, double score,
                        bool record = true) {
  switch (r) {
    case Rank::before:
      return true;
    case Rank::after:
      return false;
    case Rank::tie:
      return judge::current().ties_any_order && (!record || judge::allow_tie(t, a, b, score));
    case Rank::near:
      if (record) judge::record_near_tie(t, a, b, score);
      return true;
  }
  return false;
}

// Row t's sorted and top-k verdict; `fail(clause, location, observed,
// expected)` reports its first failure, after which it returns false.
// `record`: the judge's list names the ties and near ties allowed.
template <class Ranking, class Score, class Eligible, class Fail>
bool order_row(std::size_t t, const ClauseInfo& sorted, const ClauseInfo* topk,
               MatView<const std::int32_t> idx, std::size_t e, Ranking& rank, Score& score,
               Eligible& eligible, bool record, Fail&& fail) {
  if (!row_in_range(idx, t, e)) return true;
  const std::size_t valid = valid_slots(idx, t);
  const bool any_order = judge::current().slots_any_order;
  // (The top-k pass checks the order again, without naming its ties a
  // second time.)
  for (std::size_t j = 1; j < valid && !any_order; ++j) {
    const std::int32_t a = idx(t, j - 1), b = idx(t, j);
    if (!may_precede(rank(t, a, b), t, a, b, score(t, a), record && topk == nullptr)) {
      fail(sorted, fmt::format("t={} j={}", t, j),
           fmt::format("slot {} expert {} score {} before expert {} score {}", j - 1, a,
                       score(t, a), b, score(t, b)),
           "score descending, then index ascending");
      return false;
    }
  }
  if (!topk || valid == 0) return true;
  const std::int32_t* row = idx.row(t);
  std::int32_t kth = row[valid - 1];
  if (any_order)  // the lowest-ranked of the selected
    for (std::size_t j = 0; j < valid; ++j)
      if (rank(t, kth, row[j]) == Rank::before) kth = row[j];
  for (std::size_t i = 0; i < e; ++i) {
    const auto ii = static_cast<std::int32_t>(i);
    if (std::find(row, row + valid, ii) != row + valid || !eligible(t, i)) continue;
    if (valid < idx.cols || !may_precede(rank(t, kth, ii), t, kth, ii, score(t, kth), record)) {
      fail(*topk, fmt::format("t={}", t),
           valid < idx.cols
               ? fmt::format("eligible expert {} left out while slot {} is -1", i, valid)
               : fmt::format("unselected expert {} score {} outranks the K-th, expert {} score {}",
                             i, score(t, ii), kth, score(t, kth)),
           "no eligible unselected expert outranks the K-th");
      return false;
    }
  }
  return true;
}

// sorted and top-k property for a router whose eligible experts of row t
// are given by `eligible(t, i)`, ranked by `rank(t, a, b)`; `score(t, i)`
// names a score in messages and ties. With `parallel` (rank, score and
// eligible safe to call from several threads) and no judge list to fill,
// the rows are judged on the op's threads first, each under the caller's
// judge options, and the reporting pass starts at the first failing row.
template <class Ranking, class Score, class Eligible>
void order_rows_by(detail::Checker& c, const ClauseInfo& sorted, const ClauseInfo* topk,
                   MatView<const std::int32_t> idx, std::size_t e, Ranking rank, Score score,
                   Eligible eligible, bool parallel = false) {
  std::size_t first = 0;
  if (parallel && !judge::current().ties) {
    const judge::Options options = judge::current();
    // A row reads its K slots for each of its e scores.
    first = detail::first_failing(idx.rows, e * (idx.cols + 1), [&](std::size_t t) {
      const judge::Scope scope(options);
      return order_row(t, sorted, topk, idx, e, rank, score, eligible, false,
                       [](const ClauseInfo&, std::string, std::string, std::string) {});
    });
  }
  for (std::size_t t = first; t < idx.rows; ++t)
    if (!order_row(t, sorted, topk, idx, e, rank, score, eligible, true,
                   [&](const ClauseInfo& clause, std::string loc, std::string obs,
                       std::string exp) { c.fail(clause, loc, obs, exp); }))
      return;
}

// order_rows_by for scores the implementation takes as given (exact): a
// tie only where they are equal.
template <class Score, class Eligible>
void order_rows(detail::Checker& c, const ClauseInfo& sorted, const ClauseInfo* topk,
                MatView<const std::int32_t> idx, std::size_t e, Score score, Eligible eligible) {
  auto rank = [&](std::size_t t, std::int32_t a, std::int32_t b) {
    const auto sa = score(t, a), sb = score(t, b);
    if (sa == sb) return a < b ? Rank::before : Rank::tie;
    return ranks_before(sa, a, sb, b) ? Rank::before : Rank::after;
  };
  order_rows_by(c, sorted, topk, idx, e, rank, score, eligible, true);
}

// Weights of a row: each within [0, hi] (0 at -1 slots); their sum within
// [lo_sum, hi_sum]. Rows with an id outside [-1, e) are skipped.
inline void weight_rows(detail::Checker& c, const ClauseInfo& clause,
                        MatView<const std::int32_t> idx, std::size_t e, MatView<const float> w,
                        double hi, double lo_sum, double hi_sum) {
  // Stored in a narrower type (judge::stored; 0 for fp32): each weight
  // within its rounding of the range, the sum within the K roundings.
  hi += judge::stored(hi, 0);
  const double slack = judge::stored(hi_sum, 0) + double(w.cols) * judge::current().output_tiny;
  if (lo_sum > 0) lo_sum -= slack;
  hi_sum += slack;
  auto row = [&](std::size_t t, auto&& fail) {
    if (!row_in_range(idx, t, e, false)) return true;
    double sum = 0;
    for (std::size_t j = 0; j < w.cols; ++j) {
      const float v = w(t, j);
      if (!(v >= 0 && v <= hi) || (idx(t, j) < 0 && v != 0)) {
        fail(fmt::format("t={} j={}", t, j), fmt::format("w={} (idx {})", v, idx(t, j)),
             idx(t, j) < 0 ? "0 at a -1 slot" : fmt::format("0 <= w <= {}", hi));
        return false;
      }
      sum += v;
    }
    if (sum >= lo_sum && sum <= hi_sum) return true;
    fail(fmt::format("t={}", t), fmt::format("sum w = {:.9g}", sum),
         fmt::format("in [{:.9g}, {:.9g}]", lo_sum, hi_sum));
    return false;
  };
  detail::report_first_failing_row(
      w.rows, w.cols, row,
      [&](std::string loc, std::string obs, std::string exp) { c.fail(clause, loc, obs, exp); });
}

// Every value of each row within its bound of the binary64 reference, plus
// that reference's own rounding: row(t) gives the row's reference values and
// bounds (the bounds::*_row helpers), value(t, i) the kernel's and name(i) its
// label; `section` is the bound's place in proofs/router.md. finite_only
// leaves non-finite values to the finite clauses (gradients that overflow).
// Rows with an index out of range are skipped (the index clauses report them).
template <class Row, class Value, class Name>
void within_reference(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx,
                      std::size_t experts, std::size_t cols, bool finite_only, const char* section,
                      Row row, Value value, Name name) {
  for (std::size_t t = 0; t < idx.rows; ++t) {
    if (!row_in_range(idx, t, experts)) continue;
    const auto [ref, bound] = row(t);
    for (std::size_t i = 0; i < cols; ++i) {
      const double got = value(t, i);
      const double e = judge::stored(std::fabs(ref[i]), bound[i]);
      if ((finite_only && !std::isfinite(got)) ||
          std::fabs(got - ref[i]) <= e + bounds::gamma(64, bounds::kU64) * std::fabs(ref[i]))
        continue;
      c.fail(clause, fmt::format("t={} {}", t, name(i)),
             fmt::format("{}={:.9g} ref={:.17g}", name(i), got, ref[i]),
             fmt::format("|{} - ref| <= {:.3g} (proofs/router.md {})", name(i), e, section));
      return;
    }
  }
}

// Every weight within §3 of its own slot's reference (a weight written to
// another slot passes weights_range, not this).
template <class Row>
void weights_within(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx,
                    std::size_t experts, MatView<const float> w, Row row) {
  within_reference(
      c, clause, idx, experts, idx.cols, false, "§3", row,
      [&](std::size_t t, std::size_t j) { return w(t, j); },
      [](std::size_t j) { return fmt::format("w[{}]", j); });
}

// Every finite gradient of a row within §4 of the reference given g.
template <class Row, class Value, class Name>
void grads_within(detail::Checker& c, const ClauseInfo& clause, MatView<const std::int32_t> idx,
                  std::size_t experts, std::size_t cols, Row row, Value value, Name name) {
  within_reference(c, clause, idx, experts, cols, true, "§4", row, value, name);
}

// sigma(z) is a normal float for z >= -87 (e^-87 > 2^-126); below, it
// underflows, and a row of such logits has no weights (0 / 0; router_fuzzer).
inline bool sigmoid_logit_ok(float z) { return std::isfinite(z) && z >= -87.0f; }

// Finite and |v| <= 2^126: a sum or difference of two such values stays
// below the fp32 maximum. Product-key scores (sx + sy) and the backwards'
// gradients (g - sum_S w g with w summing to at most 1; proofs/router.md §4
// assumes no overflow, router_fuzzer finding 7).
inline bool within_2p126(float v) { return std::isfinite(v) && std::fabs(v) <= 0x1p126f; }
inline constexpr std::string_view kGradExpected = "finite, |g| <= 2^126";

// The preconditions the dense router backwards share: shapes, slot indices,
// finite g and acceptable z, dz disjoint from every input. (Clauses as
// template arguments keep MOECERT_CONTRACT's compile-time cap.)
template <const ClauseInfo& kShape, const ClauseInfo& kIdx, const ClauseInfo& kFinite,
          const ClauseInfo& kAlias, class ZOk>
void dense_backward_pre(detail::Checker& c, MatView<const float> z, MatView<const std::int32_t> idx,
                        MatView<const float> g, MatView<float> dz, ZOk z_ok,
                        std::string_view z_expected) {
  MOECERT_CONTRACT(c, kShape) {
    if (idx.rows != z.rows || g.rows != z.rows || g.cols != idx.cols || dz.rows != z.rows ||
        dz.cols != z.cols || idx.cols < 1)
      c.fail(kShape, "",
             fmt::format("{}, {}, {}, {}", shape_of("z", z.rows, z.cols),
                         shape_of("idx", idx.rows, idx.cols), shape_of("g", g.rows, g.cols),
                         shape_of("dz", dz.rows, dz.cols)),
             "z, dz T x E; idx, g T x K");
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, kIdx) { index_rows(c, kIdx, kIdx, idx, z.cols, true, true, true); }
  MOECERT_CONTRACT(c, kFinite) {
    detail::scan(c, kFinite, "g", g, within_2p126, kGradExpected) &&
        detail::scan(c, kFinite, "z", z, z_ok, z_expected);
  }
  MOECERT_CONTRACT(c, kAlias) {
    for (const auto& in : {std::pair<const char*, ByteRange>{"z", z.bytes()},
                           {"idx", idx.bytes()},
                           {"g", g.bytes()}})
      disjoint(c, kAlias, {{"dz", dz.bytes()}, in});
  }
}

}  // namespace moecert::contracts::router_detail
