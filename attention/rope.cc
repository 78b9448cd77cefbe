// Public boundary of RoPE: argument validation (check_rope) and dispatch to the CPU kernel in cpu/.
#include "attention/rope.h"

#include <cmath>

#include "attention/boundary.h"
#include "attention/cpu/rope_cpu.h"
#include "runtime/error.h"

namespace seqpar::attn {
namespace {

void validate(const TensorView& x, std::span<const std::int64_t> positions, double theta, const char* op) {
  detail::check_floating(x, str_cat(op, ": x").c_str(), "RoPE");
  SEQPAR_CHECK(x.ndim() == 4, op, ": x ", x.str(), " must be [B, S, H, D]");
  SEQPAR_CHECK(x.dim(3) % 2 == 0, op, ": head dim ", x.dim(3), " must be even");
  SEQPAR_CHECK(static_cast<std::int64_t>(positions.size()) == x.dim(1), op, ": ", positions.size(),
               " positions for a sequence of ", x.dim(1));
  SEQPAR_CHECK(std::isfinite(theta) && theta > 0, op, ": theta ", theta, " must be positive and finite");
}

}  // namespace

void check_rope(const TensorView& x, std::span<const std::int64_t> positions, double theta) {
  validate(x, positions, theta, "rope");
}

void rope_forward(const TensorView& x, std::span<const std::int64_t> positions, double theta) {
  validate(x, positions, theta, "rope_forward");
  cpu::rope_rotate_cpu(x, positions, theta, 1.0);
}

void rope_backward(const TensorView& dy, std::span<const std::int64_t> positions, double theta) {
  validate(dy, positions, theta, "rope_backward");
  cpu::rope_rotate_cpu(dy, positions, theta, -1.0);
}

}  // namespace seqpar::attn
