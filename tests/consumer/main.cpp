// Uses the installed moecert through its one header: validates a config,
// checks that a bad one raises the documented clause, and runs an op.
#include <cstdio>
#include <moecert/moecert.hpp>
#include <vector>

int main() {
  // C = A W^T on the default kernel: every element 32 * 1 * 0.5, exactly.
  std::vector<moecert::bf16> a(2 * 32, moecert::bf16(1.0f)), w(16 * 32, moecert::bf16(0.5f));
  const auto pw =
      moecert::gemm::PackedWeights::pack(moecert::MatView<const moecert::bf16>(w.data(), 16, 32));
  std::vector<float> c(2 * 16);
  moecert::gemm::matmul(moecert::MatView<const moecert::bf16>(a.data(), 2, 32), pw,
                        moecert::MatView<float>(c.data(), 2, 16), moecert::default_isa());
  for (float v : c)
    if (v != 16.0f) {
      std::printf("consumer: matmul gave %g, expected 16\n", static_cast<double>(v));
      return 1;
    }
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
