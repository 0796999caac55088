// Property, for the text of the settings moecert reads from the environment
// (MOECERT_CONTRACTS, MOECERT_CONTRACT_GROUPS, MOECERT_GUARD_PAGES,
// MOECERT_ISA) and the judge's parameters (--param NAME=VALUE): each parses
// or is refused with std::invalid_argument naming the variable, nothing else
// (no crash, no other exception, no silent default); what parses reads back
// (a level, semantic and group list print as names that parse to the same).
#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "contracts/engine/engine.hpp"
#include "contracts/judge/ops.hpp"
#include "fuzz/decode.hpp"
#include "moecert/memory.hpp"
#include "ops/gemm/dispatch.hpp"

using namespace moecert;

namespace {

constexpr const char* kName = "settings_fuzzer";

// The input's next NUL-terminated (or last) piece.
std::string piece(const std::uint8_t*& p, const std::uint8_t* end) {
  std::string s;
  while (p < end && *p) s.push_back(static_cast<char>(*p++));
  if (p < end) ++p;
  return s;
}

void contracts_setting(const std::string& contracts, const std::string& groups) {
  ContractSettings s;
  try {
    s = detail::parse_settings(contracts.c_str(), groups.c_str(), ContractSettings{});
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    if (what.rfind("MOECERT_CONTRACTS=", 0) != 0 && what.rfind("MOECERT_CONTRACT_GROUPS=", 0) != 0)
      fuzz::finding(kName, fmt::format("refusal naming no variable: {}", what));
    return;
  }
  // What parsed reads back: the names print and parse to the same settings.
  std::string names;
  for (int g = 0; g < kGroupCount; ++g)
    if (s.groups >> g & 1u)
      names += (names.empty() ? "" : ",") + std::string(group_name(static_cast<Group>(g)));
  const std::string level = fmt::format("{}:{}", level_name(s.level), semantic_name(s.semantic));
  const ContractSettings again = detail::parse_settings(
      level.c_str(), names.empty() ? "none" : names.c_str(), ContractSettings{});
  if (again.level != s.level || again.semantic != s.semantic || again.groups != s.groups)
    fuzz::finding(kName, fmt::format("'{}' '{}' does not read back", contracts, groups));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::uint8_t* p = data;
  const std::uint8_t* end = data + size;
  const std::string contracts = piece(p, end), groups = piece(p, end), guard = piece(p, end),
                    isa = piece(p, end), param = piece(p, end);
  contracts_setting(contracts, groups);
  GuardPages mode = GuardPages::off;
  if (parse_guard_pages(guard.c_str(), mode) && guard != "off" && guard != "end" &&
      guard != "start")
    fuzz::finding(kName, fmt::format("MOECERT_GUARD_PAGES={} accepted", guard));
  try {
    (void)detail::resolve_forced_isa(isa.c_str());
  } catch (const std::invalid_argument& e) {
    if (std::string(e.what()).rfind("MOECERT_ISA=", 0) != 0)
      fuzz::finding(kName, fmt::format("refusal naming no variable: {}", e.what()));
  }
  // A judge parameter: refused unless the op reads it, or judged.
  const auto eq = param.find('=');
  if (eq != std::string::npos) {
    contracts::judge::Tensors none;
    try {
      (void)contracts::judge::judge_op("router.softmax_topk.forward", none, none,
                                       {{param.substr(0, eq), param.substr(eq + 1)}});
    } catch (const std::invalid_argument&) {
      // unknown, malformed, or the tensors missing
    }
  }
  return 0;
}
