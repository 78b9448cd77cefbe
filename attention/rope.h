// Rotary position embedding (RoFormer, Su et al. 2021) on global positions, with the pairings (rotate-half,
// interleaved) and frequency scalings (llama3, YaRN) of the models sp_bench presets.
// Math: docs/design.md, "RoPE" (the rotation, the partial-rotary column window, the llama3 and YaRN frequencies and
// the attention factor, each as in HF transformers' modeling_rope_utils).
//
// x, dy: [B, S, H, D] or [B, S, D] (one head), any floating dtype, rotated in place; positions [S] int64 >= 0 (a
// layout's global positions, so a shard is rotated as the same rows of the full sequence). Angles in fp64, applied
// in fp32 (fp64 for fp64 tensors). Host-synchronous.
// Errors: Error naming the value and the rule (shape, positions size, theta, rotary_dim, column_offset, the scaling's
// parameters); device tensors are refused. RopeConfig::validate raises the same errors alone.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "runtime/tensor.h"

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

  // The parameter checks alone (theta, rotary_dim even and >= 0, column_offset >= 0, the scaling's parameters).
  void validate() const;
  // Every check rope_forward / rope_backward makes on (x, positions, this), no work.
  void validate(const TensorView& x, std::span<const std::int64_t> positions) const;
};

// "rotate-half" / "interleaved"; "none" / "llama3" / "yarn". The parsers throw Error listing the accepted names.
std::string rope_pairing_name(RopePairing p);
RopePairing parse_rope_pairing(const std::string& name);
std::string rope_scaling_name(RopeScaling s);
RopeScaling parse_rope_scaling(const std::string& name);

// The r/2 inverse frequencies f_i (radians per position) of `cfg` for r = `rotary_dim` (> 0, even), scaling
// included. Errors: those of RopeConfig::validate, rotary_dim odd or < 2.
std::vector<double> rope_inv_freq(const RopeConfig& cfg, std::int64_t rotary_dim);
// The attention factor m that multiplies cos and sin (1 unless yarn). Errors: those of RopeConfig::validate.
double rope_attention_factor(const RopeConfig& cfg);
// DeepSeek's factor on the softmax scale: mscale(factor, mscale_all_dim)^2 for yarn with mscale_all_dim > 0, else 1.
double rope_softmax_scale_factor(const RopeConfig& cfg);

void rope_forward(const TensorView& x, std::span<const std::int64_t> positions, const RopeConfig& cfg);
// dx = m R(pos)^T dy, in place on `dy`.
void rope_backward(const TensorView& dy, std::span<const std::int64_t> positions, const RopeConfig& cfg);

// The plain rotate-half RoPE over the whole head dim with base `theta` (RopeConfig{.theta = theta}).
void rope_forward(const TensorView& x, std::span<const std::int64_t> positions, double theta = kDefaultRopeTheta);
void rope_backward(const TensorView& dy, std::span<const std::int64_t> positions, double theta = kDefaultRopeTheta);

}  // namespace seqpar::attn
