// CPU rotary position embedding, "rotate half" convention (attention/rope.h).
#include "attention/cpu/rope_cpu.h"

#include <cmath>
#include <type_traits>
#include <vector>

#include "attention/cpu/scratch.h"

namespace seqpar::attn::cpu {
namespace {

template <typename T>
void rotate(T* x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t dim,
            std::span<const std::int64_t> positions, double theta, double sign) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const std::int64_t half = dim / 2;
  std::vector<double> inv_freq(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / dim);
  const WorkerScratch<Acc> ws({half, half}, "rope scratch");
#pragma omp parallel
  {
    const std::span<Acc> cos_v = ws.buffer(0), sin_v = ws.buffer(1);
#pragma omp for schedule(static)
    for (std::int64_t s = 0; s < seq; ++s) {
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
}

}  // namespace

void rope_rotate_cpu(const TensorView& x, std::span<const std::int64_t> positions, double theta, double sign) {
  dispatch_floating(x.dtype(), [&](auto t) {
    using T = decltype(t);
    rotate(static_cast<T*>(x.data()), x.dim(0), x.dim(1), x.dim(2), x.dim(3), positions, theta, sign);
  });
}

}  // namespace seqpar::attn::cpu
