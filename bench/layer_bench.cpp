// Benchmark cases: the MoE layer with LoRA, forward and backward (issue 6).
// No peer runs in this process (PyTorch is not a Debian 12 package here):
// the peer figures are the ones recorded for a straightforward PyTorch CPU
// bf16 eager implementation on the 16-core AMX machine at 16 threads, given
// only for that thread count and those shapes, and marked as recorded.
#include <cmath>
#include <random>

#include <fmt/format.h>

#include "bench/bench.hpp"
#include "moecert/isa.hpp"
#include "moecert/layer.hpp"

namespace moecert::bench {
namespace {

// Recorded PyTorch eager times (ms) at 16 threads: {T, forward, backward}.
constexpr double kPytorch[][3] = {{1024, 238, 383}, {4096, 318, 678}};

struct LayerData {
  MoeConfig cfg;
  std::vector<bf16> x, wg, wu, wd, ag, bg, au, bu, ad, bd;
  std::vector<float> wr, b, dy;
  experts::PackedExperts packed;
  layer::Weights weights() const {
    return layer::Weights::stacked(cfg, packed, wr.data(), b.data(), nullptr,
                                   layer::Lora::stacked(cfg, ag.data(), bg.data(), au.data(), bu.data(), ad.data(), bd.data()));
  }
};

LayerData make(const Shape& s) {
  LayerData d;
  d.cfg = {.experts = static_cast<std::int64_t>(s.e), .hidden = static_cast<std::int64_t>(s.h), .inter = static_cast<std::int64_t>(s.i),
           .topk = static_cast<std::int64_t>(s.k), .lora_rank = static_cast<std::int64_t>(s.r), .lora_alpha = 16.0,
           .max_tokens = static_cast<std::int64_t>(s.t)};
  auto mk = [](std::vector<bf16>& v, std::size_t n, std::uint64_t seed, float scale) {
    v.resize(n);
    fill_uniform(v, seed, scale);
  };
  const float sh = 1.7f / std::sqrt(float(s.h)), si = 1.7f / std::sqrt(float(s.i));
  mk(d.x, s.t * s.h, 11, 1.7f);
  mk(d.wg, s.e * s.i * s.h, 12, sh), mk(d.wu, s.e * s.i * s.h, 13, sh), mk(d.wd, s.e * s.h * s.i, 14, si);
  mk(d.ag, s.e * s.r * s.h, 15, sh), mk(d.au, s.e * s.r * s.h, 16, sh), mk(d.ad, s.e * s.r * s.i, 17, si);
  mk(d.bg, s.e * s.i * s.r, 18, 0.1f), mk(d.bu, s.e * s.i * s.r, 19, 0.1f), mk(d.bd, s.e * s.h * s.r, 20, 0.1f);
  std::mt19937_64 rng(21);
  std::normal_distribution<float> nd(0, 1);
  d.wr.resize(s.e * s.h);
  for (auto& v : d.wr) v = nd(rng) / std::sqrt(float(s.h));
  d.b.assign(s.e, 0.0f);
  d.dy.resize(s.t * s.h);
  for (auto& v : d.dy) v = nd(rng);
  d.packed = experts::PackedExperts::pack(s.e, {d.wg.data(), s.e * s.i, s.h}, {d.wu.data(), s.e * s.i, s.h},
                                          {d.wd.data(), s.e * s.h, s.i}, true);
  return d;
}

// base: the backward also forms the base weights' gradients (full
// fine-tuning; no recorded peer).
Result layer_case(const std::string& name, const Shape& s, bool backward, bool base, const Options& opt) {
  Result r;
  r.name = name;
  r.op = backward ? "layer.backward" : "layer.forward";
  r.shape = s;
  r.threads = opt.threads;
  const LayerData d = make(s);
  const auto w = d.weights();
  std::vector<float> y(s.t * s.h), dx(s.t * s.h), dwr(s.e * s.h), db(s.e);
  std::vector<float> gag(s.e * s.r * s.h), gau(gag.size()), gbg(s.e * s.i * s.r), gbu(gbg.size()), gad(s.e * s.r * s.i),
      gbd(s.e * s.h * s.r);
  layer::Gradients g;
  g.dx = {dx.data(), s.t, s.h};
  g.router_w = {dwr.data(), s.e, s.h};
  g.router_b = {db.data(), s.e};
  g.a_gate = {gag.data(), s.e * s.r, s.h}, g.a_up = {gau.data(), s.e * s.r, s.h};
  g.b_gate = {gbg.data(), s.e * s.i, s.r}, g.b_up = {gbu.data(), s.e * s.i, s.r};
  g.a_down = {gad.data(), s.e * s.r, s.i}, g.b_down = {gbd.data(), s.e * s.h, s.r};
  std::vector<float> gw[3];
  if (base) {
    for (auto& v : gw) v.resize(s.e * s.i * s.h);
    g.w_gate = {gw[0].data(), s.e * s.i, s.h}, g.w_up = {gw[1].data(), s.e * s.i, s.h}, g.w_down = {gw[2].data(), s.e * s.h, s.i};
  }
  layer::Saved saved;  // reused across steps, as a training loop would
  const MatView<const bf16> x(d.x.data(), s.t, s.h);
  auto fwd = [&] { layer::forward(d.cfg, w, x, {y.data(), s.t, s.h}, saved, {.isa = opt.isa}); };
  if (backward) {
    fwd();
    r.ms = time_ms(opt.reps, [&] { layer::backward(d.cfg, w, x, {d.dy.data(), s.t, s.h}, saved, g); });
  } else {
    r.ms = time_ms(opt.reps, fwd);
  }
  r.isa = std::string(isa_name(opt.isa));
  const double routed = double(s.t) * double(s.k);
  r.flops = (base ? 12.0 : 6.0) * routed * double(s.h) * double(s.i) + 2.0 * double(s.t) * double(s.e) * double(s.h);
  r.median_ms = median(r.ms);
  r.peer = "pytorch_eager_recorded";
  for (const auto& p : kPytorch)
    if (p[0] == double(s.t) && opt.threads == 16 && !base) r.peer_median_ms = backward ? p[2] : p[1];
  r.note = r.peer_median_ms > 0 ? "peer: PyTorch CPU bf16 eager, recorded on the 16-core AMX machine at 16 threads (issue 6), not run here"
                                : "no recorded peer figure for this shape and thread count";
  return r;
}

}  // namespace

void add_layer_cases(std::vector<Case>& out) {
  for (std::size_t t : {48, 1024, 4096})
    for (bool backward : {false, true}) {
      const Shape s{64, 2048, 1408, 6, 8, t};
      const std::string name = fmt::format("layer.{}/E64_H2048_I1408_K6_r8_T{}", backward ? "backward" : "forward", t);
      const std::size_t bytes = 2 * 3 * s.e * s.h * s.i * 2 + s.t * s.k * (4 * s.i + 3 * s.h) * 8;
      out.push_back({name, backward ? "layer.backward" : "layer.forward", s, bytes,
                     [name, s, backward](const Options& o) { return layer_case(name, s, backward, false, o); }});
    }
  // With the base weights' gradients (3 x E I H fp32 outputs: 2.2 GB).
  const Shape s{64, 2048, 1408, 6, 8, 1024};
  const std::string name = "layer.backward_base/E64_H2048_I1408_K6_r8_T1024";
  const std::size_t bytes = 2 * 3 * s.e * s.h * s.i * 2 + 3 * s.e * s.h * s.i * 4 + s.t * s.k * (4 * s.i + 3 * s.h) * 8;
  out.push_back({name, "layer.backward", s, bytes, [name, s](const Options& o) { return layer_case(name, s, true, true, o); }});
}

}  // namespace moecert::bench
