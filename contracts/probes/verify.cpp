// The audit probes' inner loops (contracts/probes/verify.hpp): each compiled by the
// compiler for AVX-512, AVX2 and baseline x86-64 (target_clones, chosen
// once at load time). Each lane's sum runs in a fixed order and no
// multiply-add is contracted (-ffp-contract=off), so every clone returns
// the same bits; on the AMX machine the probes ran at a third of their
// baseline time.
#include "contracts/probes/verify.hpp"

#include <algorithm>
#include <cstring>

#include "contracts/engine/checks.hpp"

namespace moecert::verify {

namespace detail {
namespace {

// 16 binary32 lanes, 16 binary64 lanes, as GCC/Clang vector types: lane-wise
// IEEE operations, the same bits as the scalar loop, kept in registers.
using V16f = float __attribute__((vector_size(64)));
using V16i = std::int32_t __attribute__((vector_size(64)));
using V16d = double __attribute__((vector_size(128)));
static_assert(kProbeLanes == 16);

// Sum a_k x_k and sum |a_k| y_k over k < n (§9.1; y null: every y_k = 1):
// lane l of a block of up to kProbeSteps steps sums its binary32 products
// in step order, the blocks' lanes are added to binary64 lanes in order, the
// tail (< 16) in binary64, then the lanes in order. Inlined into each clone.
[[gnu::always_inline]] inline void lane_sums(const float* a, const float* x, const float* y,
                                             std::size_t n, double& dot, double& mag) {
  constexpr std::size_t kL = kProbeLanes;
  V16d d = {}, m = {};
  std::size_t k = 0;
  while (k + kL <= n) {
    const std::size_t steps = std::min(kProbeSteps, (n - k) / kL);
    V16f fd = {}, fm = {};
    for (std::size_t s = 0; s < steps; ++s, k += kL) {
      V16f av, xv, yv;
      std::memcpy(&av, a + k, sizeof av);
      std::memcpy(&xv, x + k, sizeof xv);
      const V16f abs_a = reinterpret_cast<V16f>(reinterpret_cast<V16i>(av) & 0x7fffffff);
      fd += av * xv;
      if (y) {
        std::memcpy(&yv, y + k, sizeof yv);
        fm += abs_a * yv;
      } else {
        fm += abs_a;
      }
    }
    d += __builtin_convertvector(fd, V16d);
    m += __builtin_convertvector(fm, V16d);
  }
  double dl[kL], ml[kL];
  std::memcpy(dl, &d, sizeof dl);
  std::memcpy(ml, &m, sizeof ml);
  for (; k < n; ++k) {
    dl[0] += static_cast<double>(a[k]) * x[k];
    ml[0] += std::fabs(static_cast<double>(a[k])) * (y ? y[k] : 1.0f);
  }
  dot = mag = 0;
  for (std::size_t l = 0; l < kL; ++l) dot += dl[l], mag += ml[l];
  if (std::isfinite(dot) && std::isfinite(mag)) return;
  dot = mag = 0;  // a lane left binary32's range (or a holds Inf or NaN): binary64
  for (k = 0; k < n; ++k) {
    dot += static_cast<double>(a[k]) * x[k];
    mag += std::fabs(static_cast<double>(a[k])) * (y ? y[k] : 1.0f);
  }
}

}  // namespace

MOECERT_CLONES
void dot_and_magnitude(const float* a, const float* x, const float* y, std::size_t n, double& dot,
                       double& mag) {
  lane_sums(a, x, y, n, dot, mag);
}

MOECERT_CLONES
void signed_sum_and_magnitude(const float* c, const float* r, std::size_t n, double& sum,
                              double& mag) {
  lane_sums(c, r, nullptr, n, sum, mag);
}

// Lane l of the pair sums holds columns l and l + 16; the tree adds lane l
// + w into lane l for w = 8, 4, 2, 1, the sums in lanes 0-7 and the
// magnitudes in lanes 8-15 of one vector (one shuffle and add per level for
// both). The binary64 fallback sums the columns in order.
MOECERT_CLONES
void block_sums(const float* c, std::size_t ldc, std::size_t rows, const float* r, double* out,
                bool add) {
  static_assert(kBlockColumns == 2 * kProbeLanes);
  V16f r_lo, r_hi;
  std::memcpy(&r_lo, r, sizeof r_lo);
  std::memcpy(&r_hi, r + kProbeLanes, sizeof r_hi);
  for (std::size_t i = 0; i < rows; ++i, c += ldc, out += 2) {
    V16f lo, hi;
    std::memcpy(&lo, c, sizeof lo);
    std::memcpy(&hi, c + kProbeLanes, sizeof hi);
    const V16f s = lo * r_lo + hi * r_hi;
    const V16f m = reinterpret_cast<V16f>((reinterpret_cast<V16i>(lo) & 0x7fffffff)) +
                   reinterpret_cast<V16f>((reinterpret_cast<V16i>(hi) & 0x7fffffff));
    V16f u =
        __builtin_shufflevector(s, m, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(s, m, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    u += __builtin_shufflevector(u, u, 4, 5, 6, 7, 4, 5, 6, 7, 12, 13, 14, 15, 12, 13, 14, 15);
    u += __builtin_shufflevector(u, u, 2, 3, 2, 3, 2, 3, 2, 3, 10, 11, 10, 11, 10, 11, 10, 11);
    u += __builtin_shufflevector(u, u, 1, 1, 1, 1, 1, 1, 1, 1, 9, 9, 9, 9, 9, 9, 9, 9);
    double sum = u[0], mag = u[8];
    if (!std::isfinite(u[0]) || !std::isfinite(u[8])) {
      sum = mag = 0;  // past binary32's range: binary64
      for (std::size_t j = 0; j < kBlockColumns; ++j)
        sum += static_cast<double>(c[j]) * r[j], mag += std::fabs(static_cast<double>(c[j]));
    }
    if (add)
      out[0] += sum, out[1] += mag;
    else
      out[0] = sum, out[1] = mag;
  }
}

MOECERT_CLONES
void row_digests(const float* c, std::size_t ldc, std::size_t rows, std::size_t cols,
                 std::uint32_t* out, std::size_t out_stride, bool add) {
  using V16u = std::uint32_t __attribute__((vector_size(64)));
  static_assert(kBlockColumns == 2 * kProbeLanes);
  const V16u k = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const V16u m_lo = 2 * k + 1, m_hi = 2 * (k + 16) + 1;  // the odd factor of column j mod 32
  for (std::size_t i = 0; i < rows; ++i, c += ldc) {
    V16u s_lo = {}, s_hi = {};  // each column class's sum of bits; the factor once per row
    for (std::size_t j = 0; j < cols; j += kBlockColumns) {
      V16u lo, hi;
      std::memcpy(&lo, c + j, sizeof lo);
      std::memcpy(&hi, c + j + kProbeLanes, sizeof hi);
      s_lo += lo, s_hi += hi;
    }
    V16u v = s_lo * m_lo + s_hi * m_hi;
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
    out[i * out_stride] = add ? out[i * out_stride] + v[0] : v[0];
  }
}

namespace {

using V8d = double __attribute__((vector_size(64)));
using V8l = std::int64_t __attribute__((vector_size(64)));

// 8 bf16 values at p as binary64 (exact), into v (by reference: a vector
// argument or result would change the baseline clone's ABI).
[[gnu::always_inline]] inline void load8(const bf16* p, V8d& v) {
  using V8h = std::uint16_t __attribute__((vector_size(16)));
  using V8u = std::uint32_t __attribute__((vector_size(32)));
  using V8f = float __attribute__((vector_size(32)));
  V8h h;
  std::memcpy(&h, p, sizeof h);
  const V8u u = __builtin_convertvector(h, V8u) << 16;
  v = __builtin_convertvector(reinterpret_cast<V8f>(u), V8d);
}

// 8 binary32 values at p as binary64 (exact), into v.
[[gnu::always_inline]] inline void load8(const float* p, V8d& v) {
  using V8f = float __attribute__((vector_size(32)));
  V8f f;
  std::memcpy(&f, p, sizeof f);
  v = __builtin_convertvector(f, V8d);
}

// m += |v|, lane-wise.
[[gnu::always_inline]] inline void add_abs(V8d& m, const V8d& v) {
  m += reinterpret_cast<V8d>(reinterpret_cast<V8l>(v) & 0x7fffffffffffffff);
}

// Eight columns k at a time in binary64 lanes, the rows j in order within
// each lane (the order of a row-by-row loop); the last n % 8 columns in
// scalar code, in the same order. Inlined into each clone.
template <class T>
[[gnu::always_inline]] inline void add_signed_rows_of(const T* x, std::size_t ld, std::size_t rows,
                                                      std::size_t n, const float* signs,
                                                      double* sum, double* mag) {
  std::size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    V8d s, m;
    std::memcpy(&s, sum + k, sizeof s);
    std::memcpy(&m, mag + k, sizeof m);
    for (std::size_t j = 0; j < rows; ++j) {
      V8d v;
      load8(x + j * ld + k, v);
      s += static_cast<double>(signs[j]) * v;
      add_abs(m, v);
    }
    std::memcpy(sum + k, &s, sizeof s);
    std::memcpy(mag + k, &m, sizeof m);
  }
  for (; k < n; ++k)
    for (std::size_t j = 0; j < rows; ++j) {
      const double v = verify::weight_value(x[j * ld + k]);
      sum[k] += static_cast<double>(signs[j]) * v;
      mag[k] += std::fabs(v);
    }
}

}  // namespace

MOECERT_CLONES
void add_signed_rows(const bf16* x, std::size_t ld, std::size_t rows, std::size_t n,
                     const float* signs, double* sum, double* mag) {
  add_signed_rows_of(x, ld, rows, n, signs, sum, mag);
}

MOECERT_CLONES
void add_signed_rows(const float* x, std::size_t ld, std::size_t rows, std::size_t n,
                     const float* signs, double* sum, double* mag) {
  add_signed_rows_of(x, ld, rows, n, signs, sum, mag);
}

// Per row: eight binary64 lanes over the columns (lane l: columns l, l + 8,
// ... in order), the tail into lane 0, the lanes added in order.
MOECERT_CLONES
void signed_row_sums(const float* x, std::size_t ld, std::size_t rows, std::size_t n,
                     const float* signs, double* sum, double* mag) {
  using V8f = float __attribute__((vector_size(32)));
  for (std::size_t i = 0; i < rows; ++i) {
    const float* p = x + i * ld;
    V8d s = {}, m = {};
    std::size_t q = 0;
    for (; q + 8 <= n; q += 8) {
      V8f f, r;
      std::memcpy(&f, p + q, sizeof f);
      std::memcpy(&r, signs + q, sizeof r);
      const V8d v = __builtin_convertvector(f, V8d);
      s += __builtin_convertvector(r, V8d) * v;
      add_abs(m, v);
    }
    for (; q < n; ++q) {
      s[0] += static_cast<double>(signs[q]) * p[q];
      m[0] += std::fabs(static_cast<double>(p[q]));
    }
    double a = 0, b = 0;
    for (int l = 0; l < 8; ++l) a += s[l], b += m[l];
    sum[i] = a, mag[i] = b;
  }
}

MOECERT_CLONES
void column_sides(const bf16* x, std::size_t ld, std::size_t rows, std::size_t n,
                  const float* const y[2], const float* const z[2], double* const side[2]) {
  using V16h = std::uint16_t __attribute__((vector_size(32)));
  using V16u = std::uint32_t __attribute__((vector_size(64)));
  std::size_t i = 0;
  for (; i + kProbeLanes <= n; i += kProbeLanes) {
    V16d d0 = {}, m0 = {}, d1 = {}, m1 = {};
    for (std::size_t t0 = 0; t0 < rows; t0 += kProbeSteps) {
      V16f fd0 = {}, fm0 = {}, fd1 = {}, fm1 = {};
      for (std::size_t t = t0; t < std::min(rows, t0 + kProbeSteps); ++t) {
        V16h h;
        std::memcpy(&h, x + t * ld + i, sizeof h);
        const V16u u = __builtin_convertvector(h, V16u) << 16;
        const V16f v = reinterpret_cast<V16f>(u), a = reinterpret_cast<V16f>(u & 0x7fffffff);
        fd0 += v * y[0][t], fm0 += a * z[0][t];
        fd1 += v * y[1][t], fm1 += a * z[1][t];
      }
      d0 += __builtin_convertvector(fd0, V16d), m0 += __builtin_convertvector(fm0, V16d);
      d1 += __builtin_convertvector(fd1, V16d), m1 += __builtin_convertvector(fm1, V16d);
    }
    for (std::size_t l = 0; l < kProbeLanes; ++l) {
      side[0][i + l] = d0[l], side[0][n + i + l] = m0[l];
      side[1][i + l] = d1[l], side[1][n + i + l] = m1[l];
    }
  }
  for (; i < n; ++i)  // the last n % 16 columns: the same sums, one column at a time
    for (std::size_t p = 0; p < 2; ++p) {
      double d = 0, m = 0;
      for (std::size_t t0 = 0; t0 < rows; t0 += kProbeSteps) {
        float fd = 0, fm = 0;
        for (std::size_t t = t0; t < std::min(rows, t0 + kProbeSteps); ++t) {
          const float v = x[t * ld + i].to_float();
          fd += v * y[p][t], fm += std::fabs(v) * z[p][t];
        }
        d += fd, m += fm;
      }
      side[p][i] = d, side[p][n + i] = m;
    }
  for (std::size_t p = 0; p < 2; ++p)
    for (i = 0; i < n; ++i) {
      if (std::isfinite(side[p][i]) && std::isfinite(side[p][n + i])) continue;
      double d = 0, m = 0;  // a sum left binary32's range: binary64
      for (std::size_t t = 0; t < rows; ++t) {
        const double v = x[t * ld + i].to_float();
        d += v * y[p][t], m += std::fabs(v) * z[p][t];
      }
      side[p][i] = d, side[p][n + i] = m;
    }
}

// Eight rows at a time in binary64 lanes, each lane's terms in column
// order from zero; the last rows % 8 rows in scalar code, in the same order.
MOECERT_CLONES
void signed_row_sums(const bf16* x, std::size_t ld, std::size_t rows, std::size_t n,
                     const float* signs, double* sum, double* mag) {
  std::size_t i = 0;
  for (; i + 8 <= rows; i += 8) {
    V8d s = {}, m = {};
    const bf16* p = x + i * ld;
    for (std::size_t q = 0; q < n; ++q) {
      const V8d v = {p[q].to_float(),          p[ld + q].to_float(),     p[2 * ld + q].to_float(),
                     p[3 * ld + q].to_float(), p[4 * ld + q].to_float(), p[5 * ld + q].to_float(),
                     p[6 * ld + q].to_float(), p[7 * ld + q].to_float()};
      s += static_cast<double>(signs[q]) * v;
      add_abs(m, v);
    }
    std::memcpy(sum + i, &s, sizeof s);
    std::memcpy(mag + i, &m, sizeof m);
  }
  for (; i < rows; ++i) {
    double s = 0, m = 0;
    for (std::size_t q = 0; q < n; ++q) {
      const double v = x[i * ld + q].to_float();
      s += static_cast<double>(signs[q]) * v;
      m += std::fabs(v);
    }
    sum[i] = s, mag[i] = m;
  }
}

MOECERT_CLONES
void signed_sums(const bf16* x, const float* r, std::size_t n, double& sum, double& mag) {
  constexpr std::size_t kL = 8;
  double s[kL] = {}, m[kL] = {};
  std::size_t k = 0;
  for (; k + kL <= n; k += kL)
    for (std::size_t l = 0; l < kL; ++l) {
      const double v = x[k + l].to_float();
      s[l] += r[k + l] * v;
      m[l] += std::fabs(v);
    }
  for (; k < n; ++k) {
    const double v = x[k].to_float();
    s[0] += r[k] * v;
    m[0] += std::fabs(v);
  }
  sum = mag = 0;
  for (std::size_t l = 0; l < kL; ++l) sum += s[l], mag += m[l];
}

// Width 4 (the narrow probes): a pair's 8 values in one binary64 vector,
// times the signs, then each k's four terms added to zero in column order
// (+0 first, so that a sum of zeros is +0 as in the scalar loop); other
// widths and an odd K's last k in scalar code, in the same order.
MOECERT_CLONES
void pair_sides(const bf16* x, std::size_t ld, std::size_t k, std::size_t width, const float* r,
                float* br, float* babs) {
  using V2d = double __attribute__((vector_size(16)));
  std::size_t kk = 0;
  if (width == 4) {
    const V8d sv = {r[0], r[0], r[1], r[1], r[2], r[2], r[3], r[3]};
    for (; kk + 2 <= k; kk += 2) {
      V8d v, m = {};
      load8(x + (kk / 2) * ld, v);
      add_abs(m, v);
      const V8d t = v * sv;
      V2d s = {}, a = __builtin_shufflevector(m, m, 0, 1);
      s += __builtin_shufflevector(t, t, 0, 1);
      s += __builtin_shufflevector(t, t, 2, 3), a += __builtin_shufflevector(m, m, 2, 3);
      s += __builtin_shufflevector(t, t, 4, 5), a += __builtin_shufflevector(m, m, 4, 5);
      s += __builtin_shufflevector(t, t, 6, 7), a += __builtin_shufflevector(m, m, 6, 7);
      br[kk] = static_cast<float>(s[0]), br[kk + 1] = static_cast<float>(s[1]);
      babs[kk] = static_cast<float>(a[0]), babs[kk + 1] = static_cast<float>(a[1]);
    }
  }
  for (; kk < k; ++kk) {
    const bf16* pair = x + (kk / 2) * ld + kk % 2;
    double sum = 0, mag = 0;
    for (std::size_t j = 0; j < width; ++j) {
      const double v = pair[2 * j].to_float();
      sum += v * r[j];
      mag += std::fabs(v);
    }
    br[kk] = static_cast<float>(sum), babs[kk] = static_cast<float>(mag);
  }
}

}  // namespace detail

MOECERT_CLONES
bool load_bf16(const bf16* p, std::size_t n, std::size_t run, std::size_t stride, float* row) {
  std::uint16_t denormal = 0;
  for (std::size_t k0 = 0; k0 < n; k0 += run, p += stride) {
    const std::size_t m = std::min(run, n - k0);
    for (std::size_t k = 0; k < m; ++k) {
      row[k0 + k] = p[k].to_float();
      denormal |=
          static_cast<std::uint16_t>(((p[k].bits & 0x7f80u) == 0) & ((p[k].bits & 0x7fu) != 0));
    }
  }
  return denormal != 0;
}

}  // namespace moecert::verify
