// Internal: the CPU MHA / GQA kernels behind attention/mha.h. Arguments are validated by attention/mha.cc.
//
// Kernels take one flat parameter struct (pointers, sizes, flags). Visibility is reduced to one contiguous key
// range per query row: because q_pos and k_pos are non-decreasing, the keys visible to query i under any MaskSpec
// are the indices [key_begin[i], key_end[i]) (causal: k_pos <= q_pos; window W: k_pos > q_pos - W; document:
// doc_lo[i] <= k_pos < doc_hi[i]). A tile of
// keys is then fully visible, partly visible or invisible for a tile of rows by comparing index ranges only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <span>
#include <vector>

#include "mha_dropout.h"
#include "../mha.h"

namespace seqpar::attn::cpu {

// Calls with less work than this (multiply-adds) run on the calling thread only: an OpenMP fork / join costs
// microseconds, and far more on a loaded machine, which would dominate small ring blocks. Single- and
// multi-threaded runs give bitwise the same results, so the choice never changes a result.
inline constexpr double kMinParallelWork = 1 << 20;

// Tile sizes (rows of queries, keys). Multiples of every Simd<float>::W.
inline constexpr int kBlockQ = 64;
inline constexpr int kBlockK = 64;

// Visible key range [begin[i], end[i]) for each query row; begin[i] >= end[i] means no visible key.
struct KeyRanges {
  std::vector<std::int64_t> begin;
  std::vector<std::int64_t> end;
};
// q_pos / k_pos may be empty (then 0, 1, 2, ...); they must be non-decreasing (checked by the caller).
KeyRanges key_ranges(std::span<const std::int64_t> q_pos, std::int64_t sq, std::span<const std::int64_t> k_pos,
                     std::int64_t sk, const MaskSpec& mask);

struct MhaParams {
  const void* q = nullptr;  // [B, Sq, Hq, D], dtype `dtype`
  const void* k = nullptr;  // [B, Sk, Hkv, D]
  const void* v = nullptr;  // [B, Sk, Hkv, D]
  DType dtype = DType::kFloat32;
  std::int64_t batch = 0, sq = 0, sk = 0, hq = 0, hkv = 0, head_dim = 0;
  double scale = 0.0;  // > 0 (the default 1/sqrt(D) is resolved in double by the caller)
  const KeyRanges* ranges = nullptr;
  // Score modifiers (attention/mha.h ScoreMods), resolved by the caller: softcap 0 = off; alibi / sinks [Hq] or
  // empty; positions as given (empty: 0, 1, 2, ...), read by ALiBi only.
  double softcap = 0.0;
  std::vector<double> alibi, sinks;
  std::span<const std::int64_t> q_pos, k_pos;
  bool has_score_transform() const { return softcap > 0.0 || !alibi.empty(); }
  MhaDropout dropout;  // off unless args.dropout.p > 0
};

// The score-transform step of both kernels, on a tile s [mr, kBlockK] of raw dot products q_i . k_j (rows i0..,
// keys j0.., head h): s <- log2(e) (cap tanh(scale s / cap) + bias), bias = -slope_h |q_pos - k_pos| (keys past Sk
// get no bias: they are masked). dtanh (or nullptr) <- 1 - tanh^2 (1 without softcap), the factor of ds.
// Computed in double, rounded once to T.
template <typename T>
void transform_scores(const MhaParams& p, std::int64_t h, std::int64_t i0, int mr, std::int64_t j0, T* s, T* dtanh) {
  const double slope = p.alibi.empty() ? 0.0 : p.alibi[static_cast<std::size_t>(h)];
  const std::int64_t nc = std::min<std::int64_t>(kBlockK, p.sk - j0);
  auto pos = [](std::span<const std::int64_t> ps, std::int64_t i) {
    return ps.empty() ? i : ps[static_cast<std::size_t>(i)];
  };
  for (int r = 0; r < mr; ++r) {
    const std::int64_t qp = pos(p.q_pos, i0 + r);
    for (std::int64_t c = 0; c < kBlockK; ++c) {
      double a = p.scale * static_cast<double>(s[r * kBlockK + c]);
      double da = 1.0;
      if (p.softcap > 0.0) {
        const double t = std::tanh(a / p.softcap);
        a = p.softcap * t;
        da = 1.0 - t * t;
      }
      if (slope != 0.0 && c < nc) a -= slope * static_cast<double>(std::llabs(qp - pos(p.k_pos, j0 + c)));
      s[r * kBlockK + c] = static_cast<T>(a * 1.4426950408889634);
      if (dtanh != nullptr) dtanh[r * kBlockK + c] = static_cast<T>(da);
    }
  }
}

// The sink of one row (mods.sinks): lse <- logaddexp(lse, sink); returns exp(lse_old - lse_new), the factor of the
// row's out (0 for a row with no visible key, NaN stays NaN).
inline double add_sink(double& lse, double sink) {
  const double m = std::max(lse, sink);
  const double total = m + std::log(std::exp(lse - m) + std::exp(sink - m));
  const double factor = std::exp(lse - total);
  lse = total;
  return factor;
}

// How a key tile [j0, j1) is seen by rows [i0, i1): skipped, fully visible, or partly visible.
enum class TileKind { kSkip, kFull, kPartial };
inline TileKind classify(const KeyRanges& kr, std::int64_t i0, std::int64_t i1, std::int64_t j0, std::int64_t j1,
                         std::int64_t block) {
  bool any = false, full = (j1 - j0 == block);
  for (std::int64_t i = i0; i < i1; ++i) {
    const std::int64_t b = kr.begin[static_cast<std::size_t>(i)], e = kr.end[static_cast<std::size_t>(i)];
    if (std::max(b, j0) < std::min(e, j1)) any = true;
    if (b > j0 || e < j1) full = false;
  }
  if (!any) return TileKind::kSkip;
  return full ? TileKind::kFull : TileKind::kPartial;
}

// Scores s [mr, kBlockK] of rows i0.. against the key tile starting at j0: the keys outside each row's visible range
// become -inf.
template <typename T>
void mask_partial_tile(const KeyRanges& kr, std::int64_t i0, int mr, std::int64_t j0, T* s) {
  for (int r = 0; r < mr; ++r) {
    const std::int64_t cb = std::clamp<std::int64_t>(kr.begin[i0 + r] - j0, 0, kBlockK);
    const std::int64_t ce = std::clamp<std::int64_t>(kr.end[i0 + r] - j0, cb, kBlockK);
    T* srow = s + r * kBlockK;
    for (std::int64_t c = 0; c < cb; ++c) srow[c] = -std::numeric_limits<T>::infinity();
    for (std::int64_t c = ce; c < kBlockK; ++c) srow[c] = -std::numeric_limits<T>::infinity();
  }
}

// The tiling of one call, shared by the forward and backward kernels.
struct MhaTiling {
  std::int64_t group;     // query heads per KV head, Hq / Hkv
  std::int64_t Dp;        // head_dim rounded up to the vector width
  std::int64_t nkt, nqt;  // key tiles, query tiles
  std::int64_t Skp;       // Sk rounded up to whole key tiles
};
inline MhaTiling mha_tiling(const MhaParams& p, std::int64_t vector_width) {
  const std::int64_t nkt = (p.sk + kBlockK - 1) / kBlockK;
  return {p.hq / p.hkv, (p.head_dim + vector_width - 1) / vector_width * vector_width, nkt,
          (p.sq + kBlockQ - 1) / kBlockQ, nkt * kBlockK};
}

// out [B, Sq, Hq, D] of out_dtype; lse [B, Hq, Sq] of lse_dtype (fp32 or fp64).
void mha_forward_cpu(const MhaParams& p, void* out, DType out_dtype, void* lse, DType lse_dtype);

struct MhaBackwardParams {
  MhaParams fwd;
  const void* dout = nullptr;  // [B, Sq, Hq, D] of dout_dtype
  DType dout_dtype = DType::kFloat32;
  const void* out = nullptr;  // [B, Sq, Hq, D] of out_dtype; used when delta == nullptr
  DType out_dtype = DType::kFloat32;
  const void* lse = nullptr;  // [B, Hq, Sq] of lse_dtype (fp32 or fp64)
  DType lse_dtype = DType::kFloat32;
  const void* delta = nullptr;  // [B, Hq, Sq] of delta_dtype (fp32 or fp64), or nullptr
  DType delta_dtype = DType::kFloat32;
  void* dq = nullptr;  // [B, Sq, Hq, D]
  void* dk = nullptr;  // [B, Sk, Hkv, D]
  void* dv = nullptr;  // [B, Sk, Hkv, D]
  DType dq_dtype = DType::kFloat32, dk_dtype = DType::kFloat32, dv_dtype = DType::kFloat32;
  bool accumulate = false;  // add into dq / dk / dv of the compute dtype (fp32, or fp64 for fp64 inputs)
};

void mha_backward_cpu(const MhaBackwardParams& p);

// Element i of an fp32 or fp64 array, as double.
inline double load_wide(const void* p, DType dtype, std::int64_t i) {
  return dtype == DType::kFloat64 ? static_cast<const double*>(p)[i]
                                  : static_cast<double>(static_cast<const float*>(p)[i]);
}

}  // namespace seqpar::attn::cpu
