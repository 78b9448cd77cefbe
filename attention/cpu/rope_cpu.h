// Internal: the CPU RoPE kernel behind attention/rope.h. Arguments are validated by attention/rope.cc, which also
// computes the inverse frequencies.
#pragma once

#include <cstdint>
#include <span>

#include "../../runtime/tensor.h"

namespace seqpar::attn::cpu {

struct RopeRotation {
  bool interleaved = false;          // pairs (o + 2i, o + 2i + 1); else (o + i, o + i + r/2)
  std::int64_t column_offset = 0;    // o
  std::span<const double> inv_freq;  // r/2 frequencies f_i
  double attention_factor = 1.0;     // m, multiplies cos and sin
  double sign = 1.0;                 // +1 forward, -1 backward (the transposed rotation)
};

// Rotates the r = 2 inv_freq.size() columns [o, o + r) of each row of x ([batch, seq, heads, dim] contiguous) in
// place by angle sign * pos * f_i, scaled by m.
void rope_rotate_cpu(const TensorView& x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t dim,
                     std::span<const std::int64_t> positions, const RopeRotation& rot);

}  // namespace seqpar::attn::cpu
