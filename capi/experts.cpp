// The C ABI of the experts op: packing, the inference forward, the training
// forward and backward (include/moecert/experts.hpp).
#include "moecert/experts.hpp"

#include <fmt/format.h>

#include "capi/abi.hpp"
#include "contracts/engine/engine.hpp"
#include "moecert/moecert.h"

using namespace moecert;
using capi::guarded;
using capi::handle;
using capi::InvalidArgument;
using capi::mat;

namespace moecert::capi {

std::optional<Isa> isa_of(std::int32_t isa) {
  if (isa == -1) return std::nullopt;
  if (!valid_isa(isa)) throw InvalidArgument(fmt::format("isa {}", isa));
  return static_cast<Isa>(isa);
}

experts::TrainOptions train_options(const moecert_train_options* o) {
  experts::TrainOptions t;
  if (o) t.isa = isa_of(o->isa), t.training = o->training != 0, t.memory_cap = o->memory_cap;
  return t;
}

experts::Gradients experts_grads(const moecert_experts_grads& g, RoundedDx& dx) {
  experts::Gradients out;
  out.dweights = mat<float>(&g.dweights, "dweights", false);
  expert_path_grads(g, dx, out);
  return out;
}

}  // namespace moecert::capi

extern "C" {

moecert_status moecert_experts_pack(int64_t experts, const moecert_tensor* w_gate,
                                    const moecert_tensor* w_up, const moecert_tensor* w_down,
                                    int32_t backward, moecert_experts** out) {
  return guarded("moecert_experts_pack", [&] {
    if (!out) throw InvalidArgument("out: null");
    if (experts < 1) throw InvalidArgument(fmt::format("experts {}, expected >= 1", experts));
    const auto g = mat<const bf16>(w_gate, "w_gate"), u = mat<const bf16>(w_up, "w_up");
    const auto d = mat<const bf16>(w_down, "w_down");
    const auto E = static_cast<std::size_t>(experts);
    const std::size_t H = g.cols, I = g.rows / E;
    if (g.rows % E || !I || !H || u.rows != g.rows || u.cols != H || d.rows != E * H || d.cols != I)
      throw InvalidArgument(fmt::format(
          "w_gate {}x{}, w_up {}x{}, w_down {}x{} for {} experts, expected [E*I x H] twice and "
          "[E*H x I] (I, H >= 1)",
          g.rows, g.cols, u.rows, u.cols, d.rows, d.cols, E));
    auto h = std::make_unique<moecert_experts>();
    h->packed = experts::PackedExperts::pack(E, g, u, d, backward != 0);
    *out = h.release();
  });
}

moecert_status moecert_experts_unpack(const moecert_experts* w, const moecert_tensor* w_gate,
                                      const moecert_tensor* w_up, const moecert_tensor* w_down) {
  return guarded("moecert_experts_unpack", [&] {
    const auto& p = handle(w, "experts").packed;
    const auto g = mat<bf16>(w_gate, "w_gate"), u = mat<bf16>(w_up, "w_up");
    const auto d = mat<bf16>(w_down, "w_down");
    const std::size_t E = p.experts(), H = p.hidden(), I = p.inter();
    const auto shaped = [](MatView<bf16> m, std::size_t rows, std::size_t cols) {
      return m.rows == rows && m.cols == cols;
    };
    if (!shaped(g, E * I, H) || !shaped(u, E * I, H) || !shaped(d, E * H, I))
      throw InvalidArgument(fmt::format(
          "w_gate {}x{}, w_up {}x{}, w_down {}x{}, expected {}x{}, {}x{}, {}x{}", g.rows, g.cols,
          u.rows, u.cols, d.rows, d.cols, E * I, H, E * I, H, E * H, I));
    const ByteRange r[] = {g.bytes(), u.bytes(), d.bytes()};
    if (detail::first_overlap(r, 3))
      throw InvalidArgument("w_gate, w_up, w_down: overlap in memory");
    p.unpack(g, u, d);
  });
}

void moecert_experts_free(moecert_experts* w) { delete w; }

moecert_status moecert_experts_shape(const moecert_experts* w, int64_t* experts, int64_t* hidden,
                                     int64_t* inter, int32_t* backward, int64_t* bytes) {
  return guarded("moecert_experts_shape", [&] {
    const auto& p = handle(w, "experts").packed;
    if (experts) *experts = static_cast<int64_t>(p.experts());
    if (hidden) *hidden = static_cast<int64_t>(p.hidden());
    if (inter) *inter = static_cast<int64_t>(p.inter());
    if (backward) *backward = p.has_backward() ? 1 : 0;
    if (bytes) *bytes = static_cast<int64_t>(p.bytes());
  });
}

moecert_status moecert_experts_saved_new(moecert_experts_saved** out) {
  return guarded("moecert_experts_saved_new", [&] {
    if (!out) throw InvalidArgument("out: null");
    *out = new moecert_experts_saved;
  });
}

void moecert_experts_saved_free(moecert_experts_saved* s) { delete s; }

moecert_status moecert_experts_forward(const moecert_experts* w, const moecert_tensor* x,
                                       const moecert_tensor* idx, const moecert_tensor* weights,
                                       const moecert_tensor* y, int32_t isa) {
  return guarded("moecert_experts_forward", [&] {
    const auto& p = handle(w, "experts").packed;
    capi::Ids ids;
    experts::forward(p, mat<const bf16>(x, "x"), ids.view(idx, "idx", {y}),
                     mat<const float>(weights, "weights"), mat<float>(y, "y"),
                     {.isa = capi::isa_of(isa)});
  });
}

moecert_status moecert_experts_forward_train(const moecert_experts* w, const moecert_lora* lora,
                                             const moecert_tensor* x, const moecert_tensor* idx,
                                             const moecert_tensor* weights, const moecert_tensor* y,
                                             moecert_experts_saved* saved,
                                             const moecert_train_options* options) {
  return guarded("moecert_experts_forward_train", [&] {
    const auto& p = handle(w, "experts").packed;
    auto& h = handle(saved, "saved");
    capi::Ids ids;
    experts::forward_train(p, h.lora.forward(lora), mat<const bf16>(x, "x"),
                           ids.view(idx, "idx", {y}), mat<const float>(weights, "weights"),
                           mat<float>(y, "y"), h.saved, capi::train_options(options));
  });
}

moecert_status moecert_experts_backward(const moecert_experts* w, const moecert_lora* lora,
                                        const moecert_tensor* x, const moecert_tensor* dy,
                                        moecert_experts_saved* saved,
                                        const moecert_experts_grads* grads) {
  return guarded("moecert_experts_backward", [&] {
    const auto& p = handle(w, "experts").packed;
    auto& h = handle(saved, "saved");
    const auto& g = handle(grads, "grads");
    const auto views = capi::experts_grads(g, h.dx);
    experts::backward(p, h.lora.again(lora), mat<const bf16>(x, "x"), mat<const float>(dy, "dy"),
                      h.saved, views);
    h.dx.finish();
  });
}

}  // extern "C"
