// Property: the MoE layer forward with LoRA, on a usable ISA (decoded) at
// level full, given a decoded layer (fuzz/layer_common.hpp):
// invalid input (non-finite or out-of-range x or LoRA factors, a LoRA scale
// that underflows) raises exactly a precondition violation of the layer and
// leaves y untouched; valid input raises nothing: y finite, z and y within
// the derived bounds (proofs/layer.md), the packed rank padding zero. The
// router may refuse logits outside its domain (a precondition too), and an
// fp32 overflow of a valid input is a y_finite postcondition.
#include <cstring>

#include "fuzz/layer_common.hpp"
#include "moecert/isa.hpp"

using namespace moecert;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  const fuzz::LayerInput in = fuzz::decode_layer(d, false);
  const bool valid = in.x_ok && in.lora_ok && in.scale_ok;
  // One usable kernel per input, compared with the reference (the AMX tile
  // model, 50 times slower, is fuzzed by experts_fuzzer and checked bit for
  // bit against amx_bf16 by the layer tests on the AMX machine).
  const std::vector<Isa> isas = usable_isas();
  for (Isa isa : {isas[d.u8() % isas.size()]}) {
    std::vector<float> y(in.T * in.H, 1234.5f);
    const std::vector<float> before = y;
    layer::Saved saved;
    try {
      ContractScope s{Level::full, Semantic::enforce};
      layer::forward(in.cfg, in.weights(), {in.x.data(), in.T, in.H}, {y.data(), in.T, in.H}, saved, {.isa = isa});
      if (!valid) fuzz::finding("lora_fuzzer", "forward accepted invalid input");
    } catch (const ContractViolation& v) {
      const std::string c = v.clause();
      const bool router_domain = c.rfind("router.", 0) == 0 && v.violation().kind == ClauseKind::pre;
      if (valid && !router_domain && c != "layer.forward.y_finite")
        fuzz::finding("lora_fuzzer", std::string(isa_name(isa)) + ": " + v.what());
      if (!valid && v.violation().kind != ClauseKind::pre && !router_domain)
        fuzz::finding("lora_fuzzer", std::string("invalid input, not a precondition: ") + v.what());
      if (v.violation().kind == ClauseKind::pre && !y.empty() && std::memcmp(before.data(), y.data(), y.size() * 4) != 0)
        fuzz::finding("lora_fuzzer", c + " wrote y before failing a precondition");
    }
  }
  return 0;
}
