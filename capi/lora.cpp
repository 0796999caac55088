// The C ABI's fp32 inputs and bf16 outputs: LoRA factors given in fp32
// rounded to bf16 on moecert's threads (kept for the backward), and dx given
// as bf16 computed in fp32 scratch, then rounded.
#include <fmt/format.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include "capi/abi.hpp"

namespace moecert::capi {
namespace {

constexpr const char* kNames[6] = {"lora.a_gate", "lora.b_gate", "lora.a_up",
                                   "lora.b_up",   "lora.a_down", "lora.b_down"};

std::array<const moecert_tensor*, 6> descriptors(const moecert_lora& l) {
  return {&l.a_gate, &l.b_gate, &l.a_up, &l.b_up, &l.a_down, &l.b_down};
}

experts::Lora assemble(const std::array<MatView<const bf16>, 6>& v, std::size_t rank,
                       double alpha) {
  experts::Lora out;
  out.a_gate = v[0], out.b_gate = v[1], out.a_up = v[2], out.b_up = v[3], out.a_down = v[4],
  out.b_down = v[5];
  out.rank = rank, out.alpha = alpha;
  return out;
}

}  // namespace

bool LoraFactors::fp32(const moecert_lora* l) {
  if (!l || l->rank == 0) return false;
  if (l->rank < 0) throw InvalidArgument(fmt::format("lora: rank {}", l->rank));
  const auto d = descriptors(*l);
  const bool f32 = present(d[0]) && d[0]->dtype == MOECERT_F32;
  for (std::size_t i = 1; i < 6; ++i)
    if (present(d[i]) && (d[i]->dtype == MOECERT_F32) != f32)
      throw InvalidArgument(fmt::format("{}: dtype {}, the other factors' is {}", kNames[i],
                                        dtype_name(d[i]->dtype), dtype_name(d[0]->dtype)));
  return f32;
}

experts::Lora LoraFactors::forward(const moecert_lora* l) {
  if (!fp32(l)) return lora_of(l);
  const auto d = descriptors(*l);
  std::array<MatView<const float>, 6> in;
  std::size_t total = 0;
  for (std::size_t i = 0; i < 6; ++i)
    in[i] = mat<const float>(d[i], kNames[i]), total += in[i].rows * in[i].cols;
  data_.resize(total);
  std::array<MatView<const bf16>, 6> out;
  std::size_t at = 0;
  for (std::size_t i = 0; i < 6; ++i) {
    const MatView<const float> src = in[i];
    bf16* dst = data_.data() + at;
    oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, src.rows),
                              [&](const auto& r) {
                                for (std::size_t row = r.begin(); row < r.end(); ++row)
                                  for (std::size_t c = 0; c < src.cols; ++c)
                                    dst[row * src.cols + c] = bf16(src(row, c));
                              });
    out[i] = {dst, src.rows, src.cols};
    sources_[i] = {d[i]->data, d[i]->shape[0], d[i]->shape[1]};
    at += src.rows * src.cols;
  }
  views_ = out, rank_ = static_cast<std::size_t>(l->rank), alpha_ = l->alpha, held_ = true;
  return assemble(views_, rank_, alpha_);
}

experts::Lora LoraFactors::again(const moecert_lora* l) const {
  if (!fp32(l)) return lora_of(l);
  const auto d = descriptors(*l);
  for (std::size_t i = 0; i < 6; ++i) {
    check_descriptor(*d[i], MOECERT_F32, 2, kNames[i]);
    const Source s{d[i]->data, d[i]->shape[0], d[i]->shape[1]};
    if (!held_ || s.data != sources_[i].data || s.rows != sources_[i].rows ||
        s.cols != sources_[i].cols)
      throw InvalidArgument(
          fmt::format("{}: fp32 factors other than the forward's (their bf16 rounding is kept "
                      "from the forward)",
                      kNames[i]));
  }
  if (static_cast<std::size_t>(l->rank) != rank_ || l->alpha != alpha_)
    throw InvalidArgument(fmt::format("lora: r={} alpha={}, the forward's r={} alpha={}", l->rank,
                                      l->alpha, rank_, alpha_));
  return assemble(views_, rank_, alpha_);
}

MatView<float> RoundedDx::bind(const moecert_tensor* t, const char* name) {
  out_ = {};
  if (!present(t) || t->dtype != MOECERT_BF16) return mat<float>(t, name, false);
  out_ = mat<bf16>(t, name);
  scratch_.resize(out_.rows * out_.cols);
  return {scratch_.data(), out_.rows, out_.cols};
}

void RoundedDx::finish() const {
  if (!out_.data) return;
  const MatView<bf16> out = out_;
  const float* src = scratch_.data();
  oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, out.rows),
                            [&](const auto& r) {
                              for (std::size_t row = r.begin(); row < r.end(); ++row)
                                for (std::size_t c = 0; c < out.cols; ++c)
                                  out(row, c) = bf16(src[row * out.cols + c]);
                            });
}

}  // namespace moecert::capi
