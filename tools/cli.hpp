// A small argument reader for the moecert subcommands: --name value,
// --name=value and boolean --flag; unknown options are refused.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace moecert::tools {

class Args {
 public:
  /// `options` take a value, `flags` do not; `multi` options may repeat.
  Args(int argc, char** argv, std::set<std::string> options, std::set<std::string> flags = {});

  std::optional<std::string> get(const std::string& name) const;
  std::vector<std::string> all(const std::string& name) const;
  std::string get_or(const std::string& name, std::string fallback) const;
  long long get_int(const std::string& name, long long fallback) const;
  bool flag(const std::string& name) const { return flags_.count(name) != 0; }

 private:
  std::multimap<std::string, std::string> values_;
  std::set<std::string> flags_;
};

}  // namespace moecert::tools
