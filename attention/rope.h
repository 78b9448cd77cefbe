// Rotary position embedding (RoFormer, Su et al. 2021) on global positions, "rotate half" convention
// (GPT-NeoX / Llama): for pair i in [0, D/2) with inv_freq_i = theta^(-2i/D) and angle = pos * inv_freq_i,
//   y[i]       = x[i] cos(angle) - x[i + D/2] sin(angle)
//   y[i + D/2] = x[i + D/2] cos(angle) + x[i] sin(angle)
// The backward is the transposed rotation (angle -> -angle). Under sequence parallelism the positions are the
// layout's global positions of the local tokens, so a zigzag or stripe shard gets the same rotation as the
// corresponding rows of the full sequence.
//
// x, dy: [B, S, H, D] any floating dtype, rotated in place; positions: [S] int64 (any values >= 0).
// Angles are computed in fp64 and applied in fp32 (fp64 for fp64 tensors). Host-synchronous.
// Errors: x not a 4-d host tensor of a floating dtype, D odd, positions size != S, theta not positive and finite
// (RoPE has no CUDA implementation yet: a device tensor is an error). check_rope raises the same errors alone.
#pragma once

#include <cstdint>
#include <span>

#include "runtime/tensor.h"

namespace seqpar::attn {

inline constexpr double kDefaultRopeTheta = 10000.0;

// The checks of rope_forward / rope_backward, without the work.
void check_rope(const TensorView& x, std::span<const std::int64_t> positions, double theta = kDefaultRopeTheta);

void rope_forward(const TensorView& x, std::span<const std::int64_t> positions, double theta = kDefaultRopeTheta);
// dx = R(pos)^T dy, in place on `dy`.
void rope_backward(const TensorView& dy, std::span<const std::int64_t> positions, double theta = kDefaultRopeTheta);

}  // namespace seqpar::attn
