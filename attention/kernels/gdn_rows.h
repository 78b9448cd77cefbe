// Row and element bodies of the composed GDN chunk forward (attention/ops/gdn_composed.h), written once for the CPU
// ops table and a CUDA one (SEQPAR_HOST_DEVICE): the ops table loops over rows on the CPU; a CUDA launch would run
// one row per thread (or warp). T is float or double; nothing here allocates, throws or touches a library.
//
//   l2norm_scale_row: x <- s x / sqrt(x . x + eps) (eps < 0: no normalisation, x <- s x), the GDN q / k prologue.
//   relu_row: x <- max(x, 0) (the DSA indexer's per-head logits; NaN stays NaN).
//   softmax_prefix_row: x[0, end) <- exp(x_j - mx) / sum with mx their maximum and sum = sum_j exp(x_j - mx) (also
//     returned, so that a caller forms lse = mx + log(sum) in a wider dtype); x[end, n) <- 0. No entry (or only -inf):
//     x <- 0, mx = -inf, sum = 0 (lse = -inf).
//   cumsum_row: inclusive prefix sum in index order (the cumulative log decay gamma of a chunk from its g).
//   gdn_chunk_scales: per token i of a chunk of C tokens with cumulative log decay gamma and beta: the row scales
//     kscale = beta exp(gamma_i) (W's right-hand side), vscale = beta (U's), qscale = exp(gamma_i) (the inter-chunk
//     output), kend = exp(gamma_{C-1} - gamma_i) (keys decayed to the chunk end); and exp(gamma_{C-1}).
//   gdn_wy_row: row i of A = strictLower(beta_i exp(gamma_i - gamma_j) k_i . k_j), in place over k_i . k_j (the
//     diagonal and above set to 0).
//   gdn_qk_row: row i of the intra-chunk output mask, in place over q_i . k_j: exp(gamma_i - gamma_j) q_i . k_j for
//     j <= i, 0 above the diagonal.
#pragma once

#include <math.h>

#include <cstdint>

#include "../../runtime/host_device.h"

namespace seqpar::attn::rowops {

SEQPAR_HOST_DEVICE inline double gdn_exp(double x) { return exp(x); }
SEQPAR_HOST_DEVICE inline float gdn_exp(float x) { return expf(x); }
SEQPAR_HOST_DEVICE inline double gdn_sqrt(double x) { return sqrt(x); }
SEQPAR_HOST_DEVICE inline float gdn_sqrt(float x) { return sqrtf(x); }

template <typename T>
SEQPAR_HOST_DEVICE inline void l2norm_scale_row(T* x, std::int64_t n, T eps, T s) {
  T r = s;
  if (eps >= T(0)) {
    T ss = T(0);
    for (std::int64_t j = 0; j < n; ++j) ss += x[j] * x[j];
    r = s / gdn_sqrt(ss + eps);
  }
  for (std::int64_t j = 0; j < n; ++j) x[j] *= r;
}

template <typename T>
SEQPAR_HOST_DEVICE inline void relu_row(T* x, std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) x[j] = x[j] < T(0) ? T(0) : x[j];
}

template <typename T>
SEQPAR_HOST_DEVICE inline void softmax_prefix_row(T* x, std::int64_t n, std::int64_t end, T* mx_out, T* sum_out) {
  if (end > n) end = n;
  const T neg_inf = static_cast<T>(-HUGE_VAL);
  T mx = neg_inf;
  for (std::int64_t j = 0; j < end; ++j) mx = x[j] > mx ? x[j] : mx;
  T sum = T(0);
  if (mx != neg_inf)
    for (std::int64_t j = 0; j < end; ++j) sum += gdn_exp(x[j] - mx);
  for (std::int64_t j = 0; j < n; ++j) x[j] = (j < end && mx != neg_inf) ? gdn_exp(x[j] - mx) / sum : T(0);
  *mx_out = mx;
  *sum_out = sum;
}

template <typename T>
SEQPAR_HOST_DEVICE inline void cumsum_row(T* x, std::int64_t n) {
  T acc = T(0);
  for (std::int64_t j = 0; j < n; ++j) {
    acc += x[j];
    x[j] = acc;
  }
}

// gamma, beta, kscale, vscale, qscale, kend: [C]; end_decay: one value.
template <typename T>
SEQPAR_HOST_DEVICE inline void gdn_chunk_scales(const T* gamma, const T* beta, std::int64_t C, T* kscale, T* vscale,
                                                T* qscale, T* kend, T* end_decay) {
  const T last = gamma[C - 1];
  for (std::int64_t i = 0; i < C; ++i) {
    const T e = gdn_exp(gamma[i]);
    kscale[i] = beta[i] * e;
    vscale[i] = beta[i];
    qscale[i] = e;
    kend[i] = gdn_exp(last - gamma[i]);
  }
  *end_decay = gdn_exp(last);
}

template <typename T>
SEQPAR_HOST_DEVICE inline void gdn_wy_row(T* row, std::int64_t i, std::int64_t C, const T* gamma, T beta_i) {
  for (std::int64_t j = 0; j < C; ++j) row[j] = j < i ? beta_i * gdn_exp(gamma[i] - gamma[j]) * row[j] : T(0);
}

template <typename T>
SEQPAR_HOST_DEVICE inline void gdn_qk_row(T* row, std::int64_t i, std::int64_t C, const T* gamma) {
  for (std::int64_t j = 0; j < C; ++j) row[j] = j <= i ? gdn_exp(gamma[i] - gamma[j]) * row[j] : T(0);
}

}  // namespace seqpar::attn::rowops
