// Uses the installed moecert: validates a config, and checks that a bad one
// raises the documented clause.
#include <cstdio>
#include <moecert/moecert.hpp>

int main() {
  moecert::MoeConfig cfg;
  cfg.experts = 64;
  cfg.hidden = 2048;
  cfg.inter = 1408;
  cfg.topk = 6;
  cfg.max_tokens = 4096;
  moecert::ContractScope scope{moecert::Level::check, moecert::Semantic::enforce};
  moecert::validate(cfg);
  cfg.topk = 100;
  try {
    moecert::validate(cfg);
  } catch (const moecert::ContractViolation& v) {
    std::printf("consumer ok: %s; default isa %s\n", v.what(),
                std::string(moecert::isa_name(moecert::default_isa())).c_str());
    return v.clause() == "core.config.topk_range" ? 0 : 1;
  }
  std::puts("consumer: no violation raised");
  return 1;
}
