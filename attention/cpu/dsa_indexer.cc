// DSA lightning indexer on the CPU: block-wise scoring merged into a running top-k, finalisation, the scores of the
// selected slots, the KL indexer loss and its backward. See attention/dsa.h for the math and the block protocol.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention/cpu/dsa_common.h"
#include "attention/cpu/dsa_cpu.h"
#include "attention/cpu/scratch.h"

namespace seqpar::attn::cpu {
namespace {

using namespace dsa_detail;

// ---- top-k heap ---------------------------------------------------------------------------------------------------
// Strict total order on candidates: a valid candidate (position >= 0) beats an empty slot; a larger score wins; equal
// scores go to the smaller position. Each row of the state is a binary heap whose root is the worst entry. Scores are
// of the accumulator type S (fp64 for fp64 inputs), so ties are decided on the scores the indexer computed.

template <typename S>
inline bool better(S sa, std::int64_t pa, S sb, std::int64_t pb) {
  if (pb < 0) return pa >= 0;
  if (pa < 0) return false;
  if (sa != sb) return sa > sb;
  return pa < pb;
}

template <typename S>
inline void sift_down(S* hs, std::int64_t* hp, std::int64_t K, std::int64_t i) {
  for (;;) {
    const std::int64_t l = 2 * i + 1, r = l + 1;
    std::int64_t worst = i;
    if (l < K && better(hs[worst], hp[worst], hs[l], hp[l])) worst = l;
    if (r < K && better(hs[worst], hp[worst], hs[r], hp[r])) worst = r;
    if (worst == i) return;
    std::swap(hs[i], hs[worst]);
    std::swap(hp[i], hp[worst]);
    i = worst;
  }
}

template <typename S>
inline void heap_offer(S* hs, std::int64_t* hp, std::int64_t K, S score, std::int64_t pos) {
  if (K == 0 || !better(score, pos, hs[0], hp[0])) return;
  hs[0] = score;
  hp[0] = pos;
  sift_down(hs, hp, K, 0);
}

using IndexerShape = DsaIndexerShape;

// Keys per panel of the top-k pass: k_idx is converted once per call into panels of kKeyPanel keys stored
// transposed ([Di, kKeyPanel], zero padded), the B operand of one [Hi, Di] x [Di, kKeyPanel] product per query row.
// Calls with at most kInPlaceQueries query rows per batch row (a decode step: one new token, or a few drafts) read
// k_idx in place instead, kKeyPanel keys at a time (the next run prefetched): the panels, a copy of the whole of
// k_idx per call, would be read by too few rows to repay writing them. Each row then pays a transposition of its
// scores per run instead; in sp_bench's DSA decode (Hi 64, Di 128, 64K keys, one thread) reading in place was the
// faster up to 4 rows and 7% slower at 8 (docs/results.md, "DSA decode").
inline constexpr std::int64_t kKeyPanel = 64;
inline constexpr std::int64_t kInPlaceQueries = 4;

// out[l] = sum_i w_i relu(s_il) for l < N (a multiple of kPad), s [Hi, N], heads in ascending order.
template <typename Acc>
inline void weigh_heads(const Acc* s, std::int64_t N, const Acc* w, std::int64_t Hi, Acc* out) {
  using S = cpu::Simd<Acc>;
  for (std::int64_t l0 = 0; l0 < N; l0 += S::W) {
    typename S::V total = S::zero();
    for (std::int64_t i = 0; i < Hi; ++i) {
      total = S::fma(S::set1(w[i]), S::max(S::load(s + i * N + l0), S::zero()), total);
    }
    S::store(out + l0, total);
  }
}

// Index scores of one query row (Acc rows q [Hi, Di], w [Hi]) against N keys, N a multiple of kPad: kT [Di, ldk] holds
// the keys as columns (zero padded), s [Hi, N] receives q_idx_i . k_j, out[l] = sum_i w_i relu(s_il) with heads in
// ascending order. Every score of the indexer goes through these instructions or index_scores_rows' (gemm reduces
// each element over d in increasing order wherever it lies), so a pair's score is bitwise the same in the top-k pass
// and in the selected scores, in whichever block, panel or column it is computed.
template <typename Acc>
__attribute__((noinline)) void index_scores(const Acc* q, const Acc* w, const Acc* kT, std::int64_t ldk, std::int64_t N,
                                            std::int64_t Hi, std::int64_t Di, Acc* s, Acc* out) {
  gemm<Acc>(Hi, N, Di, q, Di, kT, ldk, s, N);
  weigh_heads(s, N, w, Hi, out);
}

// index_scores with the m keys as rows, read in place (k [m, Di], row-major): sT [m, Hp] = k x qT, where qT [Di, Hp]
// holds the query's heads as columns (Hp = pad16(Hi), zero padded), then s [Hi, pad16(m)] = its transpose and out as
// index_scores. Each score is the same chain of Simd::fma over d, from zero, with the two factors of each product
// swapped (a product is the same number either way), so it is bitwise index_scores' score of the pair.
template <typename Acc>
__attribute__((noinline)) void index_scores_rows(const Acc* qT, const Acc* w, const Acc* k, std::int64_t m,
                                                 std::int64_t Hi, std::int64_t Di, Acc* sT, Acc* s, Acc* out) {
  const std::int64_t Hp = pad16(Hi), mp = pad16(m);
  gemm<Acc>(m, Hp, Di, k, Di, qT, Hp, sT, Hp);
  gather_transposed<Acc>([&](std::int64_t l) { return sT + l * Hp; }, m, Hi, mp, s);
  weigh_heads(s, mp, w, Hi, out);
}

// A row of a storage-typed buffer as Acc: the pointer itself when the types agree, else converted into `buf`
// (at least n elements).
template <typename Acc, typename T>
inline const Acc* acc_row(const T* src, std::int64_t n, std::span<Acc> buf) {
  if constexpr (std::is_same_v<T, Acc>) {
    return src;
  } else {
    load_row(src, buf.data(), n);
    return buf.data();
  }
}

// The indexer inputs of one call. rows(...) gives each query row's selected slots inside the block (for the passes
// over the selection); the per-thread buffers are allocated before the region by the callers.
template <typename T>
struct IndexerInputs {
  using Acc = acc_t<T>;
  const IndexerShape& s;
  const T *q_idx, *w, *k_idx;

  IndexerInputs(const DsaIndexerArgs& a, const IndexerShape& shape)
      : s(shape),
        q_idx(static_cast<const T*>(a.q_idx.data())),
        w(static_cast<const T*>(a.w.data())),
        k_idx(static_cast<const T*>(a.k_idx.data())) {}

  const Acc* query(std::int64_t r, std::span<Acc> buf) const {
    return acc_row(q_idx + r * s.Hi * s.Di, s.Hi * s.Di, buf);
  }
  const Acc* weights(std::int64_t r, std::span<Acc> buf) const { return acc_row(w + r * s.Hi, s.Hi, buf); }
  // The m keys from index j0 of batch b as Acc rows [m, Di]: k_idx itself when T is Acc, else converted into buf.
  const Acc* key_rows(std::int64_t b, std::int64_t j0, std::int64_t m, std::span<Acc> buf) const {
    return acc_row(k_idx + (b * s.Sk + j0) * s.Di, m * s.Di, buf);
  }
  // Asks for the m keys from index j0 of batch b (none when m <= 0) to be brought into the cache, a line at a time.
  void prefetch_keys(std::int64_t b, std::int64_t j0, std::int64_t m) const {
    const char* p = reinterpret_cast<const char*>(k_idx + (b * s.Sk + j0) * s.Di);
    for (std::int64_t o = 0; o < m * s.Di * static_cast<std::int64_t>(sizeof(T)); o += 64) __builtin_prefetch(p + o);
  }
  // The n block keys keys[0..n) of batch b as the columns of kT [Di, pad16(n)].
  void keys_transposed(std::int64_t b, const std::int64_t* keys, std::int64_t n, Acc* kT) const {
    gather_transposed<Acc>([&](std::int64_t j) { return k_idx + (b * s.Sk + keys[j]) * s.Di; }, n, s.Di, pad16(n), kT);
  }
};

template <typename T>
void topk_block_impl(const DsaIndexerArgs& a, const IndexerShape& s, const DsaTopkState& st) {
  using Acc = acc_t<T>;
  const std::int64_t K = st.scores.dim(2), Hi = s.Hi, Di = s.Di, Hp = pad16(Hi), rows = s.B * s.Sq;
  if (K == 0 || s.Sk == 0) return;
  Acc* scores = static_cast<Acc*>(st.scores.data());
  std::int64_t* positions = static_cast<std::int64_t*>(st.positions.data());
  const IndexerInputs<T> in(a, s);
  const bool in_place = s.Sq <= kInPlaceQueries;
  const std::int64_t panels = in_place ? 0 : (s.Sk + kKeyPanel - 1) / kKeyPanel, panel_size = Di * kKeyPanel;
  const Tensor kT_owner =
      zeroed_workspace({s.B * panels * panel_size}, dtype_v<Acc>, "dsa_indexer_topk_block key panels");
  Acc* const kT = static_cast<Acc*>(kT_owner.data());
  // Per worker: the query row and its weights as Acc, the scores [Hi, kKeyPanel] and their weighted sums; in place
  // also the query transposed [Di, Hp], the transposed scores [kKeyPanel, Hp] and, for a storage type other than
  // Acc, the converted keys [kKeyPanel, Di].
  const std::int64_t place = in_place ? 1 : 0, convert = std::is_same_v<T, Acc> ? 0 : place;
  const WorkerScratch<Acc> ws(
      {Hi * Di, Hi, Hi * kKeyPanel, kKeyPanel, place * Di * Hp, place * kKeyPanel * Hp, convert * kKeyPanel * Di},
      "dsa_indexer_topk_block scratch");
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (std::int64_t bp = 0; bp < s.B * panels; ++bp) {
      const std::int64_t b = bp / panels, j0 = (bp % panels) * kKeyPanel;
      gather_transposed<Acc>([&](std::int64_t j) { return in.k_idx + (b * s.Sk + j0 + j) * Di; },
                             std::min(kKeyPanel, s.Sk - j0), Di, kKeyPanel, kT + bp * panel_size);
    }
    const std::span<Acc> qbuf = ws.buffer(0), wbuf = ws.buffer(1), sbuf = ws.buffer(2), tile = ws.buffer(3),
                         qT = ws.buffer(4), sT = ws.buffer(5), kbuf = ws.buffer(6);
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / s.Sq, t = r % s.Sq;
      const std::int64_t q = s.q_pos[static_cast<std::size_t>(t)];
      // Candidates: k_pos <= q, inside the window (q - k_pos < window: from q - window + 1) and inside the document
      // [doc_lo, doc_hi): one index range [first, n_vis) of the sorted keys.
      std::int64_t lo = a.window > 0 ? q - a.window + 1 : std::numeric_limits<std::int64_t>::min(), hi = q + 1;
      if (!a.doc_lo.empty()) {
        lo = std::max(lo, a.doc_lo[static_cast<std::size_t>(t)]);
        hi = std::min(hi, a.doc_hi[static_cast<std::size_t>(t)]);
      }
      const std::int64_t n_vis = std::lower_bound(s.k_pos.begin(), s.k_pos.end(), hi) - s.k_pos.begin();
      const std::int64_t first = std::lower_bound(s.k_pos.begin(), s.k_pos.end(), lo) - s.k_pos.begin();
      if (n_vis <= first) continue;
      const Acc* qr = in.query(r, qbuf);
      const Acc* wr = in.weights(r, wbuf);
      Acc* hs = scores + r * K;
      std::int64_t* hp = positions + r * K;
      // The candidates [j0, j1), scores sc[0 .. j1 - j0), into the row's top-k.
      const auto offer = [&](std::int64_t j0, std::int64_t j1, const Acc* sc) {
        for (std::int64_t j = j0; j < j1; ++j) {
          const Acc score = sc[j - j0];
          if (score < hs[0]) continue;  // worse than the row's worst entry: rejected by one compare
          heap_offer(hs, hp, K, score, s.k_pos[static_cast<std::size_t>(j)]);
        }
      };
      if (in_place) {
        gather_transposed<Acc>([&](std::int64_t i) { return qr + i * Di; }, Hi, Di, Hp, qT.data());
        for (std::int64_t j0 = first; j0 < n_vis; j0 += kKeyPanel) {
          const std::int64_t m = std::min(kKeyPanel, n_vis - j0);
          in.prefetch_keys(b, j0 + m, std::min(kKeyPanel, n_vis - j0 - m));  // the next run, while this one is scored
          index_scores_rows(qT.data(), wr, in.key_rows(b, j0, m, kbuf), m, Hi, Di, sT.data(), sbuf.data(), tile.data());
          offer(j0, j0 + m, tile.data());
        }
        continue;
      }
      for (std::int64_t p = first / kKeyPanel; p * kKeyPanel < n_vis; ++p) {
        const std::int64_t p0 = p * kKeyPanel;
        // the columns [c0, c1) of the panel that cover the candidates, in whole SIMD widths
        const std::int64_t c0 = std::max<std::int64_t>(first - p0, 0) / kPad * kPad;
        const std::int64_t c1 = std::min(pad16(n_vis - p0), kKeyPanel);
        index_scores(qr, wr, kT + (b * panels + p) * panel_size + c0, kKeyPanel, c1 - c0, Hi, Di, sbuf.data(),
                     tile.data());
        const std::int64_t j0 = std::max(first, p0);
        offer(j0, std::min(n_vis, p0 + kKeyPanel), tile.data() + (j0 - p0 - c0));
      }
    }
  }
}

template <typename S>
void selected_scores_impl(const DsaTopkState& state, const TensorView& scores) {
  const std::int64_t K = state.scores.dim(2), rows = state.scores.dim(0) * state.scores.dim(1);
  const std::int64_t* hp = static_cast<const std::int64_t*>(state.positions.data());
  const S* hs = static_cast<const S*>(state.scores.data());
  S* out = static_cast<S*>(scores.data());
  const WorkerScratch<std::int64_t> ws({K}, "dsa_topk_selected_scores scratch");
#pragma omp parallel
  {
    const std::span<std::int64_t> slot = ws.buffer(0);
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t* p = hp + r * K;
      std::int64_t n = 0;
      for (std::int64_t i = 0; i < K; ++i) {
        if (p[i] >= 0) slot[n++] = i;
      }
      // Positions are distinct within a row, so this order is dsa_topk_finalize's.
      std::sort(slot.begin(), slot.begin() + n, [&](std::int64_t a, std::int64_t b) { return p[a] < p[b]; });
      for (std::int64_t i = 0; i < n; ++i) out[r * K + i] = hs[r * K + slot[i]];
      std::fill(out + r * K + n, out + (r + 1) * K, S(0));
    }
  }
}

}  // namespace

void dsa_topk_init_cpu(const DsaTopkState& state) {
  dispatch_acc(state.scores.dtype(), [&](auto tag) {
    using S = decltype(tag);
    S* sc = static_cast<S*>(state.scores.data());
    std::fill(sc, sc + state.scores.numel(), neg_inf<S>());
  });
  std::int64_t* pos = static_cast<std::int64_t*>(state.positions.data());
  std::fill(pos, pos + state.positions.numel(), std::int64_t{-1});
}

void dsa_indexer_topk_block_cpu(const DsaIndexerArgs& args, const DsaIndexerShape& s, const DsaTopkState& state) {
  dispatch_floating(args.q_idx.dtype(), [&](auto tag) { topk_block_impl<decltype(tag)>(args, s, state); });
}

void dsa_topk_merge_cpu(const DsaTopkState& state, const DsaTopkState& other) {
  const std::int64_t K = state.scores.dim(2), rows = state.scores.dim(0) * state.scores.dim(1);
  std::int64_t* hp = static_cast<std::int64_t*>(state.positions.data());
  const std::int64_t* op = static_cast<const std::int64_t*>(other.positions.data());
  dispatch_acc(state.scores.dtype(), [&](auto tag) {
    using S = decltype(tag);
    S* hs = static_cast<S*>(state.scores.data());
    const S* os = static_cast<const S*>(other.scores.data());
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t i = 0; i < K; ++i) {
        if (op[r * K + i] >= 0) heap_offer(hs + r * K, hp + r * K, K, os[r * K + i], op[r * K + i]);
      }
    }
  });
}

void dsa_topk_finalize_cpu(const DsaTopkState& state, const TensorView& topk_indices) {
  const std::int64_t K = state.scores.dim(2), rows = state.scores.dim(0) * state.scores.dim(1);
  const std::int64_t* hp = static_cast<const std::int64_t*>(state.positions.data());
  std::int64_t* out = static_cast<std::int64_t*>(topk_indices.data());
  const WorkerScratch<std::int64_t> ws({K}, "dsa_topk_finalize scratch");
#pragma omp parallel
  {
    const std::span<std::int64_t> row = ws.buffer(0);
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int64_t n = 0;
      for (std::int64_t i = 0; i < K; ++i) {
        if (hp[r * K + i] >= 0) row[n++] = hp[r * K + i];
      }
      std::sort(row.begin(), row.begin() + n);
      std::copy(row.begin(), row.begin() + n, out + r * K);
      std::fill(out + r * K + n, out + (r + 1) * K, std::int64_t{-1});
    }
  }
}

void dsa_topk_selected_scores_cpu(const DsaTopkState& state, const TensorView& scores) {
  dispatch_acc(state.scores.dtype(), [&](auto tag) { selected_scores_impl<decltype(tag)>(state, scores); });
}

// ---- indexer loss -------------------------------------------------------------------------------------------------

namespace {

template <typename T>
void scores_selected_impl(const DsaIndexerArgs& a, const IndexerShape& s, const TensorView& topk,
                          const std::vector<std::int32_t>& valid, const TensorView& scores) {
  using Acc = acc_t<T>;
  const std::int64_t K = topk.dim(2), Hi = s.Hi, Di = s.Di, rows = s.B * s.Sq;
  const std::int64_t nmax = std::min(K, s.Sk), npad = pad16(nmax);
  const std::int64_t* idx = static_cast<const std::int64_t*>(topk.data());
  Acc* out = static_cast<Acc*>(scores.data());
  const IndexerInputs<T> in(a, s);
  const WorkerScratch<std::int64_t> iws({nmax, nmax}, "dsa_indexer_scores_selected scratch");
  const WorkerScratch<Acc> ws({Hi * Di, Hi, Di * npad, Hi * npad, npad}, "dsa_indexer_scores_selected scratch");
#pragma omp parallel
  {
    const std::span<std::int64_t> slots = iws.buffer(0), keys = iws.buffer(1);
    const std::span<Acc> qbuf = ws.buffer(0), wbuf = ws.buffer(1), kT = ws.buffer(2), sbuf = ws.buffer(3),
                         tile = ws.buffer(4);
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t n = collect_selected(idx + r * K, valid[static_cast<std::size_t>(r)], s.k_pos, slots, keys);
      if (n == 0) continue;
      in.keys_transposed(r / s.Sq, keys.data(), n, kT.data());
      index_scores(in.query(r, qbuf), in.weights(r, wbuf), kT.data(), pad16(n), pad16(n), Hi, Di, sbuf.data(),
                   tile.data());
      for (std::int64_t j = 0; j < n; ++j) out[r * K + slots[j]] = tile[j];
    }
  }
}

// Query pass per chunk of rows: s = q_idx . k_j of the row's selected pairs in the block (one [Hi, Di] x [Di, n]
// product), dw_i = sum_j g_j relu(s_ij), the coefficients a_ij = g_j w_i [s_ij > 0] (kept for the key pass) and
// dq_idx = a [Hi, n] x k [n, Di]. Key pass: each thread, over the chunk's rows in order, dk_idx_j += sum_i a_ij q_idx_i
// for the keys it owns (one [n_own, Hi] x [Hi, Di] product per row, then a scatter-add).
template <typename T>
void indexer_backward_impl(const DsaIndexerArgs& a, const IndexerShape& s, const TensorView& topk,
                           const std::vector<std::int32_t>& valid, const TensorView& dscores, const TensorView& dq_idx,
                           const TensorView& dw, const TensorView& dk_idx, bool accumulate) {
  using Acc = acc_t<T>;
  const std::int64_t K = topk.dim(2), Hi = s.Hi, Di = s.Di, Dp = pad16(Di), rows = s.B * s.Sq;
  const std::int64_t nmax = std::min(K, s.Sk), npad = pad16(nmax);
  const std::int64_t* idx = static_cast<const std::int64_t*>(topk.data());
  const Acc* g_all = static_cast<const Acc*>(dscores.data());
  const IndexerInputs<T> in(a, s);

  const KeyGradient<Acc> dk_acc(dk_idx, s.B * s.Sk, Di, accumulate, "dsa_indexer_backward dk_idx accumulator");
  // Kept per chunk row for the key pass: a [Hi, npad].
  const std::int64_t chunk = chunk_rows(Hi * npad * static_cast<std::int64_t>(sizeof(Acc)),
                                        s.B * s.Sk * Di * static_cast<std::int64_t>(sizeof(Acc)), rows, max_workers());
  const Tensor coef_owner = zeroed_workspace({chunk * Hi * npad}, dtype_v<Acc>, "dsa_indexer_backward coefficients");
  Acc* const coef = static_cast<Acc*>(coef_owner.data());
  const WorkerScratch<std::int64_t> iws({nmax, nmax}, "dsa_indexer_backward scratch");
  const WorkerScratch<Acc> ws({Hi * Di, Hi, npad * Dp, Di * npad, Hi * npad, Hi * Dp, Hi, Hi * Dp, npad},
                              "dsa_indexer_backward scratch");
#pragma omp parallel
  {
    const std::span<std::int64_t> slots = iws.buffer(0), keys = iws.buffer(1);
    const std::span<Acc> qbuf = ws.buffer(0), wbuf = ws.buffer(1), kg = ws.buffer(2), kT = ws.buffer(3),
                         sbuf = ws.buffer(4), dq = ws.buffer(5), dwr = ws.buffer(6), qpad = ws.buffer(7),
                         gs = ws.buffer(8);  // dscores of the row's selected slots, zero padded
    // the key pass reuses the query pass's buffers: own [Hi, npad] in sbuf, part [npad, Dp] in kg
    const std::span<Acc> own = sbuf, part = kg;
    const KeyOwner mine;
    for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const std::int64_t r1 = std::min(rows, r0 + chunk);
#pragma omp for schedule(dynamic, 2)
      for (std::int64_t r = r0; r < r1; ++r) {
        const std::int64_t b = r / s.Sq;
        const std::int64_t n = collect_selected(idx + r * K, valid[static_cast<std::size_t>(r)], s.k_pos, slots, keys);
        std::fill(dwr.begin(), dwr.end(), Acc(0));
        std::fill(dq.begin(), dq.end(), Acc(0));
        if (n > 0) {
          const std::int64_t np = pad16(n);
          const Acc* qr = in.query(r, qbuf);
          const Acc* wr = in.weights(r, wbuf);
          gather_rows(in.k_idx + b * s.Sk * Di, keys.data(), n, np, Di, Dp, kg.data());
          gather_transposed<Acc>([&](std::int64_t j) { return kg.data() + j * Dp; }, n, Di, np, kT.data());
          gemm<Acc>(Hi, np, Di, qr, Di, kT.data(), np, sbuf.data(), np);
          Acc* const c = coef + (r - r0) * Hi * npad;
          for (std::int64_t j = 0; j < np; ++j) gs[j] = j < n ? g_all[r * K + slots[j]] : Acc(0);
          for (std::int64_t i = 0; i < Hi; ++i) {
            Acc* __restrict sd = sbuf.data() + i * np;
            Acc* __restrict ci = c + i * npad;
            const Acc* __restrict g = gs.data();
            const Acc wi = wr[i];
#pragma omp simd
            for (std::int64_t j = 0; j < np; ++j) {
              const Acc v = sd[j];
              ci[j] = v > Acc(0) ? g[j] * wi : Acc(0);
              sd[j] = v > Acc(0) ? v : Acc(0);
            }
            dwr[i] = dot(sd, g, n);
          }
          gemm<Acc>(Hi, Dp, n, c, npad, kg.data(), Dp, dq.data(), Dp);
        }
        for (std::int64_t i = 0; i < Hi; ++i) store_row(dq_idx, (r * Hi + i) * Di, dq.data() + i * Dp, Di, accumulate);
        store_row(dw, r * Hi, dwr.data(), Hi, accumulate);
      }  // implicit barrier: the chunk's coefficients are complete
      for (std::int64_t r = r0; r < r1; ++r) {
        const std::int64_t n_own =
            owned_selected(mine, idx + r * K, valid[static_cast<std::size_t>(r)], s.k_pos, slots.data(), keys.data());
        if (n_own == 0) continue;
        const Acc* qr = in.query(r, qbuf);
        for (std::int64_t i = 0; i < Hi; ++i) {
          std::copy(qr + i * Di, qr + (i + 1) * Di, qpad.data() + i * Dp);
          std::fill(qpad.data() + i * Dp + Di, qpad.data() + (i + 1) * Dp, Acc(0));
        }
        gather_columns(coef + (r - r0) * Hi * npad, Hi, npad, slots.data(), n_own, own.data(), npad);
        gemm<Acc, false, true>(n_own, Dp, Hi, own.data(), npad, qpad.data(), Dp, part.data(), Dp);
        scatter_add_rows(part.data(), Dp, keys.data(), n_own, Di, dk_acc.data() + r / s.Sq * s.Sk * Di);
      }
#pragma omp barrier
    }
  }
  dk_acc.finish();
}

template <typename S>
double indexer_loss_impl(const DsaIndexerLossArgs& args, const TensorView& dscores) {
  const double grad_scale = static_cast<double>(static_cast<S>(args.grad_scale));  // fp32 rounding unless S is fp64
  const bool want_grad = !absent(dscores);
  const std::int64_t K = args.topk_indices.dim(2);
  const std::int64_t rows = args.topk_indices.dim(0) * args.topk_indices.dim(1);
  const std::int64_t* idx = static_cast<const std::int64_t*>(args.topk_indices.data());
  const S* probs = static_cast<const S*>(args.probs.data());
  const S* sc = static_cast<const S*>(args.scores.data());
  S* g = want_grad ? static_cast<S*>(dscores.data()) : nullptr;
  std::vector<double> row_loss(static_cast<std::size_t>(rows), 0.0);
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t* row = idx + r * K;
    double z = 0.0, mx = -INFINITY;
    for (std::int64_t s = 0; s < K; ++s) {
      if (row[s] < 0) continue;
      z += probs[r * K + s];
      mx = std::max(mx, static_cast<double>(sc[r * K + s]));
    }
    double sum_e = 0.0;
    for (std::int64_t s = 0; s < K; ++s) {
      if (row[s] >= 0) sum_e += std::exp(static_cast<double>(sc[r * K + s]) - mx);
    }
    const bool live = z > 0.0 && sum_e > 0.0;
    const double lse_i = mx + std::log(sum_e);
    double loss = 0.0;
    for (std::int64_t s = 0; s < K; ++s) {
      double grad = 0.0;
      if (row[s] >= 0 && live) {
        const double p = probs[r * K + s] / z;
        const double log_q = static_cast<double>(sc[r * K + s]) - lse_i;
        if (p > 0.0) loss += p * (std::log(p) - log_q);
        grad = std::exp(log_q) - p;
      }
      if (want_grad) g[r * K + s] = static_cast<S>(grad_scale * grad);
    }
    row_loss[static_cast<std::size_t>(r)] = loss;
  }
  double total = 0.0;
  for (double v : row_loss) total += v;
  return total;
}

}  // namespace

void dsa_indexer_scores_selected_cpu(const DsaIndexerArgs& args, const DsaIndexerShape& s,
                                     const TensorView& topk_indices, const std::vector<std::int32_t>& valid,
                                     const TensorView& scores) {
  dispatch_floating(args.q_idx.dtype(),
                    [&](auto tag) { scores_selected_impl<decltype(tag)>(args, s, topk_indices, valid, scores); });
}

double dsa_indexer_loss_cpu(const DsaIndexerLossArgs& args, const TensorView& dscores) {
  return dispatch_acc(args.probs.dtype(), [&](auto tag) { return indexer_loss_impl<decltype(tag)>(args, dscores); });
}

void dsa_indexer_backward_cpu(const DsaIndexerArgs& args, const DsaIndexerShape& s, const TensorView& topk_indices,
                              const std::vector<std::int32_t>& valid, const TensorView& dscores,
                              const TensorView& dq_idx, const TensorView& dw, const TensorView& dk_idx,
                              bool accumulate) {
  dispatch_floating(args.q_idx.dtype(), [&](auto tag) {
    indexer_backward_impl<decltype(tag)>(args, s, topk_indices, valid, dscores, dq_idx, dw, dk_idx, accumulate);
  });
}

}  // namespace seqpar::attn::cpu
