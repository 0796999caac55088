// The experts op's state as its contracts read it (contracts/engine/saved.hpp):
// plain views of the grouping, the saved rows and the packed LoRA factors.
#include "contracts/engine/saved.hpp"
#include "ops/experts/train.hpp"

namespace moecert::experts {

contracts::GroupingView grouping_view(const Grouping& g) {
  return {.experts = g.experts,
          .routed = g.routed,
          .count = g.count,
          .begin = g.begin,
          .row_slot = g.row_slot,
          .slot_row = g.slot_row};
}

contracts::OperandRows operand_rows(const bf16* p, std::size_t ld, gemm::ALayout layout) {
  const bool tiles = layout == gemm::ALayout::tiles;
  return {.data = p,
          .ld = ld,
          .tile_rows = tiles ? gemm::kTileRows : 0,
          .k_step = tiles ? gemm::kKStep : 0};
}

contracts::ExpertRows rows_view(const ForwardState& st) {
  return {.grouping = grouping_view(st.grouping),
          .c1 = st.c1,
          .ldc1 = st.ldc1,
          .h = operand_rows(st.h, st.ldh, st.layout),
          .o = st.o,
          .ldo = st.ldo,
          .rank = st.rank,
          .xa = st.xa,
          .ha = st.ha};
}

contracts::TrainSaved saved_view(const TrainState& s) {
  contracts::ExpertRows rows = rows_view(s.st);
  if (s.digests.valid) rows.c1_digests = s.digests.c1;
  return {.valid = s.valid,
          .training = s.training,
          .tokens = s.tokens,
          .topk = s.topk,
          .experts = s.st.grouping.experts,
          .rank = s.lora.rank,
          .idx = s.idx,
          .weights = s.weights,
          .rows = rows,
          .workspace = s.arena.bytes()};
}

contracts::TrainSaved saved_view(const Saved::Impl& s) {
  contracts::TrainSaved v = saved_view(static_cast<const TrainState&>(s));
  v.experts = s.experts, v.hidden = s.hidden, v.inter = s.inter, v.rank = s.rank;
  v.alpha = s.alpha;
  return v;
}

std::array<contracts::PackedFactor, 8> packed_factors(std::size_t e, const PackedLoraExpert& p) {
  return {{{e, "a_gu", &p.a_gu},
           {e, "b_gu", &p.b_gu},
           {e, "a_d", &p.a_d},
           {e, "b_d", &p.b_d},
           {e, "b_d_t", &p.b_d_t},
           {e, "a_d_t", &p.a_d_t},
           {e, "b_gu_t", &p.b_gu_t},
           {e, "a_gu_t", &p.a_gu_t}}};
}

std::vector<contracts::PackedFactor> packed_factors(const PackedLora& l) {
  std::vector<contracts::PackedFactor> out;
  for (std::size_t e = 0; e < l.experts.size(); ++e)
    for (const auto& f : packed_factors(e, l.experts[e])) out.push_back(f);
  return out;
}

PackedLora::Hook judge_packs(contracts::LoraFiniteScan* finite,
                             contracts::LoraPaddingScan* padding) {
  if (!finite && !padding) return {};
  return [finite, padding](std::size_t e, const PackedLoraExpert& p) {
    if (finite) finite->expert(e);
    if (padding) padding->expert(packed_factors(e, p));
  };
}

}  // namespace moecert::experts
