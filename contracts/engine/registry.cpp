// The clause registry: every family's table, in one list for coverage.
#include "contracts/engine/clauses.hpp"

namespace moecert {

std::vector<ClauseInfo> all_clauses() {
  std::vector<ClauseInfo> out;
  for (const auto& table : {std::span<const ClauseInfo>(clauses::config::kAll),
                            std::span<const ClauseInfo>(clauses::gemm::kAll),
                            std::span<const ClauseInfo>(clauses::experts::kAll),
                            std::span<const ClauseInfo>(clauses::experts_train::kAll),
                            std::span<const ClauseInfo>(clauses::router::kAll),
                            std::span<const ClauseInfo>(clauses::workspace::kAll),
                            std::span<const ClauseInfo>(clauses::layer::kAll)})
    out.insert(out.end(), table.begin(), table.end());
  return out;
}

}  // namespace moecert
