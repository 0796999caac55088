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

namespace {

constexpr const char* kName = "layer_backward_fuzzer";

// The forward at check (its own fuzzer is lora_fuzzer); false where it
// raised (router domain or overflow: nothing saved to differentiate).
bool forward(const fuzz::LayerInput& in, Isa isa, layer::Saved& saved) {
  std::vector<float> y(in.T * in.H);
  try {
    ContractScope s{Level::check, Semantic::enforce};
    layer::forward(in.cfg, in.weights(), in.X(), {y.data(), in.T, in.H}, saved, {.isa = isa});
    return true;
  } catch (const ContractViolation&) {
    return false;
  }
}

// How the backward is called: one buffer holds every gradient at decoded
// offsets (overlap possible), a view's shape may be wrong, the config may be
// another's, and either path may be off.
struct Plan {
  std::size_t offs[14], total = 0;
  bool bad_shape = false, stats = false, other_config = false, base_grads = false;
  layer::BackwardOptions opt;
  MoeConfig cfg;
};

Plan decode_plan(fuzz::Decoder& d, const fuzz::LayerInput& in) {
  const std::size_t E = in.E, H = in.H, I = in.I, r = in.r, R = in.R, T = in.T;
  const std::size_t sizes[14] = {T * H,     R * H,     R,         E * r * H, E * I * r,
                                 E * r * H, E * I * r, E * r * I, E * H * r, T * E,
                                 T * E,     E * I * H, E * I * H, E * H * I};
  Plan p;
  for (int i = 0; i < 14; ++i) p.offs[i] = p.total, p.total += sizes[i];
  if ((d.u8() & 15) == 0) p.offs[2] = p.offs[0] + d.range(0, 8);  // router_b grad inside dx
  p.bad_shape = (d.u8() & 15) == 0;
  p.stats = d.flag();
  const int path = d.u8() % 3;
  p.opt.router_path = path != 1, p.opt.expert_path = path != 2;
  p.cfg = in.cfg;
  p.other_config = (d.u8() & 31) == 0;
  if (p.other_config) p.cfg.lora_alpha += 1.0;
  // Base-weight gradients: decoded last, so that older corpus entries decode as before.
  p.base_grads = d.flag();
  return p;
}

// The gradient views of plan p over buf.
layer::Gradients gradients(const fuzz::LayerInput& in, const Plan& p, float* buf) {
  const std::size_t E = in.E, H = in.H, I = in.I, r = in.r, R = in.R, T = in.T;
  auto view = [&](int i, std::size_t rows, std::size_t cols) {
    return MatView<float>(buf + p.offs[i], rows, cols);
  };
  layer::Gradients g;
  g.dx = view(0, T, H + (p.bad_shape ? 1 : 0));
  g.router_w = view(1, R, H);
  g.router_b = {buf + p.offs[2], R};
  if (r) {
    g.a_gate = view(3, E * r, H), g.b_gate = view(4, E * I, r), g.a_up = view(5, E * r, H);
    g.b_up = view(6, E * I, r), g.a_down = view(7, E * r, I), g.b_down = view(8, E * H, r);
  }
  if (p.stats) g.m_a = view(9, T, E), g.m_g = view(10, T, E);
  if (p.base_grads)
    g.w_gate = view(11, E * I, H), g.w_up = view(12, E * I, H), g.w_down = view(13, E * H, I);
  return g;
}

// Any two non-empty gradient views sharing a byte.
bool views_overlap(const layer::Gradients& g) {
  const ByteRange ranges[] = {
      g.dx.bytes(),   g.router_w.bytes(), g.router_b.bytes(), g.a_gate.bytes(), g.b_gate.bytes(),
      g.a_up.bytes(), g.b_up.bytes(),     g.a_down.bytes(),   g.b_down.bytes(), g.m_a.bytes(),
      g.m_g.bytes(),  g.w_gate.bytes(),   g.w_up.bytes(),     g.w_down.bytes()};
  for (std::size_t i = 0; i < std::size(ranges); ++i)
    for (std::size_t j = i + 1; j < std::size(ranges); ++j)
      if (!ranges[i].empty() && !ranges[j].empty() && overlaps(ranges[i], ranges[j])) return true;
  return false;
}

// The backward at full on a buffer that starts as `before`: a finding where
// valid input raises (but an fp32 overflow or a router precondition on dw),
// where invalid input passes or raises other than a precondition, and where
// a precondition failed after a gradient was written.
fuzz::Outcome backward(const fuzz::LayerInput& in, const Plan& p, bool valid, Isa isa,
                       layer::Saved& s, const std::vector<float>& before) {
  fuzz::Outcome o{"", before};
  try {
    ContractScope scope{Level::full, Semantic::enforce};
    layer::backward(p.cfg, in.weights(), in.X(), in.DY(), s, gradients(in, p, o.out.data()), p.opt);
    if (!valid) fuzz::finding(kName, "backward accepted invalid input");
  } catch (const ContractViolation& v) {
    o.clause = v.clause();
    const std::string& c = o.clause;
    const bool pre = v.violation().kind == ClauseKind::pre;
    const bool router_pre = c.rfind("router.", 0) == 0 && pre;  // dw out of its domain
    // fp32 overflow: of a layer gradient, or first of the sigmoid router's dz (c |g - D|)
    const bool overflow =
        c == "layer.backward.grad_finite" || c == "router.sigmoid_topk_backward.dz_finite";
    if (valid && !overflow && !router_pre)
      fuzz::finding(kName, std::string(isa_name(isa)) + ": " + v.what());
    if (!valid && !pre)
      fuzz::finding(kName, std::string("invalid input, not a precondition: ") + v.what());
    if (pre && c.rfind("layer.", 0) == 0 &&
        std::memcmp(before.data(), o.out.data(), o.out.size() * 4) != 0)
      fuzz::finding(kName, c + " wrote a gradient before failing a precondition");
  }
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  const fuzz::LayerInput in = fuzz::decode_layer(d, true);
  if (!(in.x_ok && in.lora_ok && in.scale_ok))
    return 0;  // lora_fuzzer covers the forward's preconditions
  const std::vector<Isa> isas = usable_isas();
  const Isa isa = isas[d.u8() % isas.size()];  // usable kernels (see lora_fuzzer on amx_emu)
  layer::Saved saved;
  if (!forward(in, isa, saved)) return 0;
  const Plan p = decode_plan(d, in);
  std::vector<float> before(p.total + 64, 777.0f);  // every run's buffer starts as this
  const bool any_out = in.T && in.H;                // an empty dx view is "not computed"
  const bool valid = in.dy_ok && !(p.bad_shape && any_out) &&
                     !views_overlap(gradients(in, p, before.data())) && !p.other_config;
  const fuzz::Outcome o = backward(in, p, valid, isa, saved, before);
  // amx_bf16: the tile model's forward and backward of the same input give
  // the same gradients bit for bit (or violate the same clause).
  if (isa == Isa::amx_bf16) {
    layer::Saved emu;
    if (!forward(in, Isa::amx_emu, emu))
      fuzz::finding(kName, "amx_emu's forward failed, amx_bf16's did not");
    fuzz::expect_same_bits(kName, o, backward(in, p, valid, Isa::amx_emu, emu, before));
  }
  return 0;
}
