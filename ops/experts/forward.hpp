// What the expert forward computed besides y: the grouping and the
// intermediate buffers (in the workspace), for the contracts to judge and
// the backward to reuse.
#pragma once

#include <cstddef>
#include <memory>
#include <new>

#include "moecert/experts.hpp"
#include "ops/experts/grouping.hpp"
#include "ops/gemm/ukernel.hpp"

namespace moecert::experts {

struct ForwardState {
  Grouping grouping;
  gemm::ALayout layout = gemm::ALayout::rows;  // of a and h (the kernel's)
  std::size_t lda = 0, ldc1 = 0, ldh = 0, ldo = 0;
  bf16* a = nullptr;    // gathered x rows in `layout` (lda), K padding zero
  float* c1 = nullptr;  // gate/up GEMM output [rows x ldc1], interleaved 16-column panels
  bf16* h = nullptr;    // silu(g) * u in bf16, in `layout` (ldh), K padding zero
  float* o = nullptr;   // down GEMM output [rows x ldo]
  bf16 a_at(std::size_t r, std::size_t k) const { return a[gemm::a_offset(layout, lda, r, k)]; }
  bf16 h_at(std::size_t r, std::size_t k) const { return h[gemm::a_offset(layout, ldh, r, k)]; }
};

/// Uninitialised, 64-byte aligned storage that grows on demand.
class RawBuffer {
 public:
  template <class T>
  T* get(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes > capacity_) {
      data_.reset(static_cast<std::byte*>(::operator new[](bytes, std::align_val_t(64))));
      capacity_ = bytes;
    }
    return reinterpret_cast<T*>(data_.get());
  }
  std::size_t capacity() const { return capacity_; }

 private:
  struct Free {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<std::byte[], Free> data_;
  std::size_t capacity_ = 0;
};

struct Workspace::Impl {
  ForwardState state;
  RawBuffer a, c1, h, o;
};

}  // namespace moecert::experts
