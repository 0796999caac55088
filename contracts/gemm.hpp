// Clauses of the GEMM ops (declared in include/moecert/gemm.hpp).
#pragma once

#include "contracts/engine.hpp"
#include "moecert/gemm.hpp"

namespace moecert::contracts {

void gemm_pack_pre(detail::Checker& c, MatView<const bf16> w, MatView<const bf16> second);
void gemm_pack_post(detail::Checker& c, MatView<const bf16> w, MatView<const bf16> second,
                    const gemm::PackedWeights& out);
void gemm_pack_transposed_post(detail::Checker& c, MatView<const bf16> wt,
                               const gemm::PackedWeights& out);
void gemm_matmul_pre(detail::Checker& c, MatView<const bf16> a, const gemm::PackedWeights& w,
                     MatView<float> out);
void gemm_matmul_post(detail::Checker& c, MatView<const bf16> a, const gemm::PackedWeights& w,
                      MatView<const float> out);
/// gemm.pack.checksum for an op that reads `w` (audit).
void gemm_checksum(detail::Checker& c, const gemm::PackedWeights& w, std::string_view name);

}  // namespace moecert::contracts
