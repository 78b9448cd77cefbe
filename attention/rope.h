// Rotary position embedding (RoFormer, Su et al. 2021) on global positions, with the pairings (rotate-half,
// interleaved) and frequency scalings (llama3, YaRN) of the models sp_bench presets.
// Math: docs/design.md, "RoPE" (the rotation, the partial-rotary column window, the llama3 and YaRN frequencies and
// the attention factor, each as in HF transformers' modeling_rope_utils).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../runtime/tensor.h"

namespace seqpar::attn {

inline constexpr double kDefaultRopeTheta = 10000.0;

// Which columns a rotation pairs (docs/design.md, "RoPE").
enum class RopePairing { kRotateHalf, kInterleaved };
// The frequency scaling (docs/design.md, "RoPE").
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

// One RoPE: pairing, rotated column window, base, scaling.
struct RopeConfig {
  RopePairing pairing = RopePairing::kRotateHalf;
  std::int64_t rotary_dim = 0;     // r; 0: every column from column_offset to D
  std::int64_t column_offset = 0;  // o: the first rotated column
  double theta = kDefaultRopeTheta;
  RopeScaling scaling = RopeScaling::kNone;
  RopeLlama3Params llama3;
  RopeYarnParams yarn;

  // The parameter checks alone, no work.
  // Errors: Error naming the value and the rule: theta, rotary_dim even and >= 0, column_offset >= 0, the
  //   scaling's parameters.
  // Sync: host-only.
  void validate() const;

  // Every check rope_forward / rope_backward makes on (x, positions, this), no work.
  // Errors: those of validate(), and x's shape, positions size, device tensors.
  // Sync: host-only.
  void validate(const TensorView& x, std::span<const std::int64_t> positions) const;
};

// Names of pairings ("rotate-half" / "interleaved") and scalings ("none" / "llama3" / "yarn"), and their parsers.
// Errors: the parsers, for another name (the message lists the accepted names).
// Sync: host-only.
std::string rope_pairing_name(RopePairing p);
RopePairing parse_rope_pairing(const std::string& name);
std::string rope_scaling_name(RopeScaling s);
RopeScaling parse_rope_scaling(const std::string& name);

// The inverse frequencies of `cfg`, scaling included.
// Args: rotary_dim: r (> 0, even).
// Returns: the r/2 inverse frequencies f_i, radians per position.
// Errors: those of RopeConfig::validate; rotary_dim odd or < 2.
// Sync: host-only.
std::vector<double> rope_inv_freq(const RopeConfig& cfg, std::int64_t rotary_dim);

// The attention factor m that multiplies cos and sin.
// Returns: m; 1 unless yarn.
// Errors: those of RopeConfig::validate.
// Sync: host-only.
double rope_attention_factor(const RopeConfig& cfg);

// DeepSeek's factor on the softmax scale.
// Returns: mscale(factor, mscale_all_dim)^2 for yarn with mscale_all_dim > 0, else 1.
// Sync: host-only.
double rope_softmax_scale_factor(const RopeConfig& cfg);

// Rotates x in place (forward); backward: dx = m R(pos)^T dy, in place on `dy`. Math: docs/design.md, "RoPE".
// Args: x, dy [B, S, H, D] or [B, S, D] (one head), any floating dtype; positions [S] int64 >= 0 (a layout's
//   global positions, so a shard is rotated as the same rows of the full sequence). Angles in fp64, applied in
//   fp32 (fp64 for fp64 tensors).
// Errors: Error naming the value and the rule (shape, positions size, theta, rotary_dim, column_offset, the
//   scaling's parameters). RopeConfig::validate raises the same errors alone.
// Devices: in a CUDA build, x / dy may be a CUDA tensor (positions stay a host span): the same rotation by the pair
//   body the CPU kernel uses (attention/kernels/row_ops.h, rope_rotate_row_pair), launched by cuda/rope_kernels.h on
//   the device's default stream; never run on a GPU. Without CUDA a device tensor is refused.
// Sync: host-synchronous.
void rope_forward(const TensorView& x, std::span<const std::int64_t> positions, const RopeConfig& cfg);
void rope_backward(const TensorView& dy, std::span<const std::int64_t> positions, const RopeConfig& cfg);

// The plain rotate-half RoPE over the whole head dim with base `theta` (RopeConfig{.theta = theta}).
// Args, Errors, Sync: as the RopeConfig overloads.
void rope_forward(const TensorView& x, std::span<const std::int64_t> positions, double theta = kDefaultRopeTheta);
void rope_backward(const TensorView& dy, std::span<const std::int64_t> positions, double theta = kDefaultRopeTheta);

}  // namespace seqpar::attn
