// ISA detection and the MOECERT_ISA override: the one place that decides
// which kernel level may run (CPUID, XGETBV, the AMX permission request).
#include "ops/gemm/dispatch.hpp"

#include <cpuid.h>
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "contracts/engine/engine.hpp"
#include "moecert/isa.hpp"
#include "ops/gemm/ukernel.hpp"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace moecert {
namespace {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

std::uint64_t xgetbv0() {
  std::uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}

bool cpuid(unsigned leaf, unsigned sub, unsigned (&r)[4]) {
  return __get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3]) != 0;
}

// Asks Linux for permission to use AMX tile data; without it the first tile
// instruction raises SIGILL. Called once, from detect().
bool request_amx_permission() {
#if defined(__linux__)
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

CpuInfo detect() {
  CpuInfo c;
  unsigned r[4] = {};
  if (!cpuid(0, 0, r)) return c;
  const unsigned max_leaf = r[0];
  char vendor[13] = {};
  std::memcpy(vendor + 0, &r[1], 4);
  std::memcpy(vendor + 4, &r[3], 4);
  std::memcpy(vendor + 8, &r[2], 4);
  c.vendor = vendor;

  bool osxsave = false;
  if (cpuid(1, 0, r)) {
    c.stepping = r[0] & 0xf;
    c.family = ((r[0] >> 8) & 0xf) + (((r[0] >> 8) & 0xf) == 0xf ? ((r[0] >> 20) & 0xff) : 0);
    c.model_id = ((r[0] >> 4) & 0xf) | ((r[0] >> 12) & 0xf0);
    osxsave = (r[2] >> 27) & 1;
  }
  if (max_leaf >= 7 && cpuid(7, 0, r)) {
    c.avx2 = (r[1] >> 5) & 1;
    c.avx512f = (r[1] >> 16) & 1;
    c.avx512bw = (r[1] >> 30) & 1;
    c.avx512vl = (r[1] >> 31) & 1;
    c.amx_bf16 = (r[3] >> 22) & 1;
    c.amx_tile = (r[3] >> 24) & 1;
    if (cpuid(7, 1, r)) c.avx512_bf16 = (r[0] >> 5) & 1;
  }
  if (osxsave) {
    const std::uint64_t xcr0 = xgetbv0();
    c.os_avx = (xcr0 & 0x6) == 0x6;       // SSE, AVX
    c.os_avx512 = (xcr0 & 0xe6) == 0xe6;  // SSE, AVX, opmask, ZMM
    c.os_amx = ((xcr0 >> 17) & 3) == 3;   // XTILECFG, XTILEDATA
  }
  if (c.amx_tile && c.amx_bf16 && c.os_amx) c.amx_permission = request_amx_permission();

  if (cpuid(0x80000000u, 0, r) && r[0] >= 0x80000004u) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      cpuid(0x80000002u + i, 0, r);
      std::memcpy(brand + 16 * i, r, 16);
    }
    std::string s = brand;
    while (!s.empty() && s.back() == ' ') s.pop_back();
    while (!s.empty() && s.front() == ' ') s.erase(s.begin());
    c.model = s;
  }
  return c;
}

bool hw_detected(Isa isa) {
  const CpuInfo& c = cpu_info();
  const bool avx512 = c.avx512f && c.avx512bw && c.avx512vl && c.os_avx512;
  switch (isa) {
    case Isa::scalar:
      return true;
    case Isa::avx2:
      return c.avx2 && c.os_avx;
    case Isa::avx512_bf16:
      return avx512 && c.avx512_bf16;
    case Isa::amx_bf16:
      return c.amx_tile && c.amx_bf16 && c.os_amx && c.amx_permission;
    case Isa::amx_emu:
      return true;
  }
  return false;
}

}  // namespace

namespace detail {

std::optional<Isa> resolve_forced_isa(const char* env) {
  if (!env || !*env) return std::nullopt;
  const auto isa = parse_isa(env);
  if (!isa)
    throw std::invalid_argument(
        fmt::format("MOECERT_ISA={}: unknown, expected {}", env, isa_name_list()));
  if (!hw_detected(*isa)) {
    std::string here;
    for (Isa i : kAllIsas)
      if (hw_detected(i)) here += (here.empty() ? "" : ", ") + std::string(isa_name(i));
    throw std::invalid_argument(
        fmt::format("MOECERT_ISA={}: not supported by this CPU/OS; usable here: {}", env, here));
  }
  return isa;
}

}  // namespace detail

namespace {

// MOECERT_ISA, read and validated once per process.
const std::optional<Isa>& forced_isa() {
  static const std::optional<Isa> f = detail::resolve_forced_isa(std::getenv("MOECERT_ISA"));
  return f;
}

}  // namespace

const CpuInfo& cpu_info() {
  static const CpuInfo info = detect();  // thread-safe, once per process
  return info;
}

bool isa_detected(Isa isa) { return hw_detected(isa); }

bool isa_usable(Isa isa) {
  if (!hw_detected(isa)) return false;
  const auto& f = forced_isa();
  const int rank = isa_rank(isa);
  if (!f || rank < 0 || !kIsaTable[rank].hardware) return true;
  if (*f == Isa::amx_emu) return false;  // only scalar and the emulator
  return isa_rank(isa) <= isa_rank(*f);
}

Isa default_isa() {
  if (const auto& f = forced_isa()) return *f;
  for (std::size_t i = kIsaCount; i-- > 0;)  // the highest detected hardware level
    if (kIsaTable[i].hardware && hw_detected(kIsaTable[i].isa)) return kIsaTable[i].isa;
  return Isa::scalar;
}

std::vector<Isa> usable_isas() {
  std::vector<Isa> out;
  for (Isa isa : kAllIsas)
    if (isa_usable(isa)) out.push_back(isa);
  return out;
}

namespace gemm {
namespace {
void no_hook() {}
}  // namespace

const KernelInfo& kernel_info(Isa isa) {
  // The kernel table: each kernel registered once, with its block sizes.
  // K block of the AMX loops (in elements): all of K. Every block of 128 to
  // 1024 ran slower on AMX hardware, with panels or rows outside, with
  // prefetching across calls or not: each call's fixed cost (C's tiles
  // stored and reloaded, the tile pipeline drained) outweighs A kept in L1.
  constexpr std::size_t kAmxKc = 0;
  // With all of K per call, the AMX loops take one 32-row block of A (128
  // KiB at K = 2048) past every column panel of the item before the next,
  // where the item's B fits kItemBBytes: A and B then stay in L2, where
  // column panels outside cycle up to 512 rows of A (2 MiB) through L2 once
  // per panel. On AMX hardware this order is faster for the gate/up GEMM and
  // the backward's dx GEMM (128-column items, gemm::item_cols); the AVX-512
  // kernel, whose 8-row A block fits L1 either way, is not, so it keeps the
  // panels outside.
  constexpr std::size_t kAmxMc = 32;  // in rows
  // The vector element-wise kernels wherever AVX-512 runs (AMX machines have
  // it); the emulator takes them too where it can, and the results never
  // differ.
  static const bool avx512 = isa_usable(Isa::avx512_bf16);
  static const SwigluFn vec = avx512 ? swiglu_avx512 : swiglu_scalar;
  static const SwigluBackwardFn vec_bwd = avx512 ? swiglu_backward_avx512 : swiglu_backward_scalar;
  static const RankSumFn vec_sums = avx512 ? rank_sums_avx512 : rank_sums_scalar;
  static const ScaleToBf16Fn vec_cvt = avx512 ? scale_to_bf16_avx512 : scale_to_bf16_scalar;
  static const Dot16Fn vec_dot = avx512 ? dot16_avx512 : dot16_scalar;
  static const DecodeFn vec_decode = avx512 ? decode_avx512 : decode_scalar;
  static const KernelInfo table[] = {
      {Isa::scalar, 8, 32, 0, 0, ALayout::rows, ukernel_scalar_8x32, ukernel_scalar_edge, false,
       no_hook, no_hook, swiglu_scalar, swiglu_backward_scalar, rank_sums_scalar,
       scale_to_bf16_scalar, dot16_scalar, decode_scalar, "ukernel_scalar_8x32"},
      {Isa::avx512_bf16, 8, 32, 0, 0, ALayout::rows, ukernel_avx512_bf16_8x32,
       ukernel_avx512_bf16_edge, false, no_hook, no_hook, swiglu_avx512, swiglu_backward_avx512,
       rank_sums_avx512, scale_to_bf16_avx512, dot16_avx512, decode_avx512,
       "ukernel_avx512_bf16_8x32"},
      {Isa::amx_bf16, 32, 32, kAmxKc, kAmxMc, ALayout::tiles, ukernel_amx_bf16_32x32,
       ukernel_amx_bf16_edge, true, amx_bf16_tile_begin, amx_bf16_tile_end, swiglu_avx512,
       swiglu_backward_avx512, rank_sums_avx512, scale_to_bf16_avx512, dot16_avx512, decode_avx512,
       "ukernel_amx_bf16_32x32"},
      {Isa::amx_emu, 32, 32, kAmxKc, kAmxMc, ALayout::tiles, ukernel_amx_emu_32x32,
       ukernel_amx_emu_edge, true, amx_emu_tile_begin, amx_emu_tile_end, vec, vec_bwd, vec_sums,
       vec_cvt, vec_dot, vec_decode, "ukernel_amx_emu_32x32"},
      // Its GEMM kernel computes scalar's arithmetic; the element-wise
      // kernels are amx_emu's choice (they never change a result).
      {Isa::avx2, 4, 32, 0, 0, ALayout::rows, ukernel_avx2_4x32, ukernel_avx2_edge, false, no_hook,
       no_hook, vec, vec_bwd, vec_sums, vec_cvt, vec_dot, vec_decode, "ukernel_avx2_4x32"},
  };
  if (!isa_usable(isa))
    throw std::invalid_argument(
        fmt::format("isa {}: not usable on this machine (usable: {})", isa_name(isa), [] {
          std::string s;
          for (Isa i : usable_isas()) s += (s.empty() ? "" : ", ") + std::string(isa_name(i));
          return s;
        }()));
  const KernelInfo& k = table[static_cast<int>(isa)];
  MOECERT_ASSERT(k.isa == isa);  // the rows are in the Isa values' order
  return k;
}
}  // namespace gemm

std::optional<Isa> parse_isa(std::string_view name) {
  for (const IsaInfo& i : kIsaTable)
    if (i.name == name) return i.isa;
  return std::nullopt;
}

std::string isa_name_list() {
  std::string s;
  for (std::size_t i = 0; i < kIsaCount; ++i) {
    if (i > 0) s.append(i + 1 == kIsaCount ? " or " : ", ");
    s.append(kIsaTable[i].name);
  }
  return s;
}

}  // namespace moecert
