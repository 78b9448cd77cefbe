// Row and element bodies of the composed DSA stages (attention/ops/dsa_composed.h), written once for the CPU ops
// table and a CUDA one (SEQPAR_HOST_DEVICE): the CPU table loops over rows; a CUDA launch runs one row per thread
// (or warp). T is float or double; nothing here allocates, throws or touches a library. Math: docs/design.md, "The
// ops table" (DSA backward, indexer loss, top-k merge).
//
//   topk_better: the training tie rule as a strict order on (score, position) candidates: a valid candidate
//     (position >= 0) beats an empty slot, a larger score wins, equal scores go to the smaller position.
//   topk_union_row: two lists of k (score, position) entries, each ascending by position with -1 padding at the end
//     (a running top-k row, a block's candidates), merged into one list of up to 2k entries ascending by position
//     (positions are distinct between the lists); returns its length. The k best of the union by topk_better are
//     then a top-k over the union's columns with ties to the lower column (column order is position order).
//   relu_head_sum_row: out_j = sum_i w_i relu(s_ij) over heads i in ascending order, s [Hi, n] (leading dim ld): the
//     DSA indexer score of each key from its per-head logits.
//   indexer_grad_row: one head i of the indexer backward from its logits s_i [n], weight w_i and the score
//     gradients g [n]: s_i <- g_j w_i [s_ij > 0] (the logit gradient, in place), returns dw_i = sum_j g_j relu(s_ij)
//     in ascending j.
//   dsa_probs_row: p_j = exp(s_j - lse) for the slots j with mask_j >= 0, else 0, with lse given as hi + lo (an fp64
//     lse split into two T, so that s_j - lse keeps fp64's accuracy in fp32: (s_j - hi) is exact near the row
//     maximum, then - lo); lse = -inf (hi = -inf) gives p = 0.
//   dsa_dscore_row: ds_j = p_j (dp_j - delta), in place over dp (the softmax backward with delta = dout . out).
//   kl_row: the indexer KL loss of one query over its valid slots (idx_j >= 0), in fp64: p*_j = probs_j / sum probs,
//     q = softmax(scores) over the valid slots, loss = sum_j p*_j (log p*_j - log q_j) (terms with p*_j = 0 add 0),
//     dscores_j = grad_scale (q_j - p*_j) (0 on -1 slots); a row with sum probs = 0 or no valid slot: loss 0,
//     dscores 0.
#pragma once

#include <math.h>

#include <cstdint>

#include "../../runtime/host_device.h"

namespace seqpar::attn::rowops {

SEQPAR_HOST_DEVICE inline double dsa_exp(double x) { return exp(x); }
SEQPAR_HOST_DEVICE inline float dsa_exp(float x) { return expf(x); }

template <typename T>
SEQPAR_HOST_DEVICE inline bool topk_better(T sa, std::int64_t pa, T sb, std::int64_t pb) {
  if (pb < 0) return pa >= 0;
  if (pa < 0) return false;
  if (sa != sb) return sa > sb;
  return pa < pb;
}

template <typename T>
SEQPAR_HOST_DEVICE inline std::int64_t topk_union_row(std::int64_t k, const T* sa, const std::int64_t* pa, const T* sb,
                                                      const std::int64_t* pb, T* out_s, std::int64_t* out_p) {
  std::int64_t i = 0, j = 0, n = 0;
  while (i < k && pa[i] >= 0 && j < k && pb[j] >= 0) {
    const bool take_a = pa[i] < pb[j];
    out_s[n] = take_a ? sa[i] : sb[j];
    out_p[n++] = take_a ? pa[i++] : pb[j++];
  }
  for (; i < k && pa[i] >= 0; ++i, ++n) {
    out_s[n] = sa[i];
    out_p[n] = pa[i];
  }
  for (; j < k && pb[j] >= 0; ++j, ++n) {
    out_s[n] = sb[j];
    out_p[n] = pb[j];
  }
  return n;
}

template <typename T>
SEQPAR_HOST_DEVICE inline void relu_head_sum_row(const T* s, std::int64_t ld, std::int64_t Hi, std::int64_t n,
                                                 const T* w, T* out) {
  for (std::int64_t j = 0; j < n; ++j) {
    T acc = T(0);
    for (std::int64_t i = 0; i < Hi; ++i) {
      const T v = s[i * ld + j];
      acc += w[i] * (v > T(0) ? v : T(0));
    }
    out[j] = acc;
  }
}

template <typename T>
SEQPAR_HOST_DEVICE inline T indexer_grad_row(T* s, std::int64_t n, T w, const T* g) {
  T dw = T(0);
  for (std::int64_t j = 0; j < n; ++j) {
    const T v = s[j];
    dw += v > T(0) ? g[j] * v : T(0);
    s[j] = v > T(0) ? g[j] * w : T(0);
  }
  return dw;
}

template <typename T>
SEQPAR_HOST_DEVICE inline void dsa_probs_row(T* s, std::int64_t n, const std::int64_t* mask, T lse_hi, T lse_lo) {
  const bool empty = !(lse_hi > static_cast<T>(-HUGE_VAL));
  for (std::int64_t j = 0; j < n; ++j) s[j] = (empty || mask[j] < 0) ? T(0) : dsa_exp((s[j] - lse_hi) - lse_lo);
}

template <typename T>
SEQPAR_HOST_DEVICE inline void dsa_dscore_row(const T* p, T* dp, std::int64_t n, T delta) {
  for (std::int64_t j = 0; j < n; ++j) dp[j] = p[j] * (dp[j] - delta);
}

template <typename T>
SEQPAR_HOST_DEVICE inline double kl_row(const T* probs, const T* scores, const std::int64_t* idx, std::int64_t k,
                                        double grad_scale, T* dscores) {
  double z = 0.0, mx = -HUGE_VAL;
  for (std::int64_t j = 0; j < k; ++j) {
    if (idx[j] < 0) continue;
    z += static_cast<double>(probs[j]);
    const double s = static_cast<double>(scores[j]);
    mx = s > mx ? s : mx;
  }
  double sum_e = 0.0;
  for (std::int64_t j = 0; j < k; ++j)
    if (idx[j] >= 0) sum_e += exp(static_cast<double>(scores[j]) - mx);
  const bool live = z > 0.0 && sum_e > 0.0;
  const double lse = mx + log(sum_e);
  double loss = 0.0;
  for (std::int64_t j = 0; j < k; ++j) {
    double grad = 0.0;
    if (idx[j] >= 0 && live) {
      const double p = static_cast<double>(probs[j]) / z;
      const double log_q = static_cast<double>(scores[j]) - lse;
      if (p > 0.0) loss += p * (log(p) - log_q);
      grad = exp(log_q) - p;
    }
    if (dscores != nullptr) dscores[j] = static_cast<T>(grad_scale * grad);
  }
  return loss;
}

}  // namespace seqpar::attn::rowops
