// What this CPU and OS can run, and which kernel level moecert will use.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moecert/types.hpp"

namespace moecert {

/// Facts read from CPUID and XGETBV (once per process).
struct CpuInfo {
  std::string vendor;  // e.g. "GenuineIntel"
  std::string model;   // brand string, e.g. "Intel(R) Xeon(R) ..."
  unsigned family = 0, model_id = 0, stepping = 0;
  // CPUID feature bits
  bool avx2 = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512_bf16 = false;
  bool amx_tile = false, amx_bf16 = false;
  // XCR0: the OS saves the state
  bool os_avx = false;     // bits 1, 2
  bool os_avx512 = false;  // bits 1, 2, 5, 6, 7
  bool os_amx = false;     // bits 17, 18
  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) succeeded (Linux);
  // asked once per process, and only where CPUID and XCR0 report AMX.
  bool amx_permission = false;
};

const CpuInfo& cpu_info();

/// The hardware and OS can run `isa` (amx_emu: always).
bool isa_detected(Isa isa);

/// `isa` is detected and allowed by MOECERT_ISA. MOECERT_ISA=NAME forces
/// NAME as the default kernel; hardware levels above it become unusable
/// (NAME=amx_emu leaves scalar and amx_emu). An unknown NAME, or one this
/// machine cannot run, is refused with std::invalid_argument listing the
/// valid names, at the first call that reads it.
bool isa_usable(Isa isa);

/// The kernel level ops use by default: MOECERT_ISA if set, else the
/// highest detected hardware level.
Isa default_isa();

/// Every usable level, lowest first (amx_emu last).
std::vector<Isa> usable_isas();

std::optional<Isa> parse_isa(std::string_view name);

/// Every level's name in the ISA table's order, as messages list them:
/// "scalar, avx2, avx512_bf16, amx_bf16 or amx_emu".
std::string isa_name_list();

}  // namespace moecert
