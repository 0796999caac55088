// Non-temporal stores of whole 64-byte lines, for writes nobody reads soon
// (the workspace's poison, proofs/workspace.md "Poison").
#pragma once

#include <cstddef>
#include <cstdint>

namespace moecert::gemm {

/// Writes `value` to the 16 words of each of `lines` 64-byte lines, line i
/// at first + i * stride words (first 64-byte aligned, stride a multiple of
/// 16), past the caches where the ISA allows (SSE2 streaming stores: a whole
/// line is written without reading it first), then fences, so that the
/// stores are ordered before the caller's later ones.
void stream_lines(std::uint32_t* first, std::size_t lines, std::size_t stride, std::uint32_t value);

}  // namespace moecert::gemm
