// amx_probe: measures AMX tile code on the machine it runs on, outside the
// library, so that one run on the AMX machine compares many schedules
// (docs/PERFORMANCE.md quotes its output). Not a test: it prints TFLOP/s and
// needs AMX (it exits with a message otherwise).
//
//   amx_probe [--threads T] [--experts E] [--rows R] [--n N] [--k K] [--reps N] [--mb M] [--nb N]
//     the expert forward's gate/up GEMM shape (E experts x R rows, N = 2I
//     columns, K = H) in the packed layouts of ops/gemm/ukernel.hpp, over
//     work items of M rows x N columns of one expert handed out to T threads,
//     under each loop schedule (AMX_SCHED=a,b,... picks some):
//       full.oO.pfP  the library's loop: per 32-column block, per 32-row
//                    block, all of K in the 32x32 kernel, C in the output
//       kcN.oO       K in blocks of N; within a block, per 32-row block (A
//                    stays in L1), per 32-column block; C through the output
//       kcN.s.oO     the same with C in a per-thread contiguous scratch of
//                    1 KiB tiles, copied out once at the end
//     oO: the order of one k step's loads and products (0: four loads, then
//     four products; 1: interleaved); pfP: prefetch of the next k step's A (1),
//     B (2) tiles. Every schedule's C is compared bit for bit with the first.
//   AMX_MICRO=1 amx_probe --threads T
//     one k step (2x2 tiles, and variants) in a loop with its tiles cycling
//     through L1-, L2- or memory-sized buffers, each variant 7 times
//     interleaved; medians, minima and maxima per thread.
//   AMX_PER_CPU=1 amx_probe
//     products alone, the 2x2 step from L1 and tile loads alone, on each CPU
//     in turn (one thread pinned): how far apart the cores of a shared host are.
#include <immintrin.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

#define TZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TLOAD(t, p, s) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(p), "r"(s) : "memory")
#define TSTORE(t, p, s) \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(p), "r"(s) : "memory")
#define TDP(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

void tile_begin() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  __asm__ volatile("ldtilecfg %0" ::"m"(c) : "memory");
}

using u16 = std::uint16_t;
constexpr std::size_t kTile = 512;  // bf16 elements per 16 x 32 tile

// 32 x 32 C block over `steps` k steps. a0/a1: the two 16-row A tile runs
// (1 KiB per step); b0/b1: the two panels (1 KiB per step). C rows at ldc
// bytes; c01 = offset in bytes of the right half, c10 of the lower half.
template <int Order>
inline void k32x32(const u16* a0, const u16* a1, const u16* b0, const u16* b1, std::size_t steps,
                   char* c, std::size_t ldc, std::size_t c01, std::size_t c10, bool load_c,
                   int pf) {
  const std::size_t s64 = 64;
  if (load_c) {
    TLOAD(0, c, ldc);
    TLOAD(1, c + c01, ldc);
    TLOAD(2, c + c10, ldc);
    TLOAD(3, c + c10 + c01, ldc);
  } else {
    TZERO(0);
    TZERO(1);
    TZERO(2);
    TZERO(3);
  }
  for (std::size_t s = 0; s < steps; ++s) {
    const u16* pa0 = a0 + s * kTile;
    const u16* pa1 = a1 + s * kTile;
    const u16* pb0 = b0 + s * kTile;
    const u16* pb1 = b1 + s * kTile;
    if (pf && s + 1 < steps)
      for (int r = 0; r < 16; ++r) {
        if (pf & 1) {
          __builtin_prefetch(pa0 + kTile + r * 32, 0, 3);
          __builtin_prefetch(pa1 + kTile + r * 32, 0, 3);
        }
        if (pf & 2) {
          __builtin_prefetch(pb0 + kTile + r * 32, 0, 3);
          __builtin_prefetch(pb1 + kTile + r * 32, 0, 3);
        }
      }
    if constexpr (Order == 0) {
      TLOAD(4, pa0, s64);
      TLOAD(5, pa1, s64);
      TLOAD(6, pb0, s64);
      TLOAD(7, pb1, s64);
      TDP(0, 4, 6);
      TDP(1, 4, 7);
      TDP(2, 5, 6);
      TDP(3, 5, 7);
    } else {
      TLOAD(4, pa0, s64);
      TLOAD(6, pb0, s64);
      TDP(0, 4, 6);
      TLOAD(7, pb1, s64);
      TDP(1, 4, 7);
      TLOAD(5, pa1, s64);
      TDP(2, 5, 6);
      TDP(3, 5, 7);
    }
  }
  TSTORE(0, c, ldc);
  TSTORE(1, c + c01, ldc);
  TSTORE(2, c + c10, ldc);
  TSTORE(3, c + c10 + c01, ldc);
}

// A vector whose data is 64-byte aligned (as the library's packed buffers are).
template <class T>
struct Buf {
  T* p = nullptr;
  std::size_t n = 0;
  void resize(std::size_t m) {
    p = static_cast<T*>(std::aligned_alloc(4096, (m * sizeof(T) + 4095) / 4096 * 4096));
    n = m;
  }
  void assign(std::size_t m, T v) {
    resize(m);
    std::fill(p, p + m, v);
  }
  T* data() { return p; }
  std::size_t size() const { return n; }
  T* begin() { return p; }
  T* end() { return p + n; }
  T& operator[](std::size_t i) { return p[i]; }
};

struct Problem {
  std::size_t experts, rows, n, k;
  Buf<u16> a, b;  // A: per expert rows x k in tile layout; B: per expert n/16 panels
  Buf<float> c;
  u16* a_of(std::size_t e) { return a.data() + e * rows * k; }
  u16* b_of(std::size_t e) { return b.data() + e * n * k; }
  float* c_of(std::size_t e) { return c.data() + e * rows * n; }
};

struct Item {
  std::size_t e, m0, m1, n0, n1;
};

struct Schedule {
  std::string name;
  std::size_t kc;  // 0: all of K
  bool scratch;
  int order, pf;
};

// One work item under a schedule. A tile layout: 16-row block stride 16 k.
void run_item(Problem& p, const Item& it, const Schedule& s, float* scratch) {
  const std::size_t k = p.k, lda = 16 * k, ldc = p.n * 4, steps_all = k / 32;
  const u16* a = p.a_of(it.e);
  const u16* b = p.b_of(it.e);
  float* c = p.c_of(it.e);
  auto kern = s.order ? k32x32<1> : k32x32<0>;
  if (s.kc == 0) {
    for (std::size_t n0 = it.n0; n0 < it.n1; n0 += 32)
      for (std::size_t m0 = it.m0; m0 < it.m1; m0 += 32)
        kern(a + m0 / 16 * lda, a + (m0 / 16 + 1) * lda, b + n0 / 16 * 16 * k,
             b + (n0 / 16 + 1) * 16 * k, steps_all, reinterpret_cast<char*>(c + m0 * p.n + n0), ldc,
             64, 16 * ldc, false, s.pf);
    return;
  }
  const std::size_t kcs = s.kc / 32, nb = (it.n1 - it.n0) / 32;
  for (std::size_t k0 = 0; k0 < steps_all; k0 += kcs) {
    const std::size_t st = std::min(kcs, steps_all - k0);
    for (std::size_t m0 = it.m0; m0 < it.m1; m0 += 32) {
      const u16* a0 = a + m0 / 16 * lda + k0 * kTile;
      const u16* a1 = a0 + lda;
      for (std::size_t n0 = it.n0; n0 < it.n1; n0 += 32) {
        const u16* b0 = b + n0 / 16 * 16 * k + k0 * kTile;
        const u16* b1 = b0 + 16 * k;
        if (s.scratch) {  // block (m, n) at 4 KiB: tiles C00, C01, C10, C11
          char* blk = reinterpret_cast<char*>(
              scratch + (((m0 - it.m0) / 32) * nb + (n0 - it.n0) / 32) * 1024);
          kern(a0, a1, b0, b1, st, blk, 64, 1024, 2048, k0 > 0, s.pf);
        } else {
          kern(a0, a1, b0, b1, st, reinterpret_cast<char*>(c + m0 * p.n + n0), ldc, 64, 16 * ldc,
               k0 > 0, s.pf);
        }
      }
    }
  }
  if (s.scratch)
    for (std::size_t m0 = it.m0; m0 < it.m1; m0 += 32)
      for (std::size_t n0 = it.n0; n0 < it.n1; n0 += 32) {
        const float* blk = scratch + (((m0 - it.m0) / 32) * nb + (n0 - it.n0) / 32) * 1024;
        for (int t = 0; t < 4; ++t)
          for (int r = 0; r < 16; ++r)
            std::memcpy(c + (m0 + (t / 2) * 16 + r) * p.n + n0 + (t % 2) * 16,
                        blk + t * 256 + r * 16, 64);
      }
}

double run(Problem& p, const Schedule& s, unsigned threads, std::size_t mb, std::size_t nb) {
  std::vector<Item> items;
  for (std::size_t e = 0; e < p.experts; ++e)
    for (std::size_t m0 = 0; m0 < p.rows; m0 += mb)
      for (std::size_t n0 = 0; n0 < p.n; n0 += nb)
        items.push_back({e, m0, std::min(p.rows, m0 + mb), n0, std::min(p.n, n0 + nb)});
  std::atomic<std::size_t> next{0};
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      tile_begin();
      Buf<float> scratch;
      scratch.resize(mb * nb + 1024);
      for (std::size_t i; (i = next.fetch_add(1)) < items.size();)
        run_item(p, items[i], s, scratch.data());
      __asm__ volatile("tilerelease" ::: "memory");
    });
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Micro schedules on one core: what a k step costs when its tiles come from
// L1, L2 or nowhere. wa / wb: bytes of A / B cycled through (1 KiB per tile).
template <int Order, bool Loads, bool Dp>
double micro(const u16* a, std::size_t wa, const u16* b, std::size_t wb, std::size_t steps) {
  tile_begin();
  TZERO(0);
  TZERO(1);
  TZERO(2);
  TZERO(3);
  TZERO(4);
  TZERO(5);
  TZERO(6);
  TZERO(7);
  const std::size_t s64 = 64, na = wa / 2048, nb = wb / 2048;
  auto t0 = std::chrono::steady_clock::now();
  for (std::size_t s = 0; s < steps; ++s) {
    const u16* pa = a + (s % na) * 2 * kTile;
    const u16* pb = b + (s % nb) * 2 * kTile;
    if constexpr (Loads && Order == 0) {
      TLOAD(4, pa, s64);
      TLOAD(5, pa + kTile, s64);
      TLOAD(6, pb, s64);
      TLOAD(7, pb + kTile, s64);
    }
    if constexpr (Dp && Order == 0) {
      TDP(0, 4, 6);
      TDP(1, 4, 7);
      TDP(2, 5, 6);
      TDP(3, 5, 7);
    }
    if constexpr (Order == 1) {
      TLOAD(4, pa, s64);
      TLOAD(6, pb, s64);
      TDP(0, 4, 6);
      TLOAD(7, pb + kTile, s64);
      TDP(1, 4, 7);
      TLOAD(5, pa + kTile, s64);
      TDP(2, 5, 6);
      TDP(3, 5, 7);
    }
  }
  __asm__ volatile("tilerelease" ::: "memory");
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 4.0 * 16 * 16 * 32 * 2 * steps / t * 1e-12;
}

// Orders of one k step, software-pipelined: the loads of step s+1 are issued
// as soon as the products of step s that read the register are issued.
template <int V>
double micro2(const u16* a, std::size_t wa, const u16* b, std::size_t wb, std::size_t steps) {
  tile_begin();
  TZERO(0);
  TZERO(1);
  TZERO(2);
  TZERO(3);
  TZERO(4);
  TZERO(5);
  TZERO(6);
  TZERO(7);
  const std::size_t s64 = 64, na = wa / 2048, nb = wb / 2048;
  auto A = [&](std::size_t s) { return a + (s % na) * 2 * kTile; };
  auto B = [&](std::size_t s) { return b + (s % nb) * 2 * kTile; };
  auto t0 = std::chrono::steady_clock::now();
  if constexpr (V == 2) {  // 2x2: D06 D26 L6 D17 L4 D37 L5 L7
    TLOAD(4, A(0), s64);
    TLOAD(5, A(0) + kTile, s64);
    TLOAD(6, B(0), s64);
    TLOAD(7, B(0) + kTile, s64);
    for (std::size_t s = 0; s < steps; ++s) {
      const u16* na_ = A(s + 1);
      const u16* nb_ = B(s + 1);
      TDP(0, 4, 6);
      TDP(2, 5, 6);
      TLOAD(6, nb_, s64);
      TDP(1, 4, 7);
      TLOAD(4, na_, s64);
      TDP(3, 5, 7);
      TLOAD(5, na_ + kTile, s64);
      TLOAD(7, nb_ + kTile, s64);
    }
  } else if constexpr (V ==
                       3) {  // 2x1 (32 x 16), double-buffered operands: C0 C1, A 2-3 / 5-6, B 4 / 7
    TLOAD(2, A(0), s64);
    TLOAD(3, A(0) + kTile, s64);
    TLOAD(4, B(0), s64);
    for (std::size_t s = 0; s < steps; s += 2) {
      const u16* a1 = A(s + 1);
      const u16* b1 = B(s + 1);
      const u16* a2 = A(s + 2);
      const u16* b2 = B(s + 2);
      TLOAD(5, a1, s64);
      TLOAD(6, a1 + kTile, s64);
      TLOAD(7, b1, s64);
      TDP(0, 2, 4);
      TDP(1, 3, 4);
      TLOAD(2, a2, s64);
      TLOAD(3, a2 + kTile, s64);
      TLOAD(4, b2, s64);
      TDP(0, 5, 7);
      TDP(1, 6, 7);
    }
  } else if constexpr (
      V == 4) {  // 2x2 with the products ordered C0 C1 C3 C2: A0 free after 2, B1 after 3
    TLOAD(4, A(0), s64);
    TLOAD(5, A(0) + kTile, s64);
    TLOAD(6, B(0), s64);
    TLOAD(7, B(0) + kTile, s64);
    for (std::size_t s = 0; s < steps; ++s) {
      const u16* na_ = A(s + 1);
      const u16* nb_ = B(s + 1);
      TDP(0, 4, 6);
      TDP(1, 4, 7);
      TLOAD(4, na_, s64);
      TDP(3, 5, 7);
      TLOAD(7, nb_ + kTile, s64);
      TDP(2, 5, 6);
      TLOAD(5, na_ + kTile, s64);
      TLOAD(6, nb_, s64);
    }
  } else if constexpr (V == 5) {  // 1x3 (16 x 48): C tiles 0-2, A tile 3, B tiles 5-7
    for (std::size_t s = 0; s < steps; ++s) {
      const u16* pa = A(s);
      const u16* pb = B(s);
      TLOAD(3, pa, s64);
      TLOAD(5, pb, s64);
      TDP(0, 3, 5);
      TLOAD(6, pb + kTile, s64);
      TDP(1, 3, 6);
      TLOAD(7, pa + kTile, s64);
      TDP(2, 3, 7);
    }
  }
  __asm__ volatile("tilerelease" ::: "memory");
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tdps = V == 3 ? 2.0 : V == 5 ? 3.0 : 4.0;
  return tdps * 16 * 16 * 32 * 2 * steps / t * 1e-12;
}

// One core at a time: TDP alone and the 2x2 step from L1, per CPU.
int per_cpu_main() {
  Buf<u16> a, b;
  a.resize(1 << 20);
  b.resize(1 << 20);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = b[i] = static_cast<u16>(0x3f00 + (i & 0xff));
  const unsigned cpus = std::thread::hardware_concurrency();
  for (unsigned cpu = 0; cpu < cpus; ++cpu) {
    double r[3];
    std::thread th([&] {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      sched_setaffinity(0, sizeof set, &set);
      r[0] = micro<0, false, true>(a.data(), 2048, b.data(), 2048, 2000000);
      r[1] = micro<0, true, true>(a.data(), 16384, b.data(), 16384, 2000000);
      r[2] = micro<0, true, false>(a.data(), 16384, b.data(), 16384, 2000000);
    });
    th.join();
    std::printf("cpu %2u: tdp only %5.2f  2x2 L1 %5.2f  loads only L1 %5.2f TFLOP/s\n", cpu, r[0],
                r[1], r[2]);
    std::fflush(stdout);
  }
  return 0;
}

int micro_main(unsigned threads) {
  Buf<u16> a, b;
  a.resize(64 << 20);
  b.resize(64 << 20);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = b[i] = static_cast<u16>(0x3f00 + (i & 0xff));
  const std::size_t steps = 400000;
  struct M {
    const char* name;
    double (*f)(const u16*, std::size_t, const u16*, std::size_t, std::size_t);
    std::size_t wa, wb;
  };
  const M ms[] = {
      {"tdp only", micro<0, false, true>, 2048, 2048},
      {"loads only, L1", micro<0, true, false>, 2048, 2048},
      {"2x2 o0, A,B fixed (L1)", micro<0, true, true>, 2048, 2048},
      {"2x2 o1, A,B fixed (L1)", micro<1, true, true>, 2048, 2048},
      {"2x2 o0, A 16K B 16K (L1)", micro<0, true, true>, 16384, 16384},
      {"2x2 o1, A 16K B 16K (L1)", micro<1, true, true>, 16384, 16384},
      {"2x2 o1, A 16K (L1) B 512K (L2)", micro<1, true, true>, 16384, 512 << 10},
      {"2x2 pipelined v2, L1", micro2<2>, 16384, 16384},
      {"2x2 pipelined v4, L1", micro2<4>, 16384, 16384},
      {"2x1 double-buffered v3, L1", micro2<3>, 16384, 16384},
      {"1x3 v5, L1", micro2<5>, 16384, 16384},
      {"2x2 pipelined v2, A L1 B L2", micro2<2>, 16384, 512 << 10},
      {"2x2 pipelined v4, A L1 B L2", micro2<4>, 16384, 512 << 10},
      {"2x1 double-buffered v3, A L1 B L2", micro2<3>, 16384, 512 << 10},
      {"2x2 pipelined v2, L2", micro2<2>, 512 << 10, 512 << 10},
      {"2x2 o0, A 16K (L1) B 512K (L2)", micro<0, true, true>, 16384, 512 << 10},
      {"2x2 o1, A 512K B 512K (L2)", micro<1, true, true>, 512 << 10, 512 << 10},
      {"2x2 o1, A 16K B 32M (mem)", micro<1, true, true>, 16384, 32 << 20},
      {"loads only, L2", micro<0, true, false>, 512 << 10, 512 << 10},
  };
  const int rounds = 7;
  std::vector<std::vector<double>> res(std::size(ms));
  for (int round = 0; round < rounds; ++round)
    for (std::size_t i = 0; i < std::size(ms); ++i) {
      const M& m = ms[i];
      std::vector<double> r(threads);
      std::vector<std::thread> pool;
      for (unsigned t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
          cpu_set_t set;
          CPU_ZERO(&set);
          CPU_SET(t, &set);
          sched_setaffinity(0, sizeof set, &set);
          r[t] = m.f(a.data() + t * (m.wa / 2), m.wa, b.data() + t * (m.wb / 2) % (32 << 20), m.wb,
                     steps);
        });
      for (auto& th : pool) th.join();
      double sum = 0;
      for (double x : r) sum += x;
      res[i].push_back(sum / threads);
    }
  for (std::size_t i = 0; i < std::size(ms); ++i) {
    auto v = res[i];
    std::sort(v.begin(), v.end());
    std::printf("micro %-36s %2u thr: per thread median %5.2f  min %5.2f  max %5.2f TFLOP/s\n",
                ms[i].name, threads, v[v.size() / 2], v.front(), v.back());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  unsigned threads = 16;
  std::size_t experts = 64, rows = 384, n = 2816, k = 2048, reps = 5, mb = 512, nb = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const std::size_t v = std::strtoull(argv[i + 1], nullptr, 10);
    if (a == "--threads")
      threads = v;
    else if (a == "--experts")
      experts = v;
    else if (a == "--rows")
      rows = v;
    else if (a == "--n")
      n = v;
    else if (a == "--k")
      k = v;
    else if (a == "--reps")
      reps = v;
    else if (a == "--mb")
      mb = v;
    else if (a == "--nb")
      nb = v;
  }
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::puts("amx_probe: no AMX permission");
    return 1;
  }
  if (std::getenv("AMX_PER_CPU")) return per_cpu_main();
  if (std::getenv("AMX_MICRO")) return micro_main(threads);
  Problem p{experts, rows, n, k, {}, {}, {}};
  p.a.resize(experts * rows * k);
  p.b.resize(experts * n * k);
  p.c.assign(experts * rows * n, 0.0f);
  std::mt19937 rng(1);
  for (auto* v : {&p.a, &p.b})
    for (auto& x : *v) x = static_cast<u16>(0x3f00 + (rng() & 0xff));  // bf16 in [0.5, 1)
  const double flop = 2.0 * experts * rows * n * k;
  std::vector<Schedule> ss = {
      {"full.o0.pf3", 0, false, 0, 3},     {"full.o1.pf3", 0, false, 1, 3},
      {"full.o1.pf0", 0, false, 1, 0},     {"kc256.o0", 256, false, 0, 0},
      {"kc256.o1", 256, false, 1, 0},      {"kc256.s.o0", 256, true, 0, 0},
      {"kc256.s.o1", 256, true, 1, 0},     {"kc512.s.o1", 512, true, 1, 0},
      {"kc512.s.o1.pf2", 512, true, 1, 2}, {"kc256.s.o1.pf2", 256, true, 1, 2},
      {"kc128.s.o1", 128, true, 1, 0},     {"kc1024.s.o1", 1024, true, 1, 0},
  };
  std::vector<float> ref;
  std::printf("threads %u experts %zu rows %zu n %zu k %zu items %zux%zu\n", threads, experts, rows,
              n, k, mb, nb);
  const char* only = std::getenv("AMX_SCHED");  // comma-separated names to run
  auto picked = [&](const std::string& name) {
    if (!only) return true;
    for (const char* p = only; *p;) {
      const char* end = std::strchr(p, ',');
      const std::size_t len = end ? static_cast<std::size_t>(end - p) : std::strlen(p);
      if (name.size() == len && name.compare(0, len, p, len) == 0) return true;
      p += len + (end ? 1 : 0);
    }
    return false;
  };
  for (const auto& s : ss) {
    if (!picked(s.name)) continue;
    std::vector<double> t;
    for (std::size_t r = 0; r < reps + 1; ++r) t.push_back(run(p, s, threads, mb, nb));
    t.erase(t.begin());
    std::sort(t.begin(), t.end());
    const double med = t[t.size() / 2];
    if (ref.empty()) ref.assign(p.c.begin(), p.c.end());
    const bool same = std::memcmp(ref.data(), p.c.data(), ref.size() * 4) == 0;
    std::printf("%-18s median %8.3f ms  %6.2f TFLOP/s  min %8.3f ms  %s\n", s.name.c_str(),
                med * 1e3, flop / med * 1e-12, t[0] * 1e3, same ? "bitwise same" : "DIFFERENT");
    std::fflush(stdout);
  }
}
