// The composed DSA indexer top-k (dsa_composed.h).
#include "dsa_composed.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../../runtime/error.h"
#include "../../runtime/tensor_ops.h"
#include "host_values.h"
#include "staging.h"
#include "ops_cpu.h"

namespace seqpar::attn::ops {

namespace {

std::vector<std::int64_t> positions_or_iota(std::span<const std::int64_t> p, std::int64_t n) {
  std::vector<std::int64_t> v(p.begin(), p.end());
  if (v.empty())
    for (std::int64_t i = 0; i < n; ++i) v.push_back(i);
  return v;
}

// The block's top-k candidates of every query row: positions [B Sq, k] (ascending, then -1) and their scores (then
// -inf); the scores of every key [B Sq, Sk] (-inf outside the row's candidates) when `all` is given.
template <typename T>
void block_candidates(Ops<T>& ops, const DsaIndexerArgs& args, std::int64_t k, std::vector<std::int64_t>& cand_pos,
                      std::vector<T>& cand_val, std::vector<T>* all) {
  const std::int64_t B = args.q_idx.dim(0), Sq = args.q_idx.dim(1), Hi = args.q_idx.dim(2), Di = args.q_idx.dim(3);
  const std::int64_t Sk = args.k_idx.dim(1);
  // candidate column range of every query row
  const std::vector<std::int64_t> qp = positions_or_iota(args.q_pos, Sq), kp = positions_or_iota(args.k_pos, Sk);
  std::vector<std::int64_t> lo(B * Sq), hi(B * Sq);
  for (std::int64_t t = 0; t < Sq; ++t) {
    std::int64_t first = std::numeric_limits<std::int64_t>::min(), last = qp[t];  // positions [first, last]
    if (args.window > 0) first = qp[t] - args.window + 1;
    if (!args.doc_lo.empty()) {
      first = std::max(first, args.doc_lo[t]);
      last = std::min(last, args.doc_hi[t] - 1);
    }
    const std::int64_t l = std::lower_bound(kp.begin(), kp.end(), first) - kp.begin();
    const std::int64_t h = std::upper_bound(kp.begin(), kp.end(), last) - kp.begin();
    for (std::int64_t b = 0; b < B; ++b) {
      lo[b * Sq + t] = l;
      hi[b * Sq + t] = std::max(l, h);
    }
  }

  const Input<T> q(ops, args.q_idx, "q_idx"), w(ops, args.w, "w"), kk(ops, args.k_idx, "k_idx");
  Buffer<std::int64_t> idx(ops, B * Sq * k);
  Buffer<T> val(ops, B * Sq * k);
  std::vector<std::int64_t> first_col(static_cast<std::size_t>(B * Sq), 0);
  if (all != nullptr) all->assign(static_cast<std::size_t>(B * Sq * Sk), -std::numeric_limits<T>::infinity());
  // Per tile of kQueryTile query rows: only the key columns [c0, c1) that hold some row's candidates are scored
  // (consecutive rows of a layout are mostly consecutive positions, so a window or a document keeps the tile's
  // range short; a device table would run the tiles as one grouped GEMM).
  constexpr std::int64_t kQueryTile = 64;
  for (std::int64_t r0 = 0, tq = 0; r0 < B * Sq; r0 += tq) {
    const std::int64_t b = r0 / Sq;
    tq = std::min(kQueryTile, (b + 1) * Sq - r0);
    std::int64_t c0 = Sk, c1 = 0;
    for (std::int64_t r = r0; r < r0 + tq; ++r)
      if (lo[r] < hi[r]) {
        c0 = std::min(c0, lo[r]);
        c1 = std::max(c1, hi[r]);
      }
    if (c1 <= c0) c0 = c1 = 0;  // no candidate in the tile: an empty range, every slot -1
    const std::int64_t n = c1 - c0;
    std::vector<std::int64_t> tlo(static_cast<std::size_t>(tq)), thi(tlo.size());
    for (std::int64_t r = r0; r < r0 + tq; ++r) {
      tlo[r - r0] = lo[r] < hi[r] ? lo[r] - c0 : 0;
      thi[r - r0] = lo[r] < hi[r] ? hi[r] - c0 : 0;
      first_col[r] = c0;
    }
    const Buffer<std::int64_t> d_lo(ops, tlo), d_hi(ops, thi);
    Buffer<T> logits(ops, tq * Hi * n), score(ops, tq * n);
    // 1. relu(logits) [tq Hi, n] (fixed order: a pair's score is the same in any tile and block); 2. the
    // ReLU-weighted head sum
    if (n > 0) {
      ops.gemm_relu_fixed_order(Trans::kN, Trans::kT, tq * Hi, n, Di, T(1),
                                Mat<const T>{q.get() + r0 * Hi * Di, Di, 0, 0},
                                Mat<const T>{kk.get() + (b * Sk + c0) * Di, Di, 0, 0}, Mat<T>{logits.get(), n, 0, 0},
                                Batch{1, 1});
      ops.relu_head_sum_rows(tq, Hi, n, logits.get(), w.get() + r0 * Hi, score.get());
    }
    // 3. top-k over each row's candidate columns
    ops.topk_rows(tq, n, k, score.get(), n, d_lo.get(), d_hi.get(), idx.get() + r0 * k, val.get() + r0 * k);
    if (all != nullptr && n > 0) {
      std::vector<T> tile(static_cast<std::size_t>(tq * n));
      ops.download(tile.data(), score.get(), tile.size() * sizeof(T));
      for (std::int64_t r = r0; r < r0 + tq; ++r)
        for (std::int64_t j = lo[r]; j < hi[r]; ++j) (*all)[r * Sk + j] = tile[(r - r0) * n + j - c0];
    }
  }

  cand_pos.assign(static_cast<std::size_t>(B * Sq * k), -1);
  cand_val.assign(cand_pos.size(), T(0));
  ops.download(cand_pos.data(), idx.get(), cand_pos.size() * sizeof(std::int64_t));
  ops.download(cand_val.data(), val.get(), cand_val.size() * sizeof(T));
  for (std::size_t e = 0; e < cand_pos.size(); ++e)
    cand_pos[e] = cand_pos[e] < 0 ? -1 : kp[cand_pos[e] + first_col[e / static_cast<std::size_t>(k)]];
}

// For every slot (b, t, e) of topk [B, Sq, k]: the row b Sk + j of the block (positions bpos, strictly increasing)
// that holds the selected position, or -1 (not selected, or not in this block). Slots keep their place (no
// compaction), so that every per-slot value is computed by the same batched products whichever block it lies in.
std::vector<std::int64_t> slot_rows(const TensorView& topk, std::int64_t B, std::int64_t Sq, std::int64_t Sk,
                                    const std::vector<std::int64_t>& bpos) {
  const std::int64_t k = topk.dim(2);
  const std::int64_t* sel = topk.data_as<std::int64_t>();
  std::vector<std::int64_t> rows(static_cast<std::size_t>(B * Sq * k), -1);
  for (std::int64_t r = 0; r < B * Sq; ++r)
    for (std::int64_t e = 0; e < k; ++e) {
      const std::int64_t p = sel[r * k + e];
      if (p < 0) continue;
      const auto it = std::lower_bound(bpos.begin(), bpos.end(), p);
      if (it != bpos.end() && *it == p) rows[r * k + e] = r / Sq * Sk + (it - bpos.begin());
    }
  return rows;
}

template <typename T>
std::vector<T> download_all(Ops<T>& ops, const Buffer<T>& b) {
  std::vector<T> v(static_cast<std::size_t>(b.size()));
  if (!v.empty()) ops.download(v.data(), b.get(), v.size() * sizeof(T));
  return v;
}

// Queries per chunk of a composition whose largest per-query buffer holds `per_query` elements: the gathered rows
// and score matrices of all B Sq queries at once would take B Sq k Dqk elements (600 MB in fp32 at 1K queries, k 256,
// Dqk 576), so queries go in chunks of at most kChunkElements (64 MiB of fp32), at least one query. Chunks are
// fixed by the query count alone, so a block split chunks its queries as the one call does.
inline constexpr std::int64_t kChunkElements = std::int64_t{1} << 24;
inline std::int64_t query_chunk(std::int64_t queries, std::int64_t per_query) {
  return std::clamp<std::int64_t>(kChunkElements / std::max<std::int64_t>(per_query, 1), 1,
                                  std::max<std::int64_t>(queries, 1));
}

// dst <- v (converted to dst's dtype), or dst += v when accumulating (dst then has dtype T: the boundary's check).
template <typename T>
void store(const std::vector<T>& v, const TensorView& dst, bool accumulate) {
  if (v.empty()) return;
  if (!accumulate) {
    copy_convert(TensorView(const_cast<T*>(v.data()), dtype_v<T>, dst.shape()), dst);
    return;
  }
  T* d = dst.data_as<T>();
  for (std::size_t i = 0; i < v.size(); ++i) d[i] += v[i];
}

// dst [B Sk, cols] += for every block row, the sum of the src rows [n_src, cols] of the slots that selected it, in
// ascending slot order (the inverted index of the slot-to-row map `rows`; no atomics).
template <typename T>
void sum_by_inverted_index(Ops<T>& ops, std::int64_t n_src, const std::int64_t* rows, std::int64_t n_dst,
                           std::int64_t cols, const T* src, T* dst) {
  Buffer<std::int64_t> offsets(ops, n_dst + 1), list(ops, n_src);
  ops.inverted_index(n_src, rows, n_dst, offsets.get(), list.get());
  ops.sum_rows_indexed(n_dst, cols, src, cols, offsets.get(), list.get(), dst, cols);
}

// The indexer inputs of a selected-slot pass over one key block: the slot-to-row map and the uploaded inputs; per
// chunk of queries [q0, q0 + qc), ksel [qc, k, Di] the gathered index keys (zero rows for slots outside the block)
// and logits [qc, Hi, k] = relu(q_idx ksel^T) per query (gemm_relu_fixed_order: the scores of the top-k pass,
// bitwise; the head sum and the backward read only relu(s) and s > 0).
template <typename T>
struct SelectedIndexer {
  std::int64_t B, Sq, Hi, Di, Sk, k;
  std::vector<std::int64_t> rows;
  Input<T> q, w, kk;
  Buffer<std::int64_t> d_rows;
  SelectedIndexer(Ops<T>& ops, const DsaIndexerArgs& a, const TensorView& topk)
      : B(a.q_idx.dim(0)),
        Sq(a.q_idx.dim(1)),
        Hi(a.q_idx.dim(2)),
        Di(a.q_idx.dim(3)),
        Sk(a.k_idx.dim(1)),
        k(topk.dim(2)),
        rows(slot_rows(topk, B, Sq, Sk, positions_or_iota(a.k_pos, Sk))),
        q(ops, a.q_idx, "q_idx"),
        w(ops, a.w, "w"),
        kk(ops, a.k_idx, "k_idx"),
        d_rows(ops, rows) {}
  std::int64_t chunk() const { return query_chunk(B * Sq, k * std::max(Di, Hi)); }
  void logits(Ops<T>& ops, std::int64_t q0, std::int64_t qc, T* ksel, T* out) const {
    ops.gather_rows(qc * k, Di, kk.get(), Di, d_rows.get() + q0 * k, ksel, Di);
    ops.gemm_relu_fixed_order(Trans::kN, Trans::kT, Hi, k, Di, T(1),
                              Mat<const T>{q.get() + q0 * Hi * Di, Di, 0, Hi * Di}, Mat<const T>{ksel, Di, 0, k * Di},
                              Mat<T>{out, k, 0, Hi * k}, Batch{1, qc});
  }
};

}  // namespace

template <typename T>
void dsa_indexer_topk_composed(Ops<T>& ops, const DsaIndexerArgs& args, const TensorView& topk_indices,
                               const TensorView& scores) {
  args.validate();
  const std::int64_t B = args.q_idx.dim(0), Sq = args.q_idx.dim(1), Sk = args.k_idx.dim(1);
  SEQPAR_CHECK(topk_indices.dtype() == DType::kInt64 && topk_indices.ndim() == 3 && topk_indices.dim(0) == B &&
                   topk_indices.dim(1) == Sq && topk_indices.dim(2) >= 1,
               "dsa_indexer_topk: topk_indices must be int64 [", B, ", ", Sq, ", k >= 1], got ", topk_indices.str());
  SEQPAR_CHECK(scores.empty() || (scores.dtype() == dtype_v<T> && scores.shape() == Shape({B, Sq, Sk})),
               "dsa_indexer_topk: scores must be ", dtype_name(dtype_v<T>), " [", B, ", ", Sq, ", ", Sk, "], got ",
               scores.str());
  std::vector<std::int64_t> pos;
  std::vector<T> val, all;
  block_candidates(ops, args, topk_indices.dim(2), pos, val, scores.empty() ? nullptr : &all);
  std::copy(pos.begin(), pos.end(), topk_indices.data_as<std::int64_t>());
  if (!scores.empty()) std::copy(all.begin(), all.end(), scores.data_as<T>());
}

template <typename T>
void dsa_topk_merge_composed(Ops<T>& ops, const DsaTopkState& state, const T* s_b, const std::int64_t* p_b) {
  const std::int64_t n = state.scores.numel(), rows = state.scores.dim(0) * state.scores.dim(1);
  if (n == 0) return;
  Buffer<T> s_a(ops, std::vector<T>(state.scores.data_as<T>(), state.scores.data_as<T>() + n));
  Buffer<std::int64_t> p_a(ops, std::vector<std::int64_t>(state.positions.data_as<std::int64_t>(),
                                                          state.positions.data_as<std::int64_t>() + n));
  ops.topk_merge_rows(rows, state.scores.dim(2), s_a.get(), p_a.get(), s_b, p_b);
  ops.download(state.scores.data(), s_a.get(), static_cast<std::size_t>(n) * sizeof(T));
  ops.download(state.positions.data(), p_a.get(), static_cast<std::size_t>(n) * sizeof(std::int64_t));
}

template <typename T>
void dsa_topk_block_composed(Ops<T>& ops, const DsaIndexerArgs& args, const DsaTopkState& state) {
  args.validate(state);
  const std::int64_t rows = state.scores.dim(0) * state.scores.dim(1), k = state.scores.dim(2);
  if (rows == 0 || k == 0) return;
  std::vector<std::int64_t> pos;
  std::vector<T> val;
  block_candidates<T>(ops, args, k, pos, val, nullptr);
  const Buffer<T> s_b(ops, val);
  const Buffer<std::int64_t> p_b(ops, pos);
  dsa_topk_merge_composed(ops, state, s_b.get(), p_b.get());
}

template <typename T>
void dsa_topk_merge_composed(Ops<T>& ops, const DsaTopkState& state, const DsaTopkState& other) {
  const std::int64_t n = other.scores.numel();
  const Buffer<T> s_b(ops, std::vector<T>(other.scores.data_as<T>(), other.scores.data_as<T>() + n));
  const Buffer<std::int64_t> p_b(ops, std::vector<std::int64_t>(other.positions.data_as<std::int64_t>(),
                                                                other.positions.data_as<std::int64_t>() + n));
  dsa_topk_merge_composed(ops, state, s_b.get(), p_b.get());
}

template <typename T>
void dsa_attention_backward_composed(Ops<T>& ops, const DsaAttentionArgs& args, const TensorView& lse,
                                     const TensorView& dout, const TensorView& delta, const TensorView& dq,
                                     const TensorView& dc, bool accumulate, const TensorView& probs) {
  args.validate();
  const std::int64_t B = args.q.dim(0), Sq = args.q.dim(1), H = args.q.dim(2), Dqk = args.q.dim(3);
  const std::int64_t Sk = args.c.dim(1), k = args.topk_indices.dim(2), Dv = args.dim_v, Q = B * Sq;
  const T scale = args.scale > 0.0 ? static_cast<T>(args.scale) : T(1) / std::sqrt(static_cast<T>(Dqk));
  const bool grads = dout.data() != nullptr;
  const std::vector<std::int64_t> rows = slot_rows(args.topk_indices, B, Sq, Sk, positions_or_iota(args.c_pos, Sk));

  // lse [B, H, Sq] -> [B Sq H] as hi + lo in T (rowops::dsa_probs_row), delta likewise
  const std::vector<double> lse_v = host_values<double>(lse);
  std::vector<T> hi(static_cast<std::size_t>(Q * H)), lo(hi.size()), dl(grads ? hi.size() : 0);
  const std::vector<T> delta_v = grads ? host_values<T>(delta) : std::vector<T>();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < Sq; ++t) {
        const std::size_t from = static_cast<std::size_t>((b * H + h) * Sq + t),
                          to = static_cast<std::size_t>((b * Sq + t) * H + h);
        const double l = lse_v[from];
        hi[to] = static_cast<T>(l);
        lo[to] = std::isinf(l) ? T(0) : static_cast<T>(l - static_cast<double>(hi[to]));
        if (grads) dl[to] = delta_v[from];
      }

  const Input<T> q(ops, args.q, "q"), c(ops, args.c, "c"), d_out(ops, grads ? dout : TensorView(), "dout");
  const Buffer<T> d_hi(ops, hi), d_lo(ops, lo);
  const Buffer<std::int64_t> d_rows(ops, rows);
  const Buffer<T> d_delta(ops, dl),
      ones(ops, std::vector<T>(static_cast<std::size_t>(H), T(1)));
  const bool want_probs = !probs.empty() && probs.data() != nullptr;
  const std::int64_t chunk = query_chunk(Q, k * std::max(Dqk, H));
  Buffer<T> csel(ops, chunk * k * Dqk), p(ops, chunk * H * k), ps(ops, want_probs ? chunk * k : 0),
      dp(ops, grads ? chunk * H * k : 0), dqb(ops, grads ? Q * H * Dqk : 0), dcsel(ops, grads ? chunk * k * Dqk : 0),
      dcb(ops, grads ? B * Sk * Dqk : 0);
  std::vector<T> ps_host;
  for (std::int64_t q0 = 0; q0 < Q; q0 += chunk) {
    const std::int64_t qc = std::min(chunk, Q - q0);
    const Batch per_query{1, qc};
    const T* qq = q.get() + q0 * H * Dqk;
    const std::int64_t* rr = d_rows.get() + q0 * k;
    // 1. gather the selected latent rows; 2. scores [H, k] per query; 3. p = exp(s - lse) on the slots in the block
    ops.gather_rows(qc * k, Dqk, c.get(), Dqk, rr, csel.get(), Dqk);
    ops.gemm_fixed_order(Trans::kN, Trans::kT, H, k, Dqk, scale, Mat<const T>{qq, Dqk, 0, H * Dqk},
                         Mat<const T>{csel.get(), Dqk, 0, k * Dqk}, T(0), Mat<T>{p.get(), k, 0, H * k}, per_query);
    ops.dsa_probs_rows(qc * H, k, p.get(), k, rr, H, d_hi.get() + q0 * H, d_lo.get() + q0 * H);
    if (want_probs) {  // the head sum of p per slot: a [1, H] x [H, k] product
      ops.gemm(Trans::kN, Trans::kN, 1, k, H, T(1), Mat<const T>{ones.get(), H, 0, 0},
               Mat<const T>{p.get(), k, 0, H * k}, T(0), Mat<T>{ps.get(), k, 0, k}, per_query);
      ps_host.resize(static_cast<std::size_t>(qc * k));
      ops.download(ps_host.data(), ps.get(), ps_host.size() * sizeof(T));
      T* out = probs.data_as<T>() + q0 * k;
      for (std::size_t i = 0; i < ps_host.size(); ++i)
        if (rows[q0 * k + i] >= 0) out[i] = ps_host[i];
    }
    if (!grads) continue;
    const T* oo = d_out.get() + q0 * H * Dv;
    // 4. dp = dout v^T, ds = p (dp - delta)
    ops.gemm(Trans::kN, Trans::kT, H, k, Dv, T(1), Mat<const T>{oo, Dv, 0, H * Dv},
             Mat<const T>{csel.get(), Dqk, 0, k * Dqk}, T(0), Mat<T>{dp.get(), k, 0, H * k}, per_query);
    ops.dsa_dscore_rows(qc * H, k, p.get(), dp.get(), k, d_delta.get() + q0 * H);
    // 5. dq = scale ds c_sel; dc_sel = scale ds^T q + (p^T dout in the first Dv columns)
    ops.gemm(Trans::kN, Trans::kN, H, Dqk, k, scale, Mat<const T>{dp.get(), k, 0, H * k},
             Mat<const T>{csel.get(), Dqk, 0, k * Dqk}, T(0), Mat<T>{dqb.get() + q0 * H * Dqk, Dqk, 0, H * Dqk},
             per_query);
    ops.gemm(Trans::kT, Trans::kN, k, Dqk, H, scale, Mat<const T>{dp.get(), k, 0, H * k},
             Mat<const T>{qq, Dqk, 0, H * Dqk}, T(0), Mat<T>{dcsel.get(), Dqk, 0, k * Dqk}, per_query);
    ops.gemm(Trans::kT, Trans::kN, k, Dv, H, T(1), Mat<const T>{p.get(), k, 0, H * k}, Mat<const T>{oo, Dv, 0, H * Dv},
             T(1), Mat<T>{dcsel.get(), Dqk, 0, k * Dqk}, per_query);
    // 6. dc: each latent row adds the chunk's slots that selected it, in ascending (b, t, slot) (the inverted index)
    sum_by_inverted_index(ops, qc * k, rr, B * Sk, Dqk, dcsel.get(), dcb.get());
  }
  if (!grads) return;
  store(download_all(ops, dqb), dq, accumulate);
  store(download_all(ops, dcb), dc, accumulate);
}

template <typename T>
void dsa_indexer_scores_selected_composed(Ops<T>& ops, const DsaIndexerArgs& args, const TensorView& topk_indices,
                                          const TensorView& scores) {
  args.validate();
  const SelectedIndexer<T> sel(ops, args, topk_indices);
  const std::int64_t Q = sel.B * sel.Sq, k = sel.k, chunk = sel.chunk();
  Buffer<T> ksel(ops, chunk * k * sel.Di), logits(ops, chunk * sel.Hi * k), out(ops, Q * k);
  for (std::int64_t q0 = 0; q0 < Q; q0 += chunk) {
    const std::int64_t qc = std::min(chunk, Q - q0);
    sel.logits(ops, q0, qc, ksel.get(), logits.get());
    ops.relu_head_sum_rows(qc, sel.Hi, k, logits.get(), sel.w.get() + q0 * sel.Hi, out.get() + q0 * k);
  }
  const std::vector<T> v = download_all(ops, out);
  T* dst = scores.data_as<T>();
  for (std::size_t i = 0; i < v.size(); ++i)
    if (sel.rows[i] >= 0) dst[i] = v[i];
}

template <typename T>
void dsa_indexer_backward_composed(Ops<T>& ops, const DsaIndexerArgs& args, const TensorView& topk_indices,
                                   const TensorView& dscores, const TensorView& dq_idx, const TensorView& dw,
                                   const TensorView& dk_idx, bool accumulate) {
  args.validate();
  const SelectedIndexer<T> sel(ops, args, topk_indices);
  const std::int64_t Q = sel.B * sel.Sq, Hi = sel.Hi, Di = sel.Di, k = sel.k, chunk = sel.chunk();
  const Input<T> g(ops, dscores, "dscores");
  Buffer<T> ksel(ops, chunk * k * Di), logits(ops, chunk * Hi * k), dks(ops, chunk * k * Di);
  Buffer<T> dwb(ops, Q * Hi), dqb(ops, Q * Hi * Di), dkb(ops, sel.B * sel.Sk * Di);
  for (std::int64_t q0 = 0; q0 < Q; q0 += chunk) {
    const std::int64_t qc = std::min(chunk, Q - q0);
    const Batch per_query{1, qc};
    sel.logits(ops, q0, qc, ksel.get(), logits.get());
    // the logit gradients a_ij = g_j w_i [s_ij > 0] in place of the logits, dw_i = sum_j g_j relu(s_ij)
    ops.indexer_grad_rows(qc, Hi, k, logits.get(), sel.w.get() + q0 * Hi, g.get() + q0 * k, dwb.get() + q0 * Hi);
    ops.gemm(Trans::kN, Trans::kN, Hi, Di, k, T(1), Mat<const T>{logits.get(), k, 0, Hi * k},
             Mat<const T>{ksel.get(), Di, 0, k * Di}, T(0), Mat<T>{dqb.get() + q0 * Hi * Di, Di, 0, Hi * Di},
             per_query);
    ops.gemm(Trans::kT, Trans::kN, k, Di, Hi, T(1), Mat<const T>{logits.get(), k, 0, Hi * k},
             Mat<const T>{sel.q.get() + q0 * Hi * Di, Di, 0, Hi * Di}, T(0), Mat<T>{dks.get(), Di, 0, k * Di},
             per_query);
    sum_by_inverted_index(ops, qc * k, sel.d_rows.get() + q0 * k, sel.B * sel.Sk, Di, dks.get(), dkb.get());
  }
  store(download_all(ops, dqb), dq_idx, accumulate);
  store(download_all(ops, dwb), dw, accumulate);
  store(download_all(ops, dkb), dk_idx, accumulate);
}

template <typename T>
double dsa_indexer_loss_composed(Ops<T>& ops, const DsaIndexerLossArgs& args, const TensorView& dscores) {
  const std::int64_t k = args.topk_indices.dim(2), rows = args.topk_indices.dim(0) * args.topk_indices.dim(1);
  const bool grad = dscores.data() != nullptr;
  const Input<T> probs(ops, args.probs, "probs"), scores(ops, args.scores, "scores");
  const Buffer<std::int64_t> idx(
      ops, std::vector<std::int64_t>(args.topk_indices.data_as<std::int64_t>(),
                                     args.topk_indices.data_as<std::int64_t>() + args.topk_indices.numel()));
  Buffer<T> g(ops, grad ? rows * k : 0);
  Buffer<double> loss(ops, rows);
  ops.kl_rows(rows, k, probs.get(), scores.get(), idx.get(), static_cast<double>(static_cast<T>(args.grad_scale)),
              grad ? g.get() : nullptr, loss.get());
  std::vector<double> per_row(static_cast<std::size_t>(rows));
  if (rows > 0) ops.download(per_row.data(), loss.get(), per_row.size() * sizeof(double));
  double total = 0.0;
  for (double v : per_row) total += v;  // rows in order
  if (grad) store(download_all(ops, g), dscores, false);
  return total;
}

template <typename T>
void dsa_attention_forward_composed(Ops<T>& ops, const DsaAttentionArgs& args, const TensorView& out,
                                    const TensorView& lse) {
  args.validate(out, lse);
  const std::int64_t B = args.q.dim(0), Sq = args.q.dim(1), H = args.q.dim(2), Dqk = args.q.dim(3);
  const std::int64_t Sk = args.c.dim(1), k = args.topk_indices.dim(2), Dv = args.dim_v;
  const T scale = args.scale > 0.0 ? static_cast<T>(args.scale) : T(1) / std::sqrt(static_cast<T>(Dqk));
  std::vector<std::int64_t> qp(args.q_pos.begin(), args.q_pos.end()), cp(args.c_pos.begin(), args.c_pos.end());
  if (qp.empty())
    for (std::int64_t t = 0; t < Sq; ++t) qp.push_back(t);
  if (cp.empty())
    for (std::int64_t j = 0; j < Sk; ++j) cp.push_back(j);

  // latent rows of each query's selected positions in this block, compacted to the front; their count
  const std::int64_t* sel = args.topk_indices.data_as<std::int64_t>();
  std::vector<std::int64_t> rows(B * Sq * k, -1), count(B * Sq, 0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < Sq; ++t) {
      const std::int64_t r = b * Sq + t;
      for (std::int64_t e = 0; e < k; ++e) {
        const std::int64_t p = sel[r * k + e];
        if (p < 0 || p > qp[t]) continue;
        const auto it = std::lower_bound(cp.begin(), cp.end(), p);
        if (it == cp.end() || *it != p) continue;
        rows[r * k + count[r]++] = b * Sk + (it - cp.begin());
      }
    }

  const Input<T> q(ops, args.q, "q"), c(ops, args.c, "c");
  const Buffer<std::int64_t> d_rows(ops, rows), d_count(ops, count);
  const std::int64_t Q = B * Sq, chunk = query_chunk(Q, k * std::max(Dqk, H));
  Buffer<T> csel(ops, chunk * k * Dqk), p(ops, chunk * H * k), o(ops, Q * H * Dv), mx(ops, Q * H), sum(ops, Q * H);
  for (std::int64_t q0 = 0; q0 < Q; q0 += chunk) {
    const std::int64_t qc = std::min(chunk, Q - q0);
    const Batch per_query{1, qc};
    ops.gather_rows(qc * k, Dqk, c.get(), Dqk, d_rows.get() + q0 * k, csel.get(), Dqk);
    ops.gemm_fixed_order(Trans::kN, Trans::kT, H, k, Dqk, scale, Mat<const T>{q.get() + q0 * H * Dqk, Dqk, 0, H * Dqk},
                         Mat<const T>{csel.get(), Dqk, 0, k * Dqk}, T(0), Mat<T>{p.get(), k, 0, H * k}, per_query);
    ops.softmax_rows(qc * H, k, p.get(), k, d_count.get() + q0, H, mx.get() + q0 * H, sum.get() + q0 * H);
    ops.gemm(Trans::kN, Trans::kN, H, Dv, k, T(1), Mat<const T>{p.get(), k, 0, H * k},
             Mat<const T>{csel.get(), Dqk, 0, k * Dqk}, T(0), Mat<T>{o.get() + q0 * H * Dv, Dv, 0, H * Dv}, per_query);
  }

  std::vector<T> host_o(static_cast<std::size_t>(B * Sq * H * Dv)), host_mx(static_cast<std::size_t>(B * Sq * H)),
      host_sum(host_mx.size());
  ops.download(host_o.data(), o.get(), host_o.size() * sizeof(T));
  ops.download(host_mx.data(), mx.get(), host_mx.size() * sizeof(T));
  ops.download(host_sum.data(), sum.get(), host_sum.size() * sizeof(T));
  if (!host_o.empty()) copy_convert(TensorView(host_o.data(), dtype_v<T>, out.shape()), out);
  // lse = max + log(sum) in lse's dtype ([B, Sq, H] -> [B, H, Sq]): an fp64 lse of fp32 inputs carries no fp32 lse
  // rounding, as dsa_attention_forward's
  std::vector<double> lse_bhs(host_mx.size());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < Sq; ++t)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::size_t i = static_cast<std::size_t>((b * Sq + t) * H + h);
        lse_bhs[(b * H + h) * Sq + t] = lse.dtype() == DType::kFloat64
                                            ? double(host_mx[i]) + std::log(double(host_sum[i]))
                                            : double(T(host_mx[i] + std::log(host_sum[i])));
      }
  if (!lse_bhs.empty()) copy_convert(TensorView(lse_bhs.data(), DType::kFloat64, lse.shape()), lse);
}

template void dsa_attention_forward_composed<float>(Ops<float>&, const DsaAttentionArgs&, const TensorView&,
                                                    const TensorView&);
template void dsa_attention_forward_composed<double>(Ops<double>&, const DsaAttentionArgs&, const TensorView&,
                                                     const TensorView&);

template void dsa_indexer_topk_composed<float>(Ops<float>&, const DsaIndexerArgs&, const TensorView&,
                                               const TensorView&);
template void dsa_indexer_topk_composed<double>(Ops<double>&, const DsaIndexerArgs&, const TensorView&,
                                                const TensorView&);

#define SEQPAR_DSA_COMPOSED_INSTANTIATE(T)                                                                             \
  template void dsa_topk_block_composed<T>(Ops<T>&, const DsaIndexerArgs&, const DsaTopkState&);                       \
  template void dsa_topk_merge_composed<T>(Ops<T>&, const DsaTopkState&, const DsaTopkState&);                         \
  template void dsa_attention_backward_composed<T>(Ops<T>&, const DsaAttentionArgs&, const TensorView&,                \
                                                   const TensorView&, const TensorView&, const TensorView&,            \
                                                   const TensorView&, bool, const TensorView&);                        \
  template void dsa_indexer_scores_selected_composed<T>(Ops<T>&, const DsaIndexerArgs&, const TensorView&,             \
                                                        const TensorView&);                                            \
  template void dsa_indexer_backward_composed<T>(Ops<T>&, const DsaIndexerArgs&, const TensorView&, const TensorView&, \
                                                 const TensorView&, const TensorView&, const TensorView&, bool);       \
  template double dsa_indexer_loss_composed<T>(Ops<T>&, const DsaIndexerLossArgs&, const TensorView&);
SEQPAR_DSA_COMPOSED_INSTANTIATE(float)
SEQPAR_DSA_COMPOSED_INSTANTIATE(double)
#undef SEQPAR_DSA_COMPOSED_INSTANTIATE

void dsa_topk_block_composed_cpu(const DsaIndexerArgs& args, const DsaTopkState& state) {
  with_cpu_ops(args.q_idx.dtype(), [&](auto& ops) { dsa_topk_block_composed(ops, args, state); });
}
void dsa_topk_merge_composed_cpu(const DsaTopkState& state, const DsaTopkState& other) {
  with_cpu_ops(state.scores.dtype(), [&](auto& ops) { dsa_topk_merge_composed(ops, state, other); });
}
void dsa_attention_backward_composed_cpu(const DsaAttentionArgs& args, const TensorView& lse, const TensorView& dout,
                                         const TensorView& delta, const TensorView& dq, const TensorView& dc,
                                         bool accumulate, const TensorView& probs) {
  with_cpu_ops(args.q.dtype(), [&](auto& ops) {
    dsa_attention_backward_composed(ops, args, lse, dout, delta, dq, dc, accumulate, probs);
  });
}
void dsa_indexer_scores_selected_composed_cpu(const DsaIndexerArgs& args, const TensorView& topk_indices,
                                              const TensorView& scores) {
  with_cpu_ops(args.q_idx.dtype(),
               [&](auto& ops) { dsa_indexer_scores_selected_composed(ops, args, topk_indices, scores); });
}
void dsa_indexer_backward_composed_cpu(const DsaIndexerArgs& args, const TensorView& topk_indices,
                                       const TensorView& dscores, const TensorView& dq_idx, const TensorView& dw,
                                       const TensorView& dk_idx, bool accumulate) {
  with_cpu_ops(args.q_idx.dtype(), [&](auto& ops) {
    dsa_indexer_backward_composed(ops, args, topk_indices, dscores, dq_idx, dw, dk_idx, accumulate);
  });
}
double dsa_indexer_loss_composed_cpu(const DsaIndexerLossArgs& args, const TensorView& dscores) {
  double loss = 0.0;
  with_cpu_ops(args.probs.dtype(), [&](auto& ops) { loss = dsa_indexer_loss_composed(ops, args, dscores); });
  return loss;
}

void dsa_indexer_topk_composed_cpu(const DsaIndexerArgs& args, const TensorView& topk_indices,
                                   const TensorView& scores) {
  with_cpu_ops(args.q_idx.dtype(), [&](auto& ops) { dsa_indexer_topk_composed(ops, args, topk_indices, scores); });
}

void dsa_attention_forward_composed_cpu(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse) {
  with_cpu_ops(args.q.dtype(), [&](auto& ops) { dsa_attention_forward_composed(ops, args, out, lse); });
}

}  // namespace seqpar::attn::ops
