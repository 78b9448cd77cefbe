// CPU rotary position embedding: rotate-half and interleaved pairings on a window of columns (attention/rope.h).
#include "attention/cpu/rope_cpu.h"

#include <cmath>
#include <type_traits>

#include "attention/cpu/scratch.h"
#include "attention/kernels/row_ops.h"

namespace seqpar::attn::cpu {
namespace {

template <typename T>
void rotate(T* x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t dim,
            std::span<const std::int64_t> positions, const RopeRotation& rot) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const std::int64_t half = static_cast<std::int64_t>(rot.inv_freq.size());
  const WorkerScratch<Acc> ws({half, half}, "rope scratch");
#pragma omp parallel
  {
    const std::span<Acc> cos_v = ws.buffer(0), sin_v = ws.buffer(1);
#pragma omp for schedule(static)
    for (std::int64_t s = 0; s < seq; ++s) {
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(positions[s]) * rot.inv_freq[i];
        cos_v[i] = static_cast<Acc>(rot.attention_factor * std::cos(angle));
        sin_v[i] = static_cast<Acc>(rot.attention_factor * rot.sign * std::sin(angle));
      }
      for (std::int64_t b = 0; b < batch; ++b) {
        for (std::int64_t h = 0; h < heads; ++h) {
          T* row = x + ((b * seq + s) * heads + h) * dim;
          for (std::int64_t i = 0; i < half; ++i) {
            std::int64_t c0 = 0, c1 = 0;  // the pair's columns: the body the device kernel uses
            rowops::rope_pair_columns(rot.interleaved, rot.column_offset, half, i, c0, c1);
            T& first = row[c0];
            T& second = row[c1];
            const Acc a = static_cast<Acc>(to_float(first));
            const Acc c = static_cast<Acc>(to_float(second));
            Acc y0, y1;
            rowops::rope_rotate_pair(a, c, cos_v[i], sin_v[i], y0, y1);  // shared with the device kernels
            first = static_cast<T>(y0);
            second = static_cast<T>(y1);
          }
        }
      }
    }
  }
}

}  // namespace

void rope_rotate_cpu(const TensorView& x, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t dim,
                     std::span<const std::int64_t> positions, const RopeRotation& rot) {
  dispatch_floating(x.dtype(), [&](auto t) {
    using T = decltype(t);
    rotate(static_cast<T*>(x.data()), batch, seq, heads, dim, positions, rot);
  });
}

}  // namespace seqpar::attn::cpu
