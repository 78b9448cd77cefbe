// Rotary position embedding (RoFormer, Su et al. 2021) on global positions, with the pairings and frequency scalings
// of the models sp_bench presets.
//
// Columns. Of the head dim D, the r = rotary_dim columns [o, o + r) rotate (o = column_offset); the others pass
// through unchanged. Partial rotary (Qwen3-Next's partial_rotary_factor 0.25 of D = 256: r = 64, o = 0) and DSA's
// rope columns of the 576-wide latent (r = 64, o = 512) are both such a window. Within it there are r/2 pairs; pair
// i (i in [0, r/2)) has the inverse frequency f_i below and
//   rotate-half (GPT-NeoX / Llama / HF `rotate_half`):  columns (o + i, o + i + r/2)
//   interleaved (GPT-J / DeepSeek `view_as_complex`):   columns (o + 2i, o + 2i + 1)
// and the pair (a, b) becomes, with angle = pos * f_i and m the attention factor below,
//   a' = m (a cos(angle) - b sin(angle)),   b' = m (b cos(angle) + a sin(angle)).
// The backward is the transpose: dx = m R(-angle) dy (for m = 1, R^T R = I).
//
// Frequencies. Base: f_i = theta^(-2i/r) (the exponent counts the rotated columns r, as HF's partial rotary does).
// Scalings (each as in HF transformers' modeling_rope_utils, which follows the models' own code):
//   llama3 (Meta's Llama 3.1 reference `apply_scaling`; HF `_compute_llama3_parameters`): with L the original
//     context (original_max_position_embeddings), wavelength w_i = 2 pi / f_i, w_lo = L / low_freq_factor and
//     w_hi = L / high_freq_factor:
//       w_i < w_hi: f_i;   w_i > w_lo: f_i / factor;
//       otherwise: (1 - s) f_i / factor + s f_i  with  s = (L / w_i - low_freq_factor) / (high_freq_factor -
//       low_freq_factor).
//   yarn (YaRN, Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models"; HF
//     `_compute_yarn_parameters`, DeepSeek-V3's `precompute_freqs_cis`): the correction dimension of n rotations
//     d(n) = r ln(L / (2 pi n)) / (2 ln theta); lo = max(floor(d(beta_fast)), 0), hi = min(ceil(d(beta_slow)),
//     r - 1) (hi += 0.001 when equal); the ramp g_i = clamp((i - lo) / (hi - lo), 0, 1) over the pairs; then
//       f_i = (f_i / factor) g_i + f_i (1 - g_i)
//     (high frequencies, g = 0, keep f_i; low ones are interpolated by `factor`).
// Attention factor m (YaRN's temperature, applied to cos and sin as HF does, so that q.k scales by m^2): 1 for none
// and llama3; for yarn `attention_factor` when > 0, else with mscale(s, c) = 0.1 c ln(s) + 1 (1 when s <= 1):
//   mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both mscale and mscale_all_dim are > 0
//   (DeepSeek-V3's config: both 1, so m = 1; DeepSeek instead multiplies its softmax scale by
//   mscale(factor, mscale_all_dim)^2 — rope_softmax_scale_factor — which is the caller's to apply), else
//   mscale(factor, 1) = 0.1 ln(factor) + 1 (the paper's sqrt(1/t)).
//
// Under sequence parallelism the positions are the layout's global positions of the local tokens, so a zigzag or
// stripe shard gets the same rotation as the corresponding rows of the full sequence.
//
// x, dy: [B, S, H, D] or [B, S, D] (one head, e.g. DSA's latent and index keys), any floating dtype, rotated in
// place; positions: [S] int64 (any values >= 0). Angles and cos/sin are computed in fp64 and applied in fp32 (fp64
// for fp64 tensors). Host-synchronous.
// Errors (Error naming the value and the rule): x not a 3-d or 4-d host tensor of a floating dtype, positions size
// != S, theta not positive and finite, rotary_dim odd or negative, column_offset negative, column_offset +
// rotary_dim > D, a scaling's parameters out of range (llama3: factor >= 1, 0 < low_freq_factor < high_freq_factor,
// original_max_position_embeddings >= 1; yarn: factor >= 1, original_max_position_embeddings >= 1, beta_fast >
// beta_slow > 0, attention_factor, mscale, mscale_all_dim >= 0 and finite). RoPE has no CUDA implementation yet: a
// device tensor is an error. check_rope raises the same errors alone.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../runtime/tensor.h"

namespace seqpar::attn {

inline constexpr double kDefaultRopeTheta = 10000.0;

enum class RopePairing { kRotateHalf, kInterleaved };
enum class RopeScaling { kNone, kLlama3, kYarn };

// Llama 3.1's values (Meta-Llama-3.1-8B config.json rope_scaling).
struct RopeLlama3Params {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  std::int64_t original_max_position_embeddings = 8192;
};

// DeepSeek-V3's values (config.json rope_scaling) except factor, which defaults to 1 (no interpolation).
struct RopeYarnParams {
  double factor = 1.0;
  std::int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double attention_factor = 0.0;  // > 0: m itself; 0: from mscale / mscale_all_dim as above
  double mscale = 0.0;            // 0: unset
  double mscale_all_dim = 0.0;    // 0: unset
};

struct RopeConfig {
  RopePairing pairing = RopePairing::kRotateHalf;
  std::int64_t rotary_dim = 0;     // r; 0: every column from column_offset to D
  std::int64_t column_offset = 0;  // o: the first rotated column
  double theta = kDefaultRopeTheta;
  RopeScaling scaling = RopeScaling::kNone;
  RopeLlama3Params llama3;
  RopeYarnParams yarn;
};

// "rotate-half" / "interleaved"; "none" / "llama3" / "yarn". The parsers throw Error listing the accepted names.
std::string rope_pairing_name(RopePairing p);
RopePairing parse_rope_pairing(const std::string& name);
std::string rope_scaling_name(RopeScaling s);
RopeScaling parse_rope_scaling(const std::string& name);

// The parameter checks of `cfg` alone (theta, rotary_dim even and >= 0, column_offset >= 0, the scaling's
// parameters); the shape rules need a tensor (check_rope).
void check_rope_config(const RopeConfig& cfg);

// The r/2 inverse frequencies f_i (radians per position) of `cfg` for r = `rotary_dim` (> 0, even), scaling
// included. Errors: those of check_rope_config, rotary_dim odd or < 2.
std::vector<double> rope_inv_freq(const RopeConfig& cfg, std::int64_t rotary_dim);
// The attention factor m that multiplies cos and sin (1 unless yarn). Errors: those of check_rope_config.
double rope_attention_factor(const RopeConfig& cfg);
// DeepSeek's factor on the softmax scale: mscale(factor, mscale_all_dim)^2 for yarn with mscale_all_dim > 0, else 1.
double rope_softmax_scale_factor(const RopeConfig& cfg);

// The checks of rope_forward / rope_backward, without the work.
void check_rope(const TensorView& x, std::span<const std::int64_t> positions, const RopeConfig& cfg);
void rope_forward(const TensorView& x, std::span<const std::int64_t> positions, const RopeConfig& cfg);
// dx = m R(pos)^T dy, in place on `dy`.
void rope_backward(const TensorView& dy, std::span<const std::int64_t> positions, const RopeConfig& cfg);

// The plain rotate-half RoPE over the whole head dim with base `theta` (RopeConfig{.theta = theta}).
void check_rope(const TensorView& x, std::span<const std::int64_t> positions, double theta = kDefaultRopeTheta);
void rope_forward(const TensorView& x, std::span<const std::int64_t> positions, double theta = kDefaultRopeTheta);
void rope_backward(const TensorView& dy, std::span<const std::int64_t> positions, double theta = kDefaultRopeTheta);

}  // namespace seqpar::attn
