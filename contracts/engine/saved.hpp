// What an op keeps besides its outputs (grouping, intermediate rows, the
// state a backward reads), as plain views the op fills in: the clauses read
// these and none of the op's own types, so contracts/ includes nothing from
// ops/ (a judge that shares the code it judges cannot catch its bugs).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "moecert/gemm.hpp"
#include "moecert/layer.hpp"
#include "moecert/types.hpp"

namespace moecert::contracts {

/// Routed (token, slot) pairs grouped by expert: expert e's rows are
/// [begin[e], begin[e] + count[e]) in token order, padded up to begin[e+1];
/// row_slot[row] is the slot t*K + j the row holds, or -1 for padding;
/// slot_row[t*K + j] the row holding the slot, or -1 for an empty slot.
struct GroupingView {
  std::size_t experts = 0, routed = 0;
  std::span<const std::size_t> count, begin;  // E and E + 1 entries
  std::span<const std::int32_t> row_slot;
  std::span<const std::int64_t> slot_row;
  std::size_t rows() const { return begin.empty() ? 0 : begin.back(); }
  /// The expert whose rows (padding included) hold grouped row `row`.
  std::size_t expert_of(std::size_t row) const {
    return static_cast<std::size_t>(std::upper_bound(begin.begin(), begin.end(), row) -
                                    begin.begin()) -
           1;
  }
  /// Whether grouped row `row` holds a routed slot (not padding).
  bool routed_row(std::size_t row) const {
    const std::size_t e = expert_of(row);
    return row < begin[e] + count[e];
  }
};

/// bf16 rows stored as a GEMM's A operand: row-major at `ld` (tile_rows 0),
/// or in tiles of tile_rows x k_step elements, each row-major and
/// contiguous, the tiles of a block of tile_rows rows in k order, block b at
/// b * ld (the AMX layout: 16 x 32).
struct OperandRows {
  const bf16* data = nullptr;
  std::size_t ld = 0, tile_rows = 0, k_step = 0;
  bf16 at(std::size_t r, std::size_t k) const {
    if (tile_rows == 0) return data[r * ld + k];
    return data[(r / tile_rows) * ld + (k / k_step) * (tile_rows * k_step) +
                (r % tile_rows) * k_step + k % k_step];
  }
  /// Row r as runs of elements: its element 0 at `first`, `run` elements
  /// per run, run j at first + j stride.
  struct Runs {
    const bf16* first;
    std::size_t run, stride;
  };
  Runs row(std::size_t r, std::size_t k) const {
    if (tile_rows == 0) return {data + r * ld, std::max<std::size_t>(k, 1), 0};
    return {data + (r / tile_rows) * ld + (r % tile_rows) * k_step, k_step, tile_rows * k_step};
  }
  /// Row r's elements [0, k) in order as contiguous runs: f(k0, p, n) for
  /// elements k0 .. k0 + n - 1 at p.
  template <class F>
  void runs(std::size_t r, std::size_t k, F f) const {
    const Runs w = row(r, k);
    for (std::size_t k0 = 0, j = 0; k0 < k; k0 += w.run, ++j)
      f(k0, w.first + j * w.stride, std::min(w.run, k - k0));
  }
};

class ExpertsProbe;

/// c1's digests as the audited training forward wrote c1, for
/// experts.backward.saved_intact: verify::detail::row_digests of each
/// grouped row's part b (the columns of one work item of the op) at
/// [b rows + row] (a part's rows contiguous, as the op hands a block's rows
/// over), so that a row's digest is the sum of its parts' mod 2^32; `valid`
/// once a forward recorded them.
struct SavedDigests {
  std::vector<std::uint32_t> c1;
  bool valid = false;
};

/// The experts forward's rows in grouped order. c1 is the fused gate/up
/// output: gate column i at 2P (i / P) + i % P, up column i P further
/// (P = gemm::PackedWeights::kPanel).
struct ExpertRows {
  GroupingView grouping;
  const float* c1 = nullptr;  // [rows x ldc1], or null when not kept
  std::size_t ldc1 = 0;
  const ExpertsProbe* probe = nullptr;             // the audit probe's sums, where c1 is not kept
  std::span<const std::uint32_t> c1_digests = {};  // SavedDigests::c1 where recorded, else empty
  OperandRows h;                                   // silu(g) * u, bf16
  const float* o = nullptr;                        // down GEMM output [rows x ldo]
  std::size_t ldo = 0;
  std::size_t rank = 0;       // LoRA rank r (0: none)
  const float* xa = nullptr;  // [rows x 2r]
  const float* ha = nullptr;  // [rows x r]
};

/// What a training forward of the experts op kept for its backward.
struct TrainSaved {
  bool valid = false, training = false;
  std::size_t tokens = 0, topk = 0;
  std::size_t experts = 0, hidden = 0, inter = 0, rank = 0;
  double alpha = 0;
  const std::int32_t* idx = nullptr;  // [T x K]
  const float* weights = nullptr;     // [T x K]
  ExpertRows rows;
  ByteRange workspace;  // every byte the saved state owns
  MatView<const std::int32_t> idx_view() const { return {idx, tokens, topk, topk}; }
  MatView<const float> weights_view() const { return {weights, tokens, topk, topk}; }
};

/// What a training forward of the layer kept: the experts op's state, the
/// config it ran with, the router's logits [T x R], and dL/dw [T x K] where
/// the backward formed it (else null).
struct LayerSaved {
  TrainSaved train;
  MoeConfig cfg;
  const float* logits = nullptr;
  const float* router_dw = nullptr;
};

/// One packed LoRA factor of one expert, by name ("a_gu", "b_d_t", ...).
struct PackedFactor {
  std::size_t expert = 0;
  const char* name = "";
  const gemm::PackedWeights* packed = nullptr;
};

}  // namespace moecert::contracts
