// Packing of weights into the VNNI panel layout of ukernel.hpp, and the
// packed-bytes checksum.
#include <algorithm>
#include <cstring>

#include "contracts/gemm/gemm.hpp"
#include "contracts/gemm/pack_audit.hpp"
#include "moecert/gemm.hpp"
#include "ops/core/aligned.hpp"
#include "ops/core/task.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::gemm {
namespace {

std::size_t round_up(std::size_t x, std::size_t m) { return (x + m - 1) / m * m; }

constexpr std::size_t lo = 0, hi = 1;  // a VNNI pair: k even, then k + 1

// Writes the panel of W's columns [16 p, 16 p + 16) into dst (kp * 16
// elements): for each k pair, the 16 columns' pairs as one 64-byte run, so
// the panel is written once, in order, while the 16 source rows are read
// in order side by side. Pairs past W's depth and columns past its rows are
// zero.
void pack_panel(MatView<const bf16> w, std::size_t p, std::size_t kp, bf16* dst) {
  const std::size_t rows = w.rows > p * kPanel ? std::min(kPanel, w.rows - p * kPanel) : 0;
  const std::size_t pairs = (w.cols + 1) / 2,
                    whole = w.cols / 2;  // k pairs; those without K's odd end
  const bf16 zero{};
  const bf16* src[kPanel];
  for (std::size_t n = 0; n < rows; ++n) src[n] = w.row(p * kPanel + n);
  for (std::size_t kk = 0; kk < pairs; ++kk) {
    bf16* d = dst + kk * 2 * kPanel;
    const std::size_t k = 2 * kk;
    if (kk < whole) {
      for (std::size_t n = 0; n < rows; ++n)
        d[2 * n + lo] = src[n][k], d[2 * n + hi] = src[n][k + 1];
    } else {
      for (std::size_t n = 0; n < rows; ++n) d[2 * n + lo] = src[n][k], d[2 * n + hi] = zero;
    }
    if (rows < kPanel) std::fill(d + 2 * rows, d + 2 * kPanel, zero);
  }
  std::fill(dst + pairs * 2 * kPanel, dst + kp * kPanel, zero);
}

// The same panel of W = wt^T: W's columns [16 p, 16 p + 16) are wt's, and
// k pair kk interleaves wt's rows 2 kk and 2 kk + 1 over them (contiguous
// reads, a vectorisable interleave).
void pack_panel_transposed(MatView<const bf16> wt, std::size_t p, std::size_t kp, bf16* dst) {
  const std::size_t n0 = p * kPanel;
  const std::size_t cols = wt.cols > n0 ? std::min(kPanel, wt.cols - n0) : 0;
  const std::size_t pairs = (wt.rows + 1) / 2;
  const bf16 zero{};
  for (std::size_t kk = 0; kk < pairs; ++kk) {
    bf16* d = dst + kk * 2 * kPanel;
    if (cols) {
      const bf16* r0 = wt.row(2 * kk) + n0;
      if (2 * kk + 1 < wt.rows) {
        const bf16* r1 = wt.row(2 * kk + 1) + n0;
        for (std::size_t n = 0; n < cols; ++n) d[2 * n + lo] = r0[n], d[2 * n + hi] = r1[n];
      } else {
        for (std::size_t n = 0; n < cols; ++n) d[2 * n + lo] = r0[n], d[2 * n + hi] = zero;
      }
    }
    std::fill(d + 2 * cols, d + 2 * kPanel, zero);
  }
  std::fill(dst + pairs * 2 * kPanel, dst + kp * kPanel, zero);
}

}  // namespace

PackedWeights PackedWeights::pack(MatView<const bf16> w, MatView<const bf16> second) {
  return pack(w, second, PackedWeights{});
}

PackedWeights PackedWeights::pack(MatView<const bf16> w, MatView<const bf16> second,
                                  PackedWeights&& storage) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  detail::Checker c{"gemm.pack"};
  contracts::gemm_pack_pre(c, w, second);
  if (c.stop()) return {};
  PackedWeights out = pack_operand(w, second, std::move(storage));
  out.take_checksums();
  contracts::gemm_pack_post(c, w, second, out);
  return out;
}

PackedWeights PackedWeights::shaped(std::size_t rows, std::size_t depth, bool interleaved) {
  PackedWeights out;
  out.interleaved_ = interleaved;
  out.k_ = depth;
  out.kp_ = round_up(std::max<std::size_t>(depth, 1), kKStep);
  out.n_ = interleaved ? 2 * round_up(rows, kPanel) : rows;
  out.np_ = round_up(std::max<std::size_t>(out.n_, 1), 2 * kPanel);
  return out;
}

PackedWeights PackedWeights::sized(std::size_t rows, std::size_t depth, bool interleaved,
                                   PackedWeights&& storage) {
  PackedWeights out = shaped(rows, depth, interleaved);
  out.allocate(out.np_ * out.kp_ * sizeof(bf16), std::move(storage));
  return out;
}

void PackedWeights::allocate(std::size_t bytes, PackedWeights&& storage) {
  if (storage.data_ && storage.storage_bytes_ == bytes && !storage.quantized())
    data_ = std::move(storage.data_);
  else
    data_.reset(static_cast<bf16*>(detail::allocate(bytes)));
  storage_bytes_ = bytes;
}

std::size_t PackedWeights::bytes() const {
  return storage_bytes_ + scales_.size() * sizeof(float) + srow_.size() * sizeof(std::uint32_t);
}

ByteRange PackedWeights::storage() const {
  const auto b = reinterpret_cast<std::uintptr_t>(data_.get());
  return {b, b + storage_bytes_};
}

PackedWeights PackedWeights::pack_transposed(MatView<const bf16> wt, PackedWeights&& storage) {
  const moecert::detail::FpDefaults fp;
  detail::Checker c{"gemm.pack"};
  contracts::gemm_pack_pre(c, wt, {});
  if (c.stop()) return {};
  PackedWeights out = pack_transposed_operand(wt, std::move(storage));
  out.take_checksums();
  contracts::gemm_pack_transposed_post(c, wt, out);
  return out;
}

PackedWeights PackedWeights::pack_transposed_operand(MatView<const bf16> wt,
                                                     PackedWeights&& storage) {
  PackedWeights out = sized(wt.cols, wt.rows, false, std::move(storage));
  for (std::size_t p = 0; p < out.np_ / kPanel; ++p)
    pack_panel_transposed(wt, p, out.kp_, out.data_.get() + p * out.kp_ * kPanel);
  out.audit_ = std::make_shared<moecert::detail::PackAudit>();
  return out;
}

PackedWeights PackedWeights::pack_operand(MatView<const bf16> w, MatView<const bf16> second,
                                          PackedWeights&& storage) {
  PackedWeights out = sized(w.rows, w.cols, second.data != nullptr, std::move(storage));
  const std::size_t panel_elems = out.kp_ * kPanel;
  const std::size_t panels = out.np_ / kPanel;
  for (std::size_t p = 0; p < panels; ++p) {
    bf16* dst = out.data_.get() + p * panel_elems;
    if (out.interleaved_)
      pack_panel(p % 2 == 0 ? w : second, p / 2, out.kp_, dst);
    else
      pack_panel(w, p, out.kp_, dst);
  }
  out.audit_ = std::make_shared<moecert::detail::PackAudit>();
  return out;
}

namespace {

constexpr std::uint64_t kBasis = 0xcbf29ce484222325ull, kPrime = 0x100000001b3ull;

// FNV-1a over the 64-bit words of [p, p + bytes) in 8 interleaved lanes
// (word i into lane i mod 8, so that 8 multiplications are in flight rather
// than one chain), the lanes then folded in order by the same step. Each
// step is a bijection of its lane's state, so a change in any one word
// changes the sum.
std::uint64_t fnv_lanes(const unsigned char* p, std::size_t bytes) {
  constexpr std::size_t kLanes = 8;
  std::uint64_t lane[kLanes];
  std::fill(lane, lane + kLanes, kBasis);
  std::size_t i = 0;
  for (; i + 8 * kLanes <= bytes; i += 8 * kLanes)
    for (std::size_t l = 0; l < kLanes; ++l) {
      std::uint64_t word;
      std::memcpy(&word, p + i + 8 * l, 8);
      lane[l] = (lane[l] ^ word) * kPrime;
    }
  for (std::size_t l = 0; i + 8 <= bytes; i += 8, ++l) {
    std::uint64_t word;
    std::memcpy(&word, p + i, 8);
    lane[l] = (lane[l] ^ word) * kPrime;
  }
  std::uint64_t h = kBasis;
  for (std::uint64_t v : lane) h = (h ^ v) * kPrime;
  return h;
}

// The parts' checksums folded in order by the same step.
std::uint64_t fold(const std::vector<std::uint64_t>& parts) {
  std::uint64_t h = kBasis;
  for (std::uint64_t v : parts) h = (h ^ v) * kPrime;
  return h;
}

}  // namespace

std::uint64_t PackedWeights::compute_part_checksum(std::size_t part) const {
  const std::size_t panels = np_ / kPanel, parts = part_checksums_.size() - quantized();
  if (part == parts) {  // a quantized pack's last part: its scales and their row index
    const std::uint64_t s = fnv_lanes(reinterpret_cast<const unsigned char*>(scales_.data()),
                                      scales_.size() * sizeof(float));
    return (s ^ fnv_lanes(reinterpret_cast<const unsigned char*>(srow_.data()),
                          srow_.size() * sizeof(std::uint32_t))) *
           kPrime;
  }
  const std::size_t p0 = part * panels / parts, p1 = (part + 1) * panels / parts;
  const std::size_t panel_bytes = storage_bytes_ / panels;
  return fnv_lanes(reinterpret_cast<const unsigned char*>(data_.get()) + p0 * panel_bytes,
                   (p1 - p0) * panel_bytes);
}

std::uint64_t PackedWeights::checksum() const { return fold(part_checksums_); }

std::uint64_t PackedWeights::compute_checksum() const {
  std::vector<std::uint64_t> now(part_checksums_.size());
  for (std::size_t p = 0; p < now.size(); ++p) now[p] = compute_part_checksum(p);
  return fold(now);
}

void PackedWeights::take_checksums() {
  part_checksums_.assign(std::min(kChecksumParts, np_ / kPanel) + quantized(), 0);
  for (std::size_t p = 0; p < part_checksums_.size(); ++p)
    part_checksums_[p] = compute_part_checksum(p);
  audit_ = std::make_shared<moecert::detail::PackAudit>();
}

}  // namespace moecert::gemm
