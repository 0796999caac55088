// BF16 x BF16 -> FP32 GEMM against weights packed once: C = A W^T.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#include "moecert/formats.hpp"
#include "moecert/types.hpp"

namespace moecert {
namespace detail {
/// Frees a pack's storage (ops/core/memory.cpp).
struct AlignedFree {
  void operator()(bf16* p) const;
};
/// What the contracts keep beside one pack between calls, and the library's
/// own access to it (contracts/gemm/pack_audit.hpp).
struct PackAudit;
struct PackAccess;
}  // namespace detail

namespace gemm {
struct DecodeArgs;  // ops/gemm/ukernel.hpp: the library's own

/// Weights W [N x K] (row n = output column n, as in W[out, in]) packed for
/// every kernel: 16-column panels of VNNI pairs, N padded to a multiple of
/// 32 and K to a multiple of 32, padding zero (ops/gemm/ukernel.hpp).
/// Checksums of the packed bytes are taken at pack time, one per part of
/// the panels (up to kChecksumParts parts; a quantized pack has one more,
/// over its scales).
///
/// Clauses (contracts/gemm/gemm.cpp):
///   gemm.pack.shape      pre  shape    stride >= cols; `second` absent or of w's shape
///   gemm.pack.w_finite   pre  finite   every W element finite
///   gemm.pack.w_range    pre  numeric  every W element 0 or 2^-60 <= |w| <= 2^60 (no product of
///                                      two in-range bf16 underflows or overflows; proofs/bounds.md §0;
///                                      audit)
///   gemm.pack.roundtrip  post memory   every W element reads back from the packed layout (at());
///                                      pack_transposed: every wt[k][n] as W[n][k]; quantized:
///                                      as bf16(fp32(code * scale)), padding 0
///   gemm.pack.q_shape    pre  shape    quantized packs: a format other than bf16, codes and
///                                      scales present, stride >= the row's code bytes,
///                                      scale_stride >= scale columns; second of w's format and
///                                      shape (pack_transposed: of wt's columns)
///   gemm.pack.q_code     pre  numeric  int8 codes in [-127, 127], int4 in [-7, 7]; no e4m3 NaN
///   gemm.pack.q_scale    pre  finite   every scale finite and > 0
/// (quantized packs: w_finite and w_range judge the dequantized weights)
///   gemm.pack.checksum   invariant memory  the packed bytes still hash to the pack-time checksums,
///                                      verified by the ops that read them: at audit one part
///                                      per call in rotation (every byte within kChecksumParts
///                                      calls), at full every part on every call (packs of
///                                      pack() and pack_transposed(); an operand pack, formed
///                                      for one call, takes none)
class PackedWeights {
 public:
  /// Columns per packed panel (the interleaving unit of a fused pair).
  static constexpr std::size_t kPanel = 16;
  /// Most parts the checksums split the panels into.
  static constexpr std::size_t kChecksumParts = 64;

  PackedWeights() = default;

  /// Packs W. With `second`, packs two matrices of equal shape interleaved by
  /// panel (W's panel p, then second's panel p, ...): the fused gate+up
  /// layout, N = 2 * round_up(rows, 16) columns.
  static PackedWeights pack(MatView<const bf16> w, MatView<const bf16> second = {});
  /// pack(), writing into `storage`'s memory when it has the same padded
  /// size (no fresh pages for a repack after an optimizer step).
  static PackedWeights pack(MatView<const bf16> w, MatView<const bf16> second,
                            PackedWeights&& storage);
  /// The same layout without the gemm.pack clauses and checksums: for an
  /// operand an op forms from its own activations for one call (any finite
  /// value is legal there, and the op's own clauses judge the result).
  static PackedWeights pack_operand(MatView<const bf16> w, MatView<const bf16> second,
                                    PackedWeights&& storage);
  /// Packs W = wt^T (W[n][k] = wt[k][n]) without forming it: each packed k
  /// pair interleaves two rows of wt (the layout of pack(W) bit for bit).
  /// The gemm.pack clauses, on wt's elements.
  static PackedWeights pack_transposed(MatView<const bf16> wt, PackedWeights&& storage);
  /// pack_transposed() without the gemm.pack clauses, as pack_operand() is
  /// pack() without them: for an operand whose elements the calling op's own
  /// clauses have judged.
  static PackedWeights pack_transposed_operand(MatView<const bf16> wt, PackedWeights&& storage);
  /// Packs quantized W (a format other than bf16): its codes in the panel
  /// order of the bf16 layout (a byte per element; int4: a byte per VNNI
  /// pair, k even in the low nibble), zero codes as padding, its scales as
  /// the source has them. The loops decode a work item's panels into bf16,
  /// bf16(fp32(code * scale)), before the kernel multiplies (decode_panels),
  /// and at() reads the decoded weights. With `second` (codes set), the
  /// fused pair of pack(w, second). The gemm.pack clauses on the codes,
  /// scales and decoded weights.
  static PackedWeights pack(const QuantView& w, const QuantView& second = {});
  /// W = [wt; below]^T for quantized wt (below, if set, of wt's format and
  /// columns: its rows under wt's), as pack_transposed() for bf16.
  static PackedWeights pack_transposed(const QuantView& wt, const QuantView& below = {});

  std::size_t n() const { return n_; }    // logical columns (rows of W; 2x for a fused pair)
  std::size_t k() const { return k_; }    // logical depth
  std::size_t np() const { return np_; }  // padded columns (multiple of 32)
  std::size_t kp() const { return kp_; }  // padded depth (multiple of 32)
  bool interleaved() const { return interleaved_; }
  WeightFormat format() const { return format_; }
  bool quantized() const { return format_ != WeightFormat::bf16; }
  /// The bf16 panels (bf16 format; null for a quantized pack).
  const bf16* data() const { return quantized() ? nullptr : data_.get(); }
  std::size_t size() const { return np_ * kp_; }  // elements
  /// Bytes the pack holds: the packed values or codes, and the scales with
  /// their row index.
  std::size_t bytes() const;
  /// The byte range of the packed values or codes.
  ByteRange storage() const;
  /// W[n][k] read back from the packed layout (n < np, k < kp): a quantized
  /// pack's decoded weight.
  bf16 at(std::size_t n, std::size_t k) const {
    const std::size_t e =
        (n / kPanel) * kp_ * kPanel + (k / 2) * 2 * kPanel + (n % kPanel) * 2 + (k % 2);
    return quantized() ? decoded(n, k, e) : data_[e];
  }
  /// A quantized pack's code of W[n][k] (int4: the nibble) and its scale.
  unsigned code_at(std::size_t n, std::size_t k) const;
  float scale_at(std::size_t n, std::size_t k) const { return scale_of(n, k); }
  /// Panels [p0, p1) of a quantized pack decoded into dst in the bf16 layout
  /// ((p1 - p0) kp 16 elements) by `decode` (a kernel's; every one gives
  /// the at() values bit for bit).
  void decode_panels(std::size_t p0, std::size_t p1, bf16* dst,
                     void (*decode)(const DecodeArgs&)) const;
  /// The pack-time checksum of all packed bytes (the parts' folded).
  std::uint64_t checksum() const;
  /// The same, of the bytes as they are now.
  std::uint64_t compute_checksum() const;
  /// Parts: part p holds panels [p P / parts, (p + 1) P / parts) of the P.
  std::size_t checksum_parts() const { return part_checksums_.size(); }
  std::uint64_t part_checksum(std::size_t part) const { return part_checksums_[part]; }
  std::uint64_t compute_part_checksum(std::size_t part) const;

 private:
  friend struct moecert::detail::PackAccess;
  // The sizes for W of `rows` x `depth` (two interleaved: 2x the columns);
  // no storage yet.
  static PackedWeights shaped(std::size_t rows, std::size_t depth, bool interleaved);
  // shaped() and bf16 storage (`storage`'s where the size matches); panels
  // not yet written.
  static PackedWeights sized(std::size_t rows, std::size_t depth, bool interleaved,
                             PackedWeights&& storage);
  // The part checksums of the packed bytes and a fresh PackAudit.
  void take_checksums();
  // Storage for `bytes` of packed values or codes.
  void allocate(std::size_t bytes, PackedWeights&& storage);
  // A quantized pack of np x kp (set): its zeroed codes, returned, and its
  // scale table (a's rows, then b's if set, columns over `span` elements).
  std::uint8_t* quantized_storage(const QuantView& a, const QuantView& b, std::size_t span);
  // A quantized pack's weight (n, k) decoded; e: its element index.
  bf16 decoded(std::size_t n, std::size_t k, std::size_t e) const;
  // Its scale: the scale table's row of the packed column n (or, transposed,
  // of the packed depth k) and column of k (n) over the block width.
  float scale_of(std::size_t n, std::size_t k) const {
    return transposed_ ? scales_[srow_[k] * sstride_ + n / sblock_]
                       : scales_[srow_[n] * sstride_ + k / sblock_];
  }

  std::unique_ptr<bf16[], moecert::detail::AlignedFree> data_;
  std::size_t n_ = 0, k_ = 0, np_ = 0, kp_ = 0;
  bool interleaved_ = false;
  WeightFormat format_ = WeightFormat::bf16;
  std::size_t storage_bytes_ = 0;
  // Quantized: the scale table (the sources' rows, columns over the padded
  // dimension), the table row of each packed column (transposed: packed
  // depth), the block width along the other dimension.
  bool transposed_ = false;
  bool normal_products_ = false;  // every nonzero code * scale normal (ukernel.hpp DecodeArgs)
  std::vector<float> scales_;
  std::vector<std::uint32_t> srow_;
  std::size_t sstride_ = 0, sblock_ = 1;
  std::vector<std::uint64_t> part_checksums_;
  std::shared_ptr<moecert::detail::PackAudit> audit_;
};

/// C [M x N] = A [M x K] W^T in fp32 on kernel `isa` (every element written;
/// one writer each; the same bits for any thread count).
///
/// Clauses (contracts/gemm/gemm.cpp):
///   gemm.matmul.shape      pre   shape    a.cols == w.k(), c.rows == a.rows, c.cols == w.n()
///   gemm.matmul.a_finite   pre   finite   every A element finite
///   gemm.matmul.a_range    pre   numeric  every A element 0 or 2^-60 <= |a| <= 2^60 (audit)
///   gemm.matmul.no_alias   pre   alias    C shares no byte with A or the packed weights
///   gemm.matmul.c_finite   post  finite   every C element finite
///   gemm.matmul.probe      post  numeric  Freivalds probes within their bound (audit): every row
///                                         against W's dense probe and one 4-column block in
///                                         rotation (proofs/bounds.md §9.1)
///   gemm.matmul.within_bound post numeric every element within bounds::dot of the reference (full; §1)
/// `isa` must be usable here (std::invalid_argument otherwise: no AMX
/// instruction ever runs on a machine without AMX).
void matmul(MatView<const bf16> a, const PackedWeights& w, MatView<float> c, Isa isa);

}  // namespace gemm
}  // namespace moecert
