// The C ABI: the last-error record, version and build, contract settings,
// threads and kernels.
#include <fmt/format.h>
#include <oneapi/tbb/global_control.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <vector>

#include "capi/abi.hpp"
#include "contracts/engine/engine.hpp"
#include "moecert/contracts.hpp"
#include "moecert/isa.hpp"
#include "moecert/moecert.h"
#include "moecert/moecert.hpp"

namespace moecert::capi {
namespace {

// The strings behind this thread's moecert_error.
struct ErrorRecord {
  std::string op, clause, kind, group, level, location, observed, expected, message, file;
  moecert_error view{};
  void publish(moecert_status status, int line) {
    view = {status,           op.c_str(),      clause.c_str(),   kind.c_str(),
            group.c_str(),    level.c_str(),   location.c_str(), observed.c_str(),
            expected.c_str(), message.c_str(), file.c_str(),     line};
  }
};

ErrorRecord& record() {
  thread_local ErrorRecord r = [] {
    ErrorRecord e;
    e.publish(MOECERT_OK, 0);
    return e;
  }();
  return r;
}

std::vector<std::unique_ptr<ContractScope>>& scopes() {
  thread_local std::vector<std::unique_ptr<ContractScope>> s;
  return s;
}

std::mutex threads_mutex;
std::unique_ptr<oneapi::tbb::global_control> threads_control;  // guarded by threads_mutex

}  // namespace

void set_error(moecert_status status, const char* op, const std::string& message) {
  ErrorRecord& r = record();
  r = ErrorRecord{};
  r.op = op, r.message = fmt::format("{}: {}", op, message);
  r.publish(status, 0);
}

void set_violation(const Violation& v) {
  ErrorRecord& r = record();
  r.op = v.op, r.clause = v.clause, r.kind = clause_kind_name(v.kind),
  r.group = group_name(v.group);
  r.level = level_name(v.level), r.location = v.location, r.observed = v.observed,
  r.expected = v.expected;
  r.message = v.one_line(), r.file = v.source.file_name();
  r.publish(MOECERT_CONTRACT_VIOLATION, static_cast<int>(v.source.line()));
}

std::uint64_t observed_preconditions() { return detail::observed_preconditions().count; }

void set_observed_violation() {
  set_violation(detail::observed_preconditions().last);
  ErrorRecord& r = record();
  r.publish(MOECERT_PRECONDITION_OBSERVED, r.view.line);
}

const char* dtype_name(std::int32_t dtype) {
  switch (dtype) {
    case MOECERT_BF16:
      return "bfloat16";
    case MOECERT_F32:
      return "float32";
    case MOECERT_I32:
      return "int32";
    case MOECERT_F64:
      return "float64";
    case MOECERT_U8:
      return "uint8";
    case MOECERT_I64:
      return "int64";
    default:
      return "unknown";
  }
}

void check_descriptor(const moecert_tensor& t, moecert_dtype dtype, int ndim, const char* name) {
  if (t.dtype != dtype)
    throw InvalidArgument(
        fmt::format("{}: dtype {}, expected {}", name, dtype_name(t.dtype), dtype_name(dtype)));
  if (t.ndim != ndim)
    throw InvalidArgument(fmt::format("{}: {} dimensions, expected {}", name, t.ndim, ndim));
  std::int64_t elements = 1;
  for (int d = 0; d < ndim; ++d) {
    if (t.shape[d] < 0)
      throw InvalidArgument(fmt::format("{}: shape[{}] = {}", name, d, t.shape[d]));
    if (__builtin_mul_overflow(elements, t.shape[d], &elements))
      throw InvalidArgument(fmt::format("{}: shape {} x {} has more than 2^63 elements", name,
                                        t.shape[0], t.shape[1]));
  }
  if (t.stride[ndim - 1] != 1 && elements > 0)
    throw InvalidArgument(fmt::format("{}: stride[{}] = {}, expected 1 (rows contiguous)", name,
                                      ndim - 1, t.stride[ndim - 1]));
  if (ndim == 2 && t.stride[0] < t.shape[1] && t.shape[0] > 1)
    throw InvalidArgument(
        fmt::format("{}: row stride {} < {} columns", name, t.stride[0], t.shape[1]));
  if (!t.data && elements > 0)
    throw InvalidArgument(fmt::format("{}: null data with {} elements", name, elements));
}

namespace {

std::size_t dtype_bytes(std::int32_t dtype) {
  switch (dtype) {
    case MOECERT_BF16:
      return 2;
    case MOECERT_U8:
      return 1;
    case MOECERT_F64:
    case MOECERT_I64:
      return 8;
    default:
      return 4;
  }
}

// The bytes a descriptor's elements span; none for one that is malformed
// (its op refuses it before writing anything) or past 2^63 bytes.
std::optional<ByteRange> span_of(const moecert_tensor& t) {
  if (t.ndim != 1 && t.ndim != 2) return std::nullopt;
  const std::int64_t rows = t.ndim == 2 ? t.shape[0] : 1, cols = t.shape[t.ndim - 1];
  const std::int64_t stride = t.ndim == 2 ? t.stride[0] : 0;
  if (rows < 0 || cols < 0 || stride < 0) return std::nullopt;
  const auto begin = reinterpret_cast<std::uintptr_t>(t.data);
  if (rows == 0 || cols == 0) return ByteRange{begin, begin};
  std::int64_t last = 0;
  if (__builtin_mul_overflow(rows - 1, stride, &last) ||
      __builtin_add_overflow(last, cols, &last) ||
      __builtin_mul_overflow(last, static_cast<std::int64_t>(dtype_bytes(t.dtype)), &last))
    return std::nullopt;
  return ByteRange{begin, begin + static_cast<std::uintptr_t>(last)};
}

bool overlap(const moecert_tensor& a, const moecert_tensor* b) {
  if (!present(b)) return false;
  const auto sa = span_of(a), sb = span_of(*b);
  return sa && sb && overlaps(*sa, *sb);
}

}  // namespace

MatView<const std::int32_t> Ids::view(const moecert_tensor* t, const char* name,
                                      std::initializer_list<const moecert_tensor*> outputs) {
  if (!present(t) || t->dtype != MOECERT_I64) return mat<const std::int32_t>(t, name);
  check_descriptor(*t, MOECERT_I64, 2, name);
  const auto rows = static_cast<std::size_t>(t->shape[0]),
             cols = static_cast<std::size_t>(t->shape[1]);
  const auto* wide = static_cast<const std::int64_t*>(t->data);
  const auto stride = static_cast<std::size_t>(t->stride[0]);
  for (const moecert_tensor* out : outputs)
    if (overlap(*t, out))
      throw InvalidArgument(
          fmt::format("{} and an output share memory; pass separate tensors", name));
  narrow_.resize(rows * cols);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) {
      const std::int64_t v = wide[r * stride + c];
      if (v < std::numeric_limits<std::int32_t>::min() ||
          v > std::numeric_limits<std::int32_t>::max())
        throw InvalidArgument(fmt::format(
            "{}[{}, {}] = {}: expected -1 <= id < the expert count (an int32)", name, r, c, v));
      narrow_[r * cols + c] = static_cast<std::int32_t>(v);
    }
  return {narrow_.data(), rows, cols};
}

experts::Lora lora_of(const moecert_lora* l) {
  if (!l || l->rank == 0) return {};
  if (l->rank < 0) throw InvalidArgument(fmt::format("lora: rank {}", l->rank));
  experts::Lora out;
  out.a_gate = mat<const bf16>(&l->a_gate, "lora.a_gate"),
  out.b_gate = mat<const bf16>(&l->b_gate, "lora.b_gate");
  out.a_up = mat<const bf16>(&l->a_up, "lora.a_up"),
  out.b_up = mat<const bf16>(&l->b_up, "lora.b_up");
  out.a_down = mat<const bf16>(&l->a_down, "lora.a_down"),
  out.b_down = mat<const bf16>(&l->b_down, "lora.b_down");
  out.rank = static_cast<std::size_t>(l->rank), out.alpha = l->alpha;
  return out;
}

}  // namespace moecert::capi

using namespace moecert;
using capi::guarded;
using capi::InvalidArgument;

extern "C" {

const moecert_error* moecert_last_error(void) { return &capi::record().view; }

int32_t moecert_abi_version(void) { return MOECERT_ABI_VERSION; }

const char* moecert_version(void) { return build_info().version.c_str(); }

const char* moecert_build_info(void) {
  static const std::string line = [] {
    const BuildInfo& b = build_info();
    return fmt::format("moecert {} {} {} commit {} contract cap {}", b.version, b.build_type,
                       b.compiler, b.git_commit, level_name(b.contract_cap));
  }();
  return line.c_str();
}

moecert_status moecert_set_contract_level(int32_t level) {
  return guarded("moecert_set_contract_level", [&] {
    if (level < 0 || level > 3)
      throw InvalidArgument(fmt::format("level {}, expected 0..3", level));
    set_contract_level(static_cast<Level>(level));
  });
}

moecert_status moecert_set_contract_semantic(int32_t semantic) {
  return guarded("moecert_set_contract_semantic", [&] {
    if (semantic < 0 || semantic > 2)
      throw InvalidArgument(fmt::format("semantic {}, expected 0..2", semantic));
    set_contract_semantic(static_cast<Semantic>(semantic));
  });
}

moecert_status moecert_set_contract_groups(uint32_t groups) {
  return guarded("moecert_set_contract_groups", [&] {
    if (groups >> kGroupCount)
      throw InvalidArgument(
          fmt::format("groups {:#x}, expected bits 0..{}", groups, kGroupCount - 1));
    ContractSettings s = contract_settings();
    s.groups = groups;
    set_contract_settings(s);
  });
}

// The getters run inside the guard too: the first reads the environment,
// whose malformed values are an error (-1, or UINT32_MAX for the groups,
// with moecert_last_error() naming the variable), never an exception.
int32_t moecert_contract_level(void) {
  int32_t out = -1;
  guarded("moecert_contract_level",
          [&] { out = static_cast<int32_t>(effective_contract_settings().level); });
  return out;
}
int32_t moecert_contract_semantic(void) {
  int32_t out = -1;
  guarded("moecert_contract_semantic",
          [&] { out = static_cast<int32_t>(effective_contract_settings().semantic); });
  return out;
}
uint32_t moecert_contract_groups(void) {
  uint32_t out = UINT32_MAX;
  guarded("moecert_contract_groups", [&] { out = effective_contract_settings().groups; });
  return out;
}
int32_t moecert_contract_level_cap(void) { return static_cast<int32_t>(contract_level_cap()); }

moecert_status moecert_contract_scope_push(int32_t level, int32_t semantic, uint32_t groups) {
  return guarded("moecert_contract_scope_push", [&] {
    if (level < 0 || level > 3 || semantic < 0 || semantic > 2 || (groups >> kGroupCount))
      throw InvalidArgument(
          fmt::format("level {}, semantic {}, groups {:#x}", level, semantic, groups));
    ContractSettings s{static_cast<Level>(level), static_cast<Semantic>(semantic), groups};
    capi::scopes().push_back(std::make_unique<ContractScope>(s));
  });
}

moecert_status moecert_contract_scope_pop(void) {
  return guarded("moecert_contract_scope_pop", [&] {
    if (capi::scopes().empty()) throw InvalidArgument("no scope pushed on this thread");
    capi::scopes().pop_back();
  });
}

moecert_status moecert_set_num_threads(int32_t threads) {
  return guarded("moecert_set_num_threads", [&] {
    if (threads < 0) throw InvalidArgument(fmt::format("threads {}, expected >= 0", threads));
    const std::lock_guard lock(capi::threads_mutex);
    capi::threads_control.reset();
    if (threads > 0)
      capi::threads_control = std::make_unique<oneapi::tbb::global_control>(
          oneapi::tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(threads));
  });
}

int32_t moecert_num_threads(void) {
  return static_cast<int32_t>(oneapi::tbb::global_control::active_value(
      oneapi::tbb::global_control::max_allowed_parallelism));
}

int32_t moecert_default_isa(void) {
  int32_t out = -1;  // a malformed MOECERT_ISA
  guarded("moecert_default_isa", [&] { out = static_cast<int32_t>(default_isa()); });
  return out;
}

int32_t moecert_isa_usable(int32_t isa) {
  int32_t out = 0;
  guarded("moecert_isa_usable",
          [&] { out = capi::valid_isa(isa) && isa_usable(static_cast<Isa>(isa)) ? 1 : 0; });
  return out;
}

const char* moecert_isa_name(int32_t isa) {
  return capi::valid_isa(isa) ? isa_name(static_cast<Isa>(isa)).data() : "";
}

}  // extern "C"
