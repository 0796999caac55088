// LoRA factors packed for the expert GEMMs (forward and backward).
#pragma once

#include <functional>
#include <vector>

#include "moecert/experts.hpp"
#include "moecert/gemm.hpp"

namespace moecert::experts {

/// One expert's LoRA factors packed as B operands (C = A W^T) of the GEMMs
/// that use them; the rank is zero-padded to the packing's K step (32) and
/// N step, and that padding must stay zero (experts.forward_train.lora_padding).
struct PackedLoraExpert {
  gemm::PackedWeights a_gu;    // [A_g; A_u]            [2r x H]   xa = x [A_g; A_u]^T
  gemm::PackedWeights b_gu;    // [B_g | 0], [0 | B_u]  interleaved like gate_up; K = 2r
  gemm::PackedWeights a_d;     // A_d                   [r x I]    ha = h A_d^T
  gemm::PackedWeights b_d;     // B_d                   [H x r]    o += lb_d B_d^T
  gemm::PackedWeights b_d_t;   // B_d^T                 [r x H]    dyb = dy B_d
  gemm::PackedWeights a_d_t;   // A_d^T                 [I x r]    dh += q_d A_d
  gemm::PackedWeights b_gu_t;  // [[B_g^T 0] [0 B_u^T]] [2r x 2I] dgb = [dg du] blockdiag(B_g, B_u)
  gemm::PackedWeights a_gu_t;  // [A_g^T | A_u^T]       [H x 2r]   dx += q_gu [A_g; A_u]
};

struct PackedLora {
  std::size_t rank = 0;
  float scale = 0.0f;  // float(alpha / r)
  std::vector<PackedLoraExpert> experts;
  /// Called with each expert's packs as soon as they are written, on the
  /// thread that wrote them (a contract judges them while they are in its
  /// cache).
  using Hook = std::function<void(std::size_t expert, const PackedLoraExpert&)>;
  /// Packs every expert's factors (both orientations when `backward`) for
  /// E experts of H -> I -> H, reusing the memory of `previous` where the
  /// shapes match; `packed` (if set) sees each expert's packs.
  static PackedLora pack(const Lora& l, std::size_t experts, std::size_t hidden, std::size_t inter,
                         bool backward, PackedLora&& previous, const Hook& packed = {});
  static PackedLora pack(const Lora& l, std::size_t experts, std::size_t hidden, std::size_t inter,
                         bool backward);
};

}  // namespace moecert::experts
