// Argument reading for the moecert subcommands.
#include "tools/cli.hpp"

#include <fmt/format.h>

namespace moecert::tools {

Args::Args(int argc, char** argv, std::set<std::string> options, std::set<std::string> flags) {
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0)
      throw std::invalid_argument(fmt::format("unexpected argument '{}'", a));
    std::string name = a.substr(2), value;
    const auto eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (flags.count(name)) {
      if (inline_value) throw std::invalid_argument(fmt::format("--{} takes no value", name));
      flags_.insert(name);
    } else if (options.count(name)) {
      if (!inline_value) {
        if (i + 1 >= argc) throw std::invalid_argument(fmt::format("--{} needs a value", name));
        value = argv[++i];
      }
      values_.emplace(name, value);
    } else {
      throw std::invalid_argument(fmt::format("unknown option --{}", name));
    }
  }
}

std::optional<std::string> Args::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> Args::all(const std::string& name) const {
  std::vector<std::string> out;
  auto [lo, hi] = values_.equal_range(name);
  for (auto it = lo; it != hi; ++it) out.push_back(it->second);
  return out;
}

std::string Args::get_or(const std::string& name, std::string fallback) const {
  auto v = get(name);
  return v ? *v : fallback;
}

long long Args::get_int(const std::string& name, long long fallback) const {
  auto v = get(name);
  if (!v) return fallback;
  try {
    std::size_t used = 0;
    long long n = std::stoll(*v, &used);
    if (used != v->size()) throw std::invalid_argument("");
    return n;
  } catch (const std::exception&) {
    throw std::invalid_argument(fmt::format("--{}: expected an integer, got '{}'", name, *v));
  }
}

}  // namespace moecert::tools
