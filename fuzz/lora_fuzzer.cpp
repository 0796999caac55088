// Property: the MoE layer forward with LoRA, on a usable ISA (decoded) at
// level full, given a decoded layer (fuzz/layer_common.hpp):
// invalid input (non-finite or out-of-range x or LoRA factors, a LoRA scale
// that underflows) raises exactly a precondition violation of the layer and
// leaves y untouched; valid input raises nothing: y finite, z and y within
// the derived bounds (proofs/layer.md), the packed rank padding zero. The
// router may refuse logits outside its domain (a precondition too), and an
// fp32 overflow of a valid input is a y_finite postcondition. Where the
// decoded kernel is amx_bf16, amx_emu gives the same y bit for bit (or
// violates the same clause).
#include <cstring>

#include "fuzz/layer_common.hpp"
#include "moecert/isa.hpp"

using namespace moecert;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  const fuzz::LayerInput in = fuzz::decode_layer(d, false);
  const bool valid = in.x_ok && in.lora_ok && in.scale_ok;
  // One usable kernel per input, compared with the reference; where it is
  // amx_bf16, the AMX tile model (50 times slower) runs the same input and
  // must agree bit for bit.
  auto run = [&](Isa isa) {
    fuzz::Outcome o{"", std::vector<float>(in.T * in.H, 1234.5f)};
    const std::vector<float> before = o.out;
    layer::Saved saved;
    try {
      ContractScope s{Level::full, Semantic::enforce};
      layer::forward(in.cfg, in.weights(), {in.x.data(), in.T, in.H}, {o.out.data(), in.T, in.H},
                     saved, {.isa = isa});
      if (!valid) fuzz::finding("lora_fuzzer", "forward accepted invalid input");
    } catch (const ContractViolation& v) {
      o.clause = v.clause();
      const std::string& c = o.clause;
      const bool router_domain =
          c.rfind("router.", 0) == 0 && v.violation().kind == ClauseKind::pre;
      if (valid && !router_domain && c != "layer.forward.y_finite")
        fuzz::finding("lora_fuzzer", std::string(isa_name(isa)) + ": " + v.what());
      if (!valid && v.violation().kind != ClauseKind::pre && !router_domain)
        fuzz::finding("lora_fuzzer", std::string("invalid input, not a precondition: ") + v.what());
      if (v.violation().kind == ClauseKind::pre && !o.out.empty() &&
          std::memcmp(before.data(), o.out.data(), o.out.size() * 4) != 0)
        fuzz::finding("lora_fuzzer", c + " wrote y before failing a precondition");
    }
    return o;
  };
  const std::vector<Isa> isas = usable_isas();
  const Isa isa = isas[d.u8() % isas.size()];
  const fuzz::Outcome o = run(isa);
  if (isa == Isa::amx_bf16) fuzz::expect_same_bits("lora_fuzzer", o, run(Isa::amx_emu));
  return 0;
}
