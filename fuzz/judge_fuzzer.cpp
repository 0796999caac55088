// Property, for every op the judge reads (judge_op: the routers, the experts
// op, the layer) on structure-aware hostile tensors — the op's own names at
// shapes that mostly fit (sometimes off by one, empty or missing), values
// with NaN, Inf, denormals and extremes, ids out of range (-2, E, E + 1000,
// far beyond) and duplicated, quantized base weights (codes any bytes or
// int32, scales any values), parameters valid or not: the judge returns a
// verdict or refuses with std::invalid_argument, and nothing else (no
// crash, no read outside a tensor: ASan; no other exception); a verdict
// lists every row it skipped because an index clause rejected its ids.
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "contracts/judge/ops.hpp"
#include "fuzz/decode.hpp"
#include "moecert/formats.hpp"

using namespace moecert;
namespace judge = contracts::judge;

namespace {

constexpr const char* kName = "judge_fuzzer";

// A shape symbol of the op's tensors (docs/JUDGE.md's table).
enum Dim { T, E, K, H, I, N, R, R1, EI, EH, ER };

struct Spec {
  const char* name;
  bool index;  // int32 ids, else values
  Dim rows, cols;
};

struct Sizes {
  std::size_t t, e, k, h, i, n, r, rank;
  std::size_t of(Dim d) const {
    switch (d) {
      case T:
        return t;
      case E:
        return e;
      case K:
        return k;
      case H:
        return h;
      case I:
        return i;
      case N:
        return n;
      case R:
        return r;
      case R1:
        return 1;
      case EI:
        return e * i;
      case EH:
        return e * h;
      case ER:
        return e * rank;
    }
    return 0;
  }
};

const std::vector<Spec> kRouterIn = {{"z", false, T, E}};
const std::vector<Spec> kRouterOut = {{"idx", true, T, K}, {"w", false, T, K}};
const std::vector<Spec> kBase = {
    {"w_gate", false, EI, H}, {"w_up", false, EI, H}, {"w_down", false, EH, I}};
const std::vector<Spec> kLora = {{"a_gate", false, ER, H}, {"b_gate", false, EI, R1},
                                 {"a_up", false, ER, H},   {"b_up", false, EI, R1},
                                 {"a_down", false, ER, I}, {"b_down", false, EH, R1}};

// The tensors of op (inputs, outputs) by name and shape symbols; R1 stands
// for the LoRA rank's columns.
std::pair<std::vector<Spec>, std::vector<Spec>> specs(const std::string& op, bool lora) {
  auto join = [](std::vector<Spec> a, const std::vector<Spec>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  if (op == "router.softmax_topk.forward") return {kRouterIn, kRouterOut};
  if (op == "router.sigmoid_topk.forward")
    return {{{"z", false, T, E}, {"bias", false, E, R1}}, kRouterOut};
  if (op == "router.product_key.forward")
    return {{{"sx", false, T, N}, {"sy", false, T, N}}, kRouterOut};
  const std::vector<Spec> routed = {{"idx", true, T, K}, {"g", false, T, K}};
  if (op == "router.softmax_topk.backward" || op == "router.sigmoid_topk.backward")
    return {join(kRouterIn, routed), {{"dz", false, T, E}}};
  if (op == "router.product_key.backward")
    return {join({{"sx", false, T, N}, {"sy", false, T, N}}, routed),
            {{"dsx", false, T, N}, {"dsy", false, T, N}}};
  std::vector<Spec> experts = join({{"x", false, T, H}}, kBase);
  if (lora) experts = join(experts, kLora);
  const std::vector<Spec> routing = {{"idx", true, T, K}, {"weights", false, T, K}};
  if (op == "experts.forward" || op == "experts.forward_train")
    return {join(experts, routing), {{"y", false, T, H}}};
  if (op == "experts.backward")
    return {join(join(experts, routing), {{"dy", false, T, H}}),
            {{"dx", false, T, H}, {"dweights", false, T, K}, {"w_up_grad", false, EI, H}}};
  const std::vector<Spec> router = {
      {"router_w", false, R, H}, {"router_b", false, R, R1}, {"router_bias", false, E, R1}};
  const std::vector<Spec> forward = {
      {"z", false, T, R}, {"idx", true, T, K}, {"weights", false, T, K}};
  if (op == "layer.forward") return {join(experts, router), join(forward, {{"y", false, T, H}})};
  return {join(join(join(experts, router), forward), {{"dy", false, T, H}}),
          {{"dx", false, T, H}, {"dweights", false, T, K}, {"dz", false, T, R}}};
}

judge::Tensor make(fuzz::Decoder& d, const Spec& s, const Sizes& z) {
  judge::Tensor t;
  t.rows = z.of(s.rows), t.cols = s.cols == R1 ? 1 : z.of(s.cols);
  if (s.cols == R1 && (s.rows == EI || s.rows == EH)) t.cols = z.rank;  // b_* [E*out, r]
  switch (d.u8() & 31) {  // now and then a shape that does not fit
    case 0:
      t.rows += 1;
      break;
    case 1:
      t.cols = t.cols ? t.cols - 1 : 1;
      break;
    case 2:
      t.rows = 0;
      break;
    default:
      break;
  }
  const std::size_t n = t.rows * t.cols;
  if (s.index) {
    t.i.resize(n);
    const std::size_t experts = s.rows == T && z.n && z.r == 2 * z.n ? z.n * z.n : z.e;
    for (auto& v : t.i)
      v = (d.u8() & 63) == 0 ? static_cast<std::int32_t>(d.u32()) : d.index(experts);
  } else {
    t.f.resize(n);
    for (auto& v : t.f) v = d.value_f32();
  }
  const std::uint8_t stored = d.u8() % 3;  // fp32, bf16 or fp16 storage
  if (stored == 1) t.unit = 0x1p-8, t.tiny = 0x1p-134;
  if (stored == 2) t.unit = 0x1p-11, t.tiny = 0x1p-25;
  return t;
}

judge::Params params(fuzz::Decoder& d, const std::string& op, const std::string& router) {
  static const char* const precisions[] = {"fp32", "mixed", "bf16", "fp64"};
  static const char* const names[] = {"renormalize", "groups", "topk_group",  "scaling", "weights",
                                      "alpha",       "audit",  "renormalise", "sorted"};
  static const char* const values[] = {"true", "false",   "1",   "2", "0",
                                       "-1",   "softmax", "raw", "x", "1e300"};
  judge::Params p;
  p["precision"] = precisions[d.u8() % 4];
  if (op.rfind("layer.", 0) == 0) p["router"] = router;
  for (std::size_t i = d.range(0, 3); i > 0; --i) p[names[d.u8() % 9]] = values[d.u8() % 10];
  return p;
}

// Now and then (experts and layer ops) the base weights given quantized:
// param format (a quantized one, or an unknown name), each matrix's codes
// (bytes, now and then any int32) and scales in shapes that mostly fit.
void quantize_base(fuzz::Decoder& d, const Sizes& z, judge::Tensors& in, judge::Params& p) {
  static const char* const names[] = {"int8_channel", "int4_group", "fp8_e4m3_block128", "int3"};
  const char* name = names[d.u8() % 4];
  p["format"] = name;
  const WeightFormat f = parse_format(name).value_or(WeightFormat::int8_channel);
  const std::pair<std::size_t, std::size_t> dims[] = {{z.i, z.h}, {z.i, z.h}, {z.h, z.i}};
  const char* const matrices[] = {"w_gate", "w_up", "w_down"};
  for (std::size_t m = 0; m < 3; ++m) {
    in.erase(matrices[m]);
    const QuantView v{f, nullptr, dims[m].first, dims[m].second, 0, nullptr, 0};
    judge::Tensor codes, scales;
    codes.rows = z.e * v.rows + (d.u8() % 16 == 0), codes.cols = v.row_bytes();
    codes.i.resize(codes.rows * codes.cols);
    for (auto& c : codes.i)
      c = (d.u8() & 63) == 0 ? static_cast<std::int32_t>(d.u32())
                             : static_cast<std::int32_t>(d.u8());
    scales.rows = z.e * v.scale_rows(), scales.cols = v.scale_cols() - (d.u8() % 16 == 0);
    scales.f.resize(scales.rows * scales.cols);
    for (auto& x : scales.f) x = d.value_f32();
    in.emplace(fmt::format("{}.codes", matrices[m]), std::move(codes));
    in.emplace(fmt::format("{}.scales", matrices[m]), std::move(scales));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  const auto ops = judge::judged_ops();
  const std::string op = ops[d.u8() % ops.size()];
  static const char* const routers[] = {"softmax_topk", "sigmoid_topk", "product_key", "top1"};
  const std::string router = routers[d.u8() % 4];
  Sizes z{};
  z.t = d.range(0, 6), z.k = d.range(1, 4), z.h = d.range(1, 8), z.i = d.range(1, 6);
  z.rank = d.range(1, 3);
  if (router == "product_key" || op.find("product_key") != std::string::npos) {
    z.n = d.range(1, 4), z.e = z.n * z.n, z.r = 2 * z.n;
  } else {
    z.e = d.range(1, 9), z.n = 0, z.r = z.e;
  }
  const bool lora = d.flag();
  auto [in_specs, out_specs] = specs(op, lora);
  judge::Tensors in, out;
  for (const Spec& s : in_specs)
    if ((d.u8() & 63) != 0) in.emplace(s.name, make(d, s, z));  // now and then one missing
  for (const Spec& s : out_specs)
    if ((d.u8() & 63) != 0) out.emplace(s.name, make(d, s, z));
  judge::Params p = params(d, op, router);
  if (lora) p.insert_or_assign("alpha", std::string("2"));
  if ((op.rfind("experts.", 0) == 0 || op.rfind("layer.", 0) == 0) && d.u8() % 4 == 0)
    quantize_base(d, z, in, p);
  try {
    const judge::Verdict v = judge::judge_op(op, in, out, p);
    if (!std::is_sorted(v.skipped_rows.begin(), v.skipped_rows.end()) ||
        std::adjacent_find(v.skipped_rows.begin(), v.skipped_rows.end()) != v.skipped_rows.end())
      fuzz::finding(kName, fmt::format("{}: skipped rows not ascending and distinct", op));
    for (std::size_t t : v.skipped_rows)
      if (t >= std::max<std::size_t>(z.t + 1, 1))
        fuzz::finding(kName, fmt::format("{}: skipped row {} of {}", op, t, z.t));
  } catch (const std::invalid_argument&) {
    // a refusal: a missing or misshapen tensor, a bad parameter
  } catch (const std::exception& e) {
    fuzz::finding(kName, fmt::format("{}: {} escaped the judge", op, e.what()));
  }
  return 0;
}
