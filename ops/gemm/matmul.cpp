// gemm::matmul: clauses at the boundary, then packing of A and the blocked
// loops in parallel.
#include <oneapi/tbb/blocked_range2d.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <memory>

#include "contracts/gemm/gemm.hpp"
#include "ops/core/aligned.hpp"
#include "ops/core/task.hpp"
#include "ops/gemm/loops.hpp"

namespace moecert::gemm {

void matmul(MatView<const bf16> a, const PackedWeights& w, MatView<float> c, Isa isa) {
  const moecert::detail::FpDefaults fp;  // round to nearest, no FTZ/DAZ, whatever the caller set
  detail::Checker chk{"gemm.matmul"};
  contracts::gemm_matmul_pre(chk, a, w, c);
  if (chk.stop()) return;
  const KernelInfo& kernel = kernel_info(isa);
  const std::size_t m = a.rows, kp = w.kp();
  if (m > 0 && w.n() > 0) {
    // Work items: 64 rows x 512 columns, all of K per block (measured best
    // for AMX on the AMX machine against 128-512 rows, 128-256 columns and
    // K blocks of 512 or 1024; the AVX-512 kernel is insensitive), narrower
    // when that leaves fewer than 8 items per thread (few rows: with 4, two
    // threads split 11 items 6 to 5); no two share an element of C, so the
    // partition never changes a result.
    const std::size_t mb = std::max<std::size_t>(64, 2 * kernel.mr);
    const std::size_t threads =
        static_cast<std::size_t>(oneapi::tbb::this_task_arena::max_concurrency());
    std::size_t nb = 512;
    while (nb > 2 * kernel.nr && ((m + mb - 1) / mb) * ((w.n() + nb - 1) / nb) < 8 * threads)
      nb /= 2;
    const std::size_t m_padded = round_up(m, kernel.mr);
    const ALayout layout = kernel.a_layout;
    const std::size_t lda = a_stride(layout, kp);
    // Packed A: not value-initialised (pack_a writes every element), and
    // packed in parallel by row blocks rather than by one thread.
    const std::unique_ptr<bf16[], detail::AlignedFree> ap(
        static_cast<bf16*>(detail::allocate(a_size(layout, m_padded, kp) * sizeof(bf16))));
    oneapi::tbb::parallel_for(
        std::size_t{0}, (m + mb - 1) / mb, moecert::detail::task([&](std::size_t bi) {
          const std::size_t m0 = bi * mb, m1 = std::min(m, m0 + mb),
                            p1 = std::min(m_padded, m0 + mb);
          pack_a(layout, MatView<const bf16>(a.row(m0), m1 - m0, a.cols, a.stride), nullptr,
                 m1 - m0, p1 - m0, kp, ap.get() + a_offset(layout, lda, m0, 0));
        }));
    oneapi::tbb::parallel_for(
        oneapi::tbb::blocked_range2d<std::size_t>(0, (m + mb - 1) / mb, 0, (w.n() + nb - 1) / nb),
        moecert::detail::task([&](const oneapi::tbb::blocked_range2d<std::size_t>& r) {
          for (std::size_t bi = r.rows().begin(); bi < r.rows().end(); ++bi) {
            const std::size_t m0 = bi * mb, mm = std::min(mb, m - m0);
            for (std::size_t bj = r.cols().begin(); bj < r.cols().end(); ++bj)
              gemm_block(kernel, ap.get() + a_offset(layout, lda, m0, 0), mm, w, bj * nb,
                         std::min(w.n(), (bj + 1) * nb), w.n(), c.data + m0 * c.stride, c.stride);
          }
        }));
  }
  contracts::gemm_matmul_post(chk, a, w, c);
}

}  // namespace moecert::gemm
