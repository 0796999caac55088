// The C ABI of the judge (contracts/judge/ops.hpp).
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

#include "capi/abi.hpp"
#include "contracts/judge/ops.hpp"
#include "moecert/moecert.h"

using namespace moecert;
namespace judge = contracts::judge;

namespace {

template <class T>
void copy_rows(MatView<const T> m, std::vector<float>& out) {
  out.reserve(m.rows * m.cols);
  for (std::size_t r = 0; r < m.rows; ++r)
    for (std::size_t c = 0; c < m.cols; ++c) {
      if constexpr (std::is_same_v<T, bf16>)
        out.push_back(m(r, c).to_float());
      else
        out.push_back(static_cast<float>(m(r, c)));
    }
}

judge::Tensor tensor_of(const moecert_named_tensor& n) {
  const char* name = n.name ? n.name : "(unnamed)";
  const moecert_tensor* t = &n.tensor;
  judge::Tensor j;
  if (!capi::present(t) || t->ndim != 2)
    throw capi::InvalidArgument(fmt::format("{}: expected a 2-D tensor", name));
  j.rows = static_cast<std::size_t>(t->shape[0]), j.cols = static_cast<std::size_t>(t->shape[1]);
  switch (t->dtype) {
    case MOECERT_I32: {
      const auto m = capi::mat<const std::int32_t>(t, name);
      for (std::size_t r = 0; r < m.rows && m.cols; ++r)  // no row of no columns: data may be NULL
        j.i.insert(j.i.end(), m.row(r), m.row(r) + m.cols);
      break;
    }
    case MOECERT_I64: {  // ids as torch.topk gives them: narrowed (one outside int32 refused)
      capi::Ids ids;
      const auto m = ids.view(t, name, {});
      for (std::size_t r = 0; r < m.rows && m.cols; ++r)
        j.i.insert(j.i.end(), m.row(r), m.row(r) + m.cols);
      break;
    }
    case MOECERT_U8: {  // quantized weights' codes: bytes as indices
      const auto m = capi::mat<const std::uint8_t>(t, name);
      for (std::size_t r = 0; r < m.rows && m.cols; ++r)
        j.i.insert(j.i.end(), m.row(r), m.row(r) + m.cols);
      break;
    }
    case MOECERT_BF16:
      copy_rows(capi::mat<const bf16>(t, name), j.f);
      break;
    case MOECERT_F64:
      copy_rows(capi::mat<const double>(t, name), j.f);
      break;
    default:
      copy_rows(capi::mat<const float>(t, name), j.f);
  }
  if (n.stored_as == 1 || t->dtype == MOECERT_BF16)
    j.unit = 0x1p-8, j.tiny = 0x1p-134;
  else if (n.stored_as == 2)
    j.unit = 0x1p-11, j.tiny = 0x1p-25;
  else if (n.stored_as != 0)
    throw capi::InvalidArgument(
        fmt::format("{}: stored_as {}, expected 0, 1 or 2", name, n.stored_as));
  return j;
}

judge::Tensors tensors_of(const moecert_named_tensor* ts, size_t n) {
  judge::Tensors out;
  for (size_t i = 0; i < n; ++i) out.emplace(ts[i].name ? ts[i].name : "", tensor_of(ts[i]));
  return out;
}

}  // namespace

extern "C" {

moecert_status moecert_check(const char* op, const moecert_named_tensor* inputs, size_t n_inputs,
                             const moecert_named_tensor* outputs, size_t n_outputs,
                             const char* const* params, size_t n_params, char** verdict_json) {
  return capi::guarded<true>("moecert_check", [&] {
    if (!op || !verdict_json) throw capi::InvalidArgument("op and verdict_json must not be NULL");
    const std::pair<const void*, size_t> arrays[] = {
        {inputs, n_inputs}, {outputs, n_outputs}, {params, n_params}};
    const char* names[] = {"inputs", "outputs", "params"};
    for (int i = 0; i < 3; ++i)
      if (!arrays[i].first && arrays[i].second)
        throw capi::InvalidArgument(
            fmt::format("{}: NULL with a count of {}", names[i], arrays[i].second));
    judge::Params ps;
    for (size_t i = 0; i < n_params; ++i) {
      const std::string p = params[i] ? params[i] : "";
      const auto eq = p.find('=');
      if (eq == std::string::npos)
        throw capi::InvalidArgument(fmt::format("param '{}': expected name=value", p));
      ps[p.substr(0, eq)] = p.substr(eq + 1);
    }
    judge::Verdict v;
    try {
      v = judge::judge_op(op, tensors_of(inputs, n_inputs), tensors_of(outputs, n_outputs), ps);
    } catch (const std::invalid_argument& e) {
      throw capi::InvalidArgument(e.what());
    }
    const std::string json = judge::verdict_json(v, {});
    char* out = static_cast<char*>(std::malloc(json.size() + 1));
    if (!out) throw std::bad_alloc();
    std::memcpy(out, json.c_str(), json.size() + 1);
    *verdict_json = out;
  });
}

void moecert_free_string(char* s) { std::free(s); }

}  // extern "C"
