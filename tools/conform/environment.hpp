// The environment fingerprint shared by `info`, `conform` and `bench`.
#pragma once

#include <boost/json.hpp>
#include <string>
#include <vector>

namespace moecert::tools {

struct Environment {
  std::string cpu_model;
  std::string cpu_vendor;
  std::vector<std::string> isa_detected;
  std::vector<std::string> isa_usable;
  std::string isa_default;
  std::string isa_used;  // what the run used (e.g. --isa), else the default
  int threads = 0;
  std::string compiler, flags, build_type, git_commit;
  std::string moecert_version, fmt_version, tbb_version, boost_version, dnnl_version;
  std::string contract_cap, contract_default, contract_level;
};

/// The fingerprint of this process (threads: what the run will use).
Environment environment(int threads, const std::string& isa_used);
boost::json::object to_json(const Environment& e);

/// The number of threads oneTBB uses by default here.
int default_threads();

}  // namespace moecert::tools
