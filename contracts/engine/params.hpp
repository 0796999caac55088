// Named text parameters (the judge's NAME=VALUE params), read with messages
// naming them; and the views the judge's preconditions take.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <cstddef>
#include <map>
#include <stdexcept>
#include <string>

#include "moecert/types.hpp"

namespace moecert::contracts {

using Params = std::map<std::string, std::string>;

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

}  // namespace moecert::contracts
