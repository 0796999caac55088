// Property: the experts op with the caller's routing (experts.forward_train,
// then experts.backward asking for a decoded subset of its outputs) at level
// full, on a decoded layer's weights, LoRA, x and dy (fuzz/layer_common.hpp)
// and decoded routing that is now and then invalid (an index out of range,
// a valid slot after a -1, a duplicate, a NaN weight, a weight at a -1
// slot): invalid input raises exactly a precondition violation and leaves
// every output untouched; valid input raises nothing but fp32 overflow of a
// result (y_finite, grad_finite): dweights 0 at -1 slots, idle experts'
// gradients 0, every output within its derived bound (proofs/experts.md).
// Where the decoded kernel is amx_bf16, amx_emu gives the same bits.
#include <algorithm>
#include <cstring>

#include "fuzz/layer_common.hpp"
#include "moecert/isa.hpp"

using namespace moecert;

namespace {

struct Routing {
  std::vector<std::int32_t> idx;
  std::vector<float> w;
  bool ok = true;
};

// Per row a valid prefix of distinct experts, then -1 with weight 0;
// one row in 16 spoiled in one of five ways.
Routing decode_routing(fuzz::Decoder& d, std::size_t T, std::size_t K, std::size_t E) {
  Routing r;
  r.idx.assign(T * K, -1), r.w.assign(T * K, 0.0f);
  for (std::size_t t = 0; t < T; ++t) {
    const std::size_t valid = d.range(0, K);
    for (std::size_t j = 0; j < valid; ++j) {
      const auto e = static_cast<std::int32_t>(d.range(0, E - 1));
      if (std::find(r.idx.begin() + t * K, r.idx.begin() + t * K + j, e) !=
          r.idx.begin() + t * K + j)
        break;  // taken: the row ends
      r.idx[t * K + j] = e, r.w[t * K + j] = fuzz::small_bf16(d, false).to_float();
    }
    if ((d.u8() & 15) != 0) continue;
    const std::size_t j = d.range(0, K - 1);
    switch (d.u8() % 5) {
      case 0:
        r.idx[t * K + j] = static_cast<std::int32_t>(E + d.range(0, 3));
        break;  // out of range
      case 1:
        if (j + 1 < K && r.idx[t * K + j] >= 0)
          r.idx[t * K + j] = -1, r.w[t * K + j] = 0, r.idx[t * K + K - 1] = 0;
        break;  // -1 before a valid slot
      case 2:
        if (j > 0 && r.idx[t * K + j] >= 0) r.idx[t * K + j] = r.idx[t * K];
        break;  // duplicate
      case 3:
        r.w[t * K + j] = NAN;
        break;  // NaN weight
      case 4:
        if (r.idx[t * K + j] < 0) r.w[t * K + j] = 0.5f;
        break;  // weight at a -1 slot
    }
  }
  // The decoded routing's validity, judged here from the definitions.
  for (std::size_t t = 0; t < T; ++t) {
    bool tail = false;
    for (std::size_t j = 0; j < K; ++j) {
      const std::int32_t e = r.idx[t * K + j];
      r.ok = r.ok && e >= -1 && e < static_cast<std::int32_t>(E) && !(tail && e != -1) &&
             std::isfinite(r.w[t * K + j]) && !(e == -1 && r.w[t * K + j] != 0);
      for (std::size_t l = 0; l < j; ++l) r.ok = r.ok && !(e >= 0 && r.idx[t * K + l] == e);
      tail = tail || e == -1;
    }
  }
  return r;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  const fuzz::LayerInput in = fuzz::decode_layer(d, true);
  const std::size_t E = in.E, H = in.H, I = in.I, r = in.r, T = in.T, K = in.K;
  const Routing rt = decode_routing(d, T, K, E);
  const std::vector<Isa> isas = usable_isas();
  const Isa isa = isas[d.u8() % isas.size()];
  const unsigned ask = d.u8();  // which outputs the backward asks for (bit i: output i)
  const experts::Lora lora =
      experts::Lora::stacked(in.cfg, in.lora[0].data(), in.lora[1].data(), in.lora[2].data(),
                             in.lora[3].data(), in.lora[4].data(), in.lora[5].data());
  const bool fwd_valid = rt.ok && in.x_ok && in.lora_ok && in.scale_ok;
  // Outputs: y, then dx, dweights, m_a, m_g, the six LoRA and three base
  // gradients, in one buffer starting as 777.
  const std::size_t sizes[14] = {T * H,     T * H,     T * K,     T * E,     T * E,
                                 E * r * H, E * I * r, E * r * H, E * I * r, E * r * I,
                                 E * H * r, E * I * H, E * I * H, E * H * I};
  std::size_t offs[14], total = 0;
  for (int i = 0; i < 14; ++i) offs[i] = total, total += sizes[i];
  auto run = [&](Isa k) {
    fuzz::Outcome o{"", std::vector<float>(total, 777.0f)};
    float* b = o.out.data();
    auto view = [&](int i, std::size_t rows, std::size_t cols) {
      return MatView<float>(b + offs[i], rows, cols);
    };
    experts::Saved saved;
    ContractScope scope{Level::full, Semantic::enforce};
    try {
      experts::forward_train(in.packed, lora, {in.x.data(), T, H}, {rt.idx.data(), T, K},
                             {rt.w.data(), T, K}, view(0, T, H), saved, {.isa = k});
      if (!fwd_valid)
        fuzz::finding("experts_backward_fuzzer", "forward_train accepted invalid input");
      experts::Gradients g;
      if (ask & 1) g.dx = view(1, T, H);
      if (ask & 2) g.dweights = view(2, T, K);
      if (ask & 4) g.m_a = view(3, T, E), g.m_g = view(4, T, E);
      if ((ask & 8) && r) {
        g.a_gate = view(5, E * r, H), g.b_gate = view(6, E * I, r), g.a_up = view(7, E * r, H);
        g.b_up = view(8, E * I, r), g.a_down = view(9, E * r, I), g.b_down = view(10, E * H, r);
      }
      if (ask & 16)
        g.w_gate = view(11, E * I, H), g.w_up = view(12, E * I, H), g.w_down = view(13, E * H, I);
      const std::vector<float> before = o.out;
      try {
        experts::backward(in.packed, lora, {in.x.data(), T, H}, {in.dy.data(), T, H}, saved, g);
        if (!in.dy_ok)
          fuzz::finding("experts_backward_fuzzer", "backward accepted a non-finite dy");
      } catch (const ContractViolation& v) {
        o.clause = v.clause();
        if (v.violation().kind == ClauseKind::pre &&
            std::memcmp(before.data(), o.out.data(), total * 4) != 0)
          fuzz::finding("experts_backward_fuzzer",
                        o.clause + " wrote an output before failing a precondition");
        if (in.dy_ok && o.clause != "experts.backward.grad_finite")
          fuzz::finding("experts_backward_fuzzer", std::string(isa_name(k)) + ": " + v.what());
      }
    } catch (const ContractViolation& v) {
      o.clause = v.clause();
      const bool pre = v.violation().kind == ClauseKind::pre;
      if (fwd_valid && o.clause != "experts.forward_train.y_finite")
        fuzz::finding("experts_backward_fuzzer", std::string(isa_name(k)) + ": " + v.what());
      if (!fwd_valid && !pre)
        fuzz::finding("experts_backward_fuzzer",
                      std::string("invalid input, not a precondition: ") + v.what());
      if (pre && std::any_of(o.out.begin(), o.out.end(), [](float x) { return x != 777.0f; }))
        fuzz::finding("experts_backward_fuzzer",
                      o.clause + " wrote y before failing a precondition");
    }
    return o;
  };
  const fuzz::Outcome o = run(isa);
  if (isa == Isa::amx_bf16) fuzz::expect_same_bits("experts_backward_fuzzer", o, run(Isa::amx_emu));
  return 0;
}
