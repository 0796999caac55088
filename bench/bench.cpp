// Timing and data helpers shared by the benchmark cases.
#include "bench/bench.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <numeric>
#include <random>

namespace moecert::bench {

namespace {
// One call of f, in ms.
double elapsed_ms(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

std::vector<double> time_ms(int reps, const std::function<void()>& f) {
  f();  // warm-up: first-touch pages, caches, thread pools
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) ms.push_back(elapsed_ms(f));
  return ms;
}

namespace {

constexpr std::chrono::milliseconds kSettle{20};

// One timed run of h after untimed runs of it for at least kSettle: the
// other side's threads keep spinning after their last parallel region
// (oneDNN's OpenMP pool for milliseconds) and its data fills the caches.
// Sleeping instead lets the host idle the cores, and the next run pays for
// waking them (measured here: 2-10x slower runs).
double settled_ms(const std::function<void()>& h) {
  const auto settled = std::chrono::steady_clock::now() + kSettle;
  do h();
  while (std::chrono::steady_clock::now() < settled);
  return elapsed_ms(h);
}

// The clauses' times per op call from seconds summed over `calls` calls,
// costliest first.
std::vector<ClauseTime> per_call(const std::map<std::string, double>& seconds, std::size_t calls) {
  std::vector<ClauseTime> out;
  for (const auto& [id, s] : seconds) out.push_back({id, 1e3 * s / static_cast<double>(calls)});
  std::sort(out.begin(), out.end(),
            [](const ClauseTime& a, const ClauseTime& b) { return a.ms_per_call > b.ms_per_call; });
  return out;
}

// moecert at off and at each requested level, in alternation; the clauses'
// own times summed over every call at a level after one warm-up call
// (settling calls included).
void time_contract_levels(const Options& opt, const std::function<void()>& f, Result& r) {
  std::vector<std::map<std::string, double>> seconds(opt.contracts.size());
  std::vector<std::size_t> calls(opt.contracts.size());
  auto at = [&](std::size_t l) {
    return [&, l] {
      ContractScope scope{l < opt.contracts.size() ? opt.contracts[l] : Level::off};
      if (l == opt.contracts.size()) return f();
      reset_clause_counts();
      f();
      ++calls[l];
      for (const auto& c : clause_counts()) seconds[l][c.id] += c.seconds;
    };
  };
  r.ms.clear(), r.peer_ms.clear(), r.contracts.clear();
  for (const Level level : opt.contracts) {
    ContractRuns c;
    c.level = level;
    r.contracts.push_back(c);
  }
  for (std::size_t l = 0; l < opt.contracts.size(); ++l) {
    at(l)();  // warm-up: the first poison of the arena's padding pages faults them in
    seconds[l].clear(), calls[l] = 0;
  }
  std::vector<std::vector<double>> ratio(opt.contracts.size());
  for (int i = 0; i < opt.reps; ++i) {
    r.ms.push_back(settled_ms(at(opt.contracts.size())));
    for (std::size_t l = 0; l < opt.contracts.size(); ++l) {
      r.contracts[l].ms.push_back(settled_ms(at(l)));
      ratio[l].push_back(r.contracts[l].ms.back() / r.ms.back());
    }
  }
  r.median_ms = median(r.ms);
  for (std::size_t l = 0; l < opt.contracts.size(); ++l)
    r.contracts[l].median_ms = median(r.contracts[l].ms),
    r.contracts[l].overhead = median(ratio[l]) - 1,
    r.contracts[l].clauses = per_call(seconds[l], calls[l]);
}

}  // namespace

void forward_for_backward(const Options& opt, const std::function<void()>& fwd) {
  if (opt.contracts.empty()) return fwd();
  const ContractScope scope{*std::max_element(opt.contracts.begin(), opt.contracts.end())};
  fwd();
}

void time_against_peer(const Options& opt, const std::function<void()>& f,
                       const std::function<void()>& g, Result& r) {
  if (!opt.contracts.empty()) return time_contract_levels(opt, f, r);
  if (!g) {
    r.ms = time_ms(opt.reps, f);
    r.median_ms = median(r.ms);
    return;
  }
  r.ms.clear(), r.peer_ms.clear();
  std::vector<double> ratio;
  for (int i = 0; i < opt.reps; ++i) {
    r.ms.push_back(settled_ms(f));
    r.peer_ms.push_back(settled_ms(g));
    ratio.push_back(r.peer_ms.back() / r.ms.back());
  }
  r.median_ms = median(r.ms);
  r.peer_median_ms = median(r.peer_ms);
  r.paired_speedup = median(ratio);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Uniform values (fill_uniform, fast at these sizes): x by 1.7, the weights
// and LoRA A factors by 1.7/sqrt(fan-in), the LoRA B factors by 0.1; W_r
// N(0, 1/H), b 0, dy N(0, 1).
fixture::LayerProblem layer_problem(const Shape& s) {
  auto i64 = [](std::size_t v) { return static_cast<std::int64_t>(v); };
  fixture::LayerProblem d = fixture::LayerProblem::shaped({.experts = i64(s.e),
                                                           .hidden = i64(s.h),
                                                           .inter = i64(s.i),
                                                           .topk = i64(s.k),
                                                           .lora_rank = i64(s.r),
                                                           .lora_alpha = 16.0,
                                                           .max_tokens = i64(s.t)},
                                                          s.t);
  d.bias.clear();  // softmax_topk: no selection bias
  const float sh = 1.7f / std::sqrt(float(s.h)), si = 1.7f / std::sqrt(float(s.i));
  fill_uniform(d.x, 11, 1.7f);
  fill_uniform(d.wg, 12, sh), fill_uniform(d.wu, 13, sh), fill_uniform(d.wd, 14, si);
  fill_uniform(d.lora[0], 15, sh), fill_uniform(d.lora[2], 16, sh), fill_uniform(d.lora[4], 17, si);
  fill_uniform(d.lora[1], 18, 0.1f), fill_uniform(d.lora[3], 19, 0.1f),
      fill_uniform(d.lora[5], 20, 0.1f);
  std::mt19937_64 rng(21);
  std::normal_distribution<float> nd(0, 1);
  for (auto& v : d.wr) v = nd(rng) / std::sqrt(float(s.h));
  for (auto& v : d.dy) v = nd(rng);
  d.pack();
  return d;
}

void uniform_routing(const Shape& s, std::vector<std::int32_t>& idx, std::vector<float>& w) {
  idx.assign(s.t * s.k, 0), w.assign(s.t * s.k, 0.0f);
  std::vector<std::int32_t> perm(s.e);
  std::mt19937_64 rng(23);
  std::iota(perm.begin(), perm.end(), 0);
  for (std::size_t t = 0; t < s.t; ++t)
    for (std::size_t j = 0; j < s.k; ++j) {
      std::swap(perm[j], perm[j + rng() % (s.e - j)]);
      idx[t * s.k + j] = perm[j], w[t * s.k + j] = std::uniform_real_distribution<float>(0, 1)(rng);
    }
}

Difference difference(const std::vector<float>& ours, const std::vector<float>& peer) {
  Difference d;
  for (std::size_t q = 0; q < ours.size(); ++q) {
    d.max_diff = std::max(d.max_diff, double(std::fabs(ours[q] - peer[q])));
    d.max_abs = std::max(d.max_abs, double(std::fabs(peer[q])));
  }
  return d;
}

}  // namespace moecert::bench
