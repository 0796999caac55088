// The planner instantiated with checked 64-bit arithmetic.
#include <algorithm>
#include <cmath>

#include "contracts/workspace/workspace.hpp"
#include "moecert/workspace.hpp"
#include "ops/workspace/arena.hpp"
#include "ops/workspace/planner.hpp"

namespace moecert::workspace {
namespace {

// An unsigned 64-bit value that remembers whether any computation leading
// to it overflowed (and then saturates).
struct Checked {
  std::uint64_t v = 0;
  bool overflow = false;
  Checked() = default;
  explicit Checked(std::uint64_t x) : v(x) {}
  Checked(std::uint64_t x, bool o) : v(x), overflow(o) {}
  friend Checked operator+(const Checked& a, const Checked& b) {
    std::uint64_t r;
    const bool o = __builtin_add_overflow(a.v, b.v, &r);
    return {o ? UINT64_MAX : r, a.overflow || b.overflow || o};
  }
  friend Checked operator*(const Checked& a, const Checked& b) {
    std::uint64_t r;
    const bool o = __builtin_mul_overflow(a.v, b.v, &r);
    return {o ? UINT64_MAX : r, a.overflow || b.overflow || o};
  }
  friend Checked operator/(const Checked& a, const Checked& b) {
    return {a.v / b.v, a.overflow || b.overflow};
  }
  friend Checked max_of(const Checked& a, const Checked& b) {
    return {std::max(a.v, b.v), a.overflow || b.overflow};
  }
  friend Checked min_of(const Checked& a, const Checked& b) {
    return {std::min(a.v, b.v), a.overflow || b.overflow};
  }
};

constexpr std::string_view kStepNames[] = {"forward.route", "forward.gather",  "forward.gate_up",
                                           "forward.down",  "forward.combine", "backward.gather",
                                           "backward.dh",   "backward.router", "backward.swiglu",
                                           "backward.dx",   "backward.scatter"};
static_assert(std::size(kStepNames) == kSteps);

}  // namespace

std::string_view step_name(int step) {
  return step >= 0 && step < kSteps ? kStepNames[step] : "invalid";
}
int step_count() { return kSteps; }

const Buffer* Plan::find(std::string_view name) const {
  for (const auto& b : buffers)
    if (b.name == name) return &b;
  return nullptr;
}

Plan plan_shape(const Shape& s, bool training, std::uint64_t memory_cap, detail::Checker& chk,
                WeightFormat format) {
  auto n = [](std::uint64_t x) { return Checked{x}; };
  const Dims<Checked> d{n(s.experts), n(s.hidden), n(s.inter),     n(s.topk),
                        n(s.rank),    n(s.tokens), n(s.router_out)};
  Checked total;
  const auto planned = plan_buffers(d, training, total);
  const Checked weights = packed_weight_bytes(d, training, format_info(format));
  bool overflow = total.overflow || weights.overflow;
  for (const auto& b : planned) overflow = overflow || b.end.overflow;
  Plan p;
  p.tokens = static_cast<std::int64_t>(s.tokens);
  p.training = training;
  p.total_bytes = total.v;
  p.packed_weight_bytes = weights.v;
  for (const auto& b : planned)
    p.buffers.push_back({std::string(b.name), b.offset.v, b.bytes.v, b.first, b.last});
  for (int step = 0; step < kSteps; ++step) {
    std::uint64_t live = 0;
    for (const auto& b : p.buffers)
      if (b.first <= step && step <= b.last) live += b.bytes;
    p.peak_live_bytes = std::max(p.peak_live_bytes, live);
  }
  contracts::plan_post(chk, p, overflow, memory_cap);
  if (chk.stop()) return {};
  return p;
}

Plan plan(const MoeConfig& cfg, std::int64_t tokens, const PlanOptions& options) {
  validate(cfg);
  detail::Checker chk{"workspace.plan"};
  contracts::plan_pre(chk, cfg, tokens);
  if (chk.stop()) return {};
  auto u = [](std::int64_t x) { return static_cast<std::uint64_t>(std::max<std::int64_t>(x, 0)); };
  const Shape s{u(cfg.experts),   u(cfg.hidden), u(cfg.inter),     u(cfg.topk),
                u(cfg.lora_rank), u(tokens),     router_width(cfg)};
  return plan_shape(s, options.training, options.memory_cap, chk, options.format);
}

}  // namespace moecert::workspace
