// What the judge's op runners share (contracts/judge_*.cpp): tensors read
// by name as views, parameters parsed, and the runner type.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "contracts/engine.hpp"
#include "contracts/judge_ops.hpp"
#include "moecert/router.hpp"

namespace moecert::contracts::judge {

/// An op's clauses, pre then post, on the tensors (c: its checker).
using Run = std::function<void(detail::Checker& c, const Tensors& in, const Tensors& out,
                               const Params& params)>;

/// A judged op: its runner and the clause id prefixes its verdict lists
/// (and those that depend on its params, e.g. the layer's router).
struct OpEntry {
  Run run;
  std::vector<std::string> families;
  std::vector<std::string> (*families_for)(const Params&) = nullptr;
};
std::map<std::string, OpEntry> router_entries();
std::map<std::string, OpEntry> experts_entries();
std::map<std::string, OpEntry> layer_entries();

inline bool has(const Tensors& f, const std::string& name) { return f.count(name) != 0; }

inline const Tensor& need(const Tensors& f, const char* side, const std::string& name) {
  const auto it = f.find(name);
  if (it == f.end()) throw std::invalid_argument(fmt::format("{}: no tensor '{}'", side, name));
  return it->second;
}

inline MatView<const float> values(const Tensors& f, const char* side, const std::string& name) {
  const Tensor& t = need(f, side, name);
  if (t.f.size() != t.rows * t.cols)
    throw std::invalid_argument(
        fmt::format("{}: tensor '{}' holds indices, expected values", side, name));
  return {t.f.data(), t.rows, t.cols};
}

inline MatView<const std::int32_t> indices(const Tensors& f, const char* side,
                                           const std::string& name) {
  const Tensor& t = need(f, side, name);
  if (t.i.size() != t.rows * t.cols)
    throw std::invalid_argument(
        fmt::format("{}: tensor '{}' holds values, expected indices", side, name));
  return {t.i.data(), t.rows, t.cols};
}

/// A 1-D tensor (any shape of one row or one column) as a vector view.
inline View<const float> vector_of(const Tensors& f, const char* side, const std::string& name) {
  const auto m = values(f, side, name);
  if (m.rows != 1 && m.cols != 1)
    throw std::invalid_argument(fmt::format("{}: tensor '{}' is {}x{}, expected one dimension",
                                            side, name, m.rows, m.cols));
  return {m.data, m.rows * m.cols};
}

/// The preconditions take outputs as writable views; the judge never writes them.
template <class T>
MatView<T> writable(MatView<const T> v) {
  return {const_cast<T*>(v.data), v.rows, v.cols, v.stride};
}

inline bool flag_param(const Params& m, const std::string& name, bool def) {
  const auto it = m.find(name);
  if (it == m.end()) return def;
  if (it->second == "true" || it->second == "1") return true;
  if (it->second == "false" || it->second == "0") return false;
  throw std::invalid_argument(fmt::format("{}={}: expected true or false", name, it->second));
}

inline double number_param(const Params& m, const std::string& name, double def) {
  const auto it = m.find(name);
  if (it == m.end()) return def;
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != it->second.size())
    throw std::invalid_argument(fmt::format("{}={}: expected a number", name, it->second));
  return v;
}

inline std::size_t count_param(const Params& m, const std::string& name, std::size_t def) {
  const double v = number_param(m, name, static_cast<double>(def));
  if (!(v >= 1 && v <= 1e9 && v == std::floor(v)))
    throw std::invalid_argument(fmt::format("{}={}: expected a count >= 1", name, v));
  return static_cast<std::size_t>(v);
}

/// sigmoid_topk's params: groups (1), topk_group (1), scaling (1).
inline router::SigmoidTopkParams sigmoid_params(const Params& m) {
  return {count_param(m, "groups", 1), count_param(m, "topk_group", 1),
          static_cast<float>(number_param(m, "scaling", 1.0))};
}

/// product_key's weights: softmax (default), exp or raw.
inline router::KeyWeights key_weights(const Params& m) {
  const auto it = m.find("weights");
  if (it == m.end() || it->second == "softmax") return router::KeyWeights::softmax;
  if (it->second == "exp") return router::KeyWeights::exp;
  if (it->second == "raw") return router::KeyWeights::raw;
  throw std::invalid_argument(fmt::format("weights={}: expected softmax, exp or raw", it->second));
}

}  // namespace moecert::contracts::judge
