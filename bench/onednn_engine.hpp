// The oneDNN CPU engine the peers share.
#pragma once

#include <dnnl.hpp>

namespace moecert::bench {

inline dnnl::engine& onednn_engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

}  // namespace moecert::bench
