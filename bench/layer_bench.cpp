// Benchmark cases: the MoE layer with LoRA, forward and backward, and the
// experts op on the caller's routing. The live peer is the layer run eagerly
// on oneDNN (bench/onednn_layer_peer.hpp), in alternation with moecert.
// PyTorch CPU bf16 eager runs live from Python (python3 -m moecert.bench);
// here its figures recorded on the 16-core AMX machine at 16 threads are
// given beside the live ones for that thread count and those shapes, marked
// as recorded.
#include <fmt/format.h>

#include <cmath>
#include <numeric>
#include <random>

#include "bench/bench.hpp"
#include "bench/onednn_layer_peer.hpp"
#include "moecert/isa.hpp"
#include "moecert/layer.hpp"
#include "support/layer_problem.hpp"

namespace moecert::bench {
namespace {

// Recorded PyTorch eager times (ms) at 16 threads: {T, forward, backward}.
constexpr double kPytorch[][3] = {{1024, 238, 383}, {4096, 318, 678}};

using LayerData = fixture::LayerProblem;

/// The eager oneDNN peer of this layer, on the same arrays.
EagerLayerSpec peer_spec(const LayerData& d) {
  return {.experts = d.E,
          .hidden = d.H,
          .inter = d.I,
          .topk = d.K,
          .rank = d.r,
          .scale = float(d.cfg.lora_alpha / double(d.cfg.lora_rank)),
          .w_gate = d.wg.data(),
          .w_up = d.wu.data(),
          .w_down = d.wd.data(),
          .a_gate = d.lora[0].data(),
          .b_gate = d.lora[1].data(),
          .a_up = d.lora[2].data(),
          .b_up = d.lora[3].data(),
          .a_down = d.lora[4].data(),
          .b_down = d.lora[5].data(),
          .router_w = d.wr.data(),
          .router_b = d.b.data()};
}

// base: the backward also forms the base weights' gradients (full
// fine-tuning; no recorded peer).
Result layer_case(const std::string& name, const Shape& s, bool backward, bool base,
                  const Options& opt) {
  Result r;
  r.name = name;
  r.op = backward ? "layer.backward" : "layer.forward";
  r.shape = s;
  r.threads = opt.threads;
  const LayerData d = layer_problem(s);
  const auto w = d.weights();
  std::vector<float> y(s.t * s.h), dx(s.t * s.h), dwr(s.e * s.h), db(s.e);
  std::vector<float> gag(s.e * s.r * s.h), gau(gag.size()), gbg(s.e * s.i * s.r), gbu(gbg.size()),
      gad(s.e * s.r * s.i), gbd(s.e * s.h * s.r);
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
    g.w_gate = {gw[0].data(), s.e * s.i, s.h}, g.w_up = {gw[1].data(), s.e * s.i, s.h},
    g.w_down = {gw[2].data(), s.e * s.h, s.i};
  }
  layer::Saved saved;  // reused across steps, as a training loop would
  const MatView<const bf16> x(d.x.data(), s.t, s.h);
  auto fwd = [&] { layer::forward(d.cfg, w, x, {y.data(), s.t, s.h}, saved, {.isa = opt.isa}); };

  // The eager peer on the same data, with its own outputs.
  OnednnEagerLayer peer(peer_spec(d));
  std::vector<float> py(y.size()), pdx(dx.size()), pdwr(dwr.size()), pdb(db.size()),
      pag(gag.size()), pau(gau.size()), pbg(gbg.size()), pbu(gbu.size()), pad(gad.size()),
      pbd(gbd.size());
  const EagerLayerGrads pg{.dx = pdx.data(),
                           .router_w = pdwr.data(),
                           .router_b = pdb.data(),
                           .a_gate = pag.data(),
                           .b_gate = pbg.data(),
                           .a_up = pau.data(),
                           .b_up = pbu.data(),
                           .a_down = pad.data(),
                           .b_down = pbd.data()};
  auto peer_fwd = [&] { peer.forward(x, {py.data(), s.t, s.h}); };
  const MatView<const float> dyv(d.dy.data(), s.t, s.h);
  if (backward) {
    forward_for_backward(opt, fwd);
    auto bwd = [&] { layer::backward(d.cfg, w, x, dyv, saved, g); };
    if (base || !opt.contracts.empty()) {
      time_against_peer(opt, bwd, {}, r);  // the peer trains LoRA only; --contracts: no peer
    } else {
      peer_fwd();
      time_against_peer(
          opt, bwd, [&] { peer.backward(dyv, pg); }, r);
    }
  } else {
    time_against_peer(opt, fwd, peer_fwd, r);
  }
  r.isa = std::string(isa_name(opt.isa));
  const double routed = double(s.t) * double(s.k);
  r.flops = (base ? 12.0 : 6.0) * routed * double(s.h) * double(s.i) +
            2.0 * double(s.t) * double(s.e) * double(s.h);
  for (const auto& p : kPytorch)
    if (p[0] == double(s.t) && opt.threads == 16 && !base) {
      r.recorded_peer = "pytorch_eager_recorded";
      r.recorded_peer_ms = backward ? p[2] : p[1];
    }
  if (base) {
    r.note = "no peer: the eager peer trains LoRA only";
    return r;
  }
  r.peer = "onednn_eager";
  // The two must agree to within bf16-level differences; the worst
  // output's largest difference relative to its largest magnitude.
  struct Pair {
    const char* name;
    const std::vector<float>& ours;
    const std::vector<float>& theirs;
  };
  const std::vector<Pair> pairs =
      backward ? std::vector<Pair>{{"dx", dx, pdx},         {"d router_w", dwr, pdwr},
                                   {"d router_b", db, pdb}, {"d a_gate", gag, pag},
                                   {"d b_gate", gbg, pbg},  {"d a_up", gau, pau},
                                   {"d b_up", gbu, pbu},    {"d a_down", gad, pad},
                                   {"d b_down", gbd, pbd}}
               : std::vector<Pair>{{"y", y, py}};
  double worst = -1;
  const char* worst_name = "";
  for (const auto& pr : pairs) {
    const Difference d = difference(pr.ours, pr.theirs);
    const double rel = d.max_abs > 0 ? d.max_diff / d.max_abs : d.max_diff;
    if (rel > worst) worst = rel, worst_name = pr.name;
  }
  r.note = fmt::format(
      "peer: the layer run eagerly on oneDNN ({}); largest |ours - peer| / max |peer|: {:.2g} "
      "({})",
      peer.matmul_impls(), worst, worst_name);
  if (r.recorded_peer_ms > 0)
    r.note += fmt::format(
        "; recorded PyTorch CPU bf16 eager (AMX machine, 16 threads, not run here): {:.0f} ms = "
        "{:.2f}x",
        r.recorded_peer_ms, r.recorded_peer_ms / r.median_ms);
  return r;
}

// The experts op on the caller's routing (K distinct experts per token,
// uniform; weights in [0, 1)), forward_train or backward (dx, dweights and
// the LoRA gradients), against the eager peer's expert part on the same
// routing.
Result experts_case(const std::string& name, const Shape& s, bool backward, const Options& opt) {
  Result r;
  r.name = name;
  r.op = backward ? "experts.backward" : "experts.forward_train";
  r.shape = s;
  r.threads = opt.threads;
  r.isa = std::string(isa_name(opt.isa));
  r.peer = "onednn_eager_experts";
  const LayerData d = layer_problem(s);
  std::vector<std::int32_t> idx;
  std::vector<float> w;
  uniform_routing(s, idx, w);
  const auto lora =
      experts::Lora::stacked(d.cfg, d.lora[0].data(), d.lora[1].data(), d.lora[2].data(),
                             d.lora[3].data(), d.lora[4].data(), d.lora[5].data());
  const MatView<const bf16> x(d.x.data(), s.t, s.h);
  const MatView<const std::int32_t> iv(idx.data(), s.t, s.k);
  const MatView<const float> wv(w.data(), s.t, s.k), dyv(d.dy.data(), s.t, s.h);
  std::vector<float> y(s.t * s.h), dx(s.t * s.h), dw(s.t * s.k), g[6];
  const std::size_t sizes[6] = {s.e * s.r * s.h, s.e * s.i * s.r, s.e * s.r * s.h,
                                s.e * s.i * s.r, s.e * s.r * s.i, s.e * s.h * s.r};
  const std::size_t cols[6] = {s.h, s.r, s.h, s.r, s.i, s.r};
  experts::Gradients gr;
  gr.dx = {dx.data(), s.t, s.h}, gr.dweights = {dw.data(), s.t, s.k};
  MatView<float>* lv[6] = {&gr.a_gate, &gr.b_gate, &gr.a_up, &gr.b_up, &gr.a_down, &gr.b_down};
  for (int i = 0; i < 6; ++i)
    g[i].resize(sizes[i]), *lv[i] = {g[i].data(), sizes[i] / cols[i], cols[i]};
  experts::Saved saved;  // reused across steps, as a training loop would
  auto fwd = [&] {
    experts::forward_train(d.packed, lora, x, iv, wv, {y.data(), s.t, s.h}, saved,
                           {.isa = opt.isa});
  };
  OnednnEagerLayer peer(peer_spec(d));
  std::vector<float> py(y.size()), pdx(dx.size()), pdw(dw.size()), pg[6];
  for (int i = 0; i < 6; ++i) pg[i].resize(sizes[i]);
  const EagerLayerGrads pgr{.dx = pdx.data(),
                            .a_gate = pg[0].data(),
                            .b_gate = pg[1].data(),
                            .a_up = pg[2].data(),
                            .b_up = pg[3].data(),
                            .a_down = pg[4].data(),
                            .b_down = pg[5].data()};
  auto peer_fwd = [&] { peer.forward_experts(x, iv, wv, {py.data(), s.t, s.h}); };
  std::vector<std::pair<const std::vector<float>*, const std::vector<float>*>> pairs{{&y, &py}};
  if (backward) {
    forward_for_backward(opt, fwd);
    if (opt.contracts.empty()) peer_fwd();  // --contracts: the peer is not run
    time_against_peer(
        opt, [&] { experts::backward(d.packed, lora, x, dyv, saved, gr); },
        [&] { peer.backward_experts(dyv, pgr, pdw.data()); }, r);
    pairs = {{&dx, &pdx}, {&dw, &pdw}};
    for (int i = 0; i < 6; ++i) pairs.emplace_back(&g[i], &pg[i]);
  } else {
    time_against_peer(opt, fwd, peer_fwd, r);
  }
  // Three GEMMs of 2 T K H I each way (backward: dh, and dx through gate and up).
  r.flops = 6.0 * double(s.t) * double(s.k) * double(s.h) * double(s.i);
  double worst = 0;
  for (const auto& [ours, theirs] : pairs) {
    const Difference df = difference(*ours, *theirs);
    worst = std::max(worst, df.max_abs > 0 ? df.max_diff / df.max_abs : df.max_diff);
  }
  r.note = fmt::format(
      "peer: the eager layer's expert part on the same routing ({}); largest |ours - peer| / max "
      "|peer|: {:.2g}",
      peer.matmul_impls(), worst);
  return r;
}

}  // namespace

void add_layer_cases(std::vector<Case>& out) {
  for (std::size_t t : {48, 1024, 4096})
    for (bool backward : {false, true}) {
      const Shape s{64, 2048, 1408, 6, 8, t};
      const std::string name =
          fmt::format("layer.{}/E64_H2048_I1408_K6_r8_T{}", backward ? "backward" : "forward", t);
      // Weights; both sides' saved activations (the peer keeps bf16 copies
      // of each routed row's x, g, u, silu(g), h and o).
      const std::size_t bytes = 2 * 3 * s.e * s.h * s.i * 2 + s.t * s.k * (4 * s.i + 3 * s.h) * 8 +
                                s.t * s.k * (4 * s.i + 2 * s.h) * 2 + 4 * s.t * s.h * 4;
      out.push_back({name, backward ? "layer.backward" : "layer.forward", s, bytes,
                     [name, s, backward](const Options& o) {
                       return layer_case(name, s, backward, false, o);
                     }});
    }
  // With the base weights' gradients (3 x E I H fp32 outputs: 2.2 GB).
  const Shape s{64, 2048, 1408, 6, 8, 1024};
  for (bool backward : {false, true})
    for (std::size_t t : {std::size_t{48}, std::size_t{1024}, std::size_t{4096}}) {
      const Shape s{64, 2048, 1408, 6, 8, t};
      const std::string name = fmt::format("experts.{}/E64_H2048_I1408_K6_r8_T{}",
                                           backward ? "backward" : "forward_train", t);
      out.push_back(
          {name, backward ? "experts.backward" : "experts.forward_train", s, 0,
           [name, s, backward](const Options& o) { return experts_case(name, s, backward, o); }});
    }
  const std::string name = "layer.backward_base/E64_H2048_I1408_K6_r8_T1024";
  const std::size_t bytes =
      2 * 3 * s.e * s.h * s.i * 2 + 3 * s.e * s.h * s.i * 4 + s.t * s.k * (4 * s.i + 3 * s.h) * 8;
  out.push_back({name, "layer.backward", s, bytes,
                 [name, s](const Options& o) { return layer_case(name, s, true, true, o); }});
}

}  // namespace moecert::bench
