// PackedExperts: per-expert packing of gate+up (fused) and down.
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <vector>

#include "contracts/experts/experts.hpp"
#include "moecert/experts.hpp"
#include "ops/core/task.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::experts {

PackedExperts PackedExperts::pack(std::size_t experts, MatView<const bf16> w_gate,
                                  MatView<const bf16> w_up, MatView<const bf16> w_down,
                                  bool backward) {
  PackedExperts out;
  out.hidden_ = w_gate.cols;
  out.inter_ = experts ? w_gate.rows / experts : 0;
  out.gate_up_.resize(experts);
  out.down_.resize(experts);
  const std::size_t i_rows = out.inter_, h_rows = out.hidden_;
  // gemm.pack's clauses run per matrix, at the caller's contract settings on
  // every thread (a violation escapes the parallel loop as the exception
  // oneTBB rethrows).
  oneapi::tbb::parallel_for(
      std::size_t{0}, experts, moecert::detail::task([&](std::size_t e) {
        MatView<const bf16> g(w_gate.row(e * i_rows), i_rows, w_gate.cols, w_gate.stride);
        MatView<const bf16> u(w_up.row(e * i_rows), i_rows, w_up.cols, w_up.stride);
        MatView<const bf16> d(w_down.row(e * h_rows), h_rows, w_down.cols, w_down.stride);
        out.gate_up_[e] = gemm::PackedWeights::pack(g, u);
        out.down_[e] = gemm::PackedWeights::pack(d);
      }));
  if (!backward) return out;
  out.down_t_.resize(experts);
  out.gate_up_t_.resize(experts);
  // W_d^T, and [W_g^T | W_u^T] = [W_g; W_u]^T, packed from the weights'
  // rows (the gate and up rows stacked in one buffer: two arrays).
  oneapi::tbb::parallel_for(
      std::size_t{0}, experts, moecert::detail::task([&](std::size_t e) {
        std::vector<bf16> gu(2 * i_rows * h_rows);
        for (std::size_t i = 0; i < i_rows; ++i) {
          std::copy_n(w_gate.row(e * i_rows + i), h_rows, gu.data() + i * h_rows);
          std::copy_n(w_up.row(e * i_rows + i), h_rows, gu.data() + (i_rows + i) * h_rows);
        }
        const MatView<const bf16> d(w_down.row(e * h_rows), h_rows, w_down.cols, w_down.stride);
        out.down_t_[e] = gemm::PackedWeights::pack_transposed(d, {});
        out.gate_up_t_[e] = gemm::PackedWeights::pack_transposed(
            MatView<const bf16>(gu.data(), 2 * i_rows, h_rows), {});
      }));
  return out;
}

PackedExperts PackedExperts::pack(const std::vector<QuantView>& w_gate,
                                  const std::vector<QuantView>& w_up,
                                  const std::vector<QuantView>& w_down, bool backward) {
  detail::Checker c{"experts.pack"};
  contracts::experts_pack_pre(c, w_gate, w_up, w_down);
  if (c.stop()) return {};
  const std::size_t E = w_gate.size();
  PackedExperts out;
  out.format_ = w_gate[0].format;
  out.hidden_ = w_gate[0].cols;
  out.inter_ = w_gate[0].rows;
  out.gate_up_.resize(E);
  out.down_.resize(E);
  out.down_t_.resize(backward ? E : 0);
  out.gate_up_t_.resize(backward ? E : 0);
  // gemm.pack's clauses run per matrix, as for bf16 weights; the transposed
  // packs take the same codes: W_d^T, and [W_g; W_u]^T with up's rows under
  // gate's.
  oneapi::tbb::parallel_for(std::size_t{0}, E, moecert::detail::task([&](std::size_t e) {
                              out.gate_up_[e] = gemm::PackedWeights::pack(w_gate[e], w_up[e]);
                              out.down_[e] = gemm::PackedWeights::pack(w_down[e]);
                              if (!backward) return;
                              out.down_t_[e] = gemm::PackedWeights::pack_transposed(w_down[e]);
                              out.gate_up_t_[e] =
                                  gemm::PackedWeights::pack_transposed(w_gate[e], w_up[e]);
                            }));
  return out;
}

void PackedExperts::unpack(MatView<bf16> w_gate, MatView<bf16> w_up, MatView<bf16> w_down) const {
  const std::size_t I = inter_, H = hidden_;
  oneapi::tbb::parallel_for(std::size_t{0}, experts(), moecert::detail::task([&](std::size_t e) {
                              for (std::size_t i = 0; i < I; ++i)
                                for (std::size_t h = 0; h < H; ++h) {
                                  w_gate(e * I + i, h) = gate(e, i, h);
                                  w_up(e * I + i, h) = up(e, i, h);
                                }
                              for (std::size_t h = 0; h < H; ++h)
                                for (std::size_t i = 0; i < I; ++i)
                                  w_down(e * H + h, i) = down(e, h, i);
                            }));
}

namespace {

// Matrix [rows x cols] of format f held in pack p, element (n, k) at packed
// (column(n), k): its codes and, from one element of each block, its scales.
template <class Column>
void unpack_matrix(const gemm::PackedWeights& p, WeightFormat f, std::size_t rows, std::size_t cols,
                   Column column, const QuantOut& out) {
  const FormatInfo& info = format_info(f);
  const bool nibbles = info.code_bits == 4;
  for (std::size_t n = 0; n < rows; ++n)
    for (std::size_t k = 0; k < cols; ++k) out.set_code(nibbles, n, k, p.code_at(column(n), k));
  const std::size_t br = info.block_rows ? info.block_rows : rows,
                    bc = info.block_cols ? info.block_cols : cols;
  for (std::size_t n = 0; n < rows; n += br)
    for (std::size_t k = 0; k < cols; k += bc)
      out.scales[(n / br) * out.scale_stride + k / bc] = p.scale_at(column(n), k);
}

}  // namespace

void PackedExperts::unpack(const std::vector<QuantOut>& w_gate, const std::vector<QuantOut>& w_up,
                           const std::vector<QuantOut>& w_down) const {
  const std::size_t I = inter_, H = hidden_;
  oneapi::tbb::parallel_for(
      std::size_t{0}, experts(), moecert::detail::task([&](std::size_t e) {
        const auto gate = [](std::size_t i) {
          return 2 * gemm::kPanel * (i / gemm::kPanel) + i % gemm::kPanel;
        };
        const auto up = [](std::size_t i) {
          return 2 * gemm::kPanel * (i / gemm::kPanel) + gemm::kPanel + i % gemm::kPanel;
        };
        unpack_matrix(gate_up_[e], format_, I, H, gate, w_gate[e]);
        unpack_matrix(gate_up_[e], format_, I, H, up, w_up[e]);
        unpack_matrix(
            down_[e], format_, H, I, [](std::size_t h) { return h; }, w_down[e]);
      }));
}

bf16 PackedExperts::gate(std::size_t e, std::size_t i, std::size_t h) const {
  return gate_up_[e].at(2 * gemm::kPanel * (i / gemm::kPanel) + i % gemm::kPanel, h);
}

bf16 PackedExperts::up(std::size_t e, std::size_t i, std::size_t h) const {
  return gate_up_[e].at(2 * gemm::kPanel * (i / gemm::kPanel) + gemm::kPanel + i % gemm::kPanel, h);
}

std::size_t PackedExperts::bytes() const {
  std::size_t b = 0;
  for (std::size_t e = 0; e < experts(); ++e) b += gate_up_[e].bytes() + down_[e].bytes();
  for (std::size_t e = 0; e < down_t_.size(); ++e) b += down_t_[e].bytes() + gate_up_t_[e].bytes();
  return b;
}

}  // namespace moecert::experts
