// A small MoE layer decoded from fuzzer bytes (shared by lora_fuzzer and
// layer_backward_fuzzer): shapes, router kind, weights whose values come
// from raw bits now and then (NaN, Inf, denormals, extremes), LoRA factors,
// alpha, and dy.
#pragma once

#include <cmath>
#include <vector>

#include "contracts/engine/checks.hpp"
#include "fuzz/decode.hpp"
#include "moecert/layer.hpp"
#include "ops/workspace/arena.hpp"
#include "support/layer_problem.hpp"

namespace moecert::fuzz {

// The problem (fixture::LayerProblem, filled from the bytes) and what the
// decoder knows of its values.
struct LayerInput : fixture::LayerProblem {
  bool packed_ok = true;  // the base weights passed gemm.pack's clauses
  bool lora_ok = true, x_ok = true, scale_ok = true, dy_ok = true;
};

inline bool ok_bf16(bf16 v) { return v.is_finite() && detail::bf16_in_range(v); }

// Mostly moderate values (scaled down so activations stay in range), raw
// bit patterns only where `specials`.
inline bf16 small_bf16(Decoder& d, bool specials) {
  if (specials) return d.value_bf16();
  return bf16(static_cast<float>(static_cast<std::int16_t>(d.u16())) /
              16384.0f);  // 0 or 2^-14 <= |v| < 2
}

inline LayerInput decode_layer(Decoder& d, bool with_dy) {
  LayerInput in;
  const std::uint8_t kind = d.u8() % 3;
  in.cfg.router = static_cast<RouterKind>(kind);
  if (in.cfg.router == RouterKind::product_key) {
    const std::size_t n = d.range(1, 3);
    in.E = n * n;
  } else {
    in.E = d.range(1, 6);
  }
  in.H = d.range(1, 36), in.I = d.range(1, 36), in.K = d.range(1, std::min<std::size_t>(in.E, 3));
  in.r = d.range(0, 5), in.T = d.range(0, 6);
  in.cfg.experts = static_cast<std::int64_t>(in.E), in.cfg.hidden = static_cast<std::int64_t>(in.H);
  in.cfg.inter = static_cast<std::int64_t>(in.I), in.cfg.topk = static_cast<std::int64_t>(in.K);
  in.cfg.lora_rank = static_cast<std::int64_t>(in.r);
  in.cfg.max_tokens = static_cast<std::int64_t>(std::max<std::size_t>(in.T, 1));
  in.cfg.renormalize = d.flag();
  // alpha: usually moderate; now and then so small that float(alpha / r) underflows.
  in.cfg.lora_alpha = in.r ? ((d.u8() & 31) == 0 ? 1e-300 : 0.5 + d.range(0, 64)) : 0.0;
  // The two decoded alpha classes (1e-300, or 0.5 .. 64.5), not a tolerance:
  // only the first makes float(alpha / r) leave [2^-60, 2^60].
  in.scale_ok = in.r == 0 || in.cfg.lora_alpha > 1e-200;
  if (in.cfg.router == RouterKind::sigmoid_topk) {
    in.cfg.groups = 1, in.cfg.topk_group = 1, in.cfg.scaling = 2.0;
  }
  in.R = router_width(in.cfg);
  const bool special = (d.u8() & 7) == 0;  // this input may carry special values
  auto fill = [&](std::vector<bf16>& v, std::size_t n, bool specials, bool& ok) {
    v.resize(n);
    for (auto& q : v) {
      q = small_bf16(d, specials);
      ok = ok && ok_bf16(q);
    }
  };
  bool base_ok = true;
  fill(in.x, in.T * in.H, special && d.flag(), in.x_ok);
  fill(in.wg, in.E * in.I * in.H, false, base_ok);
  fill(in.wu, in.E * in.I * in.H, false, base_ok);
  fill(in.wd, in.E * in.H * in.I, false, base_ok);
  const std::size_t shapes[6] = {in.E * in.r * in.H, in.E * in.I * in.r, in.E * in.r * in.H,
                                 in.E * in.I * in.r, in.E * in.r * in.I, in.E * in.H * in.r};
  const bool lora_specials = special && d.flag();
  for (int i = 0; i < 6; ++i) fill(in.lora[i], shapes[i], lora_specials, in.lora_ok);
  in.wr.resize(in.R * in.H);
  for (auto& q : in.wr) q = small_bf16(d, false).to_float() * 0.1f;
  in.b.resize(in.R);
  for (auto& q : in.b) q = small_bf16(d, false).to_float() * 0.1f;
  in.bias.resize(in.E);
  for (auto& q : in.bias) q = small_bf16(d, false).to_float() * 0.01f;
  if (with_dy) {
    in.dy.resize(in.T * in.H);
    const bool dy_specials = special && d.flag();
    for (auto& q : in.dy) {
      q = dy_specials ? d.value_f32() : small_bf16(d, false).to_float();
      in.dy_ok = in.dy_ok && std::isfinite(q);
    }
  }
  in.packed = experts::PackedExperts::pack(in.E, {in.wg.data(), in.E * in.I, in.H},
                                           {in.wu.data(), in.E * in.I, in.H},
                                           {in.wd.data(), in.E * in.H, in.I}, with_dy);
  return in;
}

}  // namespace moecert::fuzz
