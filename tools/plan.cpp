// `moecert plan`: the workspace plan of a layer call (buffers, offsets, live
// steps, total), as a table or JSON.
#include <fmt/format.h>

#include <algorithm>
#include <boost/json.hpp>

#include "moecert/contracts.hpp"
#include "moecert/workspace.hpp"
#include "tools/commands.hpp"

namespace moecert::tools {

namespace {

std::string human(std::uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 0x1p30) return fmt::format("{:.2f} GiB", b / 0x1p30);
  if (b >= 0x1p20) return fmt::format("{:.2f} MiB", b / 0x1p20);
  if (b >= 0x1p10) return fmt::format("{:.2f} KiB", b / 0x1p10);
  return fmt::format("{} B", bytes);
}

}  // namespace

int run_plan(int argc, char** argv) {
  Args args(argc, argv,
            {"experts", "hidden", "inter", "topk", "rank", "alpha", "tokens", "router", "groups",
             "topk-group", "cap"},
            {"json", "forward-only"});
  MoeConfig cfg;
  auto need = [&](const char* name) {
    if (!args.get(name)) throw std::invalid_argument(fmt::format("--{} is required", name));
    return args.get_int(name, 0);
  };
  cfg.experts = need("experts");
  cfg.hidden = need("hidden");
  cfg.inter = need("inter");
  cfg.topk = need("topk");
  cfg.lora_rank = args.get_int("rank", 0);
  cfg.lora_alpha =
      cfg.lora_rank > 0 ? std::stod(args.get_or("alpha", std::to_string(2 * cfg.lora_rank))) : 0.0;
  const std::int64_t tokens = need("tokens");
  cfg.max_tokens = tokens;
  if (auto r = args.get("router")) {
    auto k = parse_router_kind(*r);
    if (!k)
      throw std::invalid_argument(fmt::format(
          "--router: expected softmax_topk, sigmoid_topk or product_key, got '{}'", *r));
    cfg.router = *k;
  }
  cfg.groups = args.get_int("groups", 1);
  cfg.topk_group = args.get_int("topk-group", cfg.groups);
  const workspace::PlanOptions opt{
      .training = !args.flag("forward-only"),
      .memory_cap = static_cast<std::uint64_t>(args.get_int("cap", 0))};
  // The plan's own clauses (the config, the memory cap asked for) at least at
  // `check`, whatever the build's default: a plan is what a user checks.
  ContractSettings checked = effective_contract_settings();
  checked.level = std::max(checked.level, Level::check);
  const ContractScope scope{checked};
  const workspace::Plan p = workspace::plan(cfg, tokens, opt);
  if (args.flag("json")) {
    boost::json::array bufs;
    for (const auto& b : p.buffers) {
      boost::json::array live;
      for (int s = b.first; s <= b.last; ++s)
        live.emplace_back(std::string(workspace::step_name(s)));
      bufs.push_back({{"name", b.name}, {"offset", b.offset}, {"bytes", b.bytes}, {"live", live}});
    }
    boost::json::object o{{"schema", "moecert-plan/1"},
                          {"config",
                           {{"E", cfg.experts},
                            {"H", cfg.hidden},
                            {"I", cfg.inter},
                            {"K", cfg.topk},
                            {"r", cfg.lora_rank},
                            {"T", tokens},
                            {"router", router_kind_name(cfg.router)}}},
                          {"training", p.training},
                          {"total_bytes", p.total_bytes},
                          {"packed_weight_bytes", p.packed_weight_bytes},
                          {"peak_live_bytes", p.peak_live_bytes},
                          {"buffers", bufs}};
    fmt::print("{}\n", boost::json::serialize(o));
    return 0;
  }
  fmt::print("workspace plan: E={} H={} I={} K={} r={} T={} router={} ({})\n", cfg.experts,
             cfg.hidden, cfg.inter, cfg.topk, cfg.lora_rank, tokens, router_kind_name(cfg.router),
             p.training ? "forward + backward" : "forward");
  fmt::print("{:<16} {:>16} {:>14} {:>12}  {}\n", "buffer", "offset", "bytes", "", "live");
  for (const auto& b : p.buffers)
    fmt::print("{:<16} {:>16} {:>14} {:>12}  {} .. {}\n", b.name, b.offset, b.bytes, human(b.bytes),
               workspace::step_name(b.first), workspace::step_name(b.last));
  fmt::print("total (arena, guards included): {} bytes ({})\n", p.total_bytes,
             human(p.total_bytes));
  fmt::print("largest co-live sum (lower bound on any placement): {} bytes ({})\n",
             p.peak_live_bytes, human(p.peak_live_bytes));
  fmt::print("packed weights (besides the arena): {} bytes ({})\n", p.packed_weight_bytes,
             human(p.packed_weight_bytes));
  return 0;
}

}  // namespace moecert::tools
