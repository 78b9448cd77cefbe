// CPU chunked gated delta rule: forward, backward and segment transitions. Math and conventions: attention/gdn.h and
// docs/design.md, "The chunked GDN kernel". The per-chunk backward below is the hand-derived reverse mode of the chunk
// equations (one step per forward equation, in reverse order); it is checked against the fp64 recurrence in
// tests/unit/test_gdn.cc.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention/cpu/gdn_cpu.h"
#include "attention/cpu/gdn_gemm.h"
#include "attention/cpu/scratch.h"
#include "runtime/error.h"

namespace seqpar::attn::cpu {
namespace {

using Dims = GdnDims;
using namespace gdn;

// ---- element access (storage dtype <-> compute dtype T) -----------------------------------------------------

// Storage of the compute dtype is copied directly (the common case: fp32 activations, fp64 for fp64).
template <typename T>
void load(const TensorView& t, std::int64_t elem_offset, std::int64_t n, T* dst) {
  if (t.dtype() == dtype_v<T>) {
    std::memcpy(dst, static_cast<const T*>(t.data()) + elem_offset, static_cast<std::size_t>(n) * sizeof(T));
    return;
  }
  const auto* src = static_cast<const char*>(t.data()) + elem_offset * static_cast<std::int64_t>(dtype_size(t.dtype()));
  convert(src, t.dtype(), dst, dtype_v<T>, static_cast<std::size_t>(n));
}

template <typename T>
void store(const T* src, std::int64_t n, const TensorView& t, std::int64_t elem_offset) {
  if (t.dtype() == dtype_v<T>) {
    std::memcpy(static_cast<T*>(t.data()) + elem_offset, src, static_cast<std::size_t>(n) * sizeof(T));
    return;
  }
  auto* dst = static_cast<char*>(t.data()) + elem_offset * static_cast<std::int64_t>(dtype_size(t.dtype()));
  convert(src, dtype_v<T>, dst, t.dtype(), static_cast<std::size_t>(n));
}

// ---- per-worker chunk scratch -------------------------------------------------------------------------------

template <typename T>
struct ChunkScratch {
  // Inputs of the current chunk (rows 0..c-1).
  T *q, *qn, *rq, *k, *rk, *v, *g, *beta;
  // Chunk quantities.
  T *gamma, *gam;      // cumulative log decay and its exp [C]
  T* e;                // L: exp(gamma_i - gamma_j) for j <= i, 0 above the diagonal [C, C]
  T *kk, *a, *t;       // k k^T, A (strictly lower), T = (I + A)^-1 [C, C]
  T *kb, *vb, *w, *u;  // diag(beta gam) k, diag(beta) v [C, K] / [C, V]; W = T kb, U = T vb
  T *kt, *vp, *p;      // K~ [C, K], V' [C, V], P = (Q K^T) * L [C, C]
  T *o, *s;            // out [C, V], running state [K, V]
  T* ktr;              // k^T [K, C] (row stride C), the B operand of k k^T and Q K^T
  // Backward.
  T *dout, *dq, *dk, *dv, *dg, *dbeta, *dgamma;
  T *dkt, *dvp, *dp, *dw, *dt, *dvb, *dkb, *x, *da, *ds, *ds_new, *qs;
  T* s0t;    // S_0^T [V, K], the B operand of dQ and dW
  T* bt;     // the transpose buffer of mm_nt
  T* extra;  // `extra` values for the caller (chunk start states, transition state)

  // Elements of one worker's scratch.
  static std::int64_t size(const Dims& d, bool backward, std::int64_t extra_count) {
    return ChunkScratch(d, backward, extra_count, nullptr).total;
  }

  // Carves the buffers out of `base` (size(d, backward, extra_count) elements); base = null only counts.
  ChunkScratch(const Dims& d, bool backward, std::int64_t extra_count, T* base) {
    const std::int64_t C = d.C, K = d.K, V = d.V;
    std::int64_t n = 0;
    auto take = [&](std::int64_t count) {
      const std::int64_t off = n;
      n += (count + 15) / 16 * 16;
      return off;
    };
    const std::int64_t o_q = take(C * K), o_rq = take(C), o_k = take(C * K), o_rk = take(C), o_v = take(C * V),
                       o_g = take(C), o_beta = take(C), o_gamma = take(C), o_gam = take(C), o_kk = take(C * C),
                       o_e = take(C * C), o_a = take(C * C), o_t = take(C * C), o_w = take(C * K), o_u = take(C * V),
                       o_kt = take(C * K), o_vp = take(C * V), o_p = take(C * C), o_o = take(C * V), o_s = take(K * V),
                       o_ktr = take(K * C);
    // Without the backward, the scratch is kept small enough for a core's L2 (at C = 64, K = V = 128: 432 KB
    // instead of 606 KB): q is normalised and scaled in place (qn is the backward's), and kb, vb, dead once W and U
    // are formed, share the buffers of O (when K <= V) and V', which are written only after that.
    const std::int64_t o_qn = backward ? take(C * K) : o_q, o_kb = backward || K > V ? take(C * K) : o_o,
                       o_vb = backward ? take(C * V) : o_vp;
    std::int64_t o_b[18] = {};
    std::int64_t o_qs = 0, o_s0t = 0;
    if (backward) {
      const std::int64_t sizes[18] = {C * V, C * K, C * K, C * V, C,     C,     C,     C * K, C * V,
                                      C * C, C * K, C * C, C * V, C * K, C * C, C * C, K * V, K * V};
      for (int i = 0; i < 18; ++i) o_b[i] = take(sizes[i]);
      o_qs = take(C * V);
      o_s0t = take(V * K);
    }
    // The transpose buffer of mm_nt, which only the backward calls.
    const std::int64_t o_bt = take(backward ? std::max({C * C, C * K, C * V, K * V}) : 0);
    const std::int64_t o_extra = take(extra_count);
    total = n;
    if (base == nullptr) return;
    q = base + o_q;
    qn = base + o_qn;
    rq = base + o_rq;
    k = base + o_k;
    rk = base + o_rk;
    v = base + o_v;
    g = base + o_g;
    beta = base + o_beta;
    gamma = base + o_gamma;
    gam = base + o_gam;
    kk = base + o_kk;
    e = base + o_e;
    a = base + o_a;
    t = base + o_t;
    kb = base + o_kb;
    vb = base + o_vb;
    w = base + o_w;
    u = base + o_u;
    kt = base + o_kt;
    vp = base + o_vp;
    p = base + o_p;
    o = base + o_o;
    s = base + o_s;
    ktr = base + o_ktr;
    if (backward) {
      T** ptrs[18] = {&dout, &dq, &dk, &dv,  &dg,  &dbeta, &dgamma, &dkt, &dvp,
                      &dp,   &dw, &dt, &dvb, &dkb, &x,     &da,     &ds,  &ds_new};
      for (int i = 0; i < 18; ++i) *ptrs[i] = base + o_b[i];
      qs = base + o_qs;
      s0t = base + o_s0t;
    }
    bt = base + o_bt;
    extra = base + o_extra;
  }

 private:
  std::int64_t total = 0;
};

// Asks for rows t0..t0+c-1 of `t` (row r at row(r) width) to be brought into the cache, so that the next chunk's rows
// (one per token) arrive while this chunk computes.
template <typename Row>
inline void prefetch_rows(const TensorView& t, Row&& row, std::int64_t width, std::int64_t t0, std::int64_t c) {
  if (t.empty() || c <= 0) return;
  const std::int64_t esize = static_cast<std::int64_t>(dtype_size(t.dtype())), bytes = width * esize;
  const char* base = static_cast<const char*>(t.data());
  for (std::int64_t i = 0; i < c; ++i) {
    const char* r = base + row(t0 + i) * bytes;
    for (std::int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(r + off);
  }
}

// Prefetches the rows of the chunk at t0 that load_chunk (and the backward's dout) reads; nothing past the sequence.
inline void prefetch_chunk(const GdnForwardArgs& a, const TensorView& dout, const Dims& d, std::int64_t b,
                           std::int64_t h, std::int64_t t0, bool with_q, bool with_v) {
  if (t0 < 0 || t0 >= d.S) return;
  const std::int64_t c = std::min(d.C, d.S - t0);
  auto krow = [&](std::int64_t t) { return d.key_row(b, t, h); };
  auto vrow = [&](std::int64_t t) { return d.value_row(b, t, h); };
  prefetch_rows(a.k, krow, d.K, t0, c);
  if (with_q) prefetch_rows(a.q, krow, d.K, t0, c);
  if (with_v) prefetch_rows(a.v, vrow, d.V, t0, c);
  prefetch_rows(dout, vrow, d.V, t0, c);
}

// Loads rows t0..t0+c-1 of (b, value head h): normalised and scaled q (and the unscaled normalised copy qn with
// 1/norm rq; in a scratch without the backward qn is q's buffer, scaled in place) and normalised k (with rk) of key
// head h / group, v (when load_v), g and beta.
template <typename T>
void load_chunk(const GdnForwardArgs& a, const Dims& d, std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t c,
                bool load_q, bool load_v, T scale, ChunkScratch<T>& w) {
  const std::int64_t K = d.K, V = d.V;
  for (std::int64_t i = 0; i < c; ++i) {
    const std::int64_t tok = d.value_row(b, t0 + i, h);
    const std::int64_t ktok = d.key_row(b, t0 + i, h);
    load(a.k, ktok * K, K, w.k + i * K);
    load(a.g, tok, 1, w.g + i);
    load(a.beta, tok, 1, w.beta + i);
    if (load_v) load(a.v, tok * V, V, w.v + i * V);
    if (a.use_qk_l2norm) {
      T* ki = w.k + i * K;
      const T r = T(1) / std::sqrt(dot(ki, ki, K) + T(kGdnL2NormEps));
      w.rk[i] = r;
      for (std::int64_t j = 0; j < K; ++j) ki[j] *= r;
    }
    if (load_q) {
      T* qi = w.qn + i * K;
      load(a.q, ktok * K, K, qi);
      if (a.use_qk_l2norm) {
        const T r = T(1) / std::sqrt(dot(qi, qi, K) + T(kGdnL2NormEps));
        w.rq[i] = r;
        for (std::int64_t j = 0; j < K; ++j) qi[j] *= r;
      }
      for (std::int64_t j = 0; j < K; ++j) w.q[i * K + j] = scale * qi[j];
    }
  }
}

// Chunk quantities that do not depend on the start state: gamma, exp(gamma), k k^T, A, T, kb, W, K~ and (when
// with_v) vb and U.
template <typename T>
void prepare_chunk(const Dims& d, std::int64_t c, bool with_v, ChunkScratch<T>& w) {
  const std::int64_t C = d.C, K = d.K, V = d.V;
  T acc = 0;
  for (std::int64_t i = 0; i < c; ++i) {
    acc += w.g[i];
    w.gamma[i] = acc;
    w.gam[i] = std::exp(acc);
  }
  transpose(c, K, w.k, K, w.ktr, C);
  mm_nn<T>(c, c, K, T(1), w.k, K, w.ktr, C, w.kk, C, false);
  for (std::int64_t i = 0; i < c; ++i) {
    for (std::int64_t j = 0; j < c; ++j) {
      w.e[i * C + j] = j <= i ? std::exp(w.gamma[i] - w.gamma[j]) : T(0);
      w.a[i * C + j] = j < i ? w.beta[i] * w.e[i * C + j] * w.kk[i * C + j] : T(0);
    }
  }
  // T = (I + A)^-1 by forward substitution: row i of T is e_i - sum_{m < i} A[i, m] T[m, :].
  for (std::int64_t i = 0; i < c; ++i) {
    T* ti = w.t + i * C;
    std::fill(ti, ti + c, T(0));
    ti[i] = T(1);
    for (std::int64_t m = 0; m < i; ++m) {
      const T aim = w.a[i * C + m];
      if (aim == T(0)) continue;
      const T* tm = w.t + m * C;
      for (std::int64_t j = 0; j <= m; ++j) ti[j] -= aim * tm[j];
    }
  }
  const T gamma_last = w.gamma[c - 1];
  for (std::int64_t i = 0; i < c; ++i) {
    const T sb = w.beta[i] * w.gam[i];
    const T sk = std::exp(gamma_last - w.gamma[i]);
    for (std::int64_t j = 0; j < K; ++j) {
      w.kb[i * K + j] = sb * w.k[i * K + j];
      w.kt[i * K + j] = sk * w.k[i * K + j];
    }
  }
  mm_nn<T>(c, K, c, T(1), w.t, C, w.kb, K, w.w, K, false, true);
  if (with_v) {
    for (std::int64_t i = 0; i < c; ++i) {
      for (std::int64_t j = 0; j < V; ++j) w.vb[i * V + j] = w.beta[i] * w.v[i * V + j];
    }
    mm_nn<T>(c, V, c, T(1), w.t, C, w.vb, V, w.u, V, false, true);
  }
}

// P = (Q K^T) * L (after prepare_chunk, which leaves k^T in ktr) with L_ij = exp(gamma_i - gamma_j) for j <= i, 0 above
// the diagonal.
template <typename T>
void decay_scores(const Dims& d, std::int64_t c, ChunkScratch<T>& w) {
  const std::int64_t C = d.C;
  mm_nn<T>(c, c, d.K, T(1), w.q, d.K, w.ktr, C, w.p, C, false);
  for (std::int64_t i = 0; i < c; ++i) {
    for (std::int64_t j = 0; j < c; ++j) {
      w.p[i * C + j] = j <= i ? w.p[i * C + j] * w.e[i * C + j] : T(0);
    }
  }
}

// vp = vsrc - W S for W [c, K] (vsrc [c, n], or null for zeros; S [K, n] with row stride lds).
template <typename T>
void subtract_product(const Dims& d, std::int64_t c, const T* vsrc, std::int64_t n, const T* s, std::int64_t lds, T* vp,
                      ChunkScratch<T>& w) {
  mm_nn<T>(c, n, d.K, T(1), w.w, d.K, s, lds, vp, n, false);
  if (vsrc == nullptr) {
    for (std::int64_t i = 0; i < c * n; ++i) vp[i] = -vp[i];
  } else {
    for (std::int64_t i = 0; i < c * n; ++i) vp[i] = vsrc[i] - vp[i];
  }
}

// vp = vsrc - W S (vsrc [c, n] or null for zeros), then s_next = exp(gamma_last) S + K~^T vp (s_next = null: S itself
// is updated). S and s_next are [K, n] with row stride lds. S is [K, n] with row
// stride lds.
template <typename T>
void advance_state(const Dims& d, std::int64_t c, const T* vsrc, std::int64_t n, T* s, std::int64_t lds, T* vp,
                   ChunkScratch<T>& w, T* s_next = nullptr) {
  const std::int64_t K = d.K;
  subtract_product(d, c, vsrc, n, s, lds, vp, w);
  const T decay = w.gam[c - 1];
  T* dst = s_next != nullptr ? s_next : s;
  for (std::int64_t i = 0; i < K; ++i) {
    for (std::int64_t j = 0; j < n; ++j) dst[i * lds + j] = decay * s[i * lds + j];
  }
  mm_tn<T>(K, n, c, T(1), w.kt, K, vp, n, dst, lds, true);
}

// Runs body(scratch, bh) for bh in [0, count) with one ChunkScratch per OpenMP thread (dynamic schedule, one
// (batch, head) at a time). The scratch of every worker is allocated before the region.
template <typename T, typename Body>
void for_each_head(std::int64_t count, const Dims& d, bool backward, std::int64_t extra_count, Body&& body) {
  const std::int64_t per_worker = ChunkScratch<T>::size(d, backward, extra_count);
  const int workers = max_workers();
  const Tensor owner = zeroed_workspace({workers * per_worker}, dtype_v<T>, "GDN per-thread chunk scratch");
#pragma omp parallel
  {
    const int w = worker_id();
    SEQPAR_ASSERT(w < workers, "worker ", w, " of ", workers);
    ChunkScratch<T> scratch(d, backward, extra_count, static_cast<T*>(owner.data()) + w * per_worker);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t bh = 0; bh < count; ++bh) body(scratch, bh);
  }
}

template <typename T>
T resolve_scale(const GdnForwardArgs& a, const Dims& d) {
  return a.scale > 0.0 ? T(a.scale) : T(1) / std::sqrt(T(d.K));
}

// The per-value-head dq or dk of a grouped backward (H > Hk): a T workspace [B, S, H, K] that the chunk loop writes
// instead of `out`, and reduce() sums the group() value heads of every key head into `out` in value-head order.
// Without grouping (or when `out` is empty) target() is `out` itself and reduce() does nothing.
template <typename T>
class GroupedGrad {
 public:
  GroupedGrad(const Dims& d, const TensorView& out, const char* what) : target_(out) {
    if (d.group() == 1 || d.windowed() || out.empty()) return;
    owner_ = zeroed_workspace({d.B, d.S, d.H, d.K}, dtype_v<T>, what);
    target_ = owner_.view();
  }
  const TensorView& target() const { return target_; }

  void reduce(const Dims& d, const TensorView& out) const {
    if (!owner_.defined()) return;
    const std::int64_t K = d.K, G = d.group(), rows = d.B * d.S * d.Hk;
    const T* src = static_cast<const T*>(owner_.data());
    const WorkerScratch<T> scratch({K}, "GDN dq/dk group sum");
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      // Row r = (b, s, hk) of out; its value heads are rows r G .. r G + G - 1 of the workspace.
      T* acc = scratch.buffer(0).data();
      std::copy(src + r * G * K, src + (r * G + 1) * K, acc);
      for (std::int64_t j = 1; j < G; ++j) {
        const T* x = src + (r * G + j) * K;
        for (std::int64_t e = 0; e < K; ++e) acc[e] += x[e];
      }
      store(acc, K, out, r * K);
    }
  }

 private:
  TensorView target_;
  Tensor owner_;
};

// ---- forward ------------------------------------------------------------------------------------------------

// Work ahead (gdn_cpu.h, GdnAheadBuffer): per chunk, what the forward's state-dependent part reads, in the scratch's
// own layout (row strides K, V and C): the scaled q, W, U, K~ [C, K | V], P [C, C] and exp(gamma) [C].
struct ForwardAheadLayout {
  std::int64_t q = 0, w = 0, u = 0, kt = 0, p = 0, gam = 0, stride = 0;
  explicit ForwardAheadLayout(const Dims& d) {
    const std::int64_t C = d.C, K = d.K, V = d.V;
    w = q + C * K;
    u = w + C * K;
    kt = u + C * V;
    p = kt + C * K;
    gam = p + C * C;
    stride = gam + C;
  }
  // The scratch with its state-independent parts pointed at the buffer's chunk at `base`.
  template <typename T>
  ChunkScratch<T> in_buffer(const ChunkScratch<T>& scratch, T* base) const {
    ChunkScratch<T> x = scratch;
    x.q = base + q;
    x.w = base + w;
    x.u = base + u;
    x.kt = base + kt;
    x.p = base + p;
    x.gam = base + gam;
    return x;
  }
};

// The state-independent part of the forward's chunk at t0 (c rows) in the scratch: inputs, T, W, U, K~ and P.
template <typename T>
void forward_chunk_ahead(const GdnForwardArgs& a, const Dims& d, std::int64_t b, std::int64_t h, std::int64_t t0,
                         std::int64_t c, T scale, ChunkScratch<T>& w) {
  load_chunk(a, d, b, h, t0, c, true, true, scale, w);
  prefetch_chunk(a, {}, d, b, h, t0 + d.C, true, true);
  prepare_chunk(d, c, true, w);
  decay_scores(d, c, w);
}

// The rest of the chunk, from the state S_0 in w.s: O (into w.o) and S_C (in place); reads w.q, w.w, w.u, w.kt, w.p
// and w.gam only.
template <typename T>
void forward_chunk_state(const Dims& d, std::int64_t c, ChunkScratch<T>& w) {
  const std::int64_t K = d.K, V = d.V, KV = K * V;
  // V' = U - W S_0 (state before this chunk), then O = diag(gam) Q S_0 + P V'.
  subtract_product(d, c, w.u, V, w.s, V, w.vp, w);
  mm_nn<T>(c, V, K, T(1), w.q, K, w.s, V, w.o, V, false);
  for (std::int64_t i = 0; i < c; ++i) {
    for (std::int64_t j = 0; j < V; ++j) w.o[i * V + j] *= w.gam[i];
  }
  mm_nn<T>(c, V, c, T(1), w.p, d.C, w.vp, V, w.o, V, true, true);
  // S_C = exp(gamma_C) S_0 + K~^T V'.
  const T decay = w.gam[c - 1];
  for (std::int64_t i = 0; i < KV; ++i) w.s[i] *= decay;
  mm_tn<T>(K, V, c, T(1), w.kt, K, w.vp, V, w.s, V, true);
}

template <typename T>
void forward_impl(const GdnForwardArgs& a, const Dims& d, const TensorView& out, const TensorView& final_state,
                  const GdnAheadBuffer* ahead) {
  const std::int64_t K = d.K, V = d.V, BH = d.B * d.H, KV = K * V, nc = d.num_chunks();
  const T scale = resolve_scale<T>(a, d);
  const ForwardAheadLayout lay(d);
  const std::int64_t done = ahead != nullptr ? ahead->chunks_done : 0;
  for_each_head<T>(BH, d, false, 0, [&](ChunkScratch<T>& w, std::int64_t bh) {
    const std::int64_t b = bh / d.H, h = bh % d.H;
    if (a.initial_state.empty()) {
      std::fill(w.s, w.s + KV, T(0));
    } else {
      load(a.initial_state, bh * KV, KV, w.s);
    }
    for (std::int64_t n = 0, t0 = 0; t0 < d.S; ++n, t0 += d.C) {
      const std::int64_t c = std::min(d.C, d.S - t0);
      ChunkScratch<T> x = w;
      if (n < done) {  // computed ahead: the state part reads it where it lies
        T* base = static_cast<T*>(ahead->data) + (bh * nc + n) * lay.stride;
        x = lay.in_buffer(w, base);
        if (n + 1 < done) {  // the next chunk's part, written long before, into L2 while this chunk computes
          const char* next = reinterpret_cast<const char*>(base + lay.stride);
          const std::int64_t bytes = lay.stride * static_cast<std::int64_t>(sizeof(T));
          for (std::int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(next + off, 0, 2);
        }
      } else {
        forward_chunk_ahead(a, d, b, h, t0, c, scale, x);
      }
      forward_chunk_state(d, c, x);
      for (std::int64_t i = 0; i < c; ++i) store(x.o + i * V, V, out, d.value_row(b, t0 + i, h) * V);
    }
    if (!final_state.empty()) store(w.s, KV, final_state, bh * KV);
  });
}

// Chunks [begin, end) of the forward's work ahead into the buffer.
template <typename T>
void forward_ahead_impl(const GdnForwardArgs& a, const Dims& d, const GdnAheadBuffer& ahead, std::int64_t begin,
                        std::int64_t end) {
  const std::int64_t BH = d.B * d.H, nc = d.num_chunks();
  const T scale = resolve_scale<T>(a, d);
  const ForwardAheadLayout lay(d);
  for_each_head<T>(BH, d, false, 0, [&](ChunkScratch<T>& w, std::int64_t bh) {
    const std::int64_t b = bh / d.H, h = bh % d.H;
    for (std::int64_t n = begin; n < end; ++n) {
      const std::int64_t t0 = n * d.C, c = std::min(d.C, d.S - t0);
      // The parts the state-dependent rest reads are computed where they are kept (the buffer has the scratch's
      // row strides), not in the scratch and copied: one pass less over C (3 K + V + C + 1) values per chunk.
      ChunkScratch<T> x = lay.in_buffer(w, static_cast<T*>(ahead.data) + (bh * nc + n) * lay.stride);
      forward_chunk_ahead(a, d, b, h, t0, c, scale, x);
    }
  });
}

// ---- backward -----------------------------------------------------------------------------------------------

// The backward's forward sweep for (b, h): chunk start states [begin, end) of `starts` [nc, K, V] (state 0: the
// initial state; state n + 1 advanced from state n, which must be there already when begin > 0).
template <typename T>
void backward_sweep_starts(const GdnForwardArgs& a, const Dims& d, std::int64_t b, std::int64_t h, std::int64_t bh,
                           std::int64_t begin, std::int64_t end, T scale, T* starts, ChunkScratch<T>& w) {
  const std::int64_t C = d.C, V = d.V, KV = d.K * d.V;
  if (begin == 0 && end > 0) {
    if (a.initial_state.empty()) {
      std::fill(starts, starts + KV, T(0));
    } else {
      load(a.initial_state, bh * KV, KV, starts);
    }
    begin = 1;
  }
  for (std::int64_t n = begin - 1; n + 1 < end; ++n) {
    const std::int64_t t0 = n * C, c = std::min(C, d.S - t0);
    load_chunk(a, d, b, h, t0, c, false, true, scale, w);
    prefetch_chunk(a, {}, d, b, h, t0 + C, false, true);
    prepare_chunk(d, c, true, w);
    advance_state(d, c, w.u, V, starts + n * KV, V, w.vp, w, starts + (n + 1) * KV);
  }
}

// Chunk start states [begin, end) of the backward's work ahead into the buffer [B H, nc, K, V].
template <typename T>
void backward_ahead_impl(const GdnForwardArgs& a, const Dims& d, const GdnAheadBuffer& ahead, std::int64_t begin,
                         std::int64_t end) {
  const std::int64_t nc = d.num_chunks(), KV = d.K * d.V;
  const T scale = resolve_scale<T>(a, d);
  for_each_head<T>(d.B * d.H, d, false, 0, [&](ChunkScratch<T>& w, std::int64_t bh) {
    backward_sweep_starts(a, d, bh / d.H, bh % d.H, bh, begin, end, scale, static_cast<T*>(ahead.data) + bh * nc * KV,
                          w);
  });
}

template <typename T>
void backward_impl(const GdnBackwardArgs& args, const Dims& d, const TensorView& dq_out, const TensorView& dk_out,
                   const TensorView& dv_out, const TensorView& dg_out, const TensorView& dbeta_out,
                   const TensorView& dinit_out, const GdnAheadBuffer* ahead) {
  const GdnForwardArgs& a = args.fwd;
  const std::int64_t C = d.C, K = d.K, V = d.V, BH = d.B * d.H, KV = K * V;
  const std::int64_t nc = d.num_chunks();
  const bool full = !dq_out.empty() || !dk_out.empty() || !dv_out.empty() || !dg_out.empty() || !dbeta_out.empty();
  const T scale = resolve_scale<T>(a, d);
  // Grouped value heads: each value head's dq, dk contribution goes to [B, S, H, K] in T, summed per key head below.
  const GroupedGrad<T> dq_group(d, dq_out, "GDN dq of every value head"),
      dk_group(d, dk_out, "GDN dk of every value head");
  const TensorView &dq_dst = dq_group.target(), &dk_dst = dk_group.target();
  // The start state of every chunk of one (batch, head) lives in the scratch's extra buffer, or in the work ahead's
  // buffer (its first ahead->chunks_done computed there already).
  const bool use_ahead = full && ahead != nullptr;
  for_each_head<T>(BH, d, true, full && !use_ahead ? nc * KV : 0, [&](ChunkScratch<T>& w, std::int64_t bh) {
    T* starts = use_ahead ? static_cast<T*>(ahead->data) + bh * nc * KV : w.extra;
    const std::int64_t b = bh / d.H, h = bh % d.H;
    // Forward sweep: the start state of every chunk, each advanced from the previous one in place.
    if (full) backward_sweep_starts(a, d, b, h, bh, use_ahead ? ahead->chunks_done : 0, nc, scale, starts, w);
    if (args.dfinal_state.empty()) {
      std::fill(w.ds, w.ds + KV, T(0));
    } else {
      load(args.dfinal_state, bh * KV, KV, w.ds);
    }
    for (std::int64_t n = nc - 1; n >= 0; --n) {
      const std::int64_t t0 = n * C, c = std::min(C, d.S - t0);
      load_chunk(a, d, b, h, t0, c, true, full, scale, w);
      prefetch_chunk(a, args.dout, d, b, h, t0 - C, true, full);
      prepare_chunk(d, c, full, w);
      for (std::int64_t i = 0; i < c; ++i) {
        const std::int64_t tok = d.value_row(b, t0 + i, h);
        if (args.dout.empty()) {
          std::fill(w.dout + i * V, w.dout + (i + 1) * V, T(0));
        } else {
          load(args.dout, tok * V, V, w.dout + i * V);
        }
      }
      decay_scores(d, c, w);
      const T* s0 = full ? starts + n * KV : nullptr;
      const T gam_c = w.gam[c - 1];
      const T gamma_c = w.gamma[c - 1];
      // dOg = diag(gam) dO, used by dS_0 and dQ.
      T* dog = w.qs;  // reused below only after dog is consumed
      for (std::int64_t i = 0; i < c; ++i) {
        for (std::int64_t j = 0; j < V; ++j) dog[i * V + j] = w.gam[i] * w.dout[i * V + j];
      }
      // S_C = gam_c S_0 + K~^T V':  dV' = K~ dS_C.
      mm_nn<T>(c, V, K, T(1), w.kt, K, w.ds, V, w.dvp, V, false);
      // O += P V':  dV' += P^T dO.
      mm_tn<T>(c, V, c, T(1), w.p, C, w.dout, V, w.dvp, V, true);
      // dS_0 = gam_c dS_C + Q^T diag(gam) dO - W^T dV'.
      for (std::int64_t i = 0; i < KV; ++i) w.ds_new[i] = gam_c * w.ds[i];
      mm_tn<T>(K, V, c, T(1), w.q, K, dog, V, w.ds_new, V, true);
      mm_tn<T>(K, V, c, T(-1), w.w, K, w.dvp, V, w.ds_new, V, true);
      if (full) {
        std::fill(w.dgamma, w.dgamma + c, T(0));
        std::fill(w.dbeta, w.dbeta + c, T(0));
        // Recompute V' = U - W S_0.
        subtract_product(d, c, w.u, V, s0, V, w.vp, w);
        // dQ from the inter-chunk term O_i += gam_i Q_i S_0: dQ = diag(gam) dO S_0^T; dgamma_i += <dO_i, gam_i
        // (Q S_0)_i>.
        transpose(K, V, s0, V, w.s0t, K);
        mm_nn<T>(c, K, V, T(1), dog, V, w.s0t, K, w.dq, K, false);
        for (std::int64_t i = 0; i < c; ++i) w.dgamma[i] += dot(w.dq + i * K, w.q + i * K, K);
        // From S_C: dgamma_c += gam_c <S_0, dS_C>; dK~ = V' dS_C^T, then into dk and gamma.
        w.dgamma[c - 1] += gam_c * dot(s0, w.ds, KV);
        mm_nt<T>(c, K, V, T(1), w.vp, V, w.ds, V, w.dkt, K, false, w.bt);
        for (std::int64_t j = 0; j < c; ++j) {
          const T r = dot(w.dkt + j * K, w.kt + j * K, K);
          w.dgamma[c - 1] += r;
          w.dgamma[j] -= r;
          const T sk = std::exp(gamma_c - w.gamma[j]);
          for (std::int64_t e = 0; e < K; ++e) w.dk[j * K + e] = sk * w.dkt[j * K + e];
        }
        // Intra-chunk term O += P V' with P = (Q K^T) * L: dP = dO V'^T (lower part).
        mm_nt<T>(c, c, V, T(1), w.dout, V, w.vp, V, w.dp, C, false, w.bt);
        for (std::int64_t i = 0; i < c; ++i) {
          for (std::int64_t j = 0; j < c; ++j) {
            if (j > i) {
              w.dp[i * C + j] = T(0);
              continue;
            }
            const T z = w.dp[i * C + j] * w.p[i * C + j];
            w.dgamma[i] += z;
            w.dgamma[j] -= z;
            w.dp[i * C + j] *= w.e[i * C + j];  // now d(Q K^T)
          }
        }
        mm_nn<T>(c, K, c, T(1), w.dp, C, w.k, K, w.dq, K, true, true);
        mm_tn<T>(c, K, c, T(1), w.dp, C, w.q, K, w.dk, K, true);
        // V' = U - W S_0: dU = dV', dW = -dV' S_0^T.
        mm_nn<T>(c, K, V, T(-1), w.dvp, V, w.s0t, K, w.dw, K, false);
        // U = T vb, W = T kb: dT = dU vb^T + dW kb^T (lower part), dvb = T^T dU, dkb = T^T dW.
        mm_nt<T>(c, c, V, T(1), w.dvp, V, w.vb, V, w.dt, C, false, w.bt);
        mm_nt<T>(c, c, K, T(1), w.dw, K, w.kb, K, w.dt, C, true, w.bt);
        mm_tn<T>(c, V, c, T(1), w.t, C, w.dvp, V, w.dvb, V, false);
        mm_tn<T>(c, K, c, T(1), w.t, C, w.dw, K, w.dkb, K, false);
        for (std::int64_t i = 0; i < c; ++i) {
          w.dbeta[i] += dot(w.dvb + i * V, w.v + i * V, V);
          for (std::int64_t j = 0; j < V; ++j) w.dv[i * V + j] = w.beta[i] * w.dvb[i * V + j];
          const T sk = dot(w.dkb + i * K, w.k + i * K, K);
          w.dbeta[i] += w.gam[i] * sk;
          w.dgamma[i] += w.beta[i] * w.gam[i] * sk;
          const T sb = w.beta[i] * w.gam[i];
          for (std::int64_t j = 0; j < K; ++j) w.dk[i * K + j] += sb * w.dkb[i * K + j];
        }
        // T = (I + A)^-1: dA = -T^T dT T^T, used below the diagonal only.
        mm_nt<T>(c, c, c, T(1), w.dt, C, w.t, C, w.x, C, false, w.bt);
        mm_tn<T>(c, c, c, T(-1), w.t, C, w.x, C, w.da, C, false);
        // A_ij = beta_i exp(gamma_i - gamma_j) (k k^T)_ij: into beta, gamma and d(k k^T) (kept in dt).
        for (std::int64_t i = 0; i < c; ++i) {
          for (std::int64_t j = 0; j < c; ++j) w.dt[i * C + j] = T(0);
        }
        for (std::int64_t i = 1; i < c; ++i) {
          for (std::int64_t j = 0; j < i; ++j) {
            const T da = w.da[i * C + j];
            const T e = w.e[i * C + j];
            w.dbeta[i] += da * e * w.kk[i * C + j];
            const T y = da * w.a[i * C + j];
            w.dgamma[i] += y;
            w.dgamma[j] -= y;
            const T dkk = da * w.beta[i] * e;
            w.dt[i * C + j] += dkk;
            w.dt[j * C + i] += dkk;
          }
        }
        mm_nn<T>(c, K, c, T(1), w.dt, C, w.k, K, w.dk, K, true);
        // gamma = cumsum(g): dg = reverse cumsum of dgamma.
        T acc = 0;
        for (std::int64_t i = c - 1; i >= 0; --i) {
          acc += w.dgamma[i];
          w.dg[i] = acc;
        }
        // Through the scale and the L2 normalisation: dx = (dy - y (y . dy)) / |x|.
        for (std::int64_t i = 0; i < c; ++i) {
          T* dqi = w.dq + i * K;
          for (std::int64_t j = 0; j < K; ++j) dqi[j] *= scale;
          if (a.use_qk_l2norm) {
            const T* y = w.qn + i * K;
            const T yd = dot(y, dqi, K);
            for (std::int64_t j = 0; j < K; ++j) dqi[j] = (dqi[j] - y[j] * yd) * w.rq[i];
            T* dki = w.dk + i * K;
            const T* z = w.k + i * K;
            const T zd = dot(z, dki, K);
            for (std::int64_t j = 0; j < K; ++j) dki[j] = (dki[j] - z[j] * zd) * w.rk[i];
          }
        }
        for (std::int64_t i = 0; i < c; ++i) {
          const std::int64_t tok = d.value_row(b, t0 + i, h);
          if (!dq_dst.empty()) store(w.dq + i * K, K, dq_dst, tok * K);
          if (!dk_dst.empty()) store(w.dk + i * K, K, dk_dst, tok * K);
          if (!dv_out.empty()) store(w.dv + i * V, V, dv_out, tok * V);
          if (!dg_out.empty()) store(w.dg + i, 1, dg_out, tok);
          if (!dbeta_out.empty()) store(w.dbeta + i, 1, dbeta_out, tok);
        }
      }
      std::swap(w.ds, w.ds_new);
    }
    if (!dinit_out.empty()) store(w.ds, KV, dinit_out, bh * KV);
  });
  dq_group.reduce(d, dq_out);
  dk_group.reduce(d, dk_out);
}

// ---- transition ---------------------------------------------------------------------------------------------

template <typename T>
void transition_impl(const GdnForwardArgs& a, const Dims& d, const TensorView& m_out, const TensorView& u_out) {
  const std::int64_t K = d.K, V = d.V, BH = d.B * d.H, n = K + V;
  const T scale = resolve_scale<T>(a, d);
  // The state [M | U] of K + V columns starts at [I | 0]; the "values" are [0 | v]. Both, and V' of the wide
  // state, live in the scratch's extra buffer.
  for_each_head<T>(BH, d, false, K * n + 2 * d.C * n, [&](ChunkScratch<T>& w, std::int64_t bh) {
    T* s = w.extra;
    T* vsrc = s + K * n;
    T* vp = vsrc + d.C * n;
    const std::int64_t b = bh / d.H, h = bh % d.H;
    std::fill(s, s + K * n, T(0));
    for (std::int64_t i = 0; i < K; ++i) s[i * n + i] = T(1);
    for (std::int64_t t0 = 0; t0 < d.S; t0 += d.C) {
      const std::int64_t c = std::min(d.C, d.S - t0);
      load_chunk(a, d, b, h, t0, c, false, true, scale, w);
      prepare_chunk(d, c, true, w);
      for (std::int64_t i = 0; i < c; ++i) {
        std::fill(vsrc + i * n, vsrc + i * n + K, T(0));
        std::copy(w.u + i * V, w.u + (i + 1) * V, vsrc + i * n + K);
      }
      advance_state(d, c, vsrc, n, s, n, vp, w);
    }
    for (std::int64_t i = 0; i < K; ++i) {
      store(s + i * n, K, m_out, bh * K * K + i * K);
      store(s + i * n + K, V, u_out, bh * K * V + i * V);
    }
  });
}

}  // namespace

void gdn_forward_cpu(const GdnForwardArgs& args, const GdnDims& d, const TensorView& out, const TensorView& final_state,
                     const GdnAheadBuffer* ahead) {
  if (accumulator_dtype(args.q.dtype()) == DType::kFloat64) {
    forward_impl<double>(args, d, out, final_state, ahead);
  } else {
    forward_impl<float>(args, d, out, final_state, ahead);
  }
}

void gdn_backward_cpu(const GdnBackwardArgs& args, const GdnDims& d, const TensorView& dq, const TensorView& dk,
                      const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                      const TensorView& dinitial_state, const GdnAheadBuffer* ahead) {
  if (accumulator_dtype(args.fwd.q.dtype()) == DType::kFloat64) {
    backward_impl<double>(args, d, dq, dk, dv, dg, dbeta, dinitial_state, ahead);
  } else {
    backward_impl<float>(args, d, dq, dk, dv, dg, dbeta, dinitial_state, ahead);
  }
}

std::int64_t gdn_ahead_numel_cpu(const GdnDims& d, bool backward) {
  const std::int64_t per_chunk = backward ? d.K * d.V : ForwardAheadLayout(d).stride;
  return d.B * d.H * d.num_chunks() * per_chunk;
}

void gdn_ahead_cpu(const GdnForwardArgs& args, const GdnDims& d, bool backward, const GdnAheadBuffer& ahead,
                   std::int64_t chunk_begin, std::int64_t chunk_end) {
  const bool f64 = accumulator_dtype(args.q.dtype()) == DType::kFloat64;
  if (backward) {
    if (f64) {
      backward_ahead_impl<double>(args, d, ahead, chunk_begin, chunk_end);
    } else {
      backward_ahead_impl<float>(args, d, ahead, chunk_begin, chunk_end);
    }
  } else if (f64) {
    forward_ahead_impl<double>(args, d, ahead, chunk_begin, chunk_end);
  } else {
    forward_ahead_impl<float>(args, d, ahead, chunk_begin, chunk_end);
  }
}

void gdn_transition_cpu(const GdnForwardArgs& args, const GdnDims& d, const TensorView& m, const TensorView& u) {
  if (accumulator_dtype(args.q.dtype()) == DType::kFloat64) {
    transition_impl<double>(args, d, m, u);
  } else {
    transition_impl<float>(args, d, m, u);
  }
}

}  // namespace seqpar::attn::cpu
