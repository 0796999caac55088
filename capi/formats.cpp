// The C ABI of the weight formats: descriptors of quantized matrices, the
// formats' scale blocks, the quantizer, and packing quantized experts.
#include "moecert/formats.hpp"

#include <fmt/format.h>

#include "capi/abi.hpp"
#include "moecert/experts.hpp"
#include "moecert/moecert.h"

using namespace moecert;
using capi::guarded;
using capi::handle;
using capi::InvalidArgument;

namespace moecert::capi {

WeightFormat quantized_format(std::int32_t format) {
  if (format <= 0 || static_cast<std::size_t>(format) >= kFormatCount)
    throw InvalidArgument(
        fmt::format("format {}, expected a quantized format 1..{}", format, kFormatCount - 1));
  return static_cast<WeightFormat>(format);
}

QuantView quant_of(const moecert_quant& q, WeightFormat format, const std::string& name) {
  const auto codes = mat<const std::uint8_t>(&q.codes, (name + ".codes").c_str());
  const auto scales = mat<const float>(&q.scales, (name + ".scales").c_str());
  if (q.cols < 0) throw InvalidArgument(fmt::format("{}.cols {}", name, q.cols));
  QuantView v;
  v.format = format;
  v.codes = codes.data, v.rows = codes.rows, v.cols = static_cast<std::size_t>(q.cols);
  v.stride = codes.stride;
  v.scales = scales.data, v.scale_stride = scales.stride;
  if (codes.cols < v.row_bytes() || scales.rows < v.scale_rows() || scales.cols < v.scale_cols())
    throw InvalidArgument(
        fmt::format("{}: codes {}x{}, scales {}x{} for {} {}x{}, expected codes "
                    "{}x{} or wider, scales {}x{}",
                    name, codes.rows, codes.cols, scales.rows, scales.cols, format_name(format),
                    v.rows, v.cols, v.rows, v.row_bytes(), v.scale_rows(), v.scale_cols()));
  return v;
}

QuantOut quant_out(const moecert_quant& q, WeightFormat format, std::size_t rows, std::size_t cols,
                   const std::string& name) {
  const auto codes = mat<std::uint8_t>(&q.codes, (name + ".codes").c_str());
  const auto scales = mat<float>(&q.scales, (name + ".scales").c_str());
  QuantView want;
  want.format = format, want.rows = rows, want.cols = cols;
  if (codes.rows != rows || codes.cols != want.row_bytes() ||
      q.cols != static_cast<std::int64_t>(cols) || scales.rows != want.scale_rows() ||
      scales.cols != want.scale_cols())
    throw InvalidArgument(fmt::format(
        "{}: codes {}x{}, scales {}x{}, cols {}, expected codes {}x{}, scales {}x{}, cols {}", name,
        codes.rows, codes.cols, scales.rows, scales.cols, q.cols, rows, want.row_bytes(),
        want.scale_rows(), want.scale_cols(), cols));
  return {codes.data, codes.stride, scales.data, scales.stride};
}

namespace {

std::vector<QuantView> views(const moecert_quant* q, std::size_t n, WeightFormat f,
                             const char* name) {
  if (!q) throw InvalidArgument(fmt::format("{}: null", name));
  std::vector<QuantView> out;
  for (std::size_t e = 0; e < n; ++e)
    out.push_back(quant_of(q[e], f, fmt::format("{}[{}]", name, e)));
  return out;
}

}  // namespace
}  // namespace moecert::capi

extern "C" {

moecert_status moecert_format_info(int32_t format, int32_t* code_bits, int64_t* block_rows,
                                   int64_t* block_cols) {
  return guarded("moecert_format_info", [&] {
    if (format < 0 || static_cast<std::size_t>(format) >= kFormatCount)
      throw InvalidArgument(fmt::format("format {}, expected 0..{}", format, kFormatCount - 1));
    const FormatInfo& f = format_info(static_cast<WeightFormat>(format));
    if (code_bits) *code_bits = static_cast<int32_t>(f.code_bits);
    if (block_rows) *block_rows = static_cast<int64_t>(f.block_rows);
    if (block_cols) *block_cols = static_cast<int64_t>(f.block_cols);
  });
}

moecert_status moecert_quantize(int32_t format, const moecert_tensor* w, const moecert_quant* out) {
  return guarded("moecert_quantize", [&] {
    const WeightFormat f = capi::quantized_format(format);
    const auto wv = capi::mat<const float>(w, "w");
    if (!out) throw InvalidArgument("out: null");
    for (std::size_t n = 0; n < wv.rows; ++n)
      for (std::size_t k = 0; k < wv.cols; ++k)
        if (!std::isfinite(wv(n, k)))
          throw InvalidArgument(fmt::format("w[{}, {}] = {}, expected finite", n, k, wv(n, k)));
    quantize(f, wv, capi::quant_out(*out, f, wv.rows, wv.cols, "out"));
  });
}

moecert_status moecert_experts_pack_quantized(int32_t format, int64_t experts,
                                              const moecert_quant* w_gate,
                                              const moecert_quant* w_up,
                                              const moecert_quant* w_down, int32_t backward,
                                              moecert_experts** out) {
  return guarded("moecert_experts_pack_quantized", [&] {
    if (!out) throw InvalidArgument("out: null");
    if (experts < 1) throw InvalidArgument(fmt::format("experts {}, expected >= 1", experts));
    const WeightFormat f = capi::quantized_format(format);
    const auto E = static_cast<std::size_t>(experts);
    auto h = std::make_unique<moecert_experts>();
    h->packed = experts::PackedExperts::pack(capi::views(w_gate, E, f, "w_gate"),
                                             capi::views(w_up, E, f, "w_up"),
                                             capi::views(w_down, E, f, "w_down"), backward != 0);
    *out = h.release();
  });
}

moecert_status moecert_experts_unpack_quantized(const moecert_experts* w,
                                                const moecert_quant* w_gate,
                                                const moecert_quant* w_up,
                                                const moecert_quant* w_down) {
  return guarded("moecert_experts_unpack_quantized", [&] {
    const auto& p = handle(w, "experts").packed;
    if (p.format() == WeightFormat::bf16)
      throw InvalidArgument("experts: a bf16 pack (moecert_experts_unpack reads it)");
    if (!w_gate || !w_up || !w_down) throw InvalidArgument("w_gate, w_up, w_down: null");
    const std::size_t E = p.experts(), H = p.hidden(), I = p.inter();
    std::vector<QuantOut> g, u, d;
    for (std::size_t e = 0; e < E; ++e) {
      g.push_back(capi::quant_out(w_gate[e], p.format(), I, H, fmt::format("w_gate[{}]", e)));
      u.push_back(capi::quant_out(w_up[e], p.format(), I, H, fmt::format("w_up[{}]", e)));
      d.push_back(capi::quant_out(w_down[e], p.format(), H, I, fmt::format("w_down[{}]", e)));
    }
    p.unpack(g, u, d);
  });
}

moecert_status moecert_experts_format(const moecert_experts* w, int32_t* format) {
  return guarded("moecert_experts_format", [&] {
    if (!format) throw InvalidArgument("format: null");
    *format = static_cast<int32_t>(handle(w, "experts").packed.format());
  });
}

}  // extern "C"
