// `moecert info`: CPU, ISA levels detected and usable, build, contracts, versions.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "moecert/moecert.hpp"
#include "tools/commands.hpp"
#include "tools/conform/environment.hpp"

namespace moecert::tools {

namespace {

int run_info(bool json) {
  const CpuInfo& cpu = cpu_info();
  const Environment env = environment(default_threads(), "");
  if (json) {
    fmt::print("{}\n", boost::json::serialize(to_json(env)));
    return 0;
  }
  const ContractSettings s = effective_contract_settings();
  fmt::print("moecert {} ({} build, {}, commit {})\n", env.moecert_version, env.build_type,
             env.compiler, env.git_commit);
  fmt::print("cpu:        {} [{}; family {} model {} stepping {}]\n",
             cpu.model.empty() ? "unknown" : cpu.model, cpu.vendor, cpu.family, cpu.model_id,
             cpu.stepping);
  fmt::print(
      "cpuid:      avx2={} avx512f={} avx512bw={} avx512vl={} avx512_bf16={} amx_tile={} "
      "amx_bf16={}\n",
      cpu.avx2, cpu.avx512f, cpu.avx512bw, cpu.avx512vl, cpu.avx512_bf16, cpu.amx_tile,
      cpu.amx_bf16);
  fmt::print(
      "os (xcr0):  avx state={} avx512 state={} amx tile state={}; amx permission "
      "(arch_prctl)={}\n",
      cpu.os_avx, cpu.os_avx512, cpu.os_amx, cpu.amx_permission);
  fmt::print("isa:        detected {}; usable {}; default {}\n", fmt::join(env.isa_detected, ", "),
             fmt::join(env.isa_usable, ", "), env.isa_default);
  fmt::print("threads:    {} (oneTBB default concurrency)\n", env.threads);
  fmt::print("contracts:  cap {} (compile time), build default {}, in effect {}/{} groups {:#x}\n",
             env.contract_cap, env.contract_default, level_name(s.level), semantic_name(s.semantic),
             s.groups);
  fmt::print("flags:      {}\n", env.flags);
  fmt::print("versions:   fmt {}, oneTBB {}, Boost {}\n", env.fmt_version, env.tbb_version,
             env.boost_version);
  return 0;
}

}  // namespace

void add_info(CLI::App& app, Command& run) {
  auto* sub =
      app.add_subcommand("info", "CPU, ISA levels detected and usable, build, contracts, versions");
  auto json = std::make_shared<bool>(false);
  sub->add_flag("--json", *json, "one JSON object (the report's environment)");
  sub->callback([json, &run] { run = [json] { return run_info(*json); }; });
}

}  // namespace moecert::tools
