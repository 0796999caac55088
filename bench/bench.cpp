// Timing and data helpers shared by the benchmark cases.
#include "bench/bench.hpp"

#include <algorithm>
#include <chrono>

#include <oneapi/tbb/parallel_for.h>

namespace moecert::bench {

std::vector<double> time_ms(int reps, const std::function<void()>& f) {
  f();  // warm-up: first-touch pages, caches, thread pools
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return ms;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

void fill_uniform(std::vector<bf16>& v, std::uint64_t seed, float scale) {
  constexpr std::size_t kBlock = 1 << 16;
  oneapi::tbb::parallel_for(std::size_t{0}, (v.size() + kBlock - 1) / kBlock, [&](std::size_t b) {
    std::uint64_t s = seed ^ (0x9e3779b97f4a7c15ull * (b + 1));
    for (std::size_t i = b * kBlock; i < std::min(v.size(), (b + 1) * kBlock); ++i) {
      s += 0x9e3779b97f4a7c15ull;  // splitmix64
      std::uint64_t z = s;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      const float u = static_cast<float>(z >> 40) * 0x1p-24f;  // [0, 1)
      v[i] = bf16((2 * u - 1) * scale);
    }
  });
}

}  // namespace moecert::bench
