// Result verification for the `audit` level: a Freivalds/ABFT probe of
// C = A B^T with a threshold derived from the same bounds as the full
// comparison, and recomputation of sampled output rows by the reference.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "contracts/compare.hpp"
#include "moecert/types.hpp"

namespace moecert::verify {

struct ProbeOptions {
  /// Columns per probe vector. Each probe r is +-1 on one block of `width`
  /// columns and 0 elsewhere; the threshold grows with the width, so a
  /// narrower probe sees smaller errors at proportionally higher cost
  /// (proofs/bounds.md §9). width >= N probes everything at once.
  std::size_t width = 4;
  std::uint64_t seed = 0x5eed;
  bool c_is_bf16 = false;  // C was rounded to bf16 (adds §2 to the bound)
};

struct ProbeResult {
  bool pass = true;
  std::size_t row = 0, block = 0;       // first failing (row, column block)
  double residual = 0, threshold = 0;   // |C r - A (B^T r)| and its allowance there
  double max_ratio = 0;                 // max residual / threshold over all probes
};

/// Checks C [M x N] against A [M x K] * B^T (B [N x K]) with one probe per
/// column block, rows all at once. Cost: (N / width) (M K + N K) double
/// operations. Never fails for a C within bounds::dot of the exact product
/// (§9: the threshold includes the probe's own double rounding).
ProbeResult probe_gemm_nt(MatView<const bf16> a, MatView<const bf16> b, MatView<const float> c,
                          const ProbeOptions& opt = {});

/// Recomputes the rows `rows` of C = A B^T with the double-double reference
/// and compares them within bounds::dot element by element.
compare::Bounded check_rows_gemm_nt(MatView<const bf16> a, MatView<const bf16> b,
                                    MatView<const float> c, const std::vector<std::size_t>& rows,
                                    bool c_is_bf16 = false);

}  // namespace moecert::verify
