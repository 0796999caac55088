// The C ABI's derived bounds: the element-wise bounds the full-level
// within_bound clauses compare with (contracts/), for callers that compare
// moecert's outputs with a reference of their own (the Python tests).
#include <fmt/format.h>

#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "capi/abi.hpp"
#include "contracts/bounds/experts.hpp"
#include "contracts/bounds/router.hpp"
#include "contracts/experts/train.hpp"
#include "contracts/layer/layer.hpp"
#include "contracts/numeric/tracked.hpp"
#include "contracts/reference/layer.hpp"
#include "contracts/router/kind.hpp"
#include "moecert/moecert.h"
#include "ops/layer/state.hpp"

using namespace moecert;
using bounds::Tracked;
using capi::guarded;
using capi::handle;
using capi::InvalidArgument;
using capi::mat;

namespace {

// Writes slack * e of each tracked element into `out` (absent: nothing).
void put(const moecert_tensor* out, const std::vector<Tracked>& ref, std::size_t rows,
         std::size_t cols, const char* name) {
  if (!capi::present(out)) return;
  const bool vector = out->ndim == 1;
  const MatView<double> m = vector
                                ? MatView<double>(static_cast<double*>(out->data), 1, out->shape[0])
                                : mat<double>(out, name);
  if (vector) capi::check_descriptor(*out, MOECERT_F64, 1, name);
  if (m.rows * m.cols != rows * cols || ref.size() != rows * cols)
    throw InvalidArgument(fmt::format("{}: {}x{}, expected {}x{} (or a path that did not run)",
                                      name, m.rows, m.cols, rows, cols));
  for (std::size_t i = 0; i < rows * cols; ++i)
    m(i / m.cols, i % m.cols) = bounds::kReferenceSlack * ref[i].e;
}

bool any(std::initializer_list<const moecert_tensor*> ts) {
  for (const auto* t : ts)
    if (capi::present(t)) return true;
  return false;
}

template <class G>
ref::Paths paths_of(const G& g, const moecert_tensor* router_side) {
  const bool base = any({&g.w_gate, &g.w_up, &g.w_down});
  const bool expert = base || any({&g.dx, &g.a_gate, &g.b_gate, &g.a_up, &g.b_up, &g.a_down,
                                   &g.b_down, &g.m_a, &g.m_g});
  return {expert, capi::present(router_side), base};
}

// The six LoRA and three base-weight bounds.
template <class G>
void put_weights(const G& g, const ref::LayerResult<Tracked>& r, std::size_t E, std::size_t H,
                 std::size_t I, std::size_t rank) {
  put(&g.a_gate, r.dag, E * rank, H, "a_gate bound"),
      put(&g.b_gate, r.dbg, E * I, rank, "b_gate bound");
  put(&g.a_up, r.dau, E * rank, H, "a_up bound"), put(&g.b_up, r.dbu, E * I, rank, "b_up bound");
  put(&g.a_down, r.dad, E * rank, I, "a_down bound"),
      put(&g.b_down, r.dbd, E * H, rank, "b_down bound");
  put(&g.w_gate, r.dwg, E * I, H, "w_gate bound"), put(&g.w_up, r.dwu, E * I, H, "w_up bound");
  put(&g.w_down, r.dwd, E * H, I, "w_down bound");
}

// x and dy (optional) as views, after checking that `saved` holds a training
// forward of their T.
template <class Saved>
std::pair<MatView<const bf16>, std::optional<MatView<const float>>> saved_rows(
    const Saved& saved, const moecert_tensor* x, const moecert_tensor* dy) {
  if (!saved.valid()) throw InvalidArgument("saved: holds no training forward");
  const auto xv = mat<const bf16>(x, "x");
  const std::size_t T = saved.impl().tokens;
  if (xv.rows != T)
    throw InvalidArgument(fmt::format("x: {} rows, the forward had T = {}", xv.rows, T));
  if (!capi::present(dy)) return {xv, std::nullopt};
  const auto dyv = mat<const float>(dy, "dy");
  if (dyv.rows != T || dyv.cols != xv.cols)
    throw InvalidArgument(
        fmt::format("dy: {}x{}, expected {}x{} (x's)", dyv.rows, dyv.cols, T, xv.cols));
  return {xv, dyv};
}

// bound + the binary64 reference's own rounding (as the router clauses).
double with_reference(double bound, double ref) {
  return bound + bounds::gamma(64, bounds::kU64) * std::fabs(ref);
}

}  // namespace

extern "C" {

moecert_status moecert_experts_bounds(const moecert_experts* w, const moecert_lora* lora,
                                      const moecert_tensor* x, const moecert_tensor* dy,
                                      const moecert_experts_saved* saved, const moecert_tensor* y,
                                      const moecert_experts_grads* grads) {
  return guarded("moecert_experts_bounds", [&] {
    const auto& p = handle(w, "experts").packed;
    const auto& h = handle(saved, "saved");
    const auto& s = h.saved;
    const auto [xv, dyv] = saved_rows(s, x, dy);
    const moecert_experts_grads none{};
    const auto& g = grads ? *grads : none;
    const auto l = h.lora.again(lora);
    const auto d = contracts::experts_data<Tracked>(p, l, xv, dyv, experts::saved_view(s.impl()));
    const auto r = ref::layer_reference(d, dyv.has_value(), paths_of(g, &g.dweights));
    const std::size_t T = d.T, H = d.H, I = d.I, E = d.E, K = d.K;
    put(y, r.y, T, H, "y bound");
    if (!dyv) return;
    put(&g.dx, r.dx, T, H, "dx bound"), put(&g.dweights, r.dw, T, K, "dweights bound");
    put(&g.m_a, r.m_a, T, E, "m_a bound"), put(&g.m_g, r.m_g, T, E, "m_g bound");
    put_weights(g, r, E, H, I, d.r);
  });
}

moecert_status moecert_layer_bounds(const moecert_config* cfg, const moecert_layer_weights* w,
                                    const moecert_tensor* x, const moecert_tensor* dy,
                                    const moecert_layer_saved* saved, const moecert_tensor* y,
                                    const moecert_layer_grads* grads) {
  return guarded("moecert_layer_bounds", [&] {
    const MoeConfig c = capi::config_of(cfg);
    const auto& h = handle(saved, "saved");
    const layer::Weights lw = capi::weights_of(w, h.lora.again(capi::lora_in(w)));
    const auto& s = h.saved;
    const auto [xv, dyv] = saved_rows(s, x, dy);
    const moecert_layer_grads none{};
    const auto& g = grads ? *grads : none;
    const std::size_t T = xv.rows, K = static_cast<std::size_t>(c.topk);
    // The router path's bound takes the kernel's dL/dw, which the backward
    // leaves in the arena.
    auto paths = paths_of(g, nullptr);
    paths.router = any({&g.dx, &g.router_w, &g.router_b});  // dx: both paths summed
    const float* dw = dyv && paths.router ? s.impl().arena.get<float>("router.dw", T * K) : nullptr;
    const auto r = contracts::layer_bounds(c, lw, xv, dyv, layer::saved_view(s), paths, dw);
    const std::size_t H = lw.experts->hidden(), I = lw.experts->inter(), E = lw.experts->experts(),
                      R = lw.router_w.rows;
    put(y, r.y, T, H, "y bound");
    if (!dyv) return;
    put(&g.dx, r.dx, T, H, "dx bound"), put(&g.router_w, r.dwr, R, H, "router_w bound");
    put(&g.router_b, r.db, 1, R, "router_b bound");
    put(&g.m_a, r.m_a, T, E, "m_a bound"), put(&g.m_g, r.m_g, T, E, "m_g bound");
    put_weights(g, r, E, H, I, static_cast<std::size_t>(c.lora_rank));
  });
}

moecert_status moecert_router_bounds(int32_t kind, double param, const moecert_tensor* z,
                                     const moecert_tensor* idx, const moecert_tensor* g,
                                     const moecert_tensor* w_bound,
                                     const moecert_tensor* dz_bound) {
  return guarded("moecert_router_bounds", [&] {
    if (kind < 0 || static_cast<std::size_t>(kind) >= kRouterKinds)
      throw InvalidArgument(fmt::format("kind {}, expected 0..{}", kind, kRouterKinds - 1));
    const auto& info = contracts::router_kind(static_cast<RouterKind>(kind));
    const contracts::RouterSettings settings = info.abi_settings(param);
    const auto zv = mat<const float>(z, "z");
    capi::Ids ids;
    const auto iv = ids.view(idx, "idx", {w_bound, dz_bound});
    const auto gv = mat<const float>(g, "g", false);
    const std::size_t T = zv.rows, K = iv.cols, C = zv.cols;
    const std::size_t experts = info.experts_of(C);
    if (iv.rows != T || (gv.data && (gv.rows != T || gv.cols != K)))
      throw InvalidArgument(
          fmt::format("idx {}x{} or g {}x{}, expected {} rows and g of idx's shape", iv.rows, K,
                      gv.rows, gv.cols, T));
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t j = 0; j < K; ++j)
        if (iv(t, j) < -1 || iv(t, j) >= static_cast<std::int64_t>(experts))
          throw InvalidArgument(
              fmt::format("idx[{}, {}] = {}, expected -1 <= idx < {}", t, j, iv(t, j), experts));
    const auto wb = mat<double>(w_bound, "w_bound", false);
    const auto db = mat<double>(dz_bound, "dz_bound", false);
    if ((wb.data && (wb.rows != T || wb.cols != K)) ||
        (db.data && (db.rows != T || db.cols != C || !gv.data)))
      throw InvalidArgument(
          fmt::format("w_bound {}x{} (expected {}x{}), dz_bound {}x{} (expected {}x{}, with g)",
                      wb.rows, wb.cols, T, K, db.rows, db.cols, T, C));
    for (std::size_t t = 0; t < T; ++t) {
      if (wb.data) {
        const auto [ref, bound] = info.weights_row(zv.row(t), C, iv.row(t), K, settings);
        for (std::size_t j = 0; j < K; ++j) wb(t, j) = with_reference(bound[j], ref[j]);
      }
      if (db.data) {
        const auto ref = info.dz_reference(zv.row(t), C, iv.row(t), gv.row(t), K, settings);
        const auto bound = info.dz_rounding(zv.row(t), C, iv.row(t), gv.row(t), K, settings);
        for (std::size_t i = 0; i < C; ++i) db(t, i) = with_reference(bound[i], ref[i]);
      }
    }
  });
}

}  // extern "C"
