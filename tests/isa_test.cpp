// ISA detection and dispatch facts.
#include "moecert/isa.hpp"

#include <cstdlib>
#include <iterator>

#include "ops/gemm/dispatch.hpp"
#include "test_util.hpp"

using namespace moecert;

TEST_CASE("core.isa: detection agrees with the compiler's CPU model", "[core][isa]") {
  const CpuInfo& c = cpu_info();
  CHECK(c.avx2 == static_cast<bool>(__builtin_cpu_supports("avx2")));
  CHECK(c.avx512f == static_cast<bool>(__builtin_cpu_supports("avx512f")));
  CHECK(c.avx512_bf16 == static_cast<bool>(__builtin_cpu_supports("avx512bf16")));
#if !defined(__clang__)  // clang 14's CPU model has no AMX features (the Release build is g++'s)
  CHECK(c.amx_tile == static_cast<bool>(__builtin_cpu_supports("amx-tile")));
  CHECK(c.amx_bf16 == static_cast<bool>(__builtin_cpu_supports("amx-bf16")));
#endif
  CHECK_FALSE(c.vendor.empty());
  CHECK(&cpu_info() == &c);  // detected once
}

TEST_CASE("core.isa: AMX needs CPUID, XCR0 and the permission", "[core][isa]") {
  const CpuInfo& c = cpu_info();
  CHECK(isa_detected(Isa::amx_bf16) == (c.amx_tile && c.amx_bf16 && c.os_amx && c.amx_permission));
  if (!(c.amx_tile && c.amx_bf16 && c.os_amx)) CHECK_FALSE(c.amx_permission);  // never asked
  CHECK(isa_detected(Isa::avx512_bf16) ==
        (c.avx512f && c.avx512bw && c.avx512vl && c.avx512_bf16 && c.os_avx512));
  CHECK(isa_detected(Isa::avx2) == (c.avx2 && c.os_avx));
  if (c.os_avx512) CHECK(c.os_avx);
}

TEST_CASE("core.isa: levels are ordered; the default is the highest detected", "[core][isa]") {
  for (std::size_t i = 0; i + 1 < std::size(kAllIsas); ++i)
    CHECK(isa_rank(kAllIsas[i]) < isa_rank(kAllIsas[i + 1]));
  if (std::getenv("MOECERT_ISA")) return;  // a forced default is checked below
  Isa best = Isa::scalar;
  for (const IsaInfo& i : kIsaTable)
    if (i.hardware && isa_detected(i.isa)) best = i.isa;
  CHECK(default_isa() == best);
}

TEST_CASE("core.isa: the default ISA is usable; scalar and amx_emu always are", "[core][isa]") {
  CHECK(isa_usable(default_isa()));
  CHECK(isa_usable(Isa::scalar));
  CHECK(isa_usable(Isa::amx_emu));
  const auto usable = usable_isas();
  REQUIRE(usable.size() >= 2);
  CHECK(usable.front() == Isa::scalar);
  CHECK(usable.back() == Isa::amx_emu);
  for (Isa isa : usable) CHECK(isa_detected(isa));
}

TEST_CASE("core.isa: names parse; unknown names are refused", "[core][isa]") {
  for (Isa isa : kAllIsas) CHECK(parse_isa(isa_name(isa)) == isa);
  CHECK(isa_name_list().starts_with("scalar, avx2, "));
  CHECK(isa_name_list().ends_with(" or amx_emu"));
  CHECK(isa_rank(static_cast<Isa>(kIsaCount)) == -1);
  CHECK(isa_name(static_cast<Isa>(kIsaCount)) == "unknown");
  CHECK_FALSE(parse_isa("avx512"));
  CHECK_FALSE(parse_isa("AMX_BF16"));
}

TEST_CASE("core.isa: MOECERT_ISA is validated against this machine", "[core][isa]") {
  CHECK_FALSE(detail::resolve_forced_isa(nullptr));
  CHECK_FALSE(detail::resolve_forced_isa(""));
  CHECK(detail::resolve_forced_isa("scalar") == Isa::scalar);
  CHECK(detail::resolve_forced_isa("amx_emu") == Isa::amx_emu);
  CHECK_THROWS_WITH(detail::resolve_forced_isa("sse2"),
                    Catch::Contains("expected " + isa_name_list()));
  for (const IsaInfo& i : kIsaTable) {
    if (!i.hardware) continue;
    const Isa isa = i.isa;
    const std::string name(i.name);
    if (isa_detected(isa))
      CHECK(detail::resolve_forced_isa(name.c_str()) == isa);
    else
      CHECK_THROWS_WITH(detail::resolve_forced_isa(name.c_str()),
                        Catch::Contains("not supported by this CPU/OS"));
  }
}
