// What the judge's op runners share (contracts/judge/): tensors read
// by name as views, parameters parsed, and the runner type.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "contracts/engine/engine.hpp"
#include "contracts/engine/params.hpp"
#include "contracts/judge/ops.hpp"
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

}  // namespace moecert::contracts::judge
