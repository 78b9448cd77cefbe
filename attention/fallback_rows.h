// The row bodies of the fallback attention (fallback_attention.h), written once for the CPU ops and the CUDA launches
// (attention/cuda/fallback_kernels.cu): C++17 and host-device, so that nvcc compiles them.
#pragma once

#include <cstdint>

#include "kernels/row_ops.h"

namespace seqpar::attn::fallback {

// A rectangle's mask in a device-friendly form: row i sees keys [max(0, i + e - left + 1), min(sk, i + e + 1))
// (causal and / or left bound; e = sk - sq bottom-right, 0 top-left).
struct RowBand {
  std::int64_t sq = 0, sk = 0, e = 0, left = 0;  // left 0: no left bound
  bool causal = false;
};
SEQPAR_HOST_DEVICE inline void band_of_row(const RowBand& b, std::int64_t i, std::int64_t& begin, std::int64_t& end) {
  begin = 0;
  end = b.sk;
  if (b.causal && i + b.e + 1 < end) end = i + b.e + 1;
  if (b.left > 0 && i + b.e - b.left + 1 > begin) begin = i + b.e - b.left + 1;
  if (end < begin) end = begin;
}

// Forward row body: s[0, n) scores of local row i (already scaled) -> p (in place allowed) and the row's lse.
template <typename T>
SEQPAR_HOST_DEVICE inline T fallback_softmax_row(const RowBand& b, std::int64_t i, const T* s, T* p) {
  std::int64_t begin = 0, end = 0;
  band_of_row(b, i, begin, end);
  return rowops::masked_softmax_row(s, b.sk, begin, end, p);
}

// Backward row body: s (scaled scores) -> p = exp(s - lse) on the band (0 elsewhere, and everywhere when lse is
// -inf); dp (dO V^T row) -> ds = p (dp - delta), in place.
template <typename T>
SEQPAR_HOST_DEVICE inline void fallback_grad_row(const RowBand& b, std::int64_t i, T lse, T delta, T* s_to_p,
                                                 T* dp_to_ds) {
  std::int64_t begin = 0, end = 0;
  band_of_row(b, i, begin, end);
  for (std::int64_t j = 0; j < b.sk; ++j) {
    const bool on = j >= begin && j < end && lse != rowops::neg_inf<T>();
    const T p = on ? rowops::row_exp(s_to_p[j] - lse) : T(0);
    s_to_p[j] = p;
    dp_to_ds[j] = p * (dp_to_ds[j] - delta);
  }
}

// delta of one (row, head): the dot product of its dO and O rows (FlashAttention-2's D_i), d elements.
template <typename T>
SEQPAR_HOST_DEVICE inline T fallback_delta_row(const T* o, const T* g, std::int64_t d) {
  T acc = T(0);
  for (std::int64_t j = 0; j < d; ++j) acc += o[j] * g[j];
  return acc;
}

}  // namespace seqpar::attn::fallback
