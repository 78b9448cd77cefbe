// DSA lightning indexer on the CPU: block-wise scoring merged into a running top-k, finalisation, the scores of the
// selected slots, the KL indexer loss and its backward. See attention/dsa.h for the math and the block protocol.
#include <algorithm>
#include <cmath>
#include <cstdint>
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

// I_tj for one query (Acc rows q [Hi, Di], w [Hi]) and a tile of keys kT [Di, kTile] (transposed, zero-padded):
// out[l] = sum_i w_i relu(s_il), s = dot_tile(q, kT), heads in ascending order for every lane. Out of line, so that a
// pair's score is bitwise the same wherever (topk or selected scores) and in whichever tile it is computed.
template <typename Acc>
__attribute__((noinline)) void index_score_tile(const Acc* q, const Acc* w, const Acc* kT, std::int64_t Hi,
                                                std::int64_t Di, Acc* s, Acc* out) {
  dot_tile(q, Hi, Di, kT, s);
  Acc total[kTile] = {};
  for (std::int64_t i = 0; i < Hi; ++i) {
    const Acc wi = w[i];
    for (std::int64_t l = 0; l < kTile; ++l) total[l] += wi * std::max(s[i * kTile + l], Acc(0));
  }
  for (std::int64_t l = 0; l < kTile; ++l) out[l] = total[l];
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

// The indexer inputs of one call and each thread's view of them: a query row (q_idx and w) as Acc, and a tile of
// key rows transposed with its per-head dot products. The per-thread buffers are allocated before the region.
template <typename T>
struct IndexerInputs {
  using Acc = acc_t<T>;
  const IndexerShape& s;
  const T *q_idx, *w, *k_idx;
  WorkerScratch<Acc> ws;

  IndexerInputs(const DsaIndexerArgs& a, const IndexerShape& shape, const char* what)
      : s(shape),
        q_idx(static_cast<const T*>(a.q_idx.data())),
        w(static_cast<const T*>(a.w.data())),
        k_idx(static_cast<const T*>(a.k_idx.data())),
        ws({s.Hi * s.Di, s.Hi, kTile * s.Di, kTile * s.Hi}, what) {}

  // Inside the parallel region: the calling thread's buffers.
  struct Thread {
    const IndexerInputs& in;
    std::span<Acc> qbuf, wbuf, kT, sbuf;  // sbuf [Hi, kTile]: q_idx_i . k_j of the tile
    const Acc* q = nullptr;               // [Hi, Di] query row r
    const Acc* wr = nullptr;              // [Hi]
    const T* krows[kTile];

    void load_query(std::int64_t r) {
      q = acc_row(in.q_idx + r * in.s.Hi * in.s.Di, in.s.Hi * in.s.Di, qbuf);
      wr = acc_row(in.w + r * in.s.Hi, in.s.Hi, wbuf);
    }
    // Keys b * Sk + key(j), j < n <= kTile, transposed into kT.
    template <typename KeyFn>
    void load_keys(std::int64_t b, std::int64_t n, KeyFn&& key) {
      for (std::int64_t j = 0; j < n; ++j) krows[j] = in.k_idx + (b * in.s.Sk + key(j)) * in.s.Di;
      load_tile_transposed(krows, n, in.s.Di, kT.data());
    }
    // Index scores I of the loaded query against the loaded keys.
    void scores(Acc* out) { index_score_tile(q, wr, kT.data(), in.s.Hi, in.s.Di, sbuf.data(), out); }
    // Only the per-head dot products, into sbuf.
    void dots() { dot_tile(q, in.s.Hi, in.s.Di, kT.data(), sbuf.data()); }
  };
  Thread thread() const {
    return {*this, ws.buffer(0), ws.buffer(1), ws.buffer(2), ws.buffer(3), nullptr, nullptr, {}};
  }

  // fn(thread, r) for every query row r = b * Sq + t, in a parallel region (dynamic schedule).
  template <typename Fn>
  void for_each_row(Fn&& fn) const {
    const std::int64_t rows = s.B * s.Sq;
#pragma omp parallel
    {
      Thread th = thread();
#pragma omp for schedule(dynamic, 4)
      for (std::int64_t r = 0; r < rows; ++r) fn(th, r);
    }
  }
};

template <typename T>
void topk_block_impl(const DsaIndexerArgs& a, const IndexerShape& s, const DsaTopkState& st) {
  using Acc = acc_t<T>;
  const std::int64_t K = st.scores.dim(2);
  Acc* scores = static_cast<Acc*>(st.scores.data());
  std::int64_t* positions = static_cast<std::int64_t*>(st.positions.data());
  const IndexerInputs<T> in(a, s, "dsa_indexer_topk_block scratch");
  in.for_each_row([&](auto& th, std::int64_t r) {
    const std::int64_t b = r / s.Sq, t = r % s.Sq;
    const std::int64_t q = s.q_pos[static_cast<std::size_t>(t)];
    const std::int64_t n_vis = std::upper_bound(s.k_pos.begin(), s.k_pos.end(), q) - s.k_pos.begin();
    // A window keeps the candidates with q - k_pos < window: from the first key at q - window + 1.
    const std::int64_t first =
        a.window > 0 ? std::lower_bound(s.k_pos.begin(), s.k_pos.end(), q - a.window + 1) - s.k_pos.begin() : 0;
    if (n_vis <= first) return;
    Acc tile_scores[kTile];
    th.load_query(r);
    Acc* hs = scores + r * K;
    std::int64_t* hp = positions + r * K;
    for (std::int64_t j0 = first; j0 < n_vis; j0 += kTile) {
      const std::int64_t nj = std::min(kTile, n_vis - j0);
      th.load_keys(b, nj, [&](std::int64_t j) { return j0 + j; });
      th.scores(tile_scores);
      for (std::int64_t j = 0; j < nj; ++j) {
        heap_offer(hs, hp, K, tile_scores[j], s.k_pos[static_cast<std::size_t>(j0 + j)]);
      }
    }
  });
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
  const std::int64_t K = topk.dim(2);
  const std::int64_t* idx = static_cast<const std::int64_t*>(topk.data());
  Acc* out = static_cast<Acc*>(scores.data());
  const IndexerInputs<T> in(a, s, "dsa_indexer_scores_selected scratch");
  in.for_each_row([&](auto& th, std::int64_t r) {
    const std::int64_t b = r / s.Sq;
    Acc tile_scores[kTile];
    bool loaded = false;
    for_each_selected_tile(
        idx + r * K, valid[r], s.k_pos, [](std::int64_t) { return true; },
        [&](const std::int64_t* slots, const std::int64_t* keys, std::int64_t n) {
          if (!loaded) th.load_query(r);
          loaded = true;
          th.load_keys(b, n, [&](std::int64_t j) { return keys[j]; });
          th.scores(tile_scores);
          for (std::int64_t j = 0; j < n; ++j) out[r * K + slots[j]] = tile_scores[j];
        });
  });
}

template <typename T>
void indexer_backward_impl(const DsaIndexerArgs& a, const IndexerShape& s, const TensorView& topk,
                           const std::vector<std::int32_t>& valid, const TensorView& dscores, const TensorView& dq_idx,
                           const TensorView& dw, const TensorView& dk_idx, bool accumulate) {
  using Acc = acc_t<T>;
  const std::int64_t K = topk.dim(2), Hi = s.Hi, Di = s.Di;
  const std::int64_t* idx = static_cast<const std::int64_t*>(topk.data());
  const Acc* g_all = static_cast<const Acc*>(dscores.data());
  const std::int64_t rows = s.B * s.Sq;

  // Queries: dq_idx and dw of each row from the selected pairs inside the block.
  const IndexerInputs<T> qin(a, s, "dsa_indexer_backward query scratch");
  const WorkerScratch<Acc> qws({Di, Hi * Di, Hi}, "dsa_indexer_backward query scratch");
  qin.for_each_row([&](auto& th, std::int64_t r) {
    const std::span<Acc> kbuf = qws.buffer(0), dq = qws.buffer(1), dwr = qws.buffer(2);
    const std::int64_t b = r / s.Sq;
    std::fill(dq.begin(), dq.end(), Acc(0));
    std::fill(dwr.begin(), dwr.end(), Acc(0));
    th.load_query(r);
    for_each_selected_tile(
        idx + r * K, valid[r], s.k_pos, [](std::int64_t) { return true; },
        [&](const std::int64_t* slots, const std::int64_t* keys, std::int64_t n) {
          th.load_keys(b, n, [&](std::int64_t j) { return keys[j]; });
          th.dots();
          for (std::int64_t j = 0; j < n; ++j) {
            const Acc g = g_all[r * K + slots[j]];
            if (g == Acc(0)) continue;
            const Acc* k = acc_row(th.krows[j], Di, kbuf);
            for (std::int64_t i = 0; i < Hi; ++i) {
              const Acc sd = th.sbuf[i * kTile + j];
              if (sd > Acc(0)) {
                dwr[i] += g * sd;
                axpy(g * th.wr[i], k, dq.data() + i * Di, Di);
              }
            }
          }
        });
    store_row(dq_idx, r * Hi * Di, dq.data(), Hi * Di, accumulate);
    store_row(dw, r * Hi, dwr.data(), Hi, accumulate);
  });

  // Keys: dk_idx of each block key, summed over its selecting queries in increasing (b, t) (see KeyOwner).
  const Tensor dk_acc_owner =
      zeroed_workspace({s.B * s.Sk * Di}, dtype_v<Acc>, "dsa_indexer_backward dk_idx accumulator");
  Acc* const dk_acc = static_cast<Acc*>(dk_acc_owner.data());
  const IndexerInputs<T> kin(a, s, "dsa_indexer_backward key scratch");
#pragma omp parallel
  {
    const KeyOwner mine;
    auto th = kin.thread();
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / s.Sq;
      bool loaded = false;
      for_each_selected_tile(idx + r * K, valid[r], s.k_pos, mine,
                             [&](const std::int64_t* slots, const std::int64_t* keys, std::int64_t n) {
                               if (!loaded) th.load_query(r);
                               loaded = true;
                               th.load_keys(b, n, [&](std::int64_t j) { return keys[j]; });
                               th.dots();
                               for (std::int64_t j = 0; j < n; ++j) {
                                 const Acc g = g_all[r * K + slots[j]];
                                 if (g == Acc(0)) continue;
                                 Acc* dk = dk_acc + (b * s.Sk + keys[j]) * Di;
                                 for (std::int64_t i = 0; i < Hi; ++i) {
                                   if (th.sbuf[i * kTile + j] > Acc(0)) axpy(g * th.wr[i], th.q + i * Di, dk, Di);
                                 }
                               }
                             });
    }
  }
  const std::int64_t keys = s.B * s.Sk;
#pragma omp parallel for schedule(static)
  for (std::int64_t km = 0; km < keys; ++km) store_row(dk_idx, km * Di, dk_acc + km * Di, Di, accumulate);
}

template <typename S>
double indexer_loss_impl(const DsaIndexerLossArgs& args, const TensorView& dscores) {
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
      if (want_grad) g[r * K + s] = static_cast<S>(args.grad_scale * grad);
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
