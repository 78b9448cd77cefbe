// CPU flash-attention backward (FlashAttention-2, Dao 2023, Algorithm 2; docs/design.md, "MHA on one device"),
// deterministic.
//
// Work item: (batch, query head, chunk of key tiles), scheduled by OpenMP. It converts Q, dO of its head and K
// (row-major and transposed per key tile), V (transposed per key tile) of its key chunk to the compute type (rows
// of query tiles with no visible key and key tiles that no query sees are not loaded at all: a ring block of a
// packed row may have many), then
// for each key tile (outer) and each visible query tile (inner) recomputes P = exp2(S log2 e - lse log2 e) with the
// final lse, and
//   dP = dO V^T, dS = P (dP - delta), dV_j += P^T dO, dK_j += dS^T Q, dQ_i += dS K     (scale applied at the end).
// Dropout: dP and then P are multiplied by the tile's multipliers z (cpu/mha_dropout.h, attention/dropout.h).
// The number of key chunks per head depends on the shape only (enough items for 8 workers when B Hq < 8; one chunk
// otherwise). With one chunk, dQ of the head is complete when the item ends; with several, each item writes a dQ
// partial and the partials are summed in chunk order. dK_j and dV_j of a key tile are sums over every visible query
// tile: each query tile's product goes to a fresh partial and the partials are added pairwise (a binary counter over
// the query tiles in increasing order: partials of 1, 2, 4, ... tiles, two of equal size added as soon as both
// exist), so the fp32 rounding error of dK / dV grows with log(Sq) rather than with Sq, as a running sum over the
// query tiles would. The finished sums go to a per-head fp32 (fp64)
// scratch that is summed over the query heads of each KV group in increasing head order. No atomics, fixed
// reduction orders: bitwise deterministic for any thread count. Extra memory O((Sq + Sk) D) per worker plus the
// dK / dV scratch (B Hq Sk D elements each) and, with several chunks, B Hq chunks Sq D elements of dQ partials.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/cpu/mha_cpu.h"
#include "attention/cpu/mha_simd.h"
#include "attention/cpu/scratch.h"
#include "runtime/dtype.h"
#include "runtime/tensor.h"

namespace seqpar::attn::cpu {
namespace {

// Pairwise sum of a sequence of n-element partials (one per query tile) in a binary counter: level l holds the sum
// of 2^l consecutive partials when occupied; a new partial is written to fresh() and push() carries it up, adding
// equal-sized sums (the older one first). finish() adds the occupied levels, smallest (newest) first, into dst
// (overwritten; zeros when nothing was pushed). The order depends on the number of partials only.
template <typename T>
class PairwiseTiles {
 public:
  // buf holds (levels + 1) * n elements; levels >= 1 + log2(the number of partials).
  PairwiseTiles(std::span<T> buf, int levels, std::int64_t n) : n_(n), levels_(levels) {
    for (int l = 0; l <= levels; ++l) slot_.push_back(buf.data() + l * n);
    used_.assign(static_cast<std::size_t>(levels), false);
  }
  void clear() { std::fill(used_.begin(), used_.end(), false); }
  T* fresh() { return slot_[static_cast<std::size_t>(levels_)]; }
  void push() {
    std::size_t l = 0;
    T*& carry = slot_[static_cast<std::size_t>(levels_)];
    while (used_[l]) {
      T* older = slot_[l];
      for (std::int64_t e = 0; e < n_; ++e) older[e] += carry[e];
      std::swap(slot_[l], carry);  // carry = the sum; the level's memory is free again
      used_[l] = false;
      ++l;
    }
    std::swap(slot_[l], carry);
    used_[l] = true;
  }
  void finish(T* dst) const {
    bool first = true;
    for (std::size_t l = 0; l < used_.size(); ++l) {
      if (!used_[l]) continue;
      const T* src = slot_[l];
      if (first) {
        std::copy(src, src + n_, dst);
      } else {
        for (std::int64_t e = 0; e < n_; ++e) dst[e] += src[e];
      }
      first = false;
    }
    if (first) std::fill(dst, dst + n_, T(0));
  }

 private:
  std::int64_t n_;
  int levels_;
  std::vector<T*> slot_;
  std::vector<bool> used_;
};

template <typename T>
void backward_typed(const MhaBackwardParams& bp) {
  using S = Simd<T>;
  using V = typename S::V;
  constexpr int W = S::W;
  constexpr int BQ = kBlockQ, BK = kBlockK;
  const MhaParams& p = bp.fwd;
  const std::int64_t B = p.batch, Sq = p.sq, Sk = p.sk, Hq = p.hq, Hkv = p.hkv, D = p.head_dim;
  const auto [group, Dp, nkt, nqt, Skp] = mha_tiling(p, W);
  const KeyRanges& kr = *p.ranges;
  const DType cdt = std::is_same_v<T, double> ? DType::kFloat64 : DType::kFloat32;
  const std::size_t in_size = dtype_size(p.dtype);
  const T scale = static_cast<T>(p.scale);
  // with a score transform, S already holds log2(e) times the modified score
  const bool transform = p.has_score_transform(), softcap = p.softcap > 0.0;
  const T c_log2 = transform ? T(1) : static_cast<T>(p.scale * 1.4426950408889634);

  // Per query tile: the union of the visible key ranges of its rows [lo, hi).
  std::vector<std::int64_t> tile_lo(static_cast<std::size_t>(nqt), Sk), tile_hi(static_cast<std::size_t>(nqt), 0);
  for (std::int64_t i = 0; i < Sq; ++i) {
    const std::int64_t kb = kr.begin[static_cast<std::size_t>(i)], ke = kr.end[static_cast<std::size_t>(i)];
    if (kb < ke) {
      tile_lo[i / BQ] = std::min(tile_lo[i / BQ], kb);
      tile_hi[i / BQ] = std::max(tile_hi[i / BQ], ke);
    }
  }
  // Key tiles some query tile sees: only their K / V rows are loaded (a ring block of a packed row may leave many
  // unseen); the others keep dK = dV = 0.
  std::vector<char> key_tile_seen(static_cast<std::size_t>(nkt), 0);
  {
    std::vector<std::int64_t> marks(static_cast<std::size_t>(nkt) + 1, 0);
    for (std::int64_t qi = 0; qi < nqt; ++qi) {
      if (tile_lo[qi] >= tile_hi[qi]) continue;
      ++marks[tile_lo[qi] / BK];
      --marks[(tile_hi[qi] - 1) / BK + 1];
    }
    std::int64_t open = 0;
    for (std::int64_t t = 0; t < nkt; ++t) key_tile_seen[t] = (open += marks[t]) > 0;
  }

  // Key chunks per head (in key tiles): a function of the shape only, so results do not depend on the thread count.
  const std::int64_t nchunks = std::clamp<std::int64_t>((8 + B * Hq - 1) / (B * Hq), 1, nkt);
  auto chunk_tile = [&](std::int64_t c) { return c * nkt / nchunks; };
  // Per-worker buffers (allocated here, before the parallel region): q, dout and dq of one head, lse2, delta, K
  // row-major, K^T and V^T per key tile, the score tiles P and dP, two rows.
  const bool parallel = static_cast<double>(B) * Hq * Sq * Sk * D >= kMinParallelWork;
  // The pairwise sums of dK / dV over query tiles: a partial of 2^l tiles per level l, plus the newest tile's.
  int levels = 1;
  while ((std::int64_t{1} << (levels - 1)) < nqt) ++levels;
  const std::int64_t pair_size = (levels + 1) * BK * Dp;
  const WorkerScratch<T> ws(
      {Sq * Dp, Sq * Dp, nchunks == 1 ? Sq * Dp : 0, Sq, Sq, Skp * Dp, nkt * D * BK, nkt * D * BK, BQ * BK, BQ * BK, Dp,
       Dp, softcap ? BQ * BK : 0, p.dropout.on ? BQ * BK : 0, pair_size, pair_size},
      "mha_backward per-thread scratch", region_workers(parallel));
  Tensor dq_partials;
  if (nchunks > 1) dq_partials = zeroed_workspace({B * Hq * nchunks * Sq * Dp}, cdt, "mha_backward dq partials");
  T* dqp = nchunks > 1 ? static_cast<T*>(dq_partials.data()) : nullptr;

  Tensor dk_scratch = zeroed_workspace({B * Hq * Skp * Dp}, cdt, "mha_backward dk scratch");
  Tensor dv_scratch = zeroed_workspace({B * Hq * Skp * Dp}, cdt, "mha_backward dv scratch");
  T* dks = static_cast<T*>(dk_scratch.data());
  T* dvs = static_cast<T*>(dv_scratch.data());

  const char* qin = static_cast<const char*>(p.q);
  const char* kin = static_cast<const char*>(p.k);
  const char* vin = static_cast<const char*>(p.v);
  const char* doin = static_cast<const char*>(bp.dout);
  const char* oin = static_cast<const char*>(bp.out);
  const std::size_t do_size = dtype_size(bp.dout_dtype), o_size = dtype_size(bp.out_dtype);
  const std::size_t dq_size = dtype_size(bp.dq_dtype);

  // dq[b, i, h, :] = scale * src (overwrite in dq's dtype, or add into fp32); tmp holds Dp elements.
  auto write_dq = [&](std::int64_t b, std::int64_t i, std::int64_t h, const T* src, T* tmp) {
    const std::int64_t e = ((b * Sq + i) * Hq + h) * D;
    char* dqc = static_cast<char*>(bp.dq);
    if (bp.accumulate) {  // dq has the compute dtype (checked by the boundary)
      T* dst_row = reinterpret_cast<T*>(dqc) + e;
      for (std::int64_t d = 0; d < D; ++d) dst_row[d] += src[d] * scale;
    } else {
      for (std::int64_t d = 0; d < D; ++d) tmp[d] = src[d] * scale;
      convert(tmp, cdt, dqc + static_cast<std::size_t>(e) * dq_size, bp.dq_dtype, static_cast<std::size_t>(D));
    }
  };

#pragma omp parallel if (parallel)
  {
    const std::span<T> q = ws.buffer(0), dout = ws.buffer(1), dq = ws.buffer(2), lse2 = ws.buffer(3),
                       delta = ws.buffer(4), kmat = ws.buffer(5), kt = ws.buffer(6), vt = ws.buffer(7),
                       s = ws.buffer(8), dp = ws.buffer(9), row = ws.buffer(10), row2 = ws.buffer(11),
                       dtanh = ws.buffer(12), z = ws.buffer(13);
    PairwiseTiles<T> dk_sum(ws.buffer(14), levels, BK * Dp), dv_sum(ws.buffer(15), levels, BK * Dp);
    std::int64_t packed_kv = -1, loaded_bh = -1;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < B * Hq * nchunks; ++task) {
      const std::int64_t bh = task / nchunks, chunk = task % nchunks;
      const std::int64_t b = bh / Hq, h = bh % Hq, hk = h / group;
      const std::int64_t kt_begin = chunk_tile(chunk), kt_end = chunk_tile(chunk + 1);
      // ---- load the keys of this chunk and the queries of this head ----
      if (packed_kv != (b * Hkv + hk) * nchunks + chunk) {
        packed_kv = (b * Hkv + hk) * nchunks + chunk;
        for (std::int64_t j = kt_begin * BK; j < std::min(Sk, kt_end * BK); ++j) {
          if (!key_tile_seen[j / BK]) continue;
          const std::size_t off = static_cast<std::size_t>(((b * Sk + j) * Hkv + hk) * D) * in_size;
          T* krow = kmat.data() + j * Dp;
          convert(kin + off, p.dtype, krow, cdt, static_cast<std::size_t>(D));
          convert(vin + off, p.dtype, row.data(), cdt, static_cast<std::size_t>(D));
          T* ktile = kt.data() + (j / BK) * D * BK;
          T* vtile = vt.data() + (j / BK) * D * BK;
          for (std::int64_t d = 0; d < D; ++d) {
            ktile[d * BK + j % BK] = krow[d];
            vtile[d * BK + j % BK] = row[static_cast<std::size_t>(d)];
          }
        }
      }
      for (std::int64_t i = 0; i < Sq && loaded_bh != bh; ++i) {
        if (tile_lo[i / BQ] >= tile_hi[i / BQ]) continue;  // a query tile with no visible key is never read
        const std::int64_t e = (b * Sq + i) * Hq + h;
        const std::int64_t li = (b * Hq + h) * Sq + i;
        T* dorow = dout.data() + i * Dp;
        if (kr.begin[static_cast<std::size_t>(i)] >= kr.end[static_cast<std::size_t>(i)]) {
          // No key of this call is visible to the row (a padding row, or a block outside its range): it adds
          // nothing, so its q, dout and delta are not read. Zeros keep a NaN there (a padding row's garbage) out of
          // the tile products, where P = 0 would multiply it (0 * NaN = NaN).
          std::fill(q.data() + i * Dp, q.data() + (i + 1) * Dp, T(0));
          std::fill(dorow, dorow + Dp, T(0));
          delta[i] = T(0);
          lse2[i] = std::numeric_limits<T>::infinity();
          continue;
        }
        convert(qin + static_cast<std::size_t>(e * D) * in_size, p.dtype, q.data() + i * Dp, cdt,
                static_cast<std::size_t>(D));
        convert(doin + static_cast<std::size_t>(e * D) * do_size, bp.dout_dtype, dorow, cdt,
                static_cast<std::size_t>(D));
        if (bp.delta != nullptr) {
          delta[i] = static_cast<T>(load_wide(bp.delta, bp.delta_dtype, li));
        } else {
          convert(oin + static_cast<std::size_t>(e * D) * o_size, bp.out_dtype, row2.data(), cdt,
                  static_cast<std::size_t>(D));
          T acc = 0;
          for (std::int64_t d = 0; d < D; ++d) acc += dorow[d] * row2[static_cast<std::size_t>(d)];
          delta[i] = acc;
        }
        const double l = load_wide(bp.lse, bp.lse_dtype, li);
        // a row with lse = -inf has no visible key anywhere: +inf here makes every P of the row exp2(-inf) = 0
        lse2[i] = l == -std::numeric_limits<double>::infinity() ? std::numeric_limits<T>::infinity()
                                                                : static_cast<T>(l * 1.4426950408889634);
      }
      loaded_bh = bh;
      T* dq_h = nchunks > 1 ? dqp + task * Sq * Dp : dq.data();
      std::fill(dq_h, dq_h + Sq * Dp, T(0));
      T* dk_h = dks + bh * Skp * Dp;
      T* dv_h = dvs + bh * Skp * Dp;

      // ---- key tiles outer, query tiles inner ----
      for (std::int64_t ktile = kt_begin; ktile < kt_end; ++ktile) {
        const std::int64_t j0 = ktile * BK, j1 = std::min(Sk, j0 + BK);
        const T* kt_tile = kt.data() + ktile * D * BK;
        const T* vt_tile = vt.data() + ktile * D * BK;
        dk_sum.clear();
        dv_sum.clear();
        for (std::int64_t qi = 0; qi < nqt; ++qi) {
          if (tile_lo[qi] >= j1 || tile_hi[qi] <= j0) continue;
          const std::int64_t i0 = qi * BQ, i1 = std::min(Sq, i0 + BQ);
          const TileKind kind = classify(kr, i0, i1, j0, j1, BK);
          if (kind == TileKind::kSkip) continue;
          const int mr = static_cast<int>(i1 - i0);
          const T* q_t = q.data() + i0 * Dp;
          const T* do_t = dout.data() + i0 * Dp;
          gemm_tile<T, false>(mr, BK, static_cast<int>(D), q_t, static_cast<int>(Dp), kt_tile, BK, s.data(), BK);
          gemm_tile<T, false>(mr, BK, static_cast<int>(D), do_t, static_cast<int>(Dp), vt_tile, BK, dp.data(), BK);
          if (transform) transform_scores<T>(p, h, i0, mr, j0, s.data(), softcap ? dtanh.data() : nullptr);
          if (kind == TileKind::kPartial) mask_partial_tile(kr, i0, mr, j0, s.data());
          if (p.dropout.on) {  // dropout (attention/dropout.h): dP = z dO V^T, so that dS = P (z dP - delta) below
            dropout_multipliers<T, BK>(p.dropout, b, h, i0, mr, j0, Sk, z.data());
            multiply_tile<T, BK>(mr, z.data(), dp.data());
          }
          const V vc = S::set1(c_log2);
          for (int r = 0; r < mr; ++r) {
            T* srow = s.data() + r * BK;
            T* dprow = dp.data() + r * BK;
            const V vl = S::set1(lse2[i0 + r]);
            const V vd = S::set1(delta[i0 + r]);
            for (int c = 0; c < BK; c += W) {
              // fma(s, c, -lse2) would give NaN for s = -inf only if lse2 = -inf, which lse2 never is
              const V pv = S::exp2(S::sub(S::mul(S::load(srow + c), vc), vl));
              S::store(srow + c, pv);
              const V ds = S::mul(pv, S::sub(S::load(dprow + c), vd));
              S::store(dprow + c, softcap ? S::mul(ds, S::load(dtanh.data() + r * BK + c)) : ds);
            }
          }
          if (p.dropout.on) multiply_tile<T, BK>(mr, z.data(), s.data());  // dropout: dV_j += (z P)^T dO_i
          // dV_j += P^T dO_i, dK_j += dS^T Q_i (P and dS read transposed in place), each into a fresh partial
          gemm_tile<T, false, true>(BK, static_cast<int>(Dp), mr, s.data(), BK, do_t, static_cast<int>(Dp),
                                    dv_sum.fresh(), static_cast<int>(Dp));
          dv_sum.push();
          gemm_tile<T, false, true>(BK, static_cast<int>(Dp), mr, dp.data(), BK, q_t, static_cast<int>(Dp),
                                    dk_sum.fresh(), static_cast<int>(Dp));
          dk_sum.push();
          gemm_tile<T, true>(mr, static_cast<int>(Dp), BK, dp.data(), BK, kmat.data() + j0 * Dp, static_cast<int>(Dp),
                             dq_h + i0 * Dp, static_cast<int>(Dp));
        }
        // each key tile of the head belongs to this item only: the sums are stored, not added
        dv_sum.finish(dv_h + j0 * Dp);
        dk_sum.finish(dk_h + j0 * Dp);
      }

      // ---- write dq of this head (one chunk) ----
      for (std::int64_t i = 0; i < Sq && nchunks == 1; ++i) write_dq(b, i, h, dq.data() + i * Dp, row.data());
    }

    // ---- dq: sum the chunk partials in chunk order ----
    if (nchunks > 1) {
#pragma omp for schedule(static)
      for (std::int64_t t = 0; t < B * Hq * Sq; ++t) {
        const std::int64_t bh = t / Sq, i = t % Sq;
        std::fill(row2.begin(), row2.end(), T(0));
        for (std::int64_t c = 0; c < nchunks; ++c) {
          const T* src = dqp + (bh * nchunks + c) * Sq * Dp + i * Dp;
          for (std::int64_t d = 0; d < D; ++d) row2[d] += src[d];
        }
        write_dq(bh / Hq, i, bh % Hq, row2.data(), row.data());
      }
    }

    // ---- dK / dV: sum the query heads of each KV group in increasing head order ----
    const std::size_t dk_size = dtype_size(bp.dk_dtype), dv_size = dtype_size(bp.dv_dtype);
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < B * Hkv * Sk; ++t) {
      const std::int64_t b = t / (Hkv * Sk), hk = (t / Sk) % Hkv, j = t % Sk;
      if (bp.accumulate && !key_tile_seen[j / BK]) continue;  // a key no query sees adds nothing
      for (int which = 0; which < 2; ++which) {
        const T* scratch = which == 0 ? dks : dvs;
        const T mult = which == 0 ? scale : T(1);
        std::fill(row.begin(), row.end(), T(0));
        for (std::int64_t g = 0; g < group; ++g) {
          const T* src = scratch + ((b * Hq + hk * group + g) * Skp + j) * Dp;
          for (std::int64_t d = 0; d < D; ++d) row[d] += src[d];
        }
        const std::int64_t e = ((b * Sk + j) * Hkv + hk) * D;
        void* out = which == 0 ? bp.dk : bp.dv;
        if (bp.accumulate) {  // dk / dv have the compute dtype (checked by the boundary)
          T* dst_row = static_cast<T*>(out) + e;
          for (std::int64_t d = 0; d < D; ++d) dst_row[d] += row[d] * mult;
        } else {
          for (std::int64_t d = 0; d < D; ++d) row[d] *= mult;
          const DType odt = which == 0 ? bp.dk_dtype : bp.dv_dtype;
          convert(row.data(), cdt,
                  static_cast<char*>(out) + static_cast<std::size_t>(e) * (which == 0 ? dk_size : dv_size), odt,
                  static_cast<std::size_t>(D));
        }
      }
    }
  }
}

}  // namespace

void mha_backward_cpu(const MhaBackwardParams& p) {
  if (p.fwd.dtype == DType::kFloat64) {
    backward_typed<double>(p);
  } else {
    backward_typed<float>(p);
  }
}

}  // namespace seqpar::attn::cpu
