// PackedLora: every expert's LoRA factors, packed as the B operands of the
// GEMMs that multiply by them (ops/experts/lora.hpp).
#include "ops/experts/lora.hpp"

#include <oneapi/tbb/parallel_for.h>

#include "ops/core/task.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::experts {

namespace {

// A small row-major bf16 matrix built from the factors before packing.
struct Dense {
  std::size_t rows, cols;
  std::vector<bf16> v;
  Dense(std::size_t r, std::size_t c) : rows(r), cols(c), v(r * c) {}
  bf16& operator()(std::size_t i, std::size_t j) { return v[i * cols + j]; }
  MatView<const bf16> view() const { return {v.data(), rows, cols, cols}; }
};

}  // namespace

PackedLora PackedLora::pack(const Lora& l, std::size_t experts, std::size_t hidden,
                            std::size_t inter, bool backward) {
  return pack(l, experts, hidden, inter, backward, PackedLora{});
}

PackedLora PackedLora::pack(const Lora& l, std::size_t experts, std::size_t hidden,
                            std::size_t inter, bool backward, PackedLora&& previous,
                            const Hook& packed) {
  PackedLora out;
  out.rank = l.rank;
  if (out.rank == 0) return out;
  out.scale = static_cast<float>(l.alpha / static_cast<double>(l.rank));
  const std::size_t r = out.rank, H = hidden, I = inter;
  out.experts = std::move(
      previous.experts);  // storage: each pack below reuses its buffer if the size matches
  out.experts.resize(experts);
  // Packed as operands, without gemm.pack's per-matrix clauses: every factor
  // element is judged by the calling op's lora_finite clause before this runs
  // and the packs' rank padding by its lora_padding through `packed`, per
  // call; the packing code is the one gemm.pack's roundtrip holds for the
  // expert weights.
  oneapi::tbb::parallel_for(
      std::size_t{0}, out.experts.size(), moecert::detail::task([&](std::size_t e) {
        auto ag = [&](std::size_t k, std::size_t h) { return l.a_gate(e * r + k, h); };
        auto au = [&](std::size_t k, std::size_t h) { return l.a_up(e * r + k, h); };
        auto bg = [&](std::size_t i, std::size_t k) { return l.b_gate(e * I + i, k); };
        auto bu = [&](std::size_t i, std::size_t k) { return l.b_up(e * I + i, k); };
        PackedLoraExpert& p = out.experts[e];
        // [A_g; A_u] (2r x H), and blockdiag(B_g, B_u) (2I x 2r): its rows [B_g | 0]
        // then [0 | B_u], the gate and up halves of the fused B_gu.
        Dense agu(2 * r, H), bgu(2 * I, 2 * r);
        for (std::size_t k = 0; k < r; ++k)
          for (std::size_t h = 0; h < H; ++h) agu(k, h) = ag(k, h), agu(r + k, h) = au(k, h);
        for (std::size_t i = 0; i < I; ++i)
          for (std::size_t k = 0; k < r; ++k) bgu(i, k) = bg(i, k), bgu(I + i, r + k) = bu(i, k);
        const MatView<const bf16> bg0(bgu.v.data(), I, 2 * r),
            bu0(bgu.v.data() + I * 2 * r, I, 2 * r);
        // A_d[e] and B_d[e] are row blocks of the stacked factors: packed in place.
        const MatView<const bf16> a_d(l.a_down.row(e * r), r, I, l.a_down.stride),
            b_d(l.b_down.row(e * H), H, r, l.b_down.stride);
        p.a_gu = gemm::PackedWeights::pack_operand(agu.view(), {}, std::move(p.a_gu));
        p.b_gu = gemm::PackedWeights::pack_operand(bg0, bu0, std::move(p.b_gu));
        p.a_d = gemm::PackedWeights::pack_operand(a_d, {}, std::move(p.a_d));
        p.b_d = gemm::PackedWeights::pack_operand(b_d, {}, std::move(p.b_d));
        if (backward) {
          // The backward's orientations are transposes of the same matrices:
          // B_d^T, A_d^T, blockdiag(B_g, B_u)^T = [[B_g^T 0] [0 B_u^T]] and
          // [A_g; A_u]^T = [A_g^T | A_u^T], packed straight from them.
          p.b_d_t = gemm::PackedWeights::pack_transposed_operand(b_d, std::move(p.b_d_t));
          p.a_d_t = gemm::PackedWeights::pack_transposed_operand(a_d, std::move(p.a_d_t));
          p.b_gu_t = gemm::PackedWeights::pack_transposed_operand(bgu.view(), std::move(p.b_gu_t));
          p.a_gu_t = gemm::PackedWeights::pack_transposed_operand(agu.view(), std::move(p.a_gu_t));
        } else {
          for (auto* t : {&p.b_d_t, &p.a_d_t, &p.b_gu_t, &p.a_gu_t}) *t = gemm::PackedWeights{};
        }
        if (packed) packed(e, p);
      }));
  return out;
}

}  // namespace moecert::experts
