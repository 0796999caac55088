// What the contracts keep beside one pack between calls: the dense probe
// formed from it on its first audited call, and the rotations of the audit
// level's windowed checks (gemm.pack.checksum parts, narrow probe blocks).
// A pack's state is fresh with every pack (PackedWeights::take_checksums).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>

#include "contracts/probes/verify.hpp"
#include "moecert/gemm.hpp"

namespace moecert::detail {

struct PackAudit {
  std::mutex mutex;                            // guards dense's formation
  std::shared_ptr<const verify::Probe> dense;  // every column; null until first used
  std::atomic<std::uint64_t> checksum_calls{0}, probe_calls{0};
};

/// What the public PackedWeights keeps private: its contracts' state, fresh
/// with every pack (null for a default-constructed one), and its packed
/// bytes to write (tests and seeded bugs that corrupt a pack).
struct PackAccess {
  static PackAudit* audit(const gemm::PackedWeights& w) { return w.audit_.get(); }
  static bf16* data(gemm::PackedWeights& w) { return w.data_.get(); }
  static float* scales(gemm::PackedWeights& w) { return w.scales_.data(); }
};

}  // namespace moecert::detail
