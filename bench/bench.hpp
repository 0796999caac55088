// Benchmark cases for `moecert bench`: moecert against a peer in the same
// process, on the same data and thread count, the two run in alternation;
// medians of repeated runs and of the runs' paired ratios.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecert/contracts.hpp"
#include "moecert/types.hpp"
#include "support/layer_problem.hpp"

namespace moecert::bench {

/// A peer that this CPU's oneDNN cannot build (oneDNN 2.6 has no bf16
/// matmul without AVX-512): `moecert bench` reports the case as skipped.
struct PeerUnavailable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Shape {
  std::size_t e = 0, h = 0, i = 0, k = 0, r = 0, t = 0;
};

struct Options {
  int threads = 1;
  Isa isa = Isa::scalar;
  int reps = 5;  // timed runs per side (after one warm-up)
  /// Contract levels to time moecert at against `off`, in alternation,
  /// instead of the peer (`moecert bench --contracts LEVEL...`).
  std::vector<Level> contracts;
};

/// One clause's mean wall time per op call at one level.
struct ClauseTime {
  std::string id;
  double ms_per_call = 0;
};

/// moecert's runs at one contract level, against its runs at `off`.
struct ContractRuns {
  Level level = Level::off;
  std::vector<double> ms;  // run i follows off's run i
  double median_ms = 0;
  double overhead = 0;              // median over i of ms[i] / off_ms[i], minus 1
  std::vector<ClauseTime> clauses;  // every clause timed at this level, costliest first
};

struct Result {
  std::string name, op, isa, peer;
  Shape shape;
  int threads = 0;
  double flops = 0;  // per run
  double median_ms = 0, peer_median_ms = 0;
  std::vector<double> ms,
      peer_ms;                // every timed run; with a live peer, run i of each side back to back
  double paired_speedup = 0;  // live peer: median over i of peer_ms[i] / ms[i]
  std::string recorded_peer;  // a peer not run here, whose time was recorded elsewhere
  double recorded_peer_ms = 0;
  std::string skipped;  // reason, when the case could not run here
  std::string note;
  std::vector<ContractRuns> contracts;  // --contracts: ms, median_ms are moecert's at off; no peer
};

struct Case {
  std::string name;
  std::string op;
  Shape shape;
  std::size_t bytes_needed;  // host memory the case allocates (both sides)
  std::function<Result(const Options&)> run;
};

/// Every registered case.
std::vector<Case> all_cases();
void add_layer_cases(std::vector<Case>& out);   // bench/layer_bench.cpp
void add_format_cases(std::vector<Case>& out);  // bench/formats_bench.cpp

/// `reps` timed calls of f (after one untimed warm-up), in ms.
std::vector<double> time_ms(int reps, const std::function<void()>& f);
/// Runs the forward a backward case times its backward on: with
/// opt.contracts, at the highest of those levels, as a training step at that
/// level runs it (its saved state then holds what an audited forward
/// records for the backward: the c1 digests of saved_intact); else at
/// the level in force.
void forward_for_backward(const Options& opt, const std::function<void()>& fwd);

/// Times f and a peer g in alternation (each timed run after untimed runs
/// of the same side for at least 20 ms), so that run i of both sides
/// meets the same moment of a shared machine; fills r.ms, r.peer_ms, the
/// medians and r.paired_speedup. With opt.contracts, times f at `off` and
/// at each of those levels in the same alternation instead (g is not run)
/// and fills r.ms, r.median_ms and r.contracts. g may be empty (no peer).
void time_against_peer(const Options& opt, const std::function<void()>& f,
                       const std::function<void()>& g, Result& r);
double median(std::vector<double> v);
/// The layer and experts cases' problem of shape s, packed: uniform values
/// (fill_uniform, fast at these sizes), x by 1.7, the weights and LoRA A
/// factors by 1.7/sqrt(fan-in), the LoRA B factors by 0.1; W_r N(0, 1/H),
/// b 0, dy N(0, 1).
fixture::LayerProblem layer_problem(const Shape& s);
/// The experts op's routing in the experts cases: K distinct experts per
/// token, uniform (seed 23); weights uniform in [0, 1).
void uniform_routing(const Shape& s, std::vector<std::int32_t>& idx, std::vector<float>& w);

/// How far moecert's output is from the peer's: the largest |ours - peer|
/// and the largest |peer| over the elements.
struct Difference {
  double max_diff = 0, max_abs = 0;
};
Difference difference(const std::vector<float>& ours, const std::vector<float>& peer);

using fixture::fill_uniform;  // (support/layer_problem.hpp)

}  // namespace moecert::bench
