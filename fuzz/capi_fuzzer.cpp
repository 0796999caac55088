// Property, for the C ABI's entry points (include/moecert/moecert.h) called
// as a foreign caller would, with descriptors that are mostly right and now
// and then hostile — a wrong dtype or dimension count, negative, huge or
// wrapping shapes, zero, negative or short strides, NULL data, NULL arrays
// with counts, out-of-range enums and settings: every call returns a status
// of the enum, never crashes (ASan), never lets an exception out (it would
// abort), and every failure leaves a last error with a message. Data
// pointers cover what their descriptor claims when the claim is a valid
// layout of at most 64 Ki elements (the caller's side of the contract); a
// larger valid layout gets NULL, an invalid one NULL or one element, which
// the ABI must refuse before reading.
#include <fmt/format.h>

#include <cstring>
#include <deque>
#include <vector>

#include "fuzz/decode.hpp"
#include "moecert/moecert.h"

using namespace moecert;

namespace {

constexpr const char* kName = "capi_fuzzer";
constexpr std::int64_t kE = 4, kH = 8, kI = 8;

// Buffers of one call (their addresses stay put while it runs).
struct Arena {
  std::deque<std::vector<std::uint8_t>> blocks;
  void* get(std::size_t bytes) {
    blocks.emplace_back(bytes ? bytes : 1, std::uint8_t{0});
    return blocks.back().data();
  }
};

std::size_t width(std::int32_t dtype) {
  switch (dtype) {
    case MOECERT_BF16:
      return 2;
    case MOECERT_F64:
      return 8;
    default:
      return 4;
  }
}

// A descriptor of rows x cols of `dtype` (cols 0: 1-D of rows), mutated now
// and then, its data covering the claimed extent where that is a valid
// layout of at most 64 Ki elements.
moecert_tensor make(fuzz::Decoder& d, Arena& a, std::int32_t dtype, std::int64_t rows,
                    std::int64_t cols) {
  moecert_tensor t{};
  t.dtype = dtype, t.ndim = cols ? 2 : 1;
  t.shape[0] = rows, t.shape[1] = cols;
  t.stride[0] = cols ? cols : 1, t.stride[1] = 1;
  switch (d.u8() & 31) {
    case 0:
      t.dtype = static_cast<std::int32_t>(d.u8() % 7) - 1;
      break;
    case 1:
      t.ndim = static_cast<std::int32_t>(d.u8() % 5) - 1;
      break;
    case 2:
      t.shape[d.u8() & 1] = static_cast<std::int64_t>(d.u32()) << (d.u8() % 40);
      break;
    case 3:
      t.shape[d.u8() & 1] = -static_cast<std::int64_t>(d.u8()) - 1;
      break;
    case 4:
      t.shape[0] = std::int64_t{1} << 62, t.shape[1] = 4;
      break;  // wraps to 0 elements
    case 5:
      t.stride[d.u8() & 1] = static_cast<std::int64_t>(d.u16()) - 32768;
      break;
    case 6:
      t.shape[0] = 0;
      break;
    default:
      break;
  }
  // A layout the ABI documents as valid (one row reads no row stride).
  const bool layout = t.ndim >= 1 && t.ndim <= 2 && t.shape[0] >= 0 &&
                      (t.ndim == 1 || (t.shape[1] >= 0 && t.stride[1] == 1 &&
                                       (t.shape[0] <= 1 || t.stride[0] >= t.shape[1])));
  __int128 extent = 0;
  if (layout) {
    const __int128 r = t.shape[0], c = t.ndim == 2 ? t.shape[1] : 1;
    extent = r && c ? (r - 1) * (t.ndim == 2 && r > 1 ? t.stride[0] : 1) + c : 0;
  }
  if ((d.u8() & 63) == 0) return t;  // NULL data whatever the shape
  if (layout && extent <= (1 << 16)) {
    const std::size_t w = t.dtype >= 0 && t.dtype <= 3 ? width(t.dtype) : 8;
    t.data = a.get(static_cast<std::size_t>(extent) * w);
    auto* p = static_cast<std::uint8_t*>(t.data);
    for (std::size_t i = 0; i < static_cast<std::size_t>(extent) * w && d.remaining(); ++i)
      p[i] = d.u8();
  } else if (!layout && d.flag()) {
    t.data = a.get(8);  // one element under a layout the ABI must refuse
  }
  return t;
}

void expect_status(moecert_status s, const char* call) {
  if (s < MOECERT_OK || s > MOECERT_PRECONDITION_OBSERVED)
    fuzz::finding(kName, fmt::format("{}: status {}", call, static_cast<int>(s)));
  if (s != MOECERT_OK && !std::strlen(moecert_last_error()->message))
    fuzz::finding(kName, fmt::format("{}: status {} without a message", call, static_cast<int>(s)));
}

// A small packed layer the forwards read (made once, from valid weights).
moecert_experts* packed() {
  static moecert_experts* p = [] {
    std::vector<std::uint16_t> g(kE * kI * kH, 0x3f80), d(kE * kH * kI, 0x3c00);
    const moecert_tensor wg{g.data(), MOECERT_BF16, 2, {kE * kI, kH}, {kH, 1}};
    const moecert_tensor wd{d.data(), MOECERT_BF16, 2, {kE * kH, kI}, {kI, 1}};
    moecert_experts* out = nullptr;
    if (moecert_experts_pack(kE, &wg, &wg, &wd, 1, &out) != MOECERT_OK) std::abort();
    return out;
  }();
  return p;
}

void call_experts(fuzz::Decoder& d, Arena& a, std::int64_t T, std::int64_t K) {
  const auto x = make(d, a, MOECERT_BF16, T, kH), idx = make(d, a, MOECERT_I32, T, K),
             w = make(d, a, MOECERT_F32, T, K), y = make(d, a, MOECERT_F32, T, kH);
  expect_status(
      moecert_experts_forward(packed(), &x, &idx, &w, &y, static_cast<int>(d.u8() % 7) - 2),
      "moecert_experts_forward");
}

void call_pack(fuzz::Decoder& d, Arena& a) {
  const std::int64_t E = static_cast<std::int64_t>(d.u8() % 6) - 1;
  const auto g = make(d, a, MOECERT_BF16, E * kI, kH), u = make(d, a, MOECERT_BF16, E * kI, kH),
             w = make(d, a, MOECERT_BF16, E * kH, d.flag() ? kI : kI + 1);
  moecert_experts* out = nullptr;
  const moecert_status s = moecert_experts_pack(E, &g, &u, &w, d.flag(), d.flag() ? &out : nullptr);
  expect_status(s, "moecert_experts_pack");
  if (s == MOECERT_OK && out) {
    std::vector<std::uint16_t> back(static_cast<std::size_t>(E * kI * kH) * 2 + E * kH * (kI + 1));
    const moecert_tensor bg{back.data(), MOECERT_BF16, 2, {E * kI, kH}, {kH, 1}};
    const moecert_tensor bu{back.data() + E * kI * kH, MOECERT_BF16, 2, {E * kI, kH}, {kH, 1}};
    const moecert_tensor bd{back.data() + 2 * E * kI * kH, MOECERT_BF16, 2, {E * kH, kI}, {kI, 1}};
    expect_status(moecert_experts_unpack(out, &bg, &bu, &bd), "moecert_experts_unpack");
    moecert_experts_free(out);
  }
}

void call_routers(fuzz::Decoder& d, Arena& a, std::int64_t T, std::int64_t K) {
  const std::int64_t E = static_cast<std::int64_t>(d.range(1, 9));
  const auto z = make(d, a, MOECERT_F32, T, E), idx = make(d, a, MOECERT_I32, T, K),
             w = make(d, a, MOECERT_F32, T, K), g = make(d, a, MOECERT_F32, T, K),
             dz = make(d, a, MOECERT_F32, T, E), bias = make(d, a, MOECERT_F32, E, 0);
  switch (d.u8() % 5) {
    case 0:
      expect_status(moecert_softmax_topk_forward(&z, &idx, &w, d.flag()), "softmax_topk_forward");
      break;
    case 1:
      expect_status(moecert_softmax_topk_backward(&z, &idx, &g, &dz, d.flag()),
                    "softmax_topk_backward");
      break;
    case 2:
      expect_status(
          moecert_sigmoid_topk_forward(&z, &bias, static_cast<int64_t>(d.u8() % 5) - 1,
                                       static_cast<int64_t>(d.u8() % 5) - 1, 1.0f, &idx, &w),
          "sigmoid_topk_forward");
      break;
    case 3:
      expect_status(
          moecert_product_key_forward(&z, &z, static_cast<int32_t>(d.u8() % 5) - 1, &idx, &w),
          "product_key_forward");
      break;
    default: {
      const auto x = make(d, a, MOECERT_BF16, T, kH), rw = make(d, a, MOECERT_F32, E, kH),
                 rb = make(d, a, MOECERT_F32, E, 0);
      expect_status(moecert_router_linear_forward(&x, &rw, &rb, &dz, -1), "router_linear_forward");
    }
  }
}

void call_check(fuzz::Decoder& d, Arena& a, std::int64_t T, std::int64_t K) {
  const moecert_named_tensor in[] = {{"z", make(d, a, MOECERT_F32, T, 6), 0}};
  const moecert_named_tensor out[] = {
      {"idx", make(d, a, MOECERT_I32, T, K), 0},
      {"w", make(d, a, MOECERT_F32, T, K), static_cast<int32_t>(d.u8() % 4)}};
  const char* params[] = {"renormalize=false", "renormalise=1", "precision=fp32", "oops"};
  char* verdict = nullptr;
  const bool null_arrays = (d.u8() & 15) == 0;
  const moecert_status s =
      moecert_check(d.flag() ? "router.softmax_topk.forward" : "router.nothing",
                    null_arrays ? nullptr : in, 1, null_arrays ? nullptr : out, 2,
                    d.flag() ? params + d.u8() % 4 : nullptr, d.u8() % 2, &verdict);
  expect_status(s, "moecert_check");
  moecert_free_string(verdict);
}

void call_settings(fuzz::Decoder& d) {
  const auto v = static_cast<std::int32_t>(static_cast<std::int8_t>(d.u8()));
  expect_status(moecert_set_contract_level(v), "set_contract_level");
  expect_status(moecert_set_contract_semantic(v), "set_contract_semantic");
  expect_status(moecert_set_contract_groups(d.u32()), "set_contract_groups");
  moecert_set_contract_level(3), moecert_set_contract_semantic(2),
      moecert_set_contract_groups(0x3f);  // back to what the other calls run at
  (void)moecert_isa_usable(v), (void)moecert_isa_name(v), (void)moecert_contract_level();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Decoder d(data, size);
  Arena a;
  const std::int64_t T = static_cast<std::int64_t>(d.range(0, 6));
  const std::int64_t K = static_cast<std::int64_t>(d.range(1, 4));
  switch (d.u8() % 5) {
    case 0:
      call_experts(d, a, T, K);
      break;
    case 1:
      call_pack(d, a);
      break;
    case 2:
      call_routers(d, a, T, K);
      break;
    case 3:
      call_check(d, a, T, K);
      break;
    default:
      call_settings(d);
  }
  return 0;
}
