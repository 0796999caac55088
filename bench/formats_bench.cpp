// Benchmark cases: the experts op over quantized base weights against the
// same op over bf16 base weights (the weights it was quantized from), on
// the same routing, LoRA and thread count, in alternation; the speedup is
// bf16's time over the format's. The note states each pack's bytes.
#include <fmt/format.h>
#include <oneapi/tbb/parallel_for.h>

#include <cmath>

#include "bench/bench.hpp"
#include "moecert/experts.hpp"
#include "moecert/formats.hpp"
#include "support/layer_problem.hpp"
#include "support/quantized.hpp"

namespace moecert::bench {
namespace {

// Quantized copies of the E matrices [rows x cols] stacked in w (moecert::quantize).
std::vector<fixture::QuantMatrix> quantized(WeightFormat f, const std::vector<bf16>& w,
                                            std::size_t E, std::size_t rows, std::size_t cols) {
  std::vector<fixture::QuantMatrix> out(E);
  oneapi::tbb::parallel_for(std::size_t{0}, E, [&](std::size_t e) {
    std::vector<float> m(rows * cols);
    for (std::size_t i = 0; i < rows * cols; ++i) m[i] = w[e * rows * cols + i].to_float();
    fixture::QuantMatrix& q = out[e];
    q.view.format = f, q.view.rows = rows, q.view.cols = cols;
    q.view.stride = q.view.row_bytes(), q.view.scale_stride = q.view.scale_cols();
    q.codes.assign(rows * q.view.stride, 0);
    q.scales.assign(q.view.scale_rows() * q.view.scale_stride, 0);
    q.rebind();
    quantize(f, MatView<const float>(m.data(), rows, cols), q.out());
  });
  return out;
}

std::vector<QuantView> views(const std::vector<fixture::QuantMatrix>& q) {
  std::vector<QuantView> v;
  for (const auto& m : q) v.push_back(m.view);
  return v;
}

Result format_case(const std::string& name, const Shape& s, WeightFormat f, bool backward,
                   const Options& opt) {
  Result r;
  r.name = name;
  r.op = backward ? "experts.backward" : "experts.forward_train";
  r.shape = s;
  r.threads = opt.threads;
  r.isa = std::string(isa_name(opt.isa));
  r.peer = "moecert_bf16";
  const fixture::LayerProblem d = layer_problem(s);
  const auto qg = quantized(f, d.wg, s.e, s.i, s.h), qu = quantized(f, d.wu, s.e, s.i, s.h),
             qd = quantized(f, d.wd, s.e, s.h, s.i);
  const auto packed = experts::PackedExperts::pack(views(qg), views(qu), views(qd), true);
  std::vector<std::int32_t> idx;
  std::vector<float> w;
  uniform_routing(s, idx, w);
  const auto lora =
      experts::Lora::stacked(d.cfg, d.lora[0].data(), d.lora[1].data(), d.lora[2].data(),
                             d.lora[3].data(), d.lora[4].data(), d.lora[5].data());
  const MatView<const bf16> x(d.x.data(), s.t, s.h);
  const MatView<const std::int32_t> iv(idx.data(), s.t, s.k);
  const MatView<const float> wv(w.data(), s.t, s.k), dyv(d.dy.data(), s.t, s.h);
  std::vector<float> y(s.t * s.h), dx(s.t * s.h), dw(s.t * s.k), y16(y.size()), dx16(dx.size()),
      dw16(dw.size());
  experts::Saved saved, saved16;
  auto forward = [&](const experts::PackedExperts& p, std::vector<float>& out, experts::Saved& sv) {
    experts::forward_train(p, lora, x, iv, wv, {out.data(), s.t, s.h}, sv, {.isa = opt.isa});
  };
  auto grads = [&](std::vector<float>& gx, std::vector<float>& gw) {
    experts::Gradients g;
    g.dx = {gx.data(), s.t, s.h}, g.dweights = {gw.data(), s.t, s.k};
    return g;
  };
  if (backward) {
    forward_for_backward(opt, [&] { forward(packed, y, saved); });
    forward(d.packed, y16, saved16);
    time_against_peer(
        opt, [&] { experts::backward(packed, lora, x, dyv, saved, grads(dx, dw)); },
        [&] { experts::backward(d.packed, lora, x, dyv, saved16, grads(dx16, dw16)); }, r);
  } else {
    time_against_peer(
        opt, [&] { forward(packed, y, saved); }, [&] { forward(d.packed, y16, saved16); }, r);
  }
  r.flops = 6.0 * double(s.t) * double(s.k) * double(s.h) * double(s.i);
  const double elements = 3.0 * double(s.e) * double(s.h) * double(s.i);
  const Difference df = backward ? difference(dx, dx16) : difference(y, y16);
  r.note = fmt::format(
      "peer: moecert over the bf16 weights it was quantized from; packed bytes per weight (both "
      "orientations) {:.3f}, bf16's {:.3f}; largest |{} - bf16's| / max: {:.2g} (the "
      "quantization's)",
      double(packed.bytes()) / elements, double(d.packed.bytes()) / elements, backward ? "dx" : "y",
      df.max_abs > 0 ? df.max_diff / df.max_abs : df.max_diff);
  return r;
}

}  // namespace

void add_format_cases(std::vector<Case>& out) {
  for (WeightFormat f :
       {WeightFormat::int8_channel, WeightFormat::int4_group, WeightFormat::fp8_e4m3_block128})
    for (bool backward : {false, true})
      for (std::size_t t : {std::size_t{48}, std::size_t{1024}, std::size_t{4096}}) {
        const Shape s{64, 2048, 1408, 6, 8, t};
        const std::string name =
            fmt::format("experts.{}.{}/E64_H2048_I1408_K6_r8_T{}",
                        backward ? "backward" : "forward_train", format_name(f), t);
        out.push_back({name, backward ? "experts.backward" : "experts.forward_train", s, 0,
                       [name, s, f, backward](const Options& o) {
                         return format_case(name, s, f, backward, o);
                       }});
      }
}

}  // namespace moecert::bench
