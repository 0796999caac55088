// Clauses of gemm.pack on quantized weights: codes, scales, the dequantized
// weights and their packed layout, judged by the contracts' own
// dequantization (contracts/gemm/formats.hpp).
#include <cmath>

#include "contracts/engine/checks.hpp"
#include "contracts/engine/clauses.hpp"
#include "contracts/gemm/formats.hpp"
#include "contracts/gemm/gemm.hpp"

namespace moecert::contracts {
namespace {

namespace k = clauses::gemm;

std::string describe(const QuantView& w) {
  return fmt::format("{} {}x{} (stride {} bytes, scales stride {})", format_name(w.format), w.rows,
                     w.cols, w.stride, w.scale_stride);
}

// Whether w's layout is one gemm.pack.q_shape accepts.
bool well_formed(const QuantView& w) {
  if (static_cast<std::size_t>(w.format) >= kFormatCount || w.format == WeightFormat::bf16)
    return false;
  if (!w.rows || !w.cols) return true;
  return w.codes && w.scales && w.stride >= w.row_bytes() && w.scale_stride >= w.scale_cols();
}

void check_shape(detail::Checker& c, const QuantView& w, const QuantView& second, bool transposed) {
  const bool paired = second.codes != nullptr;
  const bool alike = !paired || (second.format == w.format && second.cols == w.cols &&
                                 (transposed || second.rows == w.rows));
  if (!well_formed(w) || (paired && !well_formed(second)) || !alike)
    c.fail(k::kPackQShape, "", fmt::format("w {}, second {}", describe(w), describe(second)),
           transposed ? "a quantized format, stride >= row bytes, scale_stride >= scale columns; "
                        "second of w's format and columns"
                      : "a quantized format, stride >= row bytes, scale_stride >= scale columns; "
                        "second of w's format and shape");
}

// The first element (n, k) of w for which bad(n, k) holds, reported on
// `clause`; true when there is none.
template <class Bad, class Describe>
bool scan(detail::Checker& c, const ClauseInfo& clause, std::string_view name, const QuantView& w,
          Bad bad, Describe what, std::string_view expected) {
  for (std::size_t n = 0; n < w.rows; ++n)
    for (std::size_t kk = 0; kk < w.cols; ++kk)
      if (bad(n, kk)) {
        c.fail(clause, fmt::format("{}[{}, {}]", name, n, kk), what(n, kk), std::string(expected));
        return false;
      }
  return true;
}

bool check_values(detail::Checker& c, const QuantView& w, std::string_view name) {
  bool ok = true;
  MOECERT_CONTRACT(c, k::kPackQCode) {
    ok = scan(
        c, k::kPackQCode, name, w,
        [&](std::size_t n, std::size_t kk) { return !code_valid(w.format, w.code(n, kk)); },
        [&](std::size_t n, std::size_t kk) { return fmt::format("code 0x{:x}", w.code(n, kk)); },
        w.format == WeightFormat::fp8_e4m3_block128
            ? "an e4m3 code other than NaN (S.1111.111)"
            : fmt::format("{} <= code <= {}", format_info(w.format).code_min,
                          format_info(w.format).code_max));
  }
  MOECERT_CONTRACT(c, k::kPackQScale) {
    for (std::size_t r = 0; ok && r < w.scale_rows(); ++r)
      for (std::size_t q = 0; q < w.scale_cols(); ++q) {
        const float s = w.scales[r * w.scale_stride + q];
        if (!std::isfinite(s) || !(s > 0)) {
          c.fail(k::kPackQScale, fmt::format("{} scale[{}, {}]", name, r, q), fmt::format("{}", s),
                 "finite, > 0");
          ok = false;
          break;
        }
      }
  }
  if (!ok || c.stop()) return false;
  MOECERT_CONTRACT(c, k::kPackWFinite) {
    ok = scan(
        c, k::kPackWFinite, name, w,
        [&](std::size_t n, std::size_t kk) { return !kernel_weight(w, n, kk).is_finite(); },
        [&](std::size_t n, std::size_t kk) {
          return fmt::format("code * scale = {}", exact_weight(w, n, kk));
        },
        "finite in bf16");
  }
  MOECERT_CONTRACT(c, k::kPackWRange) {
    ok = ok && scan(
                   c, k::kPackWRange, name, w,
                   [&](std::size_t n, std::size_t kk) {
                     return !detail::bf16_in_range(kernel_weight(w, n, kk));
                   },
                   [&](std::size_t n, std::size_t kk) {
                     return fmt::format("dequantized {}", kernel_weight(w, n, kk).to_float());
                   },
                   "0 or 2^-60 <= |w| <= 2^60");
  }
  return ok;
}

}  // namespace

void gemm_pack_quantized_pre(detail::Checker& c, const QuantView& w, const QuantView& second,
                             bool transposed) {
  MOECERT_CONTRACT(c, k::kPackQShape) { check_shape(c, w, second, transposed); }
  if (c.stop()) return;
  check_values(c, w, "w") && (!second.codes || check_values(c, second, "w2"));
}

void gemm_pack_quantized_post(detail::Checker& c, const QuantView& w, const QuantView& second,
                              bool transposed, const gemm::PackedWeights& out) {
  MOECERT_CONTRACT(c, k::kPackRoundtrip) {
    constexpr std::size_t P = gemm::PackedWeights::kPanel;
    // Packed element (n, k) is source (row, col) of w or second as the pack
    // arranges them; every other element (padding) is 0.
    for (std::size_t n = 0; n < out.np(); ++n)
      for (std::size_t kk = 0; kk < out.kp(); ++kk) {
        const QuantView* src = nullptr;
        std::size_t row = 0, col = 0;
        if (transposed) {
          src = kk < w.rows ? &w : second.codes && kk < w.rows + second.rows ? &second : nullptr;
          row = kk < w.rows ? kk : kk - w.rows, col = n;
        } else {
          const bool from_second = out.interleaved() && (n / P) % 2 == 1;
          src = from_second ? &second : &w;
          row = out.interleaved() ? (n / P / 2) * P + n % P : n, col = kk;
        }
        const bool inside = src && row < src->rows && col < src->cols;
        const bf16 want = inside ? kernel_weight(*src, row, col) : bf16{};
        if (out.at(n, kk).bits != want.bits && (inside || out.at(n, kk).to_float() != 0.0f)) {
          c.fail(k::kPackRoundtrip,
                 inside ? fmt::format("w[{}, {}] of {}", row, col, src == &w ? "w" : "w2")
                        : fmt::format("padding ({}, {})", n, kk),
                 fmt::format("packed {}", out.at(n, kk).to_float()),
                 fmt::format("{} (bf16(fp32(code * scale)))", want.to_float()));
          return;
        }
      }
  }
}

}  // namespace moecert::contracts
