// The C ABI's plumbing: the handles behind the opaque types, descriptor to
// view conversion, and the guard every entry point runs its body in (no C++
// exception crosses the ABI; the last error is per thread).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moecert/contracts.hpp"
#include "moecert/experts.hpp"
#include "moecert/formats.hpp"
#include "moecert/layer.hpp"
#include "moecert/moecert.h"
#include "moecert/types.hpp"

struct moecert_experts {
  moecert::experts::PackedExperts packed;
};

namespace moecert::capi {

/// The LoRA factors a call reads. bf16 descriptors are read in place; fp32
/// ones are rounded to bf16 (nearest even, on moecert's threads) by the
/// forward into storage held here, and a backward or bounds call given the
/// same fp32 tensors reads that rounding.
class LoraFactors {
 public:
  experts::Lora forward(const moecert_lora* l);
  experts::Lora again(const moecert_lora* l) const;

 private:
  struct Source {
    const void* data = nullptr;
    std::int64_t rows = 0, cols = 0;
  };
  static bool fp32(const moecert_lora* l);  // all six fp32 (false: bf16 or no LoRA)
  std::vector<bf16> data_;
  std::array<MatView<const bf16>, 6> views_{};
  std::array<Source, 6> sources_{};
  std::size_t rank_ = 0;
  double alpha_ = 0;
  bool held_ = false;
};

/// dx given as bf16: the op writes fp32 scratch held here, finish() rounds
/// it into the caller's tensor (nearest even, on moecert's threads).
class RoundedDx {
 public:
  MatView<float> bind(const moecert_tensor* t, const char* name);
  void finish() const;

 private:
  std::vector<float> scratch_;
  MatView<bf16> out_;
};

}  // namespace moecert::capi

struct moecert_experts_saved {
  moecert::experts::Saved saved;
  moecert::capi::LoraFactors lora;
  moecert::capi::RoundedDx dx;
};
struct moecert_layer_saved {
  moecert::layer::Saved saved;
  moecert::capi::LoraFactors lora;
  moecert::capi::RoundedDx dx;
};

namespace moecert::capi {

/// A descriptor or handle the ABI rejects (MOECERT_INVALID_ARGUMENT).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Records `status` with `op` and `message` as this thread's last error.
void set_error(moecert_status status, const char* op, const std::string& message);
/// Records a contract violation as this thread's last error.
void set_violation(const Violation& v);

/// How many preconditions failed under observe on this thread so far.
std::uint64_t observed_preconditions();
/// Records the last of them as this thread's last error.
void set_observed_violation();

/// Runs `body` for ABI function `op`, mapping every exception to a status;
/// a precondition that failed under observe while it ran (the op wrote
/// nothing) is MOECERT_PRECONDITION_OBSERVED, unless `judge` (a verdict on
/// foreign data, where a failed clause is the result).
template <bool judge = false, class F>
moecert_status guarded(const char* op, F&& body) noexcept {
  try {
    const std::uint64_t observed = judge ? 0 : observed_preconditions();
    std::forward<F>(body)();
    if (!judge && observed_preconditions() != observed) {
      set_observed_violation();
      return MOECERT_PRECONDITION_OBSERVED;
    }
    return MOECERT_OK;
  } catch (const ContractViolation& e) {
    set_violation(e.violation());
    return MOECERT_CONTRACT_VIOLATION;
  } catch (const std::invalid_argument& e) {  // InvalidArgument, or a malformed MOECERT_* setting
    set_error(MOECERT_INVALID_ARGUMENT, op, e.what());
    return MOECERT_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    set_error(MOECERT_OUT_OF_MEMORY, op, "out of memory");
    return MOECERT_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_error(MOECERT_INTERNAL_ERROR, op, e.what());
    return MOECERT_INTERNAL_ERROR;
  } catch (...) {
    set_error(MOECERT_INTERNAL_ERROR, op, "unknown exception");
    return MOECERT_INTERNAL_ERROR;
  }
}

template <class T>
constexpr moecert_dtype dtype_of();
template <>
constexpr moecert_dtype dtype_of<bf16>() {
  return MOECERT_BF16;
}
template <>
constexpr moecert_dtype dtype_of<float>() {
  return MOECERT_F32;
}
template <>
constexpr moecert_dtype dtype_of<std::int32_t>() {
  return MOECERT_I32;
}
template <>
constexpr moecert_dtype dtype_of<double>() {
  return MOECERT_F64;
}
template <>
constexpr moecert_dtype dtype_of<std::uint8_t>() {
  return MOECERT_U8;
}

const char* dtype_name(std::int32_t dtype);

/// Whether `t` is given (a NULL pointer or ndim 0: absent).
inline bool present(const moecert_tensor* t) { return t && t->ndim != 0; }

/// Checks the descriptor's dtype, dimensions, strides and data pointer;
/// throws InvalidArgument naming `name`.
void check_descriptor(const moecert_tensor& t, moecert_dtype dtype, int ndim, const char* name);

/// A 2-D descriptor as a view (absent: the empty view; `required`: absent
/// throws).
template <class T>
MatView<T> mat(const moecert_tensor* t, const char* name, bool required = true) {
  if (!present(t)) {
    if (required) throw InvalidArgument(std::string(name) + ": absent, expected a 2-D tensor");
    return {};
  }
  check_descriptor(*t, dtype_of<std::remove_const_t<T>>(), 2, name);
  return {static_cast<T*>(t->data), static_cast<std::size_t>(t->shape[0]),
          static_cast<std::size_t>(t->shape[1]), static_cast<std::size_t>(t->stride[0])};
}

/// A 1-D descriptor as a view (absent: the empty view unless `required`).
template <class T>
View<T> vec(const moecert_tensor* t, const char* name, bool required = true) {
  if (!present(t)) {
    if (required) throw InvalidArgument(std::string(name) + ": absent, expected a 1-D tensor");
    return {};
  }
  check_descriptor(*t, dtype_of<std::remove_const_t<T>>(), 1, name);
  return {static_cast<T*>(t->data), static_cast<std::size_t>(t->shape[0])};
}

/// Expert ids [T x K] an op reads: an int32 descriptor in place; an int64 one
/// (torch.topk's) narrowed into storage held here, a value outside int32
/// refused naming its place, and refused when it shares memory with one of
/// `outputs` (the op then never sees the caller's bytes).
class Ids {
 public:
  MatView<const std::int32_t> view(const moecert_tensor* t, const char* name,
                                   std::initializer_list<const moecert_tensor*> outputs);

 private:
  std::vector<std::int32_t> narrow_;
};

/// The format numbered `format`, if quantized (InvalidArgument otherwise).
WeightFormat quantized_format(std::int32_t format);
/// A moecert_quant of `format` as a QuantView; its descriptors checked
/// (codes u8, scales f32, 2-D; the rest is gemm.pack's clauses').
QuantView quant_of(const moecert_quant& q, WeightFormat format, const std::string& name);
/// The same as an output of the quantizer or an unpack, of rows x cols:
/// codes and scales of the format's shapes.
QuantOut quant_out(const moecert_quant& q, WeightFormat format, std::size_t rows, std::size_t cols,
                   const std::string& name);

/// The LoRA descriptor as experts::Lora (NULL or rank 0: none).
experts::Lora lora_of(const moecert_lora* l);
/// The handle, or InvalidArgument naming it.
template <class H>
H& handle(H* h, const char* name) {
  if (!h) throw InvalidArgument(std::string(name) + ": null handle");
  return *h;
}

/// The gradients the experts op and the layer name alike (moecert_experts_grads
/// and moecert_layer_grads into experts::Gradients and layer::Gradients): dx
/// through `dx` (bf16: computed in its scratch), the LoRA and base-weight
/// gradients, M_A and M_G.
template <class In, class Out>
void expert_path_grads(const In& g, RoundedDx& dx, Out& out) {
  out.dx = dx.bind(&g.dx, "dx");
  out.a_gate = mat<float>(&g.a_gate, "a_gate grad", false);
  out.b_gate = mat<float>(&g.b_gate, "b_gate grad", false);
  out.a_up = mat<float>(&g.a_up, "a_up grad", false);
  out.b_up = mat<float>(&g.b_up, "b_up grad", false);
  out.a_down = mat<float>(&g.a_down, "a_down grad", false);
  out.b_down = mat<float>(&g.b_down, "b_down grad", false);
  out.w_gate = mat<float>(&g.w_gate, "w_gate grad", false);
  out.w_up = mat<float>(&g.w_up, "w_up grad", false);
  out.w_down = mat<float>(&g.w_down, "w_down grad", false);
  out.m_a = mat<float>(&g.m_a, "m_a", false);
  out.m_g = mat<float>(&g.m_g, "m_g", false);
}

/// An Isa value of the ABI (0..4; avx2, 4, is the highest).
constexpr bool valid_isa(std::int32_t isa) {
  return isa >= 0 && isa <= static_cast<std::int32_t>(Isa::avx2);
}
/// -1: the default kernel; otherwise an Isa value.
std::optional<Isa> isa_of(std::int32_t isa);
/// NULL: the defaults.
experts::TrainOptions train_options(const moecert_train_options* o);
/// dx through `dx` (bf16: computed in its scratch).
experts::Gradients experts_grads(const moecert_experts_grads& g, RoundedDx& dx);

MoeConfig config_of(const moecert_config* c);
/// The weights with `lora` for their LoRA factors (LoraFactors::forward or again of w->lora).
layer::Weights weights_of(const moecert_layer_weights* w, const experts::Lora& lora);
/// w's LoRA descriptor, or null.
inline const moecert_lora* lora_in(const moecert_layer_weights* w) {
  return w ? &w->lora : nullptr;
}
layer::Gradients layer_grads(const moecert_layer_grads& g, RoundedDx& dx);

}  // namespace moecert::capi
