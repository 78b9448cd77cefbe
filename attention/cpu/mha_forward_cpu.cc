// CPU flash-attention forward (FlashAttention-2, Dao 2023, Algorithm 1; docs/design.md, "MHA on one device").
//
// Work item: (batch, up to 8 query heads of one KV group, tile of kBlockQ queries), the heads taking each key tile in
// turn while its K and V are hot in cache, or for decode shapes (group * Sq <= kBlockQ, no score transform, no
// dropout) (batch, KV head) with the group's query heads as the tile's rows, scheduled by OpenMP. For
// each visible tile of kBlockK keys: S = Q K^T (Q pre-scaled by scale * log2 e, so that exp2 replaces exp), online
// softmax in base 2 with running row max m and row sum l, O = diag(alpha) O + P V. Only [kBlockQ, kBlockK] scores exist
// at a time. K (transposed per key tile) and V are converted to the compute type once per call and shared by all
// workers, unless they already are of the compute type: then V is read in place, and so is K by decode-shape work items
// (each transposes the key tile it attends; no copy of the cache per call). Each output element is produced by one work
// item in a fixed order of key tiles: bitwise deterministic for any thread count. Dropout: after the row sums, P is
// multiplied by the tile's multipliers z (cpu/mha_dropout.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "attention/cpu/mha_cpu.h"
#include "attention/cpu/mha_simd.h"
#include "attention/cpu/scratch.h"
#include "runtime/dtype.h"
#include "runtime/tensor.h"

namespace seqpar::attn::cpu {

KeyRanges key_ranges(std::span<const std::int64_t> q_pos, std::int64_t sq, std::span<const std::int64_t> k_pos,
                     std::int64_t sk, const MaskSpec& mask) {
  KeyRanges r;
  r.begin.assign(static_cast<std::size_t>(sq), 0);
  r.end.assign(static_cast<std::size_t>(sq), sk);
  const bool docs = !mask.doc_lo.empty();
  if (!mask.causal && !docs) return r;
  auto qp = [&](std::int64_t i) { return q_pos.empty() ? i : q_pos[static_cast<std::size_t>(i)]; };
  auto kp = [&](std::int64_t j) { return k_pos.empty() ? j : k_pos[static_cast<std::size_t>(j)]; };
  // first key index with k_pos > x (k_pos non-decreasing)
  auto upper = [&](std::int64_t x) {
    std::int64_t lo = 0, hi = sk;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (kp(mid) <= x)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo;
  };
  for (std::int64_t i = 0; i < sq; ++i) {
    const std::size_t u = static_cast<std::size_t>(i);
    const std::int64_t pos = qp(i);
    if (mask.causal) r.end[u] = upper(pos);
    // window: k_pos > pos - W, i.e. the first index with k_pos > pos - W
    if (mask.window > 0) r.begin[u] = upper(pos - mask.window);
    // document: doc_lo <= k_pos < doc_hi, i.e. from the first index with k_pos > doc_lo - 1 to the first with
    // k_pos > doc_hi - 1 (one contiguous range intersected with the causal one: still one range)
    if (docs) {
      r.begin[u] = std::max(r.begin[u], upper(mask.doc_lo[u] - 1));
      r.end[u] = std::min(r.end[u], upper(mask.doc_hi[u] - 1));
    }
  }
  return r;
}

namespace {

template <typename T>
constexpr DType compute_dtype() {
  return std::is_same_v<T, double> ? DType::kFloat64 : DType::kFloat32;
}

// Query heads of one KV group handled by one task: the whole group up to 8 heads, else the largest divisor of the
// group that is at most 8 (bounds the per-worker Q and O tiles).
std::int64_t head_chunk(std::int64_t group) {
  std::int64_t c = std::min<std::int64_t>(group, 8);
  while (group % c != 0) --c;
  return c;
}

template <typename T>
void forward_typed(const MhaParams& p, void* out, DType out_dtype, void* lse, DType lse_dtype) {
  using S = Simd<T>;
  using V = typename S::V;
  constexpr int W = S::W;
  constexpr int BQ = kBlockQ, BK = kBlockK;
  const std::int64_t B = p.batch, Sq = p.sq, Sk = p.sk, Hq = p.hq, Hkv = p.hkv, D = p.head_dim;
  const auto [group, Dp, nkt, nqt, Skp] = mha_tiling(p, W);
  const KeyRanges& kr = *p.ranges;
  const DType cdt = compute_dtype<T>();
  const std::size_t in_size = dtype_size(p.dtype), out_size = dtype_size(out_dtype);
  // with a score transform, Q stays unscaled and transform_scores applies scale and log2 e
  const bool transform = p.has_score_transform();
  const T qscale = transform ? T(1) : static_cast<T>(p.scale * 1.4426950408889634);

  // Decode shape (few queries, no per-head score transform or dropout): one task per (b, kv head) whose tile rows
  // are the group's query heads times the Sq queries, row r = (head hk * group + r / Sq, query r % Sq), so that a
  // task reads its K and V rows once for the whole group. Otherwise one task per (b, query head, query tile).
  const bool grouped = !transform && !p.dropout.on && group * Sq <= BQ;
  // K and V already of the compute type are read in place: V rows directly by the P V product (when D needs no
  // padding), K tiles transposed into a per-worker [D][BK] buffer by the task that attends them (grouped tasks only;
  // with many query tiles one shared transposition per call is cheaper). Otherwise K^T per key tile [nkt][D][BK]
  // and V [Skp][Dp] per (b, kv head), zero padded, are converted once per call and shared by all workers. The
  // products see the same numbers in the same order either way: the results are bitwise the same.
  const bool k_in_place = grouped && p.dtype == cdt;
  const bool v_in_place = p.dtype == cdt && Dp == D;
  const std::int64_t kt_size = nkt * D * BK, v_size = Skp * Dp;
  Tensor kt_pack = zeroed_workspace({k_in_place ? 0 : B * Hkv * kt_size}, cdt, "mha_forward K pack");
  Tensor v_pack = zeroed_workspace({v_in_place ? 0 : B * Hkv * v_size}, cdt, "mha_forward V pack");
  T* ktp = static_cast<T*>(kt_pack.data());
  T* vp = static_cast<T*>(v_pack.data());
  const char* kin = static_cast<const char*>(p.k);
  const char* vin = static_cast<const char*>(p.v);
  const bool parallel = static_cast<double>(B) * Hq * Sq * Sk * D >= kMinParallelWork;
  // Query heads per task (one for grouped tasks, whose rows already span the group; see the task loop).
  const std::int64_t hc = grouped ? 1 : head_chunk(group), nhc = Hq / hc;
  // Per-worker buffers, allocated before the regions: a converted K row; Q tiles, O tiles, the S tile, m, l (per
  // head of the task), a row, the dropout multipliers, an in-place K tile transposed.
  const WorkerScratch<T> ws({D, hc * BQ * Dp, hc * BQ * Dp, BQ * BK, hc * BQ, hc * BQ, Dp, p.dropout.on ? BQ * BK : 0,
                             k_in_place ? D * BK : 0},
                            "mha_forward per-thread scratch", region_workers(parallel));
  // K^T of keys [j0, j1) of (b, kv head h) into `tile` [D][BK]: columns past j1 - j0 stay zero.
  auto transpose_k = [&](std::int64_t b, std::int64_t h, std::int64_t j0, std::int64_t j1, T* tile, std::span<T> row) {
    for (std::int64_t j = j0; j < j1; ++j) {
      const std::size_t off = static_cast<std::size_t>(((b * Sk + j) * Hkv + h) * D) * in_size;
      const T* src = reinterpret_cast<const T*>(kin + off);
      if (!k_in_place) {
        convert(kin + off, p.dtype, row.data(), cdt, static_cast<std::size_t>(D));
        src = row.data();
      }
      for (std::int64_t d = 0; d < D; ++d) tile[d * BK + (j - j0)] = src[d];
    }
  };
  if (!k_in_place || !v_in_place) {
#pragma omp parallel if (parallel)
    {
      const std::span<T> row = ws.buffer(0);
#pragma omp for schedule(static)
      for (std::int64_t t = 0; t < B * Hkv * nkt; ++t) {
        const std::int64_t bh = t / nkt, kt = t % nkt, b = bh / Hkv, h = bh % Hkv;
        const std::int64_t j0 = kt * BK, j1 = std::min(Sk, j0 + BK);
        if (!k_in_place) transpose_k(b, h, j0, j1, ktp + bh * kt_size + kt * D * BK, row);
        for (std::int64_t j = j0; !v_in_place && j < j1; ++j) {
          const std::size_t off = static_cast<std::size_t>(((b * Sk + j) * Hkv + h) * D) * in_size;
          convert(vin + off, p.dtype, vp + bh * v_size + j * Dp, cdt, static_cast<std::size_t>(D));
        }
      }
    }
  }
  // Visible key ranges of a grouped task's rows (the same for every task).
  KeyRanges grouped_ranges;
  if (grouped) {
    for (std::int64_t r = 0; r < group * Sq; ++r) {
      grouped_ranges.begin.push_back(kr.begin[static_cast<std::size_t>(r % Sq)]);
      grouped_ranges.end.push_back(kr.end[static_cast<std::size_t>(r % Sq)]);
    }
  }
  const KeyRanges& rows_kr = grouped ? grouped_ranges : kr;

  const char* qin = static_cast<const char*>(p.q);
  char* outc = static_cast<char*>(out);
  // Otherwise a task takes `hc` query heads of one KV group for one query tile: each key tile's K and V are read once
  // for all of them (hc times fewer reads of K / V than one head per task, which streams the whole K / V of the head
  // from the outer caches once per query tile). Every output row is computed exactly as with one head per task.
  const std::int64_t num_tasks = grouped ? B * Hkv : B * nhc * nqt;
#pragma omp parallel if (parallel)
  {
    const std::span<T> qt_all = ws.buffer(1), o_all = ws.buffer(2), s = ws.buffer(3), m_all = ws.buffer(4),
                       l_all = ws.buffer(5), row = ws.buffer(6), z = ws.buffer(7), kbuf = ws.buffer(8);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < num_tasks; ++task) {
      // query tiles in decreasing order: under a causal mask the late tiles are the long ones
      const std::int64_t qi = grouped ? 0 : nqt - 1 - task / (B * nhc), bc = task % (B * nhc);
      const std::int64_t b = grouped ? task / Hkv : bc / nhc, h0 = grouped ? -1 : (bc % nhc) * hc;
      const std::int64_t hk = grouped ? task % Hkv : h0 / group;
      // tile rows [i0, i1) of rows_kr; row r of head slot u is query head head_of(u, r), query query_of(r)
      const std::int64_t i0 = qi * BQ, i1 = grouped ? group * Sq : std::min(Sq, i0 + BQ);
      auto head_of = [&](std::int64_t u, int r) { return grouped ? hk * group + r / Sq : h0 + u; };
      auto query_of = [&](int r) { return grouped ? r % Sq : i0 + r; };
      const int mr = static_cast<int>(i1 - i0);
      const T* ktp_h = ktp + (b * Hkv + hk) * kt_size;
      const T* vp_h = vp + (b * Hkv + hk) * v_size;

      std::int64_t lo = Sk, hi = 0;
      for (std::int64_t i = i0; i < i1; ++i) {
        const std::int64_t kb = rows_kr.begin[static_cast<std::size_t>(i)];
        const std::int64_t ke = rows_kr.end[static_cast<std::size_t>(i)];
        if (kb < ke) {
          lo = std::min(lo, kb);
          hi = std::max(hi, ke);
        }
      }
      for (std::int64_t u = 0; u < hc; ++u) {
        for (int r = 0; r < mr; ++r) {
          const std::size_t off = static_cast<std::size_t>(((b * Sq + query_of(r)) * Hq + head_of(u, r)) * D) * in_size;
          T* qrow = qt_all.data() + (u * BQ + r) * Dp;
          convert(qin + off, p.dtype, qrow, cdt, static_cast<std::size_t>(D));
          for (std::int64_t d = 0; d < D; ++d) qrow[d] *= qscale;
        }
      }
      std::fill(o_all.begin(), o_all.begin() + hc * BQ * Dp, T(0));
      std::fill(m_all.begin(), m_all.begin() + hc * BQ, -std::numeric_limits<T>::infinity());
      std::fill(l_all.begin(), l_all.begin() + hc * BQ, T(0));

      for (std::int64_t kt = lo / BK; lo < hi && kt < (hi + BK - 1) / BK; ++kt) {
        const std::int64_t j0 = kt * BK, j1 = std::min(Sk, j0 + BK);
        const TileKind kind = classify(rows_kr, i0, i1, j0, j1, BK);
        if (kind == TileKind::kSkip) continue;
        const T* ktile = ktp_h + kt * D * BK;
        if (k_in_place) {
          if (j1 - j0 < BK) std::fill(kbuf.begin(), kbuf.end(), T(0));
          transpose_k(b, hk, j0, j1, kbuf.data(), row);
          ktile = kbuf.data();
        }
        for (std::int64_t u = 0; u < hc; ++u) {
          const std::int64_t h = grouped ? -1 : h0 + u;
          T* o = o_all.data() + u * BQ * Dp;
          T* m = m_all.data() + u * BQ;
          T* l = l_all.data() + u * BQ;
          gemm_tile<T, false>(mr, BK, static_cast<int>(D), qt_all.data() + u * BQ * Dp, static_cast<int>(Dp), ktile, BK,
                              s.data(), BK);
          if (transform) transform_scores<T>(p, h, i0, mr, j0, s.data(), nullptr);
          if (kind == TileKind::kPartial) mask_partial_tile(rows_kr, i0, mr, j0, s.data());
          for (int r = 0; r < mr; ++r) {
            T* srow = s.data() + r * BK;
            V vmax = S::load(srow);
            for (int c = W; c < BK; c += W) vmax = S::max(vmax, S::load(srow + c));
            const T m_new = std::max(m[r], S::reduce_max(vmax));
            if (m_new == -std::numeric_limits<T>::infinity()) {
              // Every key masked, or the SIMD max dropped NaN scores (a NaN in q or k): the latter must poison the
              // row (l = NaN), not leave it looking like a row with no visible key.
              if (std::any_of(srow, srow + BK, [](T x) { return std::isnan(x); })) {
                l[r] = std::numeric_limits<T>::quiet_NaN();
              }
              std::fill(srow, srow + BK, T(0));
              continue;
            }
            const T alpha = std::exp2(m[r] - m_new);
            const V vm = S::set1(m_new);
            V vsum = S::zero();
            for (int c = 0; c < BK; c += W) {
              const V e = S::exp2(S::sub(S::load(srow + c), vm));
              S::store(srow + c, e);
              vsum = S::add(vsum, e);
            }
            l[r] = l[r] * alpha + S::reduce_add(vsum);
            m[r] = m_new;
            if (alpha != T(1)) {
              T* orow = o + r * Dp;
              const V va = S::set1(alpha);
              for (std::int64_t d = 0; d < Dp; d += W) S::store(orow + d, S::mul(S::load(orow + d), va));
            }
          }
          if (p.dropout.on) {  // dropout (attention/dropout.h): l summed the undropped P, O accumulates (z P) V
            dropout_multipliers<T, BK>(p.dropout, b, h, i0, mr, j0, Sk, z.data());
            multiply_tile<T, BK>(mr, z.data(), s.data());
          }
          // in place: only the tile's j1 - j0 rows of V exist (P is zero past them)
          if (v_in_place) {
            const T* vrows = reinterpret_cast<const T*>(vin) + ((b * Sk + j0) * Hkv + hk) * D;
            gemm_tile<T, true>(mr, static_cast<int>(Dp), static_cast<int>(j1 - j0), s.data(), BK, vrows,
                               static_cast<int>(Hkv * D), o, static_cast<int>(Dp));
          } else {
            gemm_tile<T, true>(mr, static_cast<int>(Dp), BK, s.data(), BK, vp_h + j0 * Dp, static_cast<int>(Dp), o,
                               static_cast<int>(Dp));
          }
        }
      }

      for (std::int64_t u = 0; u < hc; ++u) {
        const T* m = m_all.data() + u * BQ;
        const T* l = l_all.data() + u * BQ;
        for (int r = 0; r < mr; ++r) {
          const std::int64_t i = query_of(r), hr = head_of(u, r);
          const T* orow = o_all.data() + (u * BQ + r) * Dp;
          double lse_out;  // natural log, from the base-2 running max and sum, in fp64 whatever T
          if (l[r] > T(0)) {
            const T inv = T(1) / l[r];
            for (std::int64_t d = 0; d < D; ++d) row[d] = orow[d] * inv;
            lse_out = (static_cast<double>(m[r]) + std::log2(static_cast<double>(l[r]))) * 0.6931471805599453;
          } else if (l[r] == T(0)) {  // no visible key
            std::fill(row.begin(), row.end(), T(0));
            lse_out = -std::numeric_limits<double>::infinity();
          } else {  // NaN: a NaN or inf in q or k reached this row; propagate it, never report "no visible key"
            std::fill(row.begin(), row.end(), std::numeric_limits<T>::quiet_NaN());
            lse_out = std::numeric_limits<double>::quiet_NaN();
          }
          if (!p.sinks.empty()) {  // the one place of the sink: it joins the finished row's denominator
            const T factor = static_cast<T>(add_sink(lse_out, p.sinks[static_cast<std::size_t>(hr)]));
            for (std::int64_t d = 0; d < D; ++d) row[d] *= factor;
          }
          const std::int64_t li = (b * Hq + hr) * Sq + i;
          if (lse_dtype == DType::kFloat64) {
            static_cast<double*>(lse)[li] = lse_out;
          } else {
            static_cast<float*>(lse)[li] = static_cast<float>(lse_out);
          }
          const std::size_t off = static_cast<std::size_t>(((b * Sq + i) * Hq + hr) * D) * out_size;
          convert(row.data(), cdt, outc + off, out_dtype, static_cast<std::size_t>(D));
        }
      }
    }
  }
}

}  // namespace

void mha_forward_cpu(const MhaParams& p, void* out, DType out_dtype, void* lse, DType lse_dtype) {
  if (p.dtype == DType::kFloat64) {
    forward_typed<double>(p, out, out_dtype, lse, lse_dtype);
  } else {
    forward_typed<float>(p, out, out_dtype, lse, lse_dtype);
  }
}

}  // namespace seqpar::attn::cpu
