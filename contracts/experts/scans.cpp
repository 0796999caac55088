// The clauses of experts.forward_train, experts.backward and the layer
// that are judged inside the op's own passes, on data still in the cache of
// the thread that just read or wrote it: lora_finite and lora_padding as the
// factors are packed, saved_finite and saved_intact as the saved rows are
// read, grad_finite as the gradients are written
// (contracts/experts/train.hpp).
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <mutex>

#include "contracts/engine/checks.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/probes/verify.hpp"

namespace moecert::detail {

// The largest magnitude's bits over the block, in 16 lanes (one vector in
// the avx512f clone, two in avx2) and judged once: +-inf and NaN are the
// bit patterns from 0x7f800000 up.
MOECERT_CLONES
bool rows_finite(const float* p, std::size_t ld, std::size_t rows, std::size_t cols) {
  constexpr std::size_t kLanes = 16;
  std::uint32_t lanes[kLanes] = {}, most = 0;
  const std::size_t body = cols / kLanes * kLanes;
  for (std::size_t i = 0; i < rows; ++i, p += ld) {
    for (std::size_t k = 0; k < body; k += kLanes)
      for (std::size_t j = 0; j < kLanes; ++j)
        lanes[j] = std::max(lanes[j], std::bit_cast<std::uint32_t>(p[k + j]) & 0x7fffffffu);
    for (std::size_t k = body; k < cols; ++k)
      most = std::max(most, std::bit_cast<std::uint32_t>(p[k]) & 0x7fffffffu);
  }
  for (const std::uint32_t lane : lanes) most = std::max(most, lane);
  return most < 0x7f800000u;
}

}  // namespace moecert::detail

namespace moecert::contracts {

namespace {

// first = min(first, v), from any thread.
void keep_least(std::atomic<std::size_t>& first, std::size_t v) {
  for (std::size_t seen = first; v < seen && !first.compare_exchange_weak(seen, v);) {
  }
}

// Whether every element of [p, p + n) is +-0: the bits OR-ed, the sign
// masked off once (one OR per vector).
bool zero_run(const bf16* p, std::size_t n) {
  std::uint16_t acc = 0;
  for (std::size_t i = 0; i < n; ++i) acc |= p[i].bits;
  return (acc & 0x7fffu) == 0;
}

// Whether every depth-padding element of w (k >= K) of each panel that holds
// a column n < N is +-0, read in storage order: the judge's statement of
// PackedWeights' layout (include/moecert/gemm.hpp): 16-column panels kp
// deep in VNNI pairs, W[n][k] at (n / 16) kp 16 + (k / 2) 32 + (n % 16) 2 +
// k % 2. The runs: the pairs past K and an odd K's last odd elements. The
// columns past N are not judged: the GEMM loops compute them into a
// scratch block and never store them (ops/gemm/loops.cpp, edge_block), so
// they reach no result; depth padding does (NaN * 0 is NaN).
bool padding_zero(const gemm::PackedWeights& w) {
  constexpr std::size_t P = gemm::PackedWeights::kPanel;
  const std::size_t N = w.n(), K = w.k(), kp = w.kp(), pairs = (K + 1) / 2;
  for (std::size_t p = 0; p * P < N; ++p) {
    const bf16* panel = w.data() + p * kp * P;
    if (!zero_run(panel + pairs * 2 * P, (kp / 2 - pairs) * 2 * P)) return false;
    for (std::size_t col = 0; K % 2 && col < P; ++col)
      if (!zero_run(&panel[(K / 2) * 2 * P + col * 2 + 1], 1)) return false;
  }
  return true;
}

// Fails `clause` at f's first nonzero padding element, named by (n, k).
void fail_padding(detail::Checker& c, const ClauseInfo& clause, const PackedFactor& f) {
  const gemm::PackedWeights& w = *f.packed;
  constexpr std::size_t P = gemm::PackedWeights::kPanel;
  for (std::size_t n = 0; n / P * P < w.n(); ++n)
    for (std::size_t kk = w.k(); kk < w.kp(); ++kk)
      if (w.at(n, kk).bits & 0x7fff) {
        c.fail(clause, fmt::format("expert {} {} ({}, {})", f.expert, f.name, n, kk),
               fmt::format("{}", w.at(n, kk).to_float()), "0 (rank padding)");
        return;
      }
}

}  // namespace

void lora_padding(detail::Checker& c, const ClauseInfo& clause,
                  std::span<const PackedFactor> factors) {
  // The first factor with a nonzero padding element, found on the op's
  // threads in storage order, then its first such element named.
  const std::size_t work = factors.empty() ? 0 : factors[0].packed->size();
  const std::size_t i = detail::first_failing(factors.size(), work, [&](std::size_t f) {
    return !factors[f].packed->data() || padding_zero(*factors[f].packed);
  });
  if (i < factors.size()) fail_padding(c, clause, factors[i]);
}

LoraFiniteScan::LoraFiniteScan(const experts::Lora& l, std::size_t experts, bool range_on)
    : lora_(l), experts_(experts), range_on_(range_on) {
  for (auto& f : first_finite_) f = SIZE_MAX;
  for (auto& f : first_range_) f = SIZE_MAX;
}

void LoraFiniteScan::expert(std::size_t e) {
  const detail::SampledTimer timer(ns_, 1);
  for (std::size_t i = 0; i < 6; ++i) {
    const MatView<const bf16> v = lora_views(lora_)[i];
    const std::size_t per = v.rows / experts_;
    const MatView<const bf16> rows(v.row(e * per), per, v.cols, v.stride);
    const auto first = [&](std::atomic<std::size_t>& into, std::size_t at) {
      if (at < per * v.cols) keep_least(into, (e * per + at / v.cols) * v.cols + at % v.cols);
    };
    first(first_finite_[i],
          detail::first_failing_element(rows, [](bf16 x) { return detail::finite_bits(x); }));
    if (range_on_)
      first(first_range_[i],
            detail::first_failing_element(rows, [](bf16 x) { return detail::bf16_in_range(x); }));
  }
}

bool LoraFiniteScan::fail_first(detail::Checker& c, const ClauseInfo& clause,
                                const std::array<std::atomic<std::size_t>, 6>& first,
                                std::string_view expected) {
  const auto names = lora_shapes(0, 0, 0, 0);
  for (std::size_t i = 0; i < 6; ++i) {
    if (first[i] == SIZE_MAX) continue;
    const MatView<const bf16> v = lora_views(lora_)[i];
    const std::size_t row = first[i] / v.cols, col = first[i] % v.cols;
    c.fail(clause, fmt::format("lora.{}[{}, {}]", names[i].name, row, col),
           fmt::format("lora.{}={}", names[i].name, static_cast<double>(v(row, col).to_float())),
           std::string(expected));
    return true;
  }
  return false;
}

void LoraFiniteScan::report(detail::Checker& c, const ClauseInfo& finite, const ClauseInfo& range) {
  const double seconds = static_cast<double>(ns_.load()) * 1e-9;
  detail::add_clause_seconds(finite, range_on_ ? seconds / 2 : seconds);
  if (range_on_) detail::add_clause_seconds(range, seconds / 2);
  if (fail_first(c, finite, first_finite_, "finite") || c.stop() || !range_on_) return;
  fail_first(c, range, first_range_, "0 or 2^-60 <= |a| <= 2^60");
}

void LoraPaddingScan::expert(std::span<const PackedFactor, 8> factors) {
  const detail::SampledTimer timer(ns_, 1);
  for (const PackedFactor& f : factors)
    if (f.packed->data() && !padding_zero(*f.packed)) {
      std::lock_guard lock(mu_);
      if (!first_ || f.expert < first_->expert) first_ = f;
      break;
    }
}

void LoraPaddingScan::report(detail::Checker& c, const ClauseInfo& clause) {
  detail::add_clause_seconds(clause, static_cast<double>(ns_.load()) * 1e-9);
  if (first_) fail_padding(c, clause, *first_);
}

namespace {

// Whether every saved value of grouped row `row` that the backward reads is
// finite (padding rows hold none; c1's row only `with_c1`, h's only
// `with_h`): contiguous runs, scanned by detail::all_of. c1's gate and up
// columns of the full 16-column panels are one run; h is row-major or in
// tiles of k_step-element row pieces.
bool saved_row_finite(const ExpertRows& st, std::size_t I, std::size_t row, bool with_c1,
                      bool with_h) {
  constexpr std::size_t P = gemm::PackedWeights::kPanel;
  auto finite = [](auto v) { return detail::finite_bits(v); };
  if (st.grouping.row_slot[row] < 0) return true;
  const float* c1 = st.c1 + row * st.ldc1;
  const std::size_t full = I / P * P, tail = I - full;
  if (with_c1 &&
      (!detail::all_of(c1, 2 * full, finite) || !detail::all_of(c1 + 2 * full, tail, finite) ||
       !detail::all_of(c1 + 2 * full + P, tail, finite)))
    return false;
  bool h_ok = true;
  if (with_h)
    st.h.runs(row, I, [&](std::size_t, const bf16* p, std::size_t n) {
      h_ok = h_ok && detail::all_of(p, n, finite);
    });
  const std::size_t r = st.rank;
  return h_ok && detail::all_of(st.xa + row * 2 * r, 2 * r, finite) &&
         detail::all_of(st.ha + row * r, r, finite);
}

// Whether every saved value is finite, judged by each expert's contiguous
// regions in memory order: h's rows (its tiles whole; row-major, each row's
// I values), xa's and ha's routed rows and, `with_c1`, c1's. The regions
// also hold values the backward does not read (h's padding, c1's padding
// columns; zero when the forward is right), so false only sends the caller
// to the row scan, which decides.
bool saved_regions_finite(const ExpertRows& st, std::size_t I, bool with_c1) {
  const GroupingView& g = st.grouping;
  const std::size_t r = st.rank, tile = st.h.tile_rows;
  auto finite = [](auto v) { return detail::finite_bits(v); };
  auto h_finite = [&](std::size_t r0, std::size_t r1) {
    if (tile)
      return detail::all_of(st.h.data + r0 / tile * st.h.ld,
                            ((r1 + tile - 1) / tile - r0 / tile) * st.h.ld, finite);
    for (std::size_t row = r0; row < r1; ++row)
      if (!detail::all_of(st.h.data + row * st.h.ld, I, finite)) return false;
    return true;
  };
  auto expert = [&](std::size_t e) {
    const std::size_t r0 = g.begin[e], r1 = r0 + g.count[e];
    return r0 == r1 ||
           (h_finite(r0, r1) && detail::all_of(st.xa + r0 * 2 * r, (r1 - r0) * 2 * r, finite) &&
            detail::all_of(st.ha + r0 * r, (r1 - r0) * r, finite) &&
            (!with_c1 || detail::all_of(st.c1 + r0 * st.ldc1, (r1 - r0) * st.ldc1, finite)));
  };
  const std::size_t per_row = I + 3 * r + (with_c1 ? st.ldc1 : 0);
  return detail::first_failing(g.experts, g.rows() / std::max<std::size_t>(1, g.experts) * per_row,
                               [&](std::size_t e) { return expert(e); }) == g.experts;
}

// The routing copy and the router logits: finite, idx in range (false:
// `clause` failed).
bool saved_routing_finite(detail::Checker& c, const ClauseInfo& clause, const TrainSaved& s,
                          const float* logits, std::size_t R) {
  const std::size_t T = s.tokens, K = s.topk;
  auto fail = [&](const char* buffer, std::size_t row, std::size_t col, double v) {
    c.fail(clause, fmt::format("{} row {} col {}", buffer, row, col), fmt::format("{}", v),
           "finite (saved by the forward)");
    return false;
  };
  auto finite = [](float v) { return detail::finite_bits(v); };
  if (logits) {
    const std::size_t at =
        detail::first_failing_element(MatView<const float>(logits, T, R, R), finite);
    if (at < T * R) return fail("router.logits", at / R, at % R, logits[at]);
  }
  for (std::size_t i = 0; i < T * K; ++i)
    if (!std::isfinite(s.weights[i])) return fail("router.weights", i / K, i % K, s.weights[i]);
  for (std::size_t i = 0; i < T * K; ++i)
    if (s.idx[i] < -1 || s.idx[i] >= static_cast<std::int64_t>(s.rows.grouping.experts))
      return fail("router.idx", i / K, i % K, s.idx[i]);
  return true;
}

// Fails `clause` at grouped row `row`'s first non-finite saved value.
void fail_saved_row(detail::Checker& c, const ClauseInfo& clause, const ExpertRows& st,
                    std::size_t I, std::size_t row) {
  auto fail = [&](const char* buffer, std::size_t col, double v) {
    c.fail(clause, fmt::format("{} row {} col {}", buffer, row, col), fmt::format("{}", v),
           "finite (saved by the forward)");
  };
  constexpr std::size_t P = gemm::PackedWeights::kPanel;
  const std::size_t r = st.rank;
  for (std::size_t i = 0; i < I; ++i) {
    for (const std::size_t col : {2 * P * (i / P) + i % P, 2 * P * (i / P) + i % P + P})
      if (!std::isfinite(st.c1[row * st.ldc1 + col]))
        return fail("experts.c1", col, st.c1[row * st.ldc1 + col]);
    if (!std::isfinite(st.h.at(row, i).to_float()))
      return fail("experts.h", i, st.h.at(row, i).to_float());
  }
  for (std::size_t kk = 0; kk < 2 * r; ++kk)
    if (!std::isfinite(st.xa[row * 2 * r + kk]))
      return fail("lora.xa", kk, st.xa[row * 2 * r + kk]);
  for (std::size_t kk = 0; kk < r; ++kk)
    if (!std::isfinite(st.ha[row * r + kk])) return fail("lora.ha", kk, st.ha[row * r + kk]);
}

}  // namespace

bool train_saved_finite(detail::Checker& c, const ClauseInfo& clause, const TrainSaved& s,
                        std::size_t I, const float* logits, std::size_t R, bool with_c1) {
  // The saved state the backward reads, at the elements it reads (a NaN
  // here: read before write, or a co-live buffer overwrote it).
  if (!saved_routing_finite(c, clause, s, logits, R)) return false;
  // The first grouped row holding a non-finite saved value, found on the
  // op's threads, then its first such value named.
  const auto& st = s.rows;
  if (saved_regions_finite(st, I, with_c1)) return true;
  const std::size_t row = detail::first_failing(
      st.grouping.rows(), (with_c1 ? 3 : 1) * I + 3 * st.rank,
      [&](std::size_t i) { return saved_row_finite(st, I, i, with_c1, true); });
  if (row == st.grouping.rows()) return true;
  fail_saved_row(c, clause, st, I, row);
  return false;
}

SavedFiniteScan::SavedFiniteScan(detail::Checker& c, const ClauseInfo& clause, const TrainSaved& s,
                                 std::size_t I, const float* logits, std::size_t R)
    : c_(c), clause_(clause), s_(s), inter_(I), router_out_(R), logits_(logits) {}

void SavedFiniteScan::begin() {
  const detail::SampledTimer timer(ns_, 1);
  if (c_.level() < Level::audit) {
    saved_routing_finite(c_, clause_, s_, logits_, router_out_);
    return;
  }
  // At audit every saved row now, right after the first step's poison; c1
  // left to row() where saved_intact holds it to the forward's bits.
  const bool failed =
      !train_saved_finite(c_, clause_, s_, inter_, logits_, router_out_, !c1_intact_);
  reported_ = failed || !c1_intact_;  // a failure is the clause's one report
  h_judged_ = true;
}

void SavedFiniteScan::row(std::size_t q) {
  if (reported_) return;  // judged in full already
  const detail::SampledTimer timer(ns_);
  if (!saved_row_finite(s_.rows, inter_, q, true, !h_judged_))
    marked_.store(true, std::memory_order_relaxed);
}

void SavedFiniteScan::report() {
  const std::int64_t t0 = detail::now_ns();
  if (marked_ && !reported_) {
    reported_ = true;
    train_saved_finite(c_, clause_, s_, inter_, logits_, router_out_);
  }
  detail::add_clause_seconds(clause_,
                             static_cast<double>(ns_.exchange(0) + detail::now_ns() - t0) * 1e-9);
}

SavedIntactScan::SavedIntactScan(detail::Checker& c, const ClauseInfo& clause,
                                 const ExpertRows& rows)
    : c_(c),
      clause_(clause),
      rows_(rows),
      parts_(rows.grouping.rows() ? rows.c1_digests.size() / rows.grouping.rows() : 0) {
  MOECERT_ASSERT(rows.ldc1 % verify::detail::kBlockColumns == 0 &&
                 rows.c1_digests.size() == rows.grouping.rows() * parts_);
}

std::uint32_t SavedIntactScan::recorded(std::size_t q) const {
  const std::size_t rows = rows_.grouping.rows();
  std::uint32_t d = 0;  // mod 2^32
  for (std::size_t b = 0; b < parts_; ++b) d += rows_.c1_digests[b * rows + q];
  return d;
}

void SavedIntactScan::row(std::size_t q) {
  const detail::SampledTimer timer(ns_);
  std::uint32_t got = 0;
  verify::detail::row_digests(rows_.c1 + q * rows_.ldc1, rows_.ldc1, 1, rows_.ldc1, &got);
  if (got != recorded(q)) keep_least(first_, q);
}

void SavedIntactScan::report() {
  detail::add_clause_seconds(clause_, static_cast<double>(ns_.exchange(0)) * 1e-9);
  const std::size_t q = first_.load();
  if (q == SIZE_MAX) return;
  std::uint32_t got = 0;
  verify::detail::row_digests(rows_.c1 + q * rows_.ldc1, rows_.ldc1, 1, rows_.ldc1, &got);
  c_.fail(clause_, fmt::format("experts.c1 row {}", q), fmt::format("digest {:#010x}", got),
          fmt::format("{:#010x}, as the forward wrote the row", recorded(q)));
}

std::vector<GradFiniteScan::Output> experts_grad_outputs(const experts::Gradients& g, std::size_t E,
                                                         std::size_t H, std::size_t I,
                                                         std::size_t r) {
  std::vector<GradFiniteScan::Output> out = {
      {"dx", g.dx}, {"dweights", g.dweights}, {"m_a", g.m_a}, {"m_g", g.m_g}};
  const auto names = grad_shapes(E, H, I, r);
  for (std::size_t i = 0; i < kWeightGrads; ++i)
    out.push_back({fmt::format("{} grad", names[i].name), weight_grads(g)[i]});
  return out;
}

GradFiniteScan::GradFiniteScan(std::vector<Output> outputs)
    : outs_(std::move(outputs)), state_(std::make_unique<State[]>(outs_.size())) {}

namespace {

// Whether block [r0, r1) x [c0, c1) of v is finite; whole rows of a dense
// view as one run (the LoRA B gradients' rows are r columns wide).
bool block_finite(const MatView<const float>& v, std::size_t r0, std::size_t r1, std::size_t c0,
                  std::size_t c1) {
  if (c0 == 0 && c1 == v.cols && v.stride == v.cols)
    return detail::rows_finite(v.row(r0), 0, 1, (r1 - r0) * v.cols);
  return detail::rows_finite(v.row(r0) + c0, v.stride, r1 - r0, c1 - c0);
}

// Block [r0, r1) x [c0, c1) of v judged: its first offender, row-major, into `first`.
void judge_block(const MatView<const float>& v, std::size_t r0, std::size_t r1, std::size_t c0,
                 std::size_t c1, std::atomic<std::size_t>& first) {
  if (block_finite(v, r0, r1, c0, c1)) return;
  std::size_t flat = SIZE_MAX;
  for (std::size_t i = r0; i < r1 && flat == SIZE_MAX; ++i)
    for (std::size_t j = c0; j < c1 && flat == SIZE_MAX; ++j)
      if (!detail::finite_bits(v(i, j))) flat = i * v.cols + j;
  keep_least(first, flat);
}

}  // namespace

void GradFiniteScan::written(const float* m, std::size_t r0, std::size_t r1, std::size_t c0,
                             std::size_t c1) {
  const detail::SampledTimer timer(ns_);
  for (std::size_t o = 0; o < outs_.size(); ++o) {
    const MatView<const float>& v = outs_[o].m;
    if (v.data != m || v.empty()) continue;
    judge_block(v, r0, r1, c0, c1, state_[o].first);
    state_[o].handed += (r1 - r0) * (c1 - c0);
    break;
  }
}

GradFiniteScan::Task::Task(GradFiniteScan* scan, const float* m) {
  if (!scan) return;
  for (std::size_t o = 0; o < scan->outs_.size(); ++o)
    if (scan->outs_[o].m.data == m && !scan->outs_[o].m.empty()) {
      scan_ = scan, out_ = o;
      return;
    }
}

GradFiniteScan::Task::~Task() {
  if (scan_) scan_->state_[out_].handed += handed_;
}

void GradFiniteScan::Task::add(std::size_t r0, std::size_t r1, std::size_t c0, std::size_t c1) {
  if (!scan_) return;
  const detail::SampledTimer timer(scan_->ns_);
  judge_block(scan_->outs_[out_].m, r0, r1, c0, c1, scan_->state_[out_].first);
  handed_ += (r1 - r0) * (c1 - c0);
}

void GradFiniteScan::reopen(const float* m) {
  for (std::size_t o = 0; o < outs_.size(); ++o)
    if (outs_[o].m.data == m) state_[o].handed = 0, state_[o].first = SIZE_MAX;
}

void GradFiniteScan::report(detail::Checker& c, const ClauseInfo& clause) {
  const std::int64_t t0 = detail::now_ns();
  for (std::size_t o = 0; o < outs_.size(); ++o) {
    const Output& out = outs_[o];
    const std::size_t n = out.m.rows * out.m.cols;
    if (n == 0) continue;
    if (state_[o].handed != n) {
      if (!detail::scan_finite(c, clause, out.name, out.m)) break;
      continue;
    }
    const std::size_t at = state_[o].first;
    if (at == SIZE_MAX) continue;
    const std::size_t i = at / out.m.cols, j = at % out.m.cols;
    c.fail(clause, fmt::format("{}[{}, {}]", out.name, i, j),
           fmt::format("{}={}", out.name, static_cast<double>(out.m(i, j))), "finite");
    break;
  }
  detail::add_clause_seconds(clause,
                             static_cast<double>(ns_.exchange(0) + detail::now_ns() - t0) * 1e-9);
}

}  // namespace moecert::contracts
