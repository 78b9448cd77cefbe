// Public boundary of RoPE: the frequency tables (base, llama3, YaRN), argument validation (RopeConfig::validate)
// and dispatch to the CPU kernel in cpu/ (or, for a CUDA tensor, the launch of cuda/rope_kernels.h).
#include "attention/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "attention/boundary.h"
#include "attention/cpu/rope_cpu.h"
#if defined(SEQPAR_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "attention/cuda/rope_kernels.h"
#include "runtime/cuda_check.h"
#include "runtime/tensor_ops.h"
#endif
#include "runtime/error.h"

namespace seqpar::attn {
namespace {

bool finite_positive(double v) { return std::isfinite(v) && v > 0; }
bool finite_non_negative(double v) { return std::isfinite(v) && v >= 0; }

// YaRN's temperature term: 0.1 c ln(s) + 1, or 1 when s <= 1.
double yarn_mscale(double s, double c) { return s <= 1 ? 1.0 : 0.1 * c * std::log(s) + 1.0; }

// f_i for a llama3-scaled wavelength band (rope.h).
double llama3_scaled(double f, const RopeLlama3Params& p) {
  const double len = static_cast<double>(p.original_max_position_embeddings);
  const double wavelen = 2 * std::numbers::pi / f;
  if (wavelen < len / p.high_freq_factor) return f;
  if (wavelen > len / p.low_freq_factor) return f / p.factor;
  const double s = (len / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor);
  return (1 - s) * f / p.factor + s * f;
}

// The YaRN ramp g_i over the r/2 pairs (rope.h), applied to the base frequencies in place.
void yarn_scale(std::vector<double>& f, double theta, std::int64_t r, const RopeYarnParams& p) {
  const double len = static_cast<double>(p.original_max_position_embeddings), dim = static_cast<double>(r);
  auto correction_dim = [&](double rotations) {
    return dim * std::log(len / (rotations * 2 * std::numbers::pi)) / (2 * std::log(theta));
  };
  const double lo = std::max(std::floor(correction_dim(p.beta_fast)), 0.0);
  double hi = std::min(std::ceil(correction_dim(p.beta_slow)), dim - 1);
  if (hi == lo) hi += 0.001;
  for (std::size_t i = 0; i < f.size(); ++i) {
    const double g = std::clamp((static_cast<double>(i) - lo) / (hi - lo), 0.0, 1.0);
    f[i] = f[i] / p.factor * g + f[i] * (1 - g);
  }
}

// Shape rules on top of RopeConfig::validate(); returns the resolved rotary dim.
std::int64_t check_shapes(const TensorView& x, std::span<const std::int64_t> positions, const RopeConfig& cfg,
                          const char* op) {
#if defined(SEQPAR_WITH_CUDA)
  if (x.device().is_cuda()) {  // the CUDA launch (cuda/rope_kernels.h)
    SEQPAR_CHECK(x.numel() == 0 || x.data() != nullptr, op, ": x ", x.str(), " has no data");
    SEQPAR_CHECK(is_floating(x.dtype()), op, ": x has dtype ", dtype_name(x.dtype()),
                 ", expected a floating dtype (fp32, bf16, fp16 or fp64)");
  } else {
    detail::check_floating(x, str_cat(op, ": x").c_str(), "RoPE");
  }
#else
  detail::check_floating(x, str_cat(op, ": x").c_str(), "RoPE");
#endif
  SEQPAR_CHECK(x.ndim() == 4 || x.ndim() == 3, op, ": x ", x.str(), " must be [B, S, H, D] or [B, S, D]");
  SEQPAR_CHECK(static_cast<std::int64_t>(positions.size()) == x.dim(1), op, ": ", positions.size(),
               " positions for a sequence of ", x.dim(1));
  cfg.validate();
  const std::int64_t d = x.dim(x.ndim() - 1);
  if (cfg.rotary_dim == 0) {
    SEQPAR_CHECK(cfg.column_offset <= d, op, ": column_offset ", cfg.column_offset, " is beyond the head dim ", d);
    SEQPAR_CHECK((d - cfg.column_offset) % 2 == 0, op, ": head dim ", d, " must be even (minus column_offset ",
                 cfg.column_offset, ": rotary_dim 0 rotates every column from there)");
    return d - cfg.column_offset;
  }
  SEQPAR_CHECK(cfg.column_offset + cfg.rotary_dim <= d, op, ": rotary_dim ", cfg.rotary_dim, " at column_offset ",
               cfg.column_offset, " exceeds the head dim ", d);
  return cfg.rotary_dim;
}

#if defined(SEQPAR_WITH_CUDA)
// The rotation of cpu::rope_rotate_cpu on a CUDA tensor: cos and sin per (position, pair) computed here in fp64 as
// the CPU kernel does (m cos(angle), m sign sin(angle), rounded to the accumulator dtype: fp64 for fp64 x, else
// fp32) and copied to the device; a bf16 / fp16 x converted to fp32 on the device and back (one rounding, as the
// CPU's); one thread per (row, pair) runs the pair body the CPU kernel runs (cuda/rope_kernels.h). Host-synchronous
// on the device's default stream. Never run on a GPU.
template <typename Acc>
void rotate_cuda_as(const TensorView& x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t dim,
                    std::span<const std::int64_t> positions, const cpu::RopeRotation& rot, DType acc) {
  const Stream stream{x.device(), nullptr};
  const std::int64_t half = static_cast<std::int64_t>(rot.inv_freq.size()), n = seq * half;
  std::vector<Acc> table(static_cast<std::size_t>(2 * n));  // cos [seq, half], then sin
  for (std::int64_t s = 0; s < seq; ++s) {
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(positions[static_cast<std::size_t>(s)]) * rot.inv_freq[i];
      table[static_cast<std::size_t>(s * half + i)] = static_cast<Acc>(rot.attention_factor * std::cos(angle));
      table[static_cast<std::size_t>(n + s * half + i)] =
          static_cast<Acc>(rot.attention_factor * rot.sign * std::sin(angle));
    }
  }
  Tensor cs = Tensor::empty({2 * n}, acc, MemCategory::kWorkspace, x.device());
  copy_convert(TensorView(table.data(), acc, {2 * n}), cs.view(), stream);
  Tensor wide;
  TensorView xa = x;
  if (x.dtype() != acc) {
    wide = Tensor::copy_of(x, acc, MemCategory::kWorkspace, stream);
    xa = wide.view();
  }
  cuda::RopeRowsParams p;
  p.x = xa.data();
  p.cos_t = cs.data_as<Acc>();
  p.sin_t = cs.data_as<Acc>() + n;
  p.fp64 = acc == DType::kFloat64;
  p.rows = batch * seq * heads;
  p.seq = seq;
  p.heads = heads;
  p.dim = dim;
  p.half = half;
  p.offset = rot.column_offset;
  p.interleaved = rot.interleaved;
  cuda::rope_rotate_rows(p, nullptr);
  if (x.dtype() != acc) copy_convert(xa, x, stream);
  SEQPAR_CHECK_CUDA(cudaStreamSynchronize(nullptr));  // cs and wide are freed on return
}

void rotate_cuda(const TensorView& x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t dim,
                 std::span<const std::int64_t> positions, const cpu::RopeRotation& rot) {
  SEQPAR_CHECK_CUDA(cudaSetDevice(x.device().index));
  if (x.dtype() == DType::kFloat64) {
    rotate_cuda_as<double>(x, batch, seq, heads, dim, positions, rot, DType::kFloat64);
  } else {
    rotate_cuda_as<float>(x, batch, seq, heads, dim, positions, rot, DType::kFloat32);
  }
}
#endif

void rotate(const TensorView& x, std::span<const std::int64_t> positions, const RopeConfig& cfg, const char* op,
            double sign) {
  const std::int64_t r = check_shapes(x, positions, cfg, op);
  if (r == 0) return;
  const std::vector<double> inv_freq = rope_inv_freq(cfg, r);
  const std::int64_t heads = x.ndim() == 4 ? x.dim(2) : 1;
  const cpu::RopeRotation rot{cfg.pairing == RopePairing::kInterleaved, cfg.column_offset, inv_freq,
                              rope_attention_factor(cfg), sign};
#if defined(SEQPAR_WITH_CUDA)
  if (x.device().is_cuda()) return rotate_cuda(x, x.dim(0), x.dim(1), heads, x.dim(x.ndim() - 1), positions, rot);
#endif
  cpu::rope_rotate_cpu(x, x.dim(0), x.dim(1), heads, x.dim(x.ndim() - 1), positions, rot);
}

RopeConfig plain(double theta) {
  RopeConfig c;
  c.theta = theta;
  return c;
}

}  // namespace

std::string rope_pairing_name(RopePairing p) { return p == RopePairing::kInterleaved ? "interleaved" : "rotate-half"; }

RopePairing parse_rope_pairing(const std::string& name) {
  if (name == "rotate-half") return RopePairing::kRotateHalf;
  if (name == "interleaved") return RopePairing::kInterleaved;
  SEQPAR_THROW("RoPE pairing '", name, "' is not one of rotate-half, interleaved");
}

std::string rope_scaling_name(RopeScaling s) {
  switch (s) {
    case RopeScaling::kLlama3: return "llama3";
    case RopeScaling::kYarn: return "yarn";
    case RopeScaling::kNone: break;
  }
  return "none";
}

RopeScaling parse_rope_scaling(const std::string& name) {
  if (name == "none") return RopeScaling::kNone;
  if (name == "llama3") return RopeScaling::kLlama3;
  if (name == "yarn") return RopeScaling::kYarn;
  SEQPAR_THROW("RoPE scaling '", name, "' is not one of none, llama3, yarn");
}

void RopeConfig::validate() const {
  const RopeConfig& cfg = *this;
  SEQPAR_CHECK(finite_positive(cfg.theta), "rope: theta ", cfg.theta, " must be positive and finite");
  SEQPAR_CHECK(cfg.rotary_dim >= 0 && cfg.rotary_dim % 2 == 0, "rope: rotary_dim ", cfg.rotary_dim,
               " must be even and >= 0 (0: the whole head dim)");
  SEQPAR_CHECK(cfg.column_offset >= 0, "rope: column_offset ", cfg.column_offset, " must be >= 0");
  if (cfg.scaling == RopeScaling::kLlama3) {
    const RopeLlama3Params& p = cfg.llama3;
    SEQPAR_CHECK(std::isfinite(p.factor) && p.factor >= 1, "rope llama3: factor ", p.factor, " must be >= 1");
    SEQPAR_CHECK(finite_positive(p.low_freq_factor) && std::isfinite(p.high_freq_factor) &&
                     p.low_freq_factor < p.high_freq_factor,
                 "rope llama3: low_freq_factor ", p.low_freq_factor, " and high_freq_factor ", p.high_freq_factor,
                 " must satisfy 0 < low_freq_factor < high_freq_factor");
    SEQPAR_CHECK(p.original_max_position_embeddings >= 1, "rope llama3: original_max_position_embeddings ",
                 p.original_max_position_embeddings, " must be >= 1");
  } else if (cfg.scaling == RopeScaling::kYarn) {
    const RopeYarnParams& p = cfg.yarn;
    SEQPAR_CHECK(std::isfinite(p.factor) && p.factor >= 1, "rope yarn: factor ", p.factor, " must be >= 1");
    SEQPAR_CHECK(p.original_max_position_embeddings >= 1, "rope yarn: original_max_position_embeddings ",
                 p.original_max_position_embeddings, " must be >= 1");
    SEQPAR_CHECK(finite_positive(p.beta_slow) && std::isfinite(p.beta_fast) && p.beta_fast > p.beta_slow,
                 "rope yarn: beta_fast ", p.beta_fast, " and beta_slow ", p.beta_slow,
                 " must satisfy beta_fast > beta_slow > 0");
    SEQPAR_CHECK(finite_non_negative(p.attention_factor) && finite_non_negative(p.mscale) &&
                     finite_non_negative(p.mscale_all_dim),
                 "rope yarn: attention_factor ", p.attention_factor, ", mscale ", p.mscale, " and mscale_all_dim ",
                 p.mscale_all_dim, " must be finite and >= 0 (0: unset)");
  }
}

std::vector<double> rope_inv_freq(const RopeConfig& cfg, std::int64_t rotary_dim) {
  cfg.validate();
  SEQPAR_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0, "rope: rotary_dim ", rotary_dim, " must be even and >= 2");
  std::vector<double> f(static_cast<std::size_t>(rotary_dim / 2));
  for (std::size_t i = 0; i < f.size(); ++i) {
    f[i] = std::pow(cfg.theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
  }
  if (cfg.scaling == RopeScaling::kLlama3) {
    for (double& v : f) v = llama3_scaled(v, cfg.llama3);
  } else if (cfg.scaling == RopeScaling::kYarn) {
    yarn_scale(f, cfg.theta, rotary_dim, cfg.yarn);
  }
  return f;
}

double rope_attention_factor(const RopeConfig& cfg) {
  cfg.validate();
  if (cfg.scaling != RopeScaling::kYarn) return 1.0;
  const RopeYarnParams& p = cfg.yarn;
  if (p.attention_factor > 0) return p.attention_factor;
  if (p.mscale > 0 && p.mscale_all_dim > 0) {
    return yarn_mscale(p.factor, p.mscale) / yarn_mscale(p.factor, p.mscale_all_dim);
  }
  return yarn_mscale(p.factor, 1.0);
}

double rope_softmax_scale_factor(const RopeConfig& cfg) {
  cfg.validate();
  if (cfg.scaling != RopeScaling::kYarn || cfg.yarn.mscale_all_dim <= 0) return 1.0;
  const double m = yarn_mscale(cfg.yarn.factor, cfg.yarn.mscale_all_dim);
  return m * m;
}

void RopeConfig::validate(const TensorView& x, std::span<const std::int64_t> positions) const {
  check_shapes(x, positions, *this, "rope");
}

void rope_forward(const TensorView& x, std::span<const std::int64_t> positions, const RopeConfig& cfg) {
  rotate(x, positions, cfg, "rope_forward", 1.0);
}

void rope_backward(const TensorView& dy, std::span<const std::int64_t> positions, const RopeConfig& cfg) {
  rotate(dy, positions, cfg, "rope_backward", -1.0);
}

void rope_forward(const TensorView& x, std::span<const std::int64_t> positions, double theta) {
  rope_forward(x, positions, plain(theta));
}
void rope_backward(const TensorView& dy, std::span<const std::int64_t> positions, double theta) {
  rope_backward(dy, positions, plain(theta));
}

}  // namespace seqpar::attn
