// The device-neutral fallback attention driver and its CPU ops (fallback_attention.h).
#include "attention/fallback_attention.h"

#include <algorithm>

#include "runtime/error.h"

namespace seqpar::attn::fallback {

RowBand fallback_row_band(const SdpaMask& m, std::int64_t sq, std::int64_t sk) {
  RowBand b;
  b.sq = sq;
  b.sk = sk;
  b.e = m.align == DiagonalAlignment::kBottomRight ? sk - sq : 0;
  b.left = m.left_bound;
  b.causal = m.causal;
  return b;
}

namespace {

// Pointer offsets of one head's rows in the [B, S, H, D] and [B, H, S] layouts.
struct Heads {
  std::int64_t sq, sk, hq, hkv, d;
  std::int64_t q_row(std::int64_t b, std::int64_t i, std::int64_t h) const { return ((b * sq + i) * hq + h) * d; }
  std::int64_t k_row(std::int64_t b, std::int64_t j, std::int64_t hk) const { return ((b * sk + j) * hkv + hk) * d; }
  std::int64_t stat(std::int64_t b, std::int64_t h, std::int64_t i) const { return (b * hq + h) * sq + i; }
};

// The RowMods of (b, h, rectangle r) (fallback_rows.h).
template <typename T>
RowMods row_mods(const FallbackProblem<T>& p, std::int64_t b, std::int64_t h, const LoweredRect& r) {
  RowMods m;
  m.softcap = p.softcap;
  m.slope = p.alibi == nullptr ? 0.0 : p.alibi[h];
  m.dropout = p.dropout.p > 0.0;
  if (m.slope != 0.0 || m.dropout) {
    SEQPAR_CHECK(p.q_pos != nullptr && p.k_pos != nullptr, "fallback attention: ALiBi and dropout need q_pos and k_pos");
    m.q_pos = p.q_pos + r.q_begin;
    m.k_pos = p.k_pos + r.k_begin;
    if (p.q_tokens != nullptr) m.q_tokens = p.q_tokens + r.q_begin;
  }
  if (m.dropout) {
    m.seed = p.dropout.seed;
    m.threshold = dropout_threshold(p.dropout.p);
    m.keep_scale = 1.0 / (1.0 - p.dropout.p);
    m.batch_index = b;
    m.head = p.head_offset + h;
  }
  return m;
}

// Calls fn(b, h, hk, rect, band, mods, t0, rows) for every tile of every rectangle of every head, in a fixed order.
template <typename T, typename Fn>
void for_each_tile(const FallbackProblem<T>& p, const std::vector<LoweredRect>& rects, Fn&& fn) {
  const std::int64_t group = p.hq / p.hkv, tile = std::max<std::int64_t>(p.tile_rows, 1);
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.hq; ++h) {
      for (const LoweredRect& r : rects) {
        if (r.sq() <= 0 || r.sk() <= 0) continue;
        const RowBand band = fallback_row_band(r.mask, r.sq(), r.sk());
        const RowMods mods = row_mods(p, b, h, r);
        for (std::int64_t t0 = 0; t0 < r.sq(); t0 += tile)
          fn(b, h, h / group, r, band, mods, t0, std::min(tile, r.sq() - t0));
      }
    }
  }
}

}  // namespace

template <typename T>
void fallback_forward(FallbackOps<T>& ops, const FallbackProblem<T>& p, const std::vector<LoweredRect>& rects, T* out,
                      T* lse) {
  const Heads x{p.sq, p.sk, p.hq, p.hkv, p.head_dim};
  const std::int64_t ldq = p.hq * p.head_dim, ldk = p.hkv * p.head_dim, D = p.head_dim;
  for_each_tile(p, rects,
                [&](std::int64_t b, std::int64_t h, std::int64_t hk, const LoweredRect& r, const RowBand& band,
                    const RowMods& mods, std::int64_t t0, std::int64_t rows) {
                  const std::int64_t i = r.q_begin + t0, sk = r.sk();
                  T* s = ops.scratch(0, rows * sk);
                  T* lse_t = ops.scratch(1, rows);
                  T* o_t = ops.scratch(2, rows * D);
                  ops.gemm(false, true, rows, sk, D, p.scale, p.q + x.q_row(b, i, h), ldq,
                           p.k + x.k_row(b, r.k_begin, hk), ldk, T(0), s, sk);
                  ops.softmax_rows(band, mods, t0, rows, s, lse_t);
                  ops.gemm(false, false, rows, D, sk, T(1), s, sk, p.v + x.k_row(b, r.k_begin, hk), ldk, T(0), o_t, D);
                  ops.merge_rows(rows, D, out + x.q_row(b, i, h), ldq, lse + x.stat(b, h, i), o_t, D, lse_t);
                });
  if (p.sinks == nullptr) return;
  for (std::int64_t b = 0; b < p.batch; ++b)  // every rectangle merged: each row's sink joins it once
    for (std::int64_t h = 0; h < p.hq; ++h)
      ops.sink_rows(p.sinks[h], p.sq, D, out + x.q_row(b, 0, h), ldq, lse + x.stat(b, h, 0));
}

template <typename T>
void fallback_backward(FallbackOps<T>& ops, const FallbackProblem<T>& p, const std::vector<LoweredRect>& rects,
                       const T* dout, const T* lse, const T* delta, T* dq, T* dk, T* dv) {
  const Heads x{p.sq, p.sk, p.hq, p.hkv, p.head_dim};
  const std::int64_t ldq = p.hq * p.head_dim, ldk = p.hkv * p.head_dim, D = p.head_dim;
  for_each_tile(
      p, rects,
      [&](std::int64_t b, std::int64_t h, std::int64_t hk, const LoweredRect& r, const RowBand& band,
          const RowMods& mods, std::int64_t t0, std::int64_t rows) {
        const std::int64_t i = r.q_begin + t0, sk = r.sk();
        const T* q = p.q + x.q_row(b, i, h);
        const T* k = p.k + x.k_row(b, r.k_begin, hk);
        const T* v = p.v + x.k_row(b, r.k_begin, hk);
        const T* g = dout + x.q_row(b, i, h);
        T* s = ops.scratch(0, rows * sk);
        T* dp = ops.scratch(3, rows * sk);
        ops.gemm(false, true, rows, sk, D, p.scale, q, ldq, k, ldk, T(0), s, sk);              // scores
        ops.gemm(false, true, rows, sk, D, T(1), g, ldq, v, ldk, T(0), dp, sk);                // dP = dO V^T
        ops.grad_rows(band, mods, t0, rows, lse + x.stat(b, h, i), delta + x.stat(b, h, i), s, dp);  // s = zP, dp = dS
        ops.gemm(false, false, rows, D, sk, p.scale, dp, sk, k, ldk, T(1), dq + x.q_row(b, i, h), ldq);
        ops.gemm(true, false, sk, D, rows, p.scale, dp, sk, q, ldq, T(1), dk + x.k_row(b, r.k_begin, hk), ldk);
        ops.gemm(true, false, sk, D, rows, T(1), s, sk, g, ldq, T(1), dv + x.k_row(b, r.k_begin, hk), ldk);
      });
}

// ---- CPU ops ----

template <typename T>
void CpuFallbackOps<T>::gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, T alpha,
                             const T* a, std::int64_t lda, const T* b, std::int64_t ldb, T beta, T* c,
                             std::int64_t ldc) {
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      T acc = T(0);
      for (std::int64_t l = 0; l < k; ++l) {
        const T av = trans_a ? a[l * lda + i] : a[i * lda + l];
        const T bv = trans_b ? b[j * ldb + l] : b[l * ldb + j];
        acc += av * bv;
      }
      T& cv = c[i * ldc + j];
      cv = beta == T(0) ? alpha * acc : alpha * acc + beta * cv;
    }
  }
}

template <typename T>
void CpuFallbackOps<T>::softmax_rows(const RowBand& band, const RowMods& mods, std::int64_t i0, std::int64_t rows, T* s,
                                     T* lse) {
  for (std::int64_t r = 0; r < rows; ++r)
    lse[r] = fallback_softmax_row(band, mods, i0 + r, s + r * band.sk, s + r * band.sk);
}

template <typename T>
void CpuFallbackOps<T>::grad_rows(const RowBand& band, const RowMods& mods, std::int64_t i0, std::int64_t rows,
                                  const T* lse, const T* delta, T* s, T* dp) {
  for (std::int64_t r = 0; r < rows; ++r)
    fallback_grad_row(band, mods, i0 + r, lse[r], delta[r], s + r * band.sk, dp + r * band.sk);
}

template <typename T>
void CpuFallbackOps<T>::sink_rows(double sink, std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse) {
  for (std::int64_t r = 0; r < rows; ++r) fallback_sink_row(sink, d, o + r * ldo, lse + r);
}

template <typename T>
void CpuFallbackOps<T>::merge_rows(std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse, const T* o_b,
                                   std::int64_t ldo_b, const T* lse_b) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const rowops::MergeWeights<T> w = rowops::lse_merge_weights(lse[r], lse_b[r]);
    for (std::int64_t j = 0; j < d; ++j)
      o[r * ldo + j] = rowops::lse_merge_value(w, o[r * ldo + j], o_b[r * ldo_b + j]);
    lse[r] = w.lse;
  }
}

template <typename T>
T* CpuFallbackOps<T>::scratch(int slot, std::int64_t n) {
  std::vector<T>& b = buf_[slot];
  if (static_cast<std::int64_t>(b.size()) < n) b.resize(static_cast<std::size_t>(n));
  return b.data();
}

template void fallback_forward<float>(FallbackOps<float>&, const FallbackProblem<float>&,
                                      const std::vector<LoweredRect>&, float*, float*);
template void fallback_forward<double>(FallbackOps<double>&, const FallbackProblem<double>&,
                                       const std::vector<LoweredRect>&, double*, double*);
template void fallback_backward<float>(FallbackOps<float>&, const FallbackProblem<float>&,
                                       const std::vector<LoweredRect>&, const float*, const float*, const float*,
                                       float*, float*, float*);
template void fallback_backward<double>(FallbackOps<double>&, const FallbackProblem<double>&,
                                        const std::vector<LoweredRect>&, const double*, const double*, const double*,
                                        double*, double*, double*);
template class CpuFallbackOps<float>;
template class CpuFallbackOps<double>;

}  // namespace seqpar::attn::fallback
