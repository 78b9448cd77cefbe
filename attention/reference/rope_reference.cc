// Naive fp64 RoPE (attention/reference/rope_reference.h).
#include "attention/reference/rope_reference.h"

#include <cmath>
#include <numbers>

#include "runtime/error.h"

namespace seqpar::attn::reference {
namespace {

constexpr double kTwoPi = 2 * std::numbers::pi;

// The rotated columns of pair i: (first, second).
struct Pair {
  std::int64_t first, second;
};

std::vector<Pair> pairs_of(const RopeConfig& cfg, std::int64_t r) {
  std::vector<Pair> p;
  for (std::int64_t i = 0; i < r / 2; ++i) {
    if (cfg.pairing == RopePairing::kInterleaved) {
      p.push_back({cfg.column_offset + 2 * i, cfg.column_offset + 2 * i + 1});
    } else {
      p.push_back({cfg.column_offset + i, cfg.column_offset + r / 2 + i});
    }
  }
  return p;
}

// Applies the per-pair 2x2 matrix [[c, -s], [s, c]] (transpose: [[c, s], [-s, c]]) to every row.
void apply(const RopeConfig& cfg, std::span<const std::int64_t> positions, const TensorView& in, const TensorView& out,
           bool transpose) {
  SEQPAR_CHECK(in.dtype() == DType::kFloat64 && out.dtype() == DType::kFloat64, "reference rope: fp64 tensors only");
  SEQPAR_CHECK(in.shape() == out.shape(), "reference rope: shapes differ");
  SEQPAR_CHECK(in.ndim() == 3 || in.ndim() == 4, "reference rope: x must be 3-d or 4-d");
  const std::int64_t b = in.dim(0), s = in.dim(1), d = in.dim(in.ndim() - 1);
  const std::int64_t rows_per_token = in.numel() / (b * s * d);
  SEQPAR_CHECK(static_cast<std::int64_t>(positions.size()) == s, "reference rope: positions size");
  const std::int64_t r = cfg.rotary_dim > 0 ? cfg.rotary_dim : d - cfg.column_offset;
  SEQPAR_CHECK(cfg.column_offset >= 0 && cfg.column_offset + r <= d && r % 2 == 0, "reference rope: bad window");
  const std::vector<Pair> pairs = pairs_of(cfg, r);
  const std::vector<double> f = r > 0 ? reference::rope_inv_freq(cfg, r) : std::vector<double>{};
  const double m = reference::rope_attention_factor(cfg);
  const double* x = in.data_as<double>();
  double* y = out.data_as<double>();
  for (std::int64_t bi = 0; bi < b; ++bi) {
    for (std::int64_t t = 0; t < s; ++t) {
      for (std::int64_t h = 0; h < rows_per_token; ++h) {
        const std::int64_t row = ((bi * s + t) * rows_per_token + h) * d;
        for (std::int64_t c = 0; c < d; ++c) y[row + c] = x[row + c];
        for (std::size_t i = 0; i < pairs.size(); ++i) {
          const double angle = static_cast<double>(positions[t]) * f[i];
          const double co = m * std::cos(angle), si = (transpose ? -m : m) * std::sin(angle);
          const double a = x[row + pairs[i].first], c2 = x[row + pairs[i].second];
          y[row + pairs[i].first] = co * a - si * c2;
          y[row + pairs[i].second] = si * a + co * c2;
        }
      }
    }
  }
}

}  // namespace

std::vector<double> rope_inv_freq(const RopeConfig& cfg, std::int64_t rotary_dim) {
  const std::int64_t n = rotary_dim / 2;
  std::vector<double> f(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    // theta^(-2i/r) as 1 / theta^(2i/r), the form of HF's `1.0 / (base ** (arange(0, dim, 2) / dim))`.
    f[i] = 1.0 / std::pow(cfg.theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim));
  }
  if (cfg.scaling == RopeScaling::kLlama3) {
    const RopeLlama3Params& p = cfg.llama3;
    const double old_len = static_cast<double>(p.original_max_position_embeddings);
    for (double& v : f) {
      const double wavelen = kTwoPi / v;
      if (wavelen > old_len / p.low_freq_factor) {
        v /= p.factor;  // low frequencies: interpolated
      } else if (wavelen >= old_len / p.high_freq_factor) {
        // medium: smooth blend between interpolation and extrapolation
        const double smooth = (old_len / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor);
        v = (1.0 - smooth) * (v / p.factor) + smooth * v;
      }
    }
  } else if (cfg.scaling == RopeScaling::kYarn) {
    const RopeYarnParams& p = cfg.yarn;
    const double old_len = static_cast<double>(p.original_max_position_embeddings);
    // The (fractional) pair index whose wavelength fits `rotations` times into the original context, as a column
    // index: theta^(2 d / r) = L / (2 pi rotations)  =>  d = (r / 2) log_theta(L / (2 pi rotations)).
    auto dim_of = [&](double rotations) {
      return 0.5 * static_cast<double>(rotary_dim) * std::log(old_len / (kTwoPi * rotations)) / std::log(cfg.theta);
    };
    double low = std::floor(dim_of(p.beta_fast)), high = std::ceil(dim_of(p.beta_slow));
    if (low < 0) low = 0;
    if (high > static_cast<double>(rotary_dim - 1)) high = static_cast<double>(rotary_dim - 1);
    if (low == high) high += 0.001;
    for (std::int64_t i = 0; i < n; ++i) {
      double ramp = (static_cast<double>(i) - low) / (high - low);
      ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
      const double extrapolation = f[i], interpolation = f[i] / p.factor;
      f[i] = interpolation * ramp + extrapolation * (1.0 - ramp);
    }
  }
  return f;
}

double rope_attention_factor(const RopeConfig& cfg) {
  if (cfg.scaling != RopeScaling::kYarn) return 1.0;
  const RopeYarnParams& p = cfg.yarn;
  if (p.attention_factor > 0) return p.attention_factor;
  auto get_mscale = [&](double c) { return p.factor <= 1 ? 1.0 : 1.0 + 0.1 * c * std::log(p.factor); };
  if (p.mscale > 0 && p.mscale_all_dim > 0) return get_mscale(p.mscale) / get_mscale(p.mscale_all_dim);
  return get_mscale(1.0);
}

void rope_forward(const RopeConfig& cfg, std::span<const std::int64_t> positions, const TensorView& x,
                  const TensorView& y) {
  apply(cfg, positions, x, y, false);
}

void rope_backward(const RopeConfig& cfg, std::span<const std::int64_t> positions, const TensorView& dy,
                   const TensorView& dx) {
  apply(cfg, positions, dy, dx, true);
}

}  // namespace seqpar::attn::reference
