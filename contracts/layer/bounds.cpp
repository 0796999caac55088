// The layer's bounded reference (contracts/layer/bounds.hpp): the layer
// reference over bounds::Tracked on the kernel's routing, plus the router
// backward kernel's own rounding of dz (the kind's, proofs/router.md §4).
#include "contracts/layer/bounds.hpp"

#include "contracts/experts/train.hpp"
#include "contracts/router/kind.hpp"

namespace moecert::contracts {

using bounds::Tracked;

template <class S>
ref::LayerData<S> layer_data(const MoeConfig& cfg, const layer::Weights& w, MatView<const bf16> x,
                             std::optional<MatView<const float>> dy, const LayerSaved& s) {
  const auto H = static_cast<std::size_t>(cfg.hidden), R = router_width(cfg);
  auto d = experts_data<S>(*w.experts, cfg.lora_rank ? w.lora : experts::Lora{}, x, dy, s.train);
  d.router = true, d.R = R;
  d.kind = cfg.router, d.renormalize = cfg.renormalize,
  d.scaling = static_cast<double>(static_cast<float>(cfg.scaling));
  d.wr.resize(R * H);
  for (std::size_t e = 0; e < R; ++e)
    for (std::size_t h = 0; h < H; ++h) d.wr[e * H + h] = S(double(w.router_w(e, h)));
  d.b.resize(R);
  for (std::size_t e = 0; e < R; ++e) d.b[e] = S(double(w.router_b[e]));
  d.z_given.resize(d.T * d.R);
  for (std::size_t i = 0; i < d.T * d.R; ++i) d.z_given[i] = S(double(s.logits[i]));
  return d;
}

template ref::LayerData<double> layer_data<double>(const MoeConfig&, const layer::Weights&,
                                                   MatView<const bf16>,
                                                   std::optional<MatView<const float>>,
                                                   const LayerSaved&);
template ref::LayerData<Tracked> layer_data<Tracked>(const MoeConfig&, const layer::Weights&,
                                                     MatView<const bf16>,
                                                     std::optional<MatView<const float>>,
                                                     const LayerSaved&);

ref::LayerResult<Tracked> layer_bounds(const MoeConfig& cfg, const layer::Weights& w,
                                       MatView<const bf16> x,
                                       std::optional<MatView<const float>> dy, const LayerSaved& s,
                                       ref::Paths paths, const float* dw_kernel) {
  const auto d = layer_data<Tracked>(cfg, w, x, dy, s);
  const RouterKindInfo& kind = router_kind(cfg.router);
  const RouterSettings settings = router_settings(cfg);
  return ref::layer_reference(
      d, dy.has_value(), paths, [&](std::size_t t, std::vector<Tracked>& dz) {
        if (!dw_kernel) return;
        // The router backward kernel's own rounding, given the g it was fed
        // (proofs/router.md §4).
        const std::int32_t* ir = s.train.idx + t * d.K;
        const std::size_t v = ref::valid_prefix(ir, d.K);
        if (v == 0) return;
        const auto extra =
            kind.dz_rounding(s.logits + t * d.R, d.R, ir, dw_kernel + t * d.K, v, settings);
        for (std::size_t i = 0; i < d.R; ++i) dz[i].e += extra[i];
      });
}

}  // namespace moecert::contracts
