// `moecert plan`: the workspace plan of a layer call (buffers, offsets, live
// steps, total), as a table or JSON.
#include <fmt/format.h>

#include <algorithm>
#include <boost/json.hpp>
#include <optional>
#include <string>
#include <vector>

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

struct PlanArgs {
  MoeConfig cfg;
  std::int64_t tokens = 0;
  std::optional<double> alpha;
  std::string router = "softmax_topk";
  std::string format = "bf16";
  std::optional<std::int64_t> topk_group;
  std::uint64_t cap = 0;
  bool forward_only = false, json = false;
};

void print_json(const MoeConfig& cfg, std::int64_t tokens, const workspace::Plan& p);

// The weight formats' names, in their order (the --format option's choices).
std::vector<std::string> format_names() {
  std::vector<std::string> out;
  for (const FormatInfo& f : kFormatTable) out.emplace_back(f.name);
  return out;
}

// The router kinds' names, in their order (the --router option's choices).
std::vector<std::string> router_kind_names() {
  std::vector<std::string> names;
  for (std::size_t i = 0; i < kRouterKinds; ++i)
    names.emplace_back(router_kind_name(static_cast<RouterKind>(i)));
  return names;
}
void print_table(const MoeConfig& cfg, std::int64_t tokens, const workspace::Plan& p);

int run_plan(PlanArgs a) {
  MoeConfig& cfg = a.cfg;
  cfg.lora_alpha = cfg.lora_rank > 0 ? a.alpha.value_or(2.0 * cfg.lora_rank) : 0.0;
  cfg.max_tokens = a.tokens;
  cfg.router = *parse_router_kind(a.router);  // one of the names the option admits
  cfg.topk_group = a.topk_group.value_or(cfg.groups);
  const workspace::PlanOptions opt{
      .training = !a.forward_only, .memory_cap = a.cap, .format = *parse_format(a.format)};
  // The plan's own clauses (the config, the memory cap asked for) at least at
  // `check`, whatever the build's default: a plan is what a user checks.
  ContractSettings checked = effective_contract_settings();
  checked.level = std::max(checked.level, Level::check);
  const ContractScope scope{checked};
  const workspace::Plan p = workspace::plan(cfg, a.tokens, opt);
  (a.json ? print_json : print_table)(cfg, a.tokens, p);
  return 0;
}

void print_json(const MoeConfig& cfg, std::int64_t tokens, const workspace::Plan& p) {
  boost::json::array bufs;
  for (const auto& b : p.buffers) {
    boost::json::array live;
    for (int s = b.first; s <= b.last; ++s) live.emplace_back(std::string(workspace::step_name(s)));
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
}

void print_table(const MoeConfig& cfg, std::int64_t tokens, const workspace::Plan& p) {
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
}

}  // namespace

void add_plan(CLI::App& app, Command& run) {
  auto* sub = app.add_subcommand("plan", "print the workspace plan of a layer call");
  auto a = std::make_shared<PlanArgs>();
  MoeConfig& c = a->cfg;
  // Values are judged by the config's clauses (config.*), not here.
  sub->add_option("--experts", c.experts, "E, experts")->required();
  sub->add_option("--hidden", c.hidden, "H, hidden size")->required();
  sub->add_option("--inter", c.inter, "I, expert intermediate size")->required();
  sub->add_option("--topk", c.topk, "K, experts per token")->required();
  sub->add_option("--tokens", a->tokens, "T, tokens in the call")->required();
  sub->add_option("--rank", c.lora_rank, "r, LoRA rank (0: no LoRA)");
  sub->add_option("--alpha", a->alpha, "LoRA alpha (default 2r)");
  sub->add_option("--router", a->router, "router kind")
      ->check(CLI::IsMember(router_kind_names()))
      ->capture_default_str();
  sub->add_option("--format", a->format, "the base weights' format (packed weights' bytes)")
      ->check(CLI::IsMember(format_names()))
      ->capture_default_str();
  sub->add_option("--groups", c.groups, "expert groups (grouped top-k)");
  sub->add_option("--topk-group", a->topk_group, "groups kept per token (default: all)");
  sub->add_option("--cap", a->cap, "memory cap in bytes; a plan over it is a violation")
      ->check(CLI::NonNegativeNumber);
  sub->add_flag("--forward-only", a->forward_only, "plan the forward only (no training buffers)");
  sub->add_flag("--json", a->json, "JSON (schema moecert-plan/1) instead of a table");
  sub->callback([a, &run] { run = [a] { return run_plan(*a); }; });
}

}  // namespace moecert::tools
