// The environment fingerprint: CPU, ISA levels, threads, build, versions.
#include "tools/conform/environment.hpp"

#include <oneapi/tbb/info.h>

#include "moecert/moecert.hpp"

namespace moecert::tools {

int default_threads() { return oneapi::tbb::info::default_concurrency(); }

Environment environment(int threads, const std::string& isa_used) {
  Environment e;
  const CpuInfo& cpu = cpu_info();
  const BuildInfo& b = build_info();
  e.cpu_model = cpu.model;
  e.cpu_vendor = cpu.vendor;
  for (Isa isa : kAllIsas) {
    if (isa_detected(isa)) e.isa_detected.emplace_back(isa_name(isa));
    if (isa_usable(isa)) e.isa_usable.emplace_back(isa_name(isa));
  }
  e.isa_default = std::string(isa_name(default_isa()));
  e.isa_used = isa_used.empty() ? e.isa_default : isa_used;
  e.threads = threads;
  e.compiler = b.compiler;
  e.flags = b.flags;
  e.build_type = b.build_type;
  e.git_commit = b.git_commit;
  e.moecert_version = b.version;
  e.fmt_version = b.fmt_version;
  e.tbb_version = b.tbb_version;
  e.boost_version = b.boost_version;
  e.contract_cap = std::string(level_name(b.contract_cap));
  e.contract_default = std::string(level_name(b.contract_default));
  e.contract_level = std::string(level_name(effective_contract_settings().level));
  return e;
}

boost::json::object to_json(const Environment& e) {
  boost::json::array detected(e.isa_detected.begin(), e.isa_detected.end());
  boost::json::array usable(e.isa_usable.begin(), e.isa_usable.end());
  return {
      {"cpu_model", e.cpu_model},
      {"cpu_vendor", e.cpu_vendor},
      {"isa_detected", detected},
      {"isa_usable", usable},
      {"isa_default", e.isa_default},
      {"isa_used", e.isa_used},
      {"threads", e.threads},
      {"compiler", e.compiler},
      {"flags", e.flags},
      {"build_type", e.build_type},
      {"git_commit", e.git_commit},
      {"contract_cap", e.contract_cap},
      {"contract_default", e.contract_default},
      {"contract_level", e.contract_level},
      {"versions",
       {{"moecert", e.moecert_version},
        {"fmt", e.fmt_version},
        {"onetbb", e.tbb_version},
        {"boost", e.boost_version}}},
  };
}

}  // namespace moecert::tools
