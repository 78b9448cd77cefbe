// The row bodies of the fallback attention (fallback_attention.h), written once for the CPU ops and the CUDA launches
// (attention/cuda/fallback_kernels.cu): C++17 and host-device, so that nvcc compiles them.
#pragma once

#include <cstdint>

#include "dropout.h"
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

// Score modifiers and dropout of one (batch entry, query head, rectangle), as the row bodies read them (docs/design.md,
// "Score modifiers" and "Attention dropout"; the CPU kernels' transform_scores and dropout_multipliers compute the
// same). Pointers point at the rectangle's first query / key (local row i, key j) and are on the device of the
// scores. All off: the bodies are the plain masked softmax and gradient.
struct RowMods {
  double softcap = 0.0;  // > 0: a <- softcap tanh(a / softcap)
  double slope = 0.0;    // ALiBi: a -= slope |q_pos - k_pos| (this head's slope; 0: off)
  const std::int64_t* q_pos = nullptr;  // global positions (read by ALiBi and dropout)
  const std::int64_t* k_pos = nullptr;
  bool dropout = false;
  std::uint64_t seed = 0, threshold = 0;  // keep iff the pair's Philox word >= threshold (dropout_threshold(p))
  double keep_scale = 1.0;                // 1 / (1 - p)
  std::int64_t batch_index = 0, head = 0;  // the counter's b and global query head (head_offset + h)
  const std::int64_t* q_tokens = nullptr;  // MhaForwardArgs::q_tokens of the rectangle's rows; null: tokens = positions
  SEQPAR_HOST_DEVICE bool transforms() const { return softcap > 0.0 || slope != 0.0; }
};

// The score a of local pair (i, j) from the scaled dot product s (softcap, then the ALiBi bias), in double; *dtanh
// <- d a / d s (1 - tanh^2; 1 without softcap).
SEQPAR_HOST_DEVICE inline double mod_score(const RowMods& m, std::int64_t i, std::int64_t j, double s, double* dtanh) {
  double a = s, da = 1.0;
  if (m.softcap > 0.0) {
    const double t = tanh(a / m.softcap);
    a = m.softcap * t;
    da = 1.0 - t * t;
  }
  if (m.slope != 0.0) {
    const std::int64_t d = m.q_pos[i] - m.k_pos[j];
    a -= m.slope * static_cast<double>(d < 0 ? -d : d);
  }
  if (dtanh != nullptr) *dtanh = da;
  return a;
}

// The dropout multiplier of local pair (i, j): keep_scale if kept, else 0 (1 without dropout). The pair's counter
// uses tokens (MhaForwardArgs::q_tokens): the query's token and the key's position moved by the query's token -
// position; a padding query (token -1) keeps positions (attention/cpu/mha_dropout.h, dropout_row_token).
SEQPAR_HOST_DEVICE inline double dropout_factor(const RowMods& m, std::int64_t i, std::int64_t j) {
  if (!m.dropout) return 1.0;
  const std::int64_t qp = m.q_pos[i], qt = m.q_tokens == nullptr ? qp : m.q_tokens[i];
  const std::int64_t q_tok = qt < 0 ? qp : qt, shift = qt < 0 ? 0 : qt - qp;
  return dropout_word(m.seed, m.batch_index, m.head, q_tok, m.k_pos[j] + shift) >= m.threshold ? m.keep_scale : 0.0;
}

// Forward row body: s[0, n) scores of local row i (already scaled) -> p (in place allowed) and the row's lse: the
// scores modified (mod_score) on the band, the masked softmax, then the dropout multipliers (lse stays undropped).
template <typename T>
SEQPAR_HOST_DEVICE inline T fallback_softmax_row(const RowBand& b, const RowMods& m, std::int64_t i, const T* s, T* p) {
  std::int64_t begin = 0, end = 0;
  band_of_row(b, i, begin, end);
  const T* scores = s;
  if (m.transforms()) {
    for (std::int64_t j = begin; j < end; ++j) p[j] = static_cast<T>(mod_score(m, i, j, static_cast<double>(s[j]), nullptr));
    scores = p;
  }
  const T lse = rowops::masked_softmax_row(scores, b.sk, begin, end, p);
  if (m.dropout)
    for (std::int64_t j = begin; j < end; ++j) p[j] = static_cast<T>(static_cast<double>(p[j]) * dropout_factor(m, i, j));
  return lse;
}
template <typename T>
SEQPAR_HOST_DEVICE inline T fallback_softmax_row(const RowBand& b, std::int64_t i, const T* s, T* p) {
  return fallback_softmax_row(b, RowMods{}, i, s, p);
}

// Backward row body: s (scaled scores) -> z p with p = exp(a - lse) on the band (0 elsewhere, and everywhere when
// lse is -inf; a the modified score, z the dropout multiplier), the operand of dV += (z P)^T dO; dp (dO V^T row) ->
// ds = p (z dp - delta) da/ds, in place (FlashAttention-2 with dropout; the softcap's chain rule).
template <typename T>
SEQPAR_HOST_DEVICE inline void fallback_grad_row(const RowBand& b, const RowMods& m, std::int64_t i, T lse, T delta,
                                                 T* s_to_p, T* dp_to_ds) {
  std::int64_t begin = 0, end = 0;
  band_of_row(b, i, begin, end);
  const bool plain = !m.transforms() && !m.dropout;
  for (std::int64_t j = 0; j < b.sk; ++j) {
    const bool on = j >= begin && j < end && lse != rowops::neg_inf<T>();
    if (plain) {
      const T p = on ? rowops::row_exp(s_to_p[j] - lse) : T(0);
      s_to_p[j] = p;
      dp_to_ds[j] = p * (dp_to_ds[j] - delta);
      continue;
    }
    if (!on) {
      s_to_p[j] = T(0);
      dp_to_ds[j] = T(0);
      continue;
    }
    double da = 1.0;
    const T a = static_cast<T>(mod_score(m, i, j, static_cast<double>(s_to_p[j]), &da));
    const T p = rowops::row_exp(a - lse);
    const T z = static_cast<T>(dropout_factor(m, i, j));
    s_to_p[j] = z * p;
    dp_to_ds[j] = static_cast<T>(static_cast<double>(p * (z * dp_to_ds[j] - delta)) * da);
  }
}
template <typename T>
SEQPAR_HOST_DEVICE inline void fallback_grad_row(const RowBand& b, std::int64_t i, T lse, T delta, T* s_to_p,
                                                 T* dp_to_ds) {
  fallback_grad_row(b, RowMods{}, i, lse, delta, s_to_p, dp_to_ds);
}

// A sink logit joins a finished row once (docs/design.md, "Score modifiers"): lse <- logaddexp(lse, sink), the row's
// d outputs o[0, d) scaled by exp(lse_old - lse_new) (0 for a row with no visible key), in double.
template <typename T>
SEQPAR_HOST_DEVICE inline void fallback_sink_row(double sink, std::int64_t d, T* o, T* lse) {
  const double l = static_cast<double>(*lse);
  const double mx = l > sink ? l : sink;
  const double total = mx + log(exp(l - mx) + exp(sink - mx));
  const double factor = exp(l - total);
  for (std::int64_t j = 0; j < d; ++j) o[j] = static_cast<T>(factor * static_cast<double>(o[j]));
  *lse = static_cast<T>(total);
}

// delta of one (row, head): the dot product of its dO and O rows (FlashAttention-2's D_i), d elements.
template <typename T>
SEQPAR_HOST_DEVICE inline T fallback_delta_row(const T* o, const T* g, std::int64_t d) {
  T acc = T(0);
  for (std::int64_t j = 0; j < d; ++j) acc += o[j] * g[j];
  return acc;
}

}  // namespace seqpar::attn::fallback
