// Element and row bodies written once for the CPU and the CUDA kernels (SEQPAR_HOST_DEVICE): the CPU code and tests
// call them on the host, a CUDA file holds only the launch that calls them per element or row. T is float or
// double; nothing here allocates, throws or touches a library.
//
//   lse_merge_weights / lse_merge_value: two partial attention results over disjoint key sets (out_1, lse_1),
//     (out_2, lse_2) merged (docs/design.md, the LSE merge; FlashAttention-2's rescaling): lse = logaddexp(lse_1,
//     lse_2), out = w_1 out_1 + w_2 out_2 with w_s = exp(lse_s - lse). With mx = max, mn = min, e = exp(mn - mx) in
//     [0, 1]: lse = mx + log1p(e), weights 1 / (1 + e) (larger side) and e / (1 + e): no inf - inf, no cancellation,
//     so lse differences of any size (1e4 and more) give weights 1 and 0, never NaN. A side with lse = -inf has
//     weight exactly 0 and contributes nothing even if its out holds garbage; both -inf: lse = -inf, out = 0.
//   masked_softmax_row: p_j = exp(s_j - m) / sum_k exp(s_k - m) over the visible keys [begin, end) of one score row
//     (m their maximum), lse = m + log sum_k exp(s_k - m) (natural log), p_j = 0 outside; a row with no visible key (or
//     only -inf scores) gets lse = -inf and p = 0 (no NaN).
//   rope_rotate_pair / rope_unrotate_pair: one RoPE pair (Su et al. 2021, "RoFormer"): (x0, x1) rotated by the angle
//     whose cosine and sine are c, s: (x0 c - x1 s, x1 c + x0 s), and its transpose (the backward).
//   Dtype conversions: runtime/dtype.h's bf16 / fp16 <-> fp32 conversions (round to nearest even; NaN stays NaN,
//     overflow gives inf) are host-device themselves; bf16_to_float, fp16_to_float, float_to_bf16, float_to_fp16
//     name them here on bit patterns.
#pragma once

#include <math.h>

#include <cstdint>

#include "../../runtime/dtype.h"
#include "../../runtime/host_device.h"

namespace seqpar::attn::rowops {

SEQPAR_HOST_DEVICE inline double row_exp(double x) { return exp(x); }
SEQPAR_HOST_DEVICE inline float row_exp(float x) { return expf(x); }
SEQPAR_HOST_DEVICE inline double row_log(double x) { return log(x); }
SEQPAR_HOST_DEVICE inline float row_log(float x) { return logf(x); }
SEQPAR_HOST_DEVICE inline double row_log1p(double x) { return log1p(x); }
SEQPAR_HOST_DEVICE inline float row_log1p(float x) { return log1pf(x); }
template <typename T>
SEQPAR_HOST_DEVICE inline T neg_inf() {
  return static_cast<T>(-HUGE_VAL);
}

template <typename T>
struct MergeWeights {
  T w1, w2;  // weights of side 1 and side 2
  T lse;     // merged lse
};

template <typename T>
SEQPAR_HOST_DEVICE inline MergeWeights<T> lse_merge_weights(T l1, T l2) {
  MergeWeights<T> m{T(0), T(0), neg_inf<T>()};
  if (l1 != neg_inf<T>() || l2 != neg_inf<T>()) {
    const bool first_max = l1 >= l2;
    const T mx = first_max ? l1 : l2, mn = first_max ? l2 : l1;
    const T e = row_exp(mn - mx);  // exp(-inf) = 0
    m.lse = mx + row_log1p(e);
    const T w_max = T(1) / (T(1) + e), w_min = e / (T(1) + e);
    m.w1 = first_max ? w_max : w_min;
    m.w2 = first_max ? w_min : w_max;
  }
  return m;
}

// One merged out element; a side with weight 0 contributes nothing, even if its out holds garbage.
template <typename T>
SEQPAR_HOST_DEVICE inline T lse_merge_value(const MergeWeights<T>& m, T o1, T o2) {
  const T a = m.w1 == T(0) ? T(0) : m.w1 * o1;
  const T c = m.w2 == T(0) ? T(0) : m.w2 * o2;
  return a + c;
}

// Scores s[0, n), visible keys [begin, end) (clamped to [0, n)); writes p[0, n) and returns lse.
template <typename T>
SEQPAR_HOST_DEVICE inline T masked_softmax_row(const T* s, std::int64_t n, std::int64_t begin, std::int64_t end, T* p) {
  if (begin < 0) begin = 0;
  if (end > n) end = n;
  T mx = neg_inf<T>();
  for (std::int64_t j = begin; j < end; ++j) mx = s[j] > mx ? s[j] : mx;
  if (mx == neg_inf<T>()) {  // no visible key, or only -inf scores: nothing to normalise
    for (std::int64_t j = 0; j < n; ++j) p[j] = T(0);
    return neg_inf<T>();
  }
  T sum = T(0);
  for (std::int64_t j = begin; j < end; ++j) sum += row_exp(s[j] - mx);
  // p from the row maximum, not from lse: lse = mx + log(sum) carries |lse| eps absolute, which exp would turn
  // into a relative error of every p
  for (std::int64_t j = 0; j < n; ++j) p[j] = (j >= begin && j < end) ? row_exp(s[j] - mx) / sum : T(0);
  return mx + row_log(sum);
}

template <typename T>
SEQPAR_HOST_DEVICE inline void rope_rotate_pair(T x0, T x1, T c, T s, T& y0, T& y1) {
  y0 = x0 * c - x1 * s;
  y1 = x1 * c + x0 * s;
}
template <typename T>
SEQPAR_HOST_DEVICE inline void rope_unrotate_pair(T y0, T y1, T c, T s, T& x0, T& x1) {
  rope_rotate_pair(y0, y1, c, -s, x0, x1);
}

// The columns of RoPE pair i in a window of 2 half columns starting at `offset`: (offset + i, offset + i + half)
// rotate-half, (offset + 2i, offset + 2i + 1) interleaved (docs/design.md, "RoPE").
SEQPAR_HOST_DEVICE inline void rope_pair_columns(bool interleaved, std::int64_t offset, std::int64_t half,
                                                 std::int64_t i, std::int64_t& c0, std::int64_t& c1) {
  c0 = offset + (interleaved ? 2 * i : i);
  c1 = c0 + (interleaved ? 1 : half);
}
// Pair i of one row rotated in place (rope_pair_columns, rope_rotate_pair) by the cosine and sine c, s (the attention
// factor and the backward's sign folded in by the caller).
template <typename T>
SEQPAR_HOST_DEVICE inline void rope_rotate_row_pair(T* row, bool interleaved, std::int64_t offset, std::int64_t half,
                                                    std::int64_t i, T c, T s) {
  std::int64_t c0 = 0, c1 = 0;
  rope_pair_columns(interleaved, offset, half, i, c0, c1);
  T y0, y1;
  rope_rotate_pair(row[c0], row[c1], c, s, y0, y1);
  row[c0] = y0;
  row[c1] = y1;
}

// Storage element <-> float (16-bit types: runtime/dtype.h's round-to-nearest-even bodies).
SEQPAR_HOST_DEVICE inline float bf16_to_float(std::uint16_t bits) { return bf16_bits_to_float(bits); }
SEQPAR_HOST_DEVICE inline float fp16_to_float(std::uint16_t bits) { return fp16_bits_to_float(bits); }
SEQPAR_HOST_DEVICE inline std::uint16_t float_to_bf16(float x) { return float_to_bf16_bits(x); }
SEQPAR_HOST_DEVICE inline std::uint16_t float_to_fp16(float x) { return float_to_fp16_bits(x); }

}  // namespace seqpar::attn::rowops
