// Streaming line stores (stream.hpp): SSE2, baseline on x86-64; plain
// stores elsewhere.
#include "ops/gemm/stream.hpp"

#include <algorithm>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace moecert::gemm {

void stream_lines(std::uint32_t* first, std::size_t lines, std::size_t stride,
                  std::uint32_t value) {
  constexpr std::size_t kLineWords = 16;
#if defined(__SSE2__)
  const __m128i v = _mm_set1_epi32(static_cast<int>(value));
  for (std::size_t i = 0; i < lines; ++i) {
    auto* line = reinterpret_cast<__m128i*>(first + i * stride);
    for (std::size_t q = 0; q < kLineWords / 4; ++q) _mm_stream_si128(line + q, v);
  }
  _mm_sfence();
#else
  for (std::size_t i = 0; i < lines; ++i)
    std::fill(first + i * stride, first + i * stride + kLineWords, value);
#endif
}

}  // namespace moecert::gemm
