// The C ABI's enums: each value static_asserted against the C++ enum it
// stands for, and their names, read from the C++ API where it names them.
#include <cstdint>
#include <string_view>

#include "moecert/config.hpp"
#include "moecert/contracts.hpp"
#include "moecert/formats.hpp"
#include "moecert/moecert.h"
#include "moecert/router.hpp"
#include "moecert/types.hpp"

namespace moecert::capi {
namespace {

template <typename E>
constexpr int as_int(E e) {
  return static_cast<int>(e);
}

static_assert(MOECERT_LEVEL_OFF == as_int(Level::off) &&
              MOECERT_LEVEL_CHECK == as_int(Level::check) &&
              MOECERT_LEVEL_AUDIT == as_int(Level::audit) &&
              MOECERT_LEVEL_FULL == as_int(Level::full));
static_assert(MOECERT_SEMANTIC_IGNORE == as_int(Semantic::ignore) &&
              MOECERT_SEMANTIC_OBSERVE == as_int(Semantic::observe) &&
              MOECERT_SEMANTIC_ENFORCE == as_int(Semantic::enforce));
static_assert(MOECERT_GROUP_SHAPE == as_int(Group::shape) &&
              MOECERT_GROUP_INDEX == as_int(Group::index) &&
              MOECERT_GROUP_ALIAS == as_int(Group::alias) &&
              MOECERT_GROUP_FINITE == as_int(Group::finite) &&
              MOECERT_GROUP_NUMERIC == as_int(Group::numeric) &&
              MOECERT_GROUP_MEMORY == as_int(Group::memory));
static_assert(MOECERT_ISA_SCALAR == as_int(Isa::scalar) &&
              MOECERT_ISA_AVX512_BF16 == as_int(Isa::avx512_bf16) &&
              MOECERT_ISA_AMX_BF16 == as_int(Isa::amx_bf16) &&
              MOECERT_ISA_AMX_EMU == as_int(Isa::amx_emu) && MOECERT_ISA_AVX2 == as_int(Isa::avx2));
static_assert(MOECERT_ROUTER_SOFTMAX_TOPK == as_int(RouterKind::softmax_topk) &&
              MOECERT_ROUTER_SIGMOID_TOPK == as_int(RouterKind::sigmoid_topk) &&
              MOECERT_ROUTER_PRODUCT_KEY == as_int(RouterKind::product_key));
static_assert(MOECERT_FORMAT_BF16 == as_int(WeightFormat::bf16) &&
              MOECERT_FORMAT_INT8_CHANNEL == as_int(WeightFormat::int8_channel) &&
              MOECERT_FORMAT_INT4_GROUP == as_int(WeightFormat::int4_group) &&
              MOECERT_FORMAT_FP8_E4M3_BLOCK128 == as_int(WeightFormat::fp8_e4m3_block128));
static_assert(MOECERT_KEY_WEIGHTS_RAW == as_int(router::KeyWeights::raw) &&
              MOECERT_KEY_WEIGHTS_EXP == as_int(router::KeyWeights::exp) &&
              MOECERT_KEY_WEIGHTS_SOFTMAX == as_int(router::KeyWeights::softmax));

// The C ABI's own enums (no C++ counterpart), in value order.
constexpr const char* kStatus[] = {"ok",
                                   "contract_violation",
                                   "invalid_argument",
                                   "out_of_memory",
                                   "internal_error",
                                   "precondition_observed"};
static_assert(sizeof(kStatus) / sizeof(kStatus[0]) == MOECERT_PRECONDITION_OBSERVED + 1);
constexpr const char* kDtype[] = {"bf16", "f32", "i32", "f64", "u8", "i64"};
static_assert(sizeof(kDtype) / sizeof(kDtype[0]) == MOECERT_I64 + 1);

// The enums' own names and the last value of each, in moecert_enum order.
constexpr const char* kEnums[] = {"status", "dtype",  "level",       "semantic",     "group",
                                  "isa",    "router", "key_weights", "weight_format"};
constexpr int kLast[] = {MOECERT_PRECONDITION_OBSERVED,
                         MOECERT_I64,
                         MOECERT_LEVEL_FULL,
                         MOECERT_SEMANTIC_ENFORCE,
                         MOECERT_GROUP_MEMORY,
                         static_cast<int>(kIsaCount) - 1,
                         static_cast<int>(kRouterKinds) - 1,
                         MOECERT_KEY_WEIGHTS_SOFTMAX,
                         static_cast<int>(kFormatCount) - 1};
static_assert(sizeof(kLast) / sizeof(kLast[0]) == MOECERT_ENUM_WEIGHT_FORMAT + 1);
static_assert(sizeof(kEnums) / sizeof(kEnums[0]) == MOECERT_ENUM_WEIGHT_FORMAT + 1);

// A name of the C++ API as a C string (each is a literal: NUL-terminated).
const char* c_str(std::string_view name) { return name.empty() ? nullptr : name.data(); }

}  // namespace
}  // namespace moecert::capi

extern "C" const char* moecert_enum_name(int32_t which, int32_t value) {
  using namespace moecert;
  using capi::c_str;
  if (which == -1)
    return value >= 0 && value <= MOECERT_ENUM_WEIGHT_FORMAT ? capi::kEnums[value] : nullptr;
  if (which < 0 || which > MOECERT_ENUM_WEIGHT_FORMAT || value < 0 || value > capi::kLast[which])
    return nullptr;
  switch (static_cast<moecert_enum>(which)) {
    case MOECERT_ENUM_STATUS:
      return capi::kStatus[value];
    case MOECERT_ENUM_DTYPE:
      return capi::kDtype[value];
    case MOECERT_ENUM_LEVEL:
      return c_str(level_name(static_cast<Level>(value)));
    case MOECERT_ENUM_SEMANTIC:
      return c_str(semantic_name(static_cast<Semantic>(value)));
    case MOECERT_ENUM_GROUP:
      return c_str(group_name(static_cast<Group>(value)));
    case MOECERT_ENUM_ISA:
      return c_str(isa_name(static_cast<Isa>(value)));
    case MOECERT_ENUM_ROUTER:
      return c_str(router_kind_name(static_cast<RouterKind>(value)));
    case MOECERT_ENUM_KEY_WEIGHTS:
      return c_str(router::key_weights_name(static_cast<router::KeyWeights>(value)));
    case MOECERT_ENUM_WEIGHT_FORMAT:
      return c_str(format_name(static_cast<WeightFormat>(value)));
  }
  return nullptr;
}
