// Clauses of gemm.pack and gemm.matmul.
#include "contracts/gemm/gemm.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

#include "contracts/engine/checks.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/gemm/pack_audit.hpp"
#include "contracts/probes/verify.hpp"

namespace moecert::contracts {

namespace k = clauses::gemm;

void gemm_pack_pre(detail::Checker& c, MatView<const bf16> w, MatView<const bf16> second) {
  MOECERT_CONTRACT(c, k::kPackShape) {
    if (w.stride < w.cols || (second.data && (second.rows != w.rows || second.cols != w.cols ||
                                              second.stride < second.cols)))
      c.fail(k::kPackShape, "",
             fmt::format("w {}x{} (stride {}), second {}x{} (stride {})", w.rows, w.cols, w.stride,
                         second.rows, second.cols, second.stride),
             "stride >= cols; second absent or of w's shape");
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kPackWFinite) {
    detail::scan_finite(c, k::kPackWFinite, "w", w) &&
        (!second.data || detail::scan_finite(c, k::kPackWFinite, "w2", second));
  }
  MOECERT_CONTRACT(c, k::kPackWRange) {
    detail::scan_bf16_range(c, k::kPackWRange, "w", w) &&
        (!second.data || detail::scan_bf16_range(c, k::kPackWRange, "w2", second));
  }
}

void gemm_pack_post(detail::Checker& c, MatView<const bf16> w, MatView<const bf16> second,
                    const gemm::PackedWeights& out) {
  MOECERT_CONTRACT(c, k::kPackRoundtrip) {
    // Column n of the packed W is row n of w (or, interleaved by 16-column
    // panel, of w and second).
    for (std::size_t n = 0; n < out.n(); ++n) {
      const std::size_t panel = n / gemm::PackedWeights::kPanel,
                        lane = n % gemm::PackedWeights::kPanel;
      const MatView<const bf16>& src = out.interleaved() && panel % 2 ? second : w;
      const std::size_t row =
          out.interleaved() ? (panel / 2) * gemm::PackedWeights::kPanel + lane : n;
      if (row >= src.rows) continue;  // padding of an interleaved panel
      for (std::size_t kk = 0; kk < w.cols; ++kk)
        if (out.at(n, kk).bits != src(row, kk).bits) {
          c.fail(k::kPackRoundtrip, fmt::format("w[{}, {}]", row, kk),
                 fmt::format("packed {}", out.at(n, kk).to_float()),
                 fmt::format("{} (the input)", src(row, kk).to_float()));
          return;
        }
    }
  }
}

void gemm_pack_transposed_post(detail::Checker& c, MatView<const bf16> wt,
                               const gemm::PackedWeights& out) {
  MOECERT_CONTRACT(c, k::kPackRoundtrip) {
    // Column n of the packed W is column n of wt.
    for (std::size_t kk = 0; kk < wt.rows; ++kk)
      for (std::size_t n = 0; n < wt.cols; ++n)
        if (out.at(n, kk).bits != wt(kk, n).bits) {
          c.fail(k::kPackRoundtrip, fmt::format("wt[{}, {}]", kk, n),
                 fmt::format("packed {}", out.at(n, kk).to_float()),
                 fmt::format("{} (the input)", wt(kk, n).to_float()));
          return;
        }
  }
}

namespace {

// The parts of each pack this call verifies: every part at full, else the
// next in the pack's rotation (one call of the clause, one step).
std::vector<std::size_t> parts_due(const detail::Checker& c,
                                   const std::vector<const gemm::PackedWeights*>& packs) {
  std::vector<std::size_t> part(packs.size());
  if (c.level() >= Level::full) return part;
  for (std::size_t i = 0; i < packs.size(); ++i)
    if (auto* st = detail::PackAccess::audit(*packs[i]); st && packs[i]->checksum_parts())
      part[i] =
          st->checksum_calls.fetch_add(1, std::memory_order_relaxed) % packs[i]->checksum_parts();
  return part;
}

// The first part of w failing its checksum among those due (w's parts
// count if none).
std::size_t failing_part(const gemm::PackedWeights& w, std::size_t due, bool every) {
  const std::size_t parts = w.checksum_parts();
  for (std::size_t p = every ? 0 : due; p < (every ? parts : due + 1); ++p)
    if (w.compute_part_checksum(p) != w.part_checksum(p)) return p;
  return parts;
}

}  // namespace

void gemm_checksums(detail::Checker& c, const std::vector<const gemm::PackedWeights*>& packs,
                    const std::function<std::string(std::size_t)>& name) {
  MOECERT_CONTRACT(c, k::kPackChecksum) {
    const bool every = c.level() >= Level::full;
    const std::vector<std::size_t> due = parts_due(c, packs);
    const std::size_t bytes = packs.empty() ? 0 : packs[0]->size() * sizeof(bf16);
    const std::size_t i = detail::first_failing(
        packs.size(), every ? bytes : bytes / gemm::PackedWeights::kChecksumParts,
        [&](std::size_t i) {
          return failing_part(*packs[i], due[i], every) == packs[i]->checksum_parts();
        });
    if (i == packs.size()) return;
    const gemm::PackedWeights& w = *packs[i];
    const std::size_t p = failing_part(w, due[i], every);
    c.fail(k::kPackChecksum, fmt::format("{} part {} of {}", name(i), p, w.checksum_parts()),
           fmt::format("checksum {:#018x}", w.compute_part_checksum(p)),
           fmt::format("{:#018x} (taken at pack time)", w.part_checksum(p)));
  }
}

void gemm_checksum(detail::Checker& c, const gemm::PackedWeights& w, std::string_view name) {
  gemm_checksums(c, {&w}, [&](std::size_t) { return std::string(name); });
}

void fail_probe(detail::Checker& c, const ClauseInfo& clause, std::string location,
                const verify::ProbeResult& p) {
  c.fail(clause, std::move(location), fmt::format("residual {:.6g}", p.residual),
         fmt::format("<= {:.6g} (proofs/bounds.md §9)", p.threshold));
}

std::string grouped_probe_location(const GroupingView& g, const verify::ProbeResult& p,
                                   std::string_view gemm) {
  const std::size_t e = g.expert_of(p.row);
  return fmt::format("e={} {} GEMM row {} columns [{}, {})", e, gemm, p.row - g.begin[e], p.j0,
                     p.j0 + p.width);
}

std::vector<const verify::Probe*> PackProbes::all() const {
  std::vector<const verify::Probe*> out{dense.get()};
  for (const auto& p : narrow) out.push_back(&p);
  return out;
}

verify::Probe panel_probe(const gemm::PackedWeights& w, std::size_t j0, std::size_t width,
                          std::uint64_t seed) {
  constexpr std::size_t kPanel = gemm::PackedWeights::kPanel;
  MOECERT_ASSERT(j0 % kPanel + width <= kPanel && j0 + width <= w.n());
  // Column j0 + j of K pair kk / 2 at panel[(kk / 2) 2 kPanel + 2 j + kk % 2]:
  // a pair's 2 width values are adjacent, one line per pair. A quantized
  // pack's panel: its weights as at() reads them, in that layout.
  std::vector<bf16> decoded;
  if (w.quantized()) {
    decoded.resize(w.kp() * kPanel);
    const std::size_t n0 = j0 - j0 % kPanel;
    for (std::size_t kk = 0; kk < w.kp(); ++kk)
      for (std::size_t j = 0; j < kPanel; ++j)
        decoded[(kk / 2) * 2 * kPanel + 2 * j + kk % 2] = w.at(n0 + j, kk);
  }
  const bf16* panel =
      (w.quantized() ? decoded.data() : w.data() + (j0 / kPanel) * w.kp() * kPanel) +
      (j0 % kPanel) * 2;
  verify::Probe p{j0, width, verify::probe_signs(width, seed), std::vector<float>(w.k()),
                  std::vector<float>(w.k())};
  verify::detail::pair_sides(panel, 2 * kPanel, w.k(), width, p.r.data(), p.br.data(),
                             p.babs.data());
  return p;
}

PackProbes pack_probes(const gemm::PackedWeights& w) {
  constexpr std::uint64_t kSeed = 0x5eed;
  auto b = [&w](std::size_t j, std::size_t kk) { return w.at(j, kk); };
  PackProbes p;
  detail::PackAudit* st = detail::PackAccess::audit(w);
  MOECERT_ASSERT(st != nullptr);
  {
    const std::lock_guard lock(st->mutex);
    if (!st->dense)
      st->dense =
          std::make_shared<const verify::Probe>(verify::make_probe(w.k(), b, 0, w.n(), kSeed));
    p.dense = st->dense;
  }
  const std::size_t width = PackProbes::kNarrowWidth;
  static_assert(gemm::PackedWeights::kPanel % PackProbes::kNarrowWidth == 0);  // one panel each
  const std::size_t blocks = (w.n() + width - 1) / width;
  const std::uint64_t call = st->probe_calls.fetch_add(1, std::memory_order_relaxed);
  for (std::size_t q = 0; q < std::min(PackProbes::kNarrow, blocks); ++q) {
    const std::size_t block = (call * PackProbes::kNarrow + q) % blocks, j0 = block * width;
    p.narrow.push_back(panel_probe(w, j0, std::min(width, w.n() - j0), kSeed + j0 + 1));
  }
  return p;
}

void RowSums::size(std::size_t rows) {
  const std::size_t n = rows * kProbes;
  if (storage_.size() < n) storage_.resize(n);
  detail::fill_parallel(storage_.data(), n, std::pair<double, double>{NAN, NAN});
}

void RowSums::form(std::size_t row, const PackProbes& p, const float* c) {
  std::pair<double, double>* out = &storage_[row * kProbes];
  verify::detail::signed_sum_and_magnitude(c, p.dense->r.data(), p.dense->width, out[0].first,
                                           out[0].second);
  for (std::size_t q = 0; q < p.narrow.size(); ++q)
    verify::detail::signed_sum_and_magnitude(c + p.narrow[q].j0, p.narrow[q].r.data(),
                                             p.narrow[q].width, out[1 + q].first,
                                             out[1 + q].second);
}

void gemm_matmul_pre(detail::Checker& c, MatView<const bf16> a, const gemm::PackedWeights& w,
                     MatView<float> out) {
  MOECERT_CONTRACT(c, k::kShape) {
    if (a.cols != w.k() || out.rows != a.rows || out.cols != w.n() || a.stride < a.cols ||
        out.stride < out.cols)
      c.fail(k::kShape, "",
             fmt::format("a {}x{} (stride {}), w {}x{}, c {}x{} (stride {})", a.rows, a.cols,
                         a.stride, w.n(), w.k(), out.rows, out.cols, out.stride),
             fmt::format("a ?x{}, c {}x{}", w.k(), a.rows, w.n()));
  }
  if (c.stop()) return;
  MOECERT_CONTRACT(c, k::kNoAlias) {
    const ByteRange wr = w.storage();
    if (overlaps(out.bytes(), a.bytes()) || overlaps(out.bytes(), wr))
      c.fail(k::kNoAlias, "",
             fmt::format("c {} overlaps {}", detail::format_range(out.bytes()),
                         overlaps(out.bytes(), a.bytes()) ? "a " + detail::format_range(a.bytes())
                                                          : "w " + detail::format_range(wr)),
             "disjoint");
  }
  MOECERT_CONTRACT(c, k::kAFinite) { detail::scan_finite(c, k::kAFinite, "a", a); }
  MOECERT_CONTRACT(c, k::kARange) { detail::scan_bf16_range(c, k::kARange, "a", a); }
  gemm_checksum(c, w, "w");
}

void gemm_matmul_post(detail::Checker& c, MatView<const bf16> a, const gemm::PackedWeights& w,
                      MatView<const float> out) {
  MOECERT_CONTRACT(c, k::kCFinite) { detail::scan_finite(c, k::kCFinite, "c", out); }
  auto b_at = [&](std::size_t j, std::size_t kk) { return w.at(j, kk); };
  // A, W in range (gemm.*.range), no overflow; each row against the pack's
  // probes (the dense one and this call's narrow blocks) with verify's
  // threshold (bounds::dot + the probe's own rounding); never fails
  // within bounds; proofs/bounds.md §9.
  MOECERT_CONTRACT(c, k::kProbe) {
    const PackProbes probes = pack_probes(w);
    const auto r = probe_rows(
        a.rows, a.cols,
        [&](std::size_t i, float* row) { return verify::load_bf16(a.row(i), a.cols, row); },
        [&](std::size_t i) { return out.row(i); },
        [all = probes.all()](std::size_t) -> const std::vector<const verify::Probe*>& {
          return all;
        });
    if (!r.pass)
      fail_probe(c, k::kProbe, fmt::format("row {} columns [{}, {})", r.row, r.j0, r.j0 + r.width),
                 r);
  }
  // The same assumptions; every element against the double-double reference
  // within bounds::gemm_element (any order, flushed inputs apart); proofs/bounds.md §1.
  MOECERT_CONTRACT(c, k::kWithinBound) {
    std::vector<std::size_t> rows(a.rows);
    for (std::size_t i = 0; i < a.rows; ++i) rows[i] = i;
    const auto r = verify::check_rows_gemm_nt(a.cols, a, w.n(), b_at, out, rows);
    if (!r.pass())
      c.fail(k::kWithinBound, fmt::format("i={} j={}", r.worst / w.n(), r.worst % w.n()),
             fmt::format("c={:.9g} ref={:.17g} (utilisation {:.3g})", r.worst_got, r.worst_ref,
                         r.max_utilization),
             fmt::format("|c - ref| <= {:.6g} (proofs/bounds.md §1)", r.worst_bound));
  }
}

}  // namespace moecert::contracts
