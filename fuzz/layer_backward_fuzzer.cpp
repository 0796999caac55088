// Property: the MoE layer backward (expert path, router path, or both) at
// level full, after a valid forward of a decoded layer
// (fuzz/layer_common.hpp): invalid input (non-finite dy, a gradient view of
// the wrong shape or overlapping another, a saved state of another config)
// raises exactly a precondition violation and leaves every gradient
// untouched; valid input raises nothing: gradients finite, LoRA gradients of
// idle experts exactly 0, dL/dw 0 at -1 slots, every gradient within its
// derived bound of the reference (proofs/layer.md). A valid dy large enough
// to overflow fp32 may fail grad_finite (or, first, the sigmoid router's
// dz_finite). Where the decoded kernel is amx_bf16, amx_emu's forward and
// backward give the same gradients bit for bit.
#include <cstring>

#include "fuzz/layer_common.hpp"
#include "moecert/isa.hpp"

using namespace moecert;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  const fuzz::LayerInput in = fuzz::decode_layer(d, true);
  if (!(in.x_ok && in.lora_ok && in.scale_ok))
    return 0;  // lora_fuzzer covers the forward's preconditions
  const std::vector<Isa> isas = usable_isas();
  const Isa isa = isas[d.u8() % isas.size()];  // usable kernels (see lora_fuzzer on amx_emu)
  auto forward = [&](Isa k, layer::Saved& saved) {
    std::vector<float> y(in.T * in.H);
    try {
      ContractScope s{Level::check, Semantic::enforce};
      layer::forward(in.cfg, in.weights(), {in.x.data(), in.T, in.H}, {y.data(), in.T, in.H}, saved,
                     {.isa = k});
      return true;
    } catch (const ContractViolation&) {
      return false;  // router domain or overflow: nothing saved to differentiate
    }
  };
  layer::Saved saved;
  if (!forward(isa, saved)) return 0;
  // One buffer holds every gradient at decoded offsets (overlap possible).
  const std::size_t E = in.E, H = in.H, I = in.I, r = in.r, R = in.R, T = in.T;
  const std::size_t sizes[14] = {T * H,     R * H,     R,         E * r * H, E * I * r,
                                 E * r * H, E * I * r, E * r * I, E * H * r, T * E,
                                 T * E,     E * I * H, E * I * H, E * H * I};
  std::size_t total = 0;
  for (auto s : sizes) total += s;
  std::size_t offs[14], at = 0;
  const bool alias = (d.u8() & 15) == 0;
  for (int i = 0; i < 14; ++i) {
    offs[i] = at;
    at += sizes[i];
  }
  if (alias) offs[2] = offs[0] + d.range(0, 8);  // router_b grad inside dx
  const bool bad_shape = (d.u8() & 15) == 0;
  const bool stats = d.flag();
  layer::BackwardOptions opt;
  switch (d.u8() % 3) {
    case 0:
      break;
    case 1:
      opt.router_path = false;
      break;
    case 2:
      opt.expert_path = false;
      break;
  }
  MoeConfig cfg = in.cfg;
  const bool other_config = (d.u8() & 31) == 0;
  if (other_config) cfg.lora_alpha += 1.0;
  // Base-weight gradients: decoded last, so that older corpus entries decode as before.
  const bool base_grads = d.flag();
  auto gradients = [&](float* buf) {
    auto view = [&](int i, std::size_t rows, std::size_t cols) {
      return MatView<float>(buf + offs[i], rows, cols);
    };
    layer::Gradients g;
    g.dx = view(0, T, H + (bad_shape ? 1 : 0));
    g.router_w = view(1, R, H);
    g.router_b = {buf + offs[2], R};
    if (r) {
      g.a_gate = view(3, E * r, H), g.b_gate = view(4, E * I, r), g.a_up = view(5, E * r, H);
      g.b_up = view(6, E * I, r), g.a_down = view(7, E * r, I), g.b_down = view(8, E * H, r);
    }
    if (stats) g.m_a = view(9, T, E), g.m_g = view(10, T, E);
    if (base_grads)
      g.w_gate = view(11, E * I, H), g.w_up = view(12, E * I, H), g.w_down = view(13, E * H, I);
    return g;
  };
  std::vector<float> before(total + 64, 777.0f);  // every run's buffer starts as this
  const layer::Gradients g0 =
      gradients(before.data());  // where the views lie (nothing writes them)
  const bool any_out = T && H;   // an empty dx view is "not computed"
  // Any two non-empty gradient views sharing a byte.
  const ByteRange ranges[] = {g0.dx.bytes(),     g0.router_w.bytes(), g0.router_b.bytes(),
                              g0.a_gate.bytes(), g0.b_gate.bytes(),   g0.a_up.bytes(),
                              g0.b_up.bytes(),   g0.a_down.bytes(),   g0.b_down.bytes(),
                              g0.m_a.bytes(),    g0.m_g.bytes(),      g0.w_gate.bytes(),
                              g0.w_up.bytes(),   g0.w_down.bytes()};
  bool overlap = false;
  for (std::size_t i = 0; i < std::size(ranges); ++i)
    for (std::size_t j = i + 1; j < std::size(ranges); ++j)
      overlap =
          overlap || (!ranges[i].empty() && !ranges[j].empty() && overlaps(ranges[i], ranges[j]));
  const bool valid = in.dy_ok && !(bad_shape && any_out) && !overlap && !other_config;
  auto backward = [&](Isa k, layer::Saved& s) {
    fuzz::Outcome o{"", before};
    try {
      ContractScope scope{Level::full, Semantic::enforce};
      layer::backward(cfg, in.weights(), {in.x.data(), T, H}, {in.dy.data(), T, H}, s,
                      gradients(o.out.data()), opt);
      if (!valid) fuzz::finding("layer_backward_fuzzer", "backward accepted invalid input");
    } catch (const ContractViolation& v) {
      o.clause = v.clause();
      const std::string& c = o.clause;
      const bool router_pre = c.rfind("router.", 0) == 0 &&
                              v.violation().kind == ClauseKind::pre;  // dw out of its domain
      // fp32 overflow: of a layer gradient, or first of the sigmoid router's dz (c |g - D|)
      const bool overflow =
          c == "layer.backward.grad_finite" || c == "router.sigmoid_topk_backward.dz_finite";
      if (valid && !overflow && !router_pre)
        fuzz::finding("layer_backward_fuzzer", std::string(isa_name(k)) + ": " + v.what());
      if (!valid && v.violation().kind != ClauseKind::pre)
        fuzz::finding("layer_backward_fuzzer",
                      std::string("invalid input, not a precondition: ") + v.what());
      if (v.violation().kind == ClauseKind::pre && c.rfind("layer.", 0) == 0 &&
          std::memcmp(before.data(), o.out.data(), o.out.size() * 4) != 0)
        fuzz::finding("layer_backward_fuzzer",
                      c + " wrote a gradient before failing a precondition");
    }
    return o;
  };
  const fuzz::Outcome o = backward(isa, saved);
  // amx_bf16: the tile model's forward and backward of the same input give
  // the same gradients bit for bit (or violate the same clause).
  if (isa == Isa::amx_bf16) {
    layer::Saved emu;
    if (!forward(Isa::amx_emu, emu))
      fuzz::finding("layer_backward_fuzzer", "amx_emu's forward failed, amx_bf16's did not");
    fuzz::expect_same_bits("layer_backward_fuzzer", o, backward(Isa::amx_emu, emu));
  }
  return 0;
}
