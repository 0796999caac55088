// How the judge reads outputs it did not compute (`moecert check`): ties in
// any order, each one recorded, and the outputs' own storage rounding (bf16
// or fp16) added to every bound. moecert's own ops are judged with the
// defaults: the declared tie order (score descending, then expert index
// ascending; contracts/engine/order.hpp) and fp32 outputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moecert::contracts::judge {

/// Two experts of row t with equal scores (or, `near`, scores within the
/// implementation's own rounding of each other) whose order the
/// implementation chose: a before b (or a selected and b not) where the
/// declared order puts b first.
struct Tie {
  std::size_t t;
  std::int32_t a, b;
  double score;
  bool near = false;
};

/// One output's error as a whole: ||v - ref||_F / ||ref||_F, and the same
/// ratio for the worst-case bound and for the probabilistic bound of the
/// declared precision (NaN where not formed): how far the implementation
/// is against how far a correct one may be, and typically is.
struct ErrorSummary {
  std::string output;
  double relative_error, relative_worst, relative_probable;
};

struct Options {
  bool ties_any_order = false;
  // The slots of a row in any order: the selection is judged as a set, each
  // id with its own weight (`sorted` is evaluated only when declared).
  bool slots_any_order = false;
  double output_unit = 0;            // unit roundoff of the outputs' storage: 2^-8 bf16, 2^-11 fp16
  double output_tiny = 0;            // half its least denormal: 2^-134 bf16, 2^-25 fp16
  std::vector<Tie>* ties = nullptr;  // where ties are recorded, if anywhere
  // Rows a clause skipped because an index clause rejected their expert
  // ids (it would read scores through them), if recorded anywhere.
  std::vector<std::size_t>* skipped_rows = nullptr;
  std::vector<ErrorSummary>* errors = nullptr;  // where outputs' error summaries go, if anywhere
};

/// The calling thread's options (the router clauses run on it).
inline Options& current() {
  thread_local Options o;
  return o;
}

/// Sets the options for its lifetime, then restores the previous ones.
class Scope {
 public:
  explicit Scope(const Options& o) : saved_(current()) { current() = o; }
  ~Scope() { current() = saved_; }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Options saved_;
};

/// Whether a tie between a and b of row t is allowed; records it when so.
inline bool allow_tie(std::size_t t, std::int32_t a, std::int32_t b, double score) {
  Options& o = current();
  if (!o.ties_any_order) return false;
  if (o.ties) o.ties->push_back({t, a, b, score});
  return true;
}

/// Records a choice between a and b of row t whose scores are within the
/// implementation's own rounding of each other, where it differs from the
/// exact order (always allowed; recorded only when judging).
inline void record_near_tie(std::size_t t, std::int32_t a, std::int32_t b, double score) {
  Options& o = current();
  if (o.ties) o.ties->push_back({t, a, b, score, true});
}

/// Records that a clause skipped row t (its ids failed an index clause).
inline void skip_row(std::size_t t) {
  Options& o = current();
  if (o.skipped_rows && (o.skipped_rows->empty() || o.skipped_rows->back() != t))
    o.skipped_rows->push_back(t);
}

/// Bound e on a value with exact magnitude ref_abs, widened by the
/// outputs' storage rounding (proofs/bounds.md §2 with that unit).
inline double stored(double ref_abs, double e) {
  const Options& o = current();
  return o.output_unit ? e + o.output_unit * (ref_abs + e) + o.output_tiny : e;
}

}  // namespace moecert::contracts::judge
