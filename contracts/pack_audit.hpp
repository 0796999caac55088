// What the contracts keep beside one pack between calls: the dense probe
// formed from it on its first audited call, and the rotations of the audit
// level's windowed checks (gemm.pack.checksum parts, narrow probe blocks).
// A pack's state is fresh with every pack (PackedWeights::take_checksums).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>

#include "contracts/verify.hpp"

namespace moecert::detail {

struct PackAudit {
  std::mutex mutex;                            // guards dense's formation
  std::shared_ptr<const verify::Probe> dense;  // every column; null until first used
  std::atomic<std::uint64_t> checksum_calls{0}, probe_calls{0};
};

}  // namespace moecert::detail
