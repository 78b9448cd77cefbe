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
// The backward (attention/ops/gdn_composed.h, gdn_backward_composed; docs/design.md, "The ops table"):
//   dot_row: a . b.
//   l2norm_scale_backward_row: dy <- J^T dy for y = s x / sqrt(x . x + eps): s r (dy - x r (x r . dy)) with
//     r = 1 / sqrt(x . x + eps) (eps < 0: dy <- s dy), from the raw x.
//   gdn_masks_backward_row: row i of the adjoint of gdn_wy_row and gdn_qk_row. In: the raw products kk = k k^T,
//     qk = q k^T and their masked forms' gradients dp = dL/d(masked qk), da = dL/dA [C, C]. Out: row i of
//     dqk = dp * L (j <= i) and of dkk = D + D^T with D_ij = da_ij beta_i exp(gamma_i - gamma_j) (j < i), the
//     gradients of the raw products; dgamma_i = the row sum minus the column sum of Z = dp * (masked qk) and
//     Y = da * A (each mask entry depends on gamma_i - gamma_j); dbeta_i = sum_j<i da_ij exp(gamma_i - gamma_j) kk_ij.
//   gdn_scales_backward: per chunk, the adjoint of gdn_chunk_scales and of the end-of-chunk decay added to dgamma and
//     dbeta (which hold the masks' part): dgamma_i += dqq_i + beta_i e^gamma_i dkbk_i - dktk_i, dbeta_i += dvbv_i +
//     e^gamma_i dkbk_i, dgamma_{C-1} += e^gamma_{C-1} sds + sum_j dktk_j; then dgamma becomes dg, the reverse
//     cumulative sum (gamma is the cumulative sum of g).
// The short causal depthwise conv (attention/ops/gdn_composed.h, short_conv_*_composed), weight [C, W], on rows of C
// channels; the W inputs of an output row are consecutive rows of xin (W-1 earlier inputs, then its own):
//   short_conv_row: y_c = sum_w weight[c, w] xin[w, c], then SiLU (y sigmoid(y)) when silu.
//   short_conv_dpre_row: dy <- dy silu'(y) at the recomputed pre-activation y (unchanged without SiLU).
//   short_conv_dx_row: dxin_c = sum_w weight[c, w] dpre[src[w], c] over the w with src[w] >= 0 (src[w]: the output row
//     that reads this input row as its w-th).
//   short_conv_dweight_channel: dweight[c, w] = sum_r dpre[r, c] xin[first[r] + w, c], rows r in ascending order.
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

template <typename T>
SEQPAR_HOST_DEVICE inline T dot_row(const T* a, const T* b, std::int64_t n) {
  T acc = T(0);
  for (std::int64_t j = 0; j < n; ++j) acc += a[j] * b[j];
  return acc;
}

template <typename T>
SEQPAR_HOST_DEVICE inline void l2norm_scale_backward_row(const T* x, T* dy, std::int64_t n, T eps, T s) {
  if (eps < T(0)) {
    for (std::int64_t j = 0; j < n; ++j) dy[j] *= s;
    return;
  }
  const T r = T(1) / gdn_sqrt(dot_row(x, x, n) + eps);
  const T xdy = dot_row(x, dy, n) * r;  // y . dy with y = x r
  for (std::int64_t j = 0; j < n; ++j) dy[j] = s * r * (dy[j] - x[j] * r * xdy);
}

// kk, qk, dp, da: the chunk's [C, C] matrices; dqk_row, dkk_row: row i of the outputs [C].
template <typename T>
SEQPAR_HOST_DEVICE inline void gdn_masks_backward_row(std::int64_t i, std::int64_t C, const T* gamma, const T* beta,
                                                      const T* kk, const T* qk, const T* dp, const T* da, T* dqk_row,
                                                      T* dkk_row, T* dgamma_i, T* dbeta_i) {
  T dgam = T(0), dbet = T(0);
  for (std::int64_t j = 0; j < C; ++j) {
    if (j <= i) {  // row i: entries (i, j) of the masks
      const T e = gdn_exp(gamma[i] - gamma[j]);
      const T dqk = dp[i * C + j] * e;
      dqk_row[j] = dqk;
      if (j < i) {
        dgam += dqk * qk[i * C + j];
        const T dkk = da[i * C + j] * beta[i] * e;
        dkk_row[j] = dkk;
        dgam += dkk * kk[i * C + j];
        dbet += da[i * C + j] * e * kk[i * C + j];
      } else {
        dkk_row[j] = T(0);  // the diagonal of A is 0; that of the qk mask does not depend on gamma
      }
    } else {  // column i: entries (j, i) of the masks, j > i
      const T e = gdn_exp(gamma[j] - gamma[i]);
      dqk_row[j] = T(0);
      dgam -= dp[j * C + i] * e * qk[j * C + i];
      const T dkk = da[j * C + i] * beta[j] * e;
      dkk_row[j] = dkk;
      dgam -= dkk * kk[j * C + i];
    }
  }
  *dgamma_i = dgam;
  *dbeta_i = dbet;
}

// Per chunk of C tokens: gamma, beta, dqq, dkbk, dvbv, dktk, dgamma, dbeta [C]; sds one value.
template <typename T>
SEQPAR_HOST_DEVICE inline void gdn_scales_backward(const T* gamma, const T* beta, std::int64_t C, const T* dqq,
                                                   const T* dkbk, const T* dvbv, const T* dktk, T sds, T* dgamma,
                                                   T* dbeta) {
  T rsum = T(0);
  for (std::int64_t i = 0; i < C; ++i) {
    const T e = gdn_exp(gamma[i]);
    dgamma[i] += dqq[i] + beta[i] * e * dkbk[i] - dktk[i];
    dbeta[i] += dvbv[i] + e * dkbk[i];
    rsum += dktk[i];
  }
  dgamma[C - 1] += gdn_exp(gamma[C - 1]) * sds + rsum;
  T acc = T(0);
  for (std::int64_t i = C - 1; i >= 0; --i) {
    acc += dgamma[i];
    dgamma[i] = acc;
  }
}

template <typename T>
SEQPAR_HOST_DEVICE inline T conv_pre(const T* xin_first, std::int64_t C, std::int64_t W, const T* weight,
                                     std::int64_t c) {
  T acc = T(0);
  for (std::int64_t w = 0; w < W; ++w) acc += weight[c * W + w] * xin_first[w * C + c];
  return acc;
}

template <typename T>
SEQPAR_HOST_DEVICE inline void short_conv_row(const T* xin_first, std::int64_t C, std::int64_t W, const T* weight,
                                              bool silu, T* y) {
  for (std::int64_t c = 0; c < C; ++c) {
    const T v = conv_pre(xin_first, C, W, weight, c);
    y[c] = silu ? v / (T(1) + gdn_exp(-v)) : v;
  }
}

template <typename T>
SEQPAR_HOST_DEVICE inline void short_conv_dpre_row(const T* xin_first, std::int64_t C, std::int64_t W, const T* weight,
                                                   bool silu, T* dy) {
  if (!silu) return;
  for (std::int64_t c = 0; c < C; ++c) {
    const T v = conv_pre(xin_first, C, W, weight, c);
    const T s = T(1) / (T(1) + gdn_exp(-v));
    dy[c] *= s * (T(1) + v * (T(1) - s));
  }
}

template <typename T>
SEQPAR_HOST_DEVICE inline void short_conv_dx_row(const T* dpre, const std::int64_t* src, std::int64_t C, std::int64_t W,
                                                 const T* weight, T* dx) {
  for (std::int64_t c = 0; c < C; ++c) {
    T acc = T(0);
    for (std::int64_t w = 0; w < W; ++w)
      if (src[w] >= 0) acc += weight[c * W + w] * dpre[src[w] * C + c];
    dx[c] = acc;
  }
}

template <typename T>
SEQPAR_HOST_DEVICE inline void short_conv_dweight_channel(std::int64_t c, std::int64_t rows, std::int64_t C,
                                                          std::int64_t W, const T* dpre, const T* xin,
                                                          const std::int64_t* first, T* dweight) {
  for (std::int64_t w = 0; w < W; ++w) {
    T acc = T(0);
    for (std::int64_t r = 0; r < rows; ++r) acc += dpre[r * C + c] * xin[(first[r] + w) * C + c];
    dweight[c * W + w] = acc;
  }
}

}  // namespace seqpar::attn::rowops
