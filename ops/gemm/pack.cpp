// Packing of weights into the VNNI panel layout of ukernel.hpp, and the
// packed-bytes checksum.
#include <cstring>

#include "contracts/gemm.hpp"
#include "moecert/gemm.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {
namespace {

std::size_t round_up(std::size_t x, std::size_t m) { return (x + m - 1) / m * m; }

// Writes the panel of W's columns [16 p, 16 p + 16) into dst (kp * 16 elements).
void pack_panel(MatView<const bf16> w, std::size_t p, std::size_t kp, bf16* dst) {
  std::memset(static_cast<void*>(dst), 0, kp * kPanel * sizeof(bf16));
  for (std::size_t n = 0; n < kPanel; ++n) {
    const std::size_t row = p * kPanel + n;
    if (row >= w.rows) break;
#ifdef MOECERT_MUTANT_VNNI_PAIR_SWAPPED
    for (std::size_t k = 0; k < w.cols; ++k) dst[(k / 2) * 2 * kPanel + n * 2 + (1 - k % 2)] = w(row, k);  // mutant (docs/MUTANTS.md): pair order swapped
#else
    for (std::size_t k = 0; k < w.cols; ++k) dst[(k / 2) * 2 * kPanel + n * 2 + (k % 2)] = w(row, k);
#endif
  }
}

}  // namespace

PackedWeights PackedWeights::pack(MatView<const bf16> w, MatView<const bf16> second) {
  return pack(w, second, PackedWeights{});
}

PackedWeights PackedWeights::pack(MatView<const bf16> w, MatView<const bf16> second, PackedWeights&& storage) {
  detail::Checker c{"gemm.pack"};
  contracts::gemm_pack_pre(c, w, second);
  if (c.stop()) return {};
  PackedWeights out = pack_operand(w, second, std::move(storage));
  contracts::gemm_pack_post(c, w, second, out);
  return out;
}

PackedWeights PackedWeights::pack_operand(MatView<const bf16> w, MatView<const bf16> second, PackedWeights&& storage) {
  PackedWeights out;
  out.interleaved_ = second.data != nullptr;
  const std::size_t panels_one = round_up(w.rows, kPanel) / kPanel;
  out.k_ = w.cols;
  out.kp_ = round_up(std::max<std::size_t>(w.cols, 1), kKStep);
  out.n_ = out.interleaved_ ? 2 * panels_one * kPanel : w.rows;
  out.np_ = round_up(std::max<std::size_t>(out.n_, 1), 2 * kPanel);
  if (storage.data_ && storage.size() == out.np_ * out.kp_) out.data_ = std::move(storage.data_);
  else out.data_.reset(static_cast<bf16*>(detail::allocate(out.np_ * out.kp_ * sizeof(bf16))));
  const std::size_t panel_elems = out.kp_ * kPanel;
  const std::size_t panels = out.np_ / kPanel;
  for (std::size_t p = 0; p < panels; ++p) {
    bf16* dst = out.data_.get() + p * panel_elems;
    if (out.interleaved_) pack_panel(p % 2 == 0 ? w : second, p / 2, out.kp_, dst);
    else pack_panel(w, p, out.kp_, dst);
  }
  out.checksum_ = out.compute_checksum();
  return out;
}

bf16 PackedWeights::at(std::size_t n, std::size_t k) const {
  return data_[(n / kPanel) * kp_ * kPanel + (k / 2) * 2 * kPanel + (n % kPanel) * 2 + (k % 2)];
}

std::uint64_t PackedWeights::compute_checksum() const {
  // FNV-1a over 64-bit words: cheap, and any changed bit changes the sum.
  std::uint64_t h = 0xcbf29ce484222325ull;
  const std::size_t bytes = size() * sizeof(bf16);
  const auto* p = reinterpret_cast<const unsigned char*>(data_.get());
  for (std::size_t i = 0; i + 8 <= bytes; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, p + i, 8);
    h = (h ^ word) * 0x100000001b3ull;
  }
  return h;
}

}  // namespace moecert::gemm
