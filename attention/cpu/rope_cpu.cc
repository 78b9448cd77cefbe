#include <cmath>
#include <type_traits>
#include <vector>

#include "attention/rope.h"

namespace seqpar::attn {
namespace {

template <typename T>
void rotate(T* x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t dim,
            std::span<const std::int64_t> positions, double theta, double sign) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const std::int64_t half = dim / 2;
  std::vector<double> inv_freq(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / dim);
#pragma omp parallel for schedule(static)
  for (std::int64_t s = 0; s < seq; ++s) {
    std::vector<Acc> cos_v(static_cast<std::size_t>(half)), sin_v(static_cast<std::size_t>(half));
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(positions[s]) * inv_freq[i];
      cos_v[i] = static_cast<Acc>(std::cos(angle));
      sin_v[i] = static_cast<Acc>(sign * std::sin(angle));
    }
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t h = 0; h < heads; ++h) {
        T* row = x + ((b * seq + s) * heads + h) * dim;
        for (std::int64_t i = 0; i < half; ++i) {
          const Acc a = static_cast<Acc>(to_float(row[i]));
          const Acc c = static_cast<Acc>(to_float(row[i + half]));
          row[i] = static_cast<T>(a * cos_v[i] - c * sin_v[i]);
          row[i + half] = static_cast<T>(c * cos_v[i] + a * sin_v[i]);
        }
      }
    }
  }
}

void apply(const TensorView& x, std::span<const std::int64_t> positions, double theta, double sign, const char* op) {
  check_cpu(x, op);
  SEQPAR_CHECK(x.ndim() == 4, op, ": x ", x.str(), " must be [B, S, H, D]");
  SEQPAR_CHECK(x.dim(3) % 2 == 0, op, ": head dim ", x.dim(3), " must be even");
  SEQPAR_CHECK(static_cast<std::int64_t>(positions.size()) == x.dim(1), op, ": ", positions.size(),
               " positions for a sequence of ", x.dim(1));
  SEQPAR_CHECK(theta > 0, op, ": theta ", theta, " must be positive");
  dispatch_floating(x.dtype(), [&](auto t) {
    using T = decltype(t);
    rotate(static_cast<T*>(x.data()), x.dim(0), x.dim(1), x.dim(2), x.dim(3), positions, theta, sign);
  });
}

}  // namespace

void rope_forward(const TensorView& x, std::span<const std::int64_t> positions, double theta) {
  apply(x, positions, theta, 1.0, "rope_forward");
}

void rope_backward(const TensorView& dy, std::span<const std::int64_t> positions, double theta) {
  apply(dy, positions, theta, -1.0, "rope_backward");
}

}  // namespace seqpar::attn
