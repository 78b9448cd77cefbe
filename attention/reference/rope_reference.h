// Naive fp64 RoPE for tests: builds its own cos/sin tables from the formulas of attention/rope.h (base frequencies,
// llama3 wavelength bands, YaRN's correction range and ramp, the attention factor) without calling the library's
// frequency code, and rotates pair by pair into a separate output. The backward applies the transposed matrix
// explicitly. All tensors fp64, [B, S, H, D] or [B, S, D]; positions [S]. Host-synchronous.
// Errors: Error for non-fp64 tensors, mismatched shapes, or a rotated window outside the head dim.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "../rope.h"

namespace seqpar::attn::reference {

// The r/2 inverse frequencies of `cfg` for rotary dim r.
std::vector<double> rope_inv_freq(const RopeConfig& cfg, std::int64_t rotary_dim);
// The factor on cos and sin.
double rope_attention_factor(const RopeConfig& cfg);

// y = RoPE(x); y may not alias x.
void rope_forward(const RopeConfig& cfg, std::span<const std::int64_t> positions, const TensorView& x,
                  const TensorView& y);
// dx = R^T dy; dx may not alias dy.
void rope_backward(const RopeConfig& cfg, std::span<const std::int64_t> positions, const TensorView& dy,
                   const TensorView& dx);

}  // namespace seqpar::attn::reference
