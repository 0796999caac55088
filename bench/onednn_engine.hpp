// The oneDNN CPU engine the peers share.
#pragma once

#include <dnnl.hpp>
#include <string>

#include "bench/bench.hpp"

namespace moecert::bench {

inline dnnl::engine& onednn_engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

/// The matmul primitive of `d` on the shared engine; PeerUnavailable where
/// oneDNN has no implementation of it here.
inline dnnl::matmul::primitive_desc matmul_pd(const dnnl::matmul::desc& d) {
  try {
    return dnnl::matmul::primitive_desc(d, onednn_engine());  // oneDNN 2.x API
  } catch (const dnnl::error& e) {
    throw PeerUnavailable(std::string("oneDNN has no such matmul on this CPU (") + e.what() + ")");
  }
}

}  // namespace moecert::bench
