// Internal: the CPU RoPE kernel behind attention/rope.h. Arguments are validated by attention/rope.cc.
#pragma once

#include <cstdint>
#include <span>

#include "runtime/tensor.h"

namespace seqpar::attn::cpu {

// Rotates x [B, S, H, D] in place by angle sign * pos * theta^(-2i/D).
void rope_rotate_cpu(const TensorView& x, std::span<const std::int64_t> positions, double theta, double sign);

}  // namespace seqpar::attn::cpu
