// DSA lightning indexer on the CPU: block-wise scoring merged into a running top-k, finalisation, the scores of the
// selected slots, the KL indexer loss and its backward. See attention/dsa.h for the math and the block protocol.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention/cpu/dsa_common.h"
#include "attention/dsa.h"

namespace seqpar::attn {
namespace {

using namespace dsa_detail;

// ---- top-k heap ---------------------------------------------------------------------------------------------------
// Strict total order on candidates: a valid candidate (position >= 0) beats an empty slot; a larger score wins; equal
// scores go to the smaller position. Each row of the state is a binary heap whose root is the worst entry.

inline bool better(float sa, std::int64_t pa, float sb, std::int64_t pb) {
  if (pb < 0) return pa >= 0;
  if (pa < 0) return false;
  if (sa != sb) return sa > sb;
  return pa < pb;
}

inline void sift_down(float* hs, std::int64_t* hp, std::int64_t K, std::int64_t i) {
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

inline void heap_offer(float* hs, std::int64_t* hp, std::int64_t K, float score, std::int64_t pos) {
  if (K == 0 || !better(score, pos, hs[0], hp[0])) return;
  hs[0] = score;
  hp[0] = pos;
  sift_down(hs, hp, K, 0);
}

struct IndexerShape {
  std::int64_t B, Sq, Hi, Di, Sk;
  std::vector<std::int64_t> q_pos, k_pos;
};

IndexerShape check_indexer_args(const DsaIndexerArgs& a) {
  check_floating(a.q_idx, "q_idx");
  check_floating(a.w, "w");
  check_floating(a.k_idx, "k_idx");
  SEQPAR_CHECK(a.q_idx.ndim() == 4, "q_idx must be [B, Sq, Hi, Di], got ", shape_str(a.q_idx.shape()));
  IndexerShape s;
  s.B = a.q_idx.dim(0);
  s.Sq = a.q_idx.dim(1);
  s.Hi = a.q_idx.dim(2);
  s.Di = a.q_idx.dim(3);
  SEQPAR_CHECK(a.k_idx.ndim() == 3 && a.k_idx.dim(0) == s.B && a.k_idx.dim(2) == s.Di, "k_idx must be [B, Sk, Di] = [",
               s.B, ", Sk, ", s.Di, "], got ", shape_str(a.k_idx.shape()));
  s.Sk = a.k_idx.dim(1);
  check_shape(a.w, {s.B, s.Sq, s.Hi}, "w");
  SEQPAR_CHECK(a.k_idx.dtype() == a.q_idx.dtype() && a.w.dtype() == a.q_idx.dtype(),
               "q_idx, w and k_idx must share one dtype, got ", dtype_name(a.q_idx.dtype()), ", ",
               dtype_name(a.w.dtype()), ", ", dtype_name(a.k_idx.dtype()));
  s.q_pos = positions_or_iota(a.q_pos, s.Sq, "q_pos", "Sq");
  s.k_pos = positions_or_iota(a.k_pos, s.Sk, "k_pos", "Sk");
  check_strictly_increasing(s.k_pos, "k_pos");
  return s;
}

void check_state(const DsaTopkState& st, std::int64_t B, std::int64_t Sq, const char* what) {
  check_cpu(st.scores, what);
  check_cpu(st.positions, what);
  check_dtype(st.scores, DType::kFloat32, "top-k state scores");
  check_dtype(st.positions, DType::kInt64, "top-k state positions");
  SEQPAR_CHECK(st.scores.ndim() == 3 && st.scores.shape() == st.positions.shape(), what,
               ": scores and positions must both be [B, Sq, k], got ", shape_str(st.scores.shape()), " and ",
               shape_str(st.positions.shape()));
  if (B >= 0) {
    SEQPAR_CHECK(st.scores.dim(0) == B && st.scores.dim(1) == Sq, what, " must be [", B, ", ", Sq, ", k], got ",
                 shape_str(st.scores.shape()));
  }
}

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

// A row of a storage-typed buffer as Acc: the pointer itself when the types agree, else converted into `buf`.
template <typename Acc, typename T>
inline const Acc* acc_row(const T* src, std::int64_t n, std::vector<Acc>& buf) {
  if constexpr (std::is_same_v<T, Acc>) {
    return src;
  } else {
    buf.resize(static_cast<std::size_t>(n));
    load_row(src, buf.data(), n);
    return buf.data();
  }
}

template <typename T>
void topk_block_impl(const DsaIndexerArgs& a, const IndexerShape& s, const DsaTopkState& st) {
  using Acc = acc_t<T>;
  const std::int64_t K = st.scores.dim(2);
  const T* q_idx = static_cast<const T*>(a.q_idx.data());
  const T* w = static_cast<const T*>(a.w.data());
  const T* k_idx = static_cast<const T*>(a.k_idx.data());
  float* scores = static_cast<float*>(st.scores.data());
  std::int64_t* positions = static_cast<std::int64_t*>(st.positions.data());
  const std::int64_t rows = s.B * s.Sq;
#pragma omp parallel
  {
    std::vector<Acc> qbuf, wbuf, kT(static_cast<std::size_t>(kTile * s.Di)),
        sbuf(static_cast<std::size_t>(kTile * s.Hi));
    Acc tile_scores[kTile];
    const T* krows[kTile];
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / s.Sq, t = r % s.Sq;
      const std::int64_t n_vis =
          std::upper_bound(s.k_pos.begin(), s.k_pos.end(), s.q_pos[static_cast<std::size_t>(t)]) - s.k_pos.begin();
      if (n_vis == 0) continue;
      const Acc* q = acc_row(q_idx + r * s.Hi * s.Di, s.Hi * s.Di, qbuf);
      const Acc* wr = acc_row(w + r * s.Hi, s.Hi, wbuf);
      float* hs = scores + r * K;
      std::int64_t* hp = positions + r * K;
      for (std::int64_t j0 = 0; j0 < n_vis; j0 += kTile) {
        const std::int64_t nj = std::min(kTile, n_vis - j0);
        for (std::int64_t j = 0; j < nj; ++j) krows[j] = k_idx + (b * s.Sk + j0 + j) * s.Di;
        load_tile_transposed(krows, nj, s.Di, kT.data());
        index_score_tile(q, wr, kT.data(), s.Hi, s.Di, sbuf.data(), tile_scores);
        for (std::int64_t j = 0; j < nj; ++j) {
          heap_offer(hs, hp, K, static_cast<float>(tile_scores[j]), s.k_pos[static_cast<std::size_t>(j0 + j)]);
        }
      }
    }
  }
}

}  // namespace

void dsa_topk_init(const DsaTopkState& state, Stream stream) {
  check_cpu_stream(stream, "dsa_topk_init");
  check_state(state, -1, -1, "top-k state");
  float* sc = static_cast<float*>(state.scores.data());
  std::int64_t* pos = static_cast<std::int64_t*>(state.positions.data());
  std::fill(sc, sc + state.scores.numel(), neg_inf());
  std::fill(pos, pos + state.positions.numel(), std::int64_t{-1});
}

void dsa_indexer_topk_block(const DsaIndexerArgs& args, const DsaTopkState& state, Stream stream) {
  check_cpu_stream(stream, "dsa_indexer_topk_block");
  const IndexerShape s = check_indexer_args(args);
  check_state(state, s.B, s.Sq, "top-k state");
  dispatch_floating(args.q_idx.dtype(), [&](auto tag) { topk_block_impl<decltype(tag)>(args, s, state); });
}

void dsa_topk_merge(const DsaTopkState& state, const DsaTopkState& other, Stream stream) {
  check_cpu_stream(stream, "dsa_topk_merge");
  check_state(state, -1, -1, "top-k state");
  check_state(other, -1, -1, "other top-k state");
  SEQPAR_CHECK(state.scores.shape() == other.scores.shape(), "top-k states to merge must have one shape, got ",
               shape_str(state.scores.shape()), " and ", shape_str(other.scores.shape()));
  const std::int64_t K = state.scores.dim(2), rows = state.scores.dim(0) * state.scores.dim(1);
  float* hs = static_cast<float*>(state.scores.data());
  std::int64_t* hp = static_cast<std::int64_t*>(state.positions.data());
  const float* os = static_cast<const float*>(other.scores.data());
  const std::int64_t* op = static_cast<const std::int64_t*>(other.positions.data());
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t i = 0; i < K; ++i) {
      if (op[r * K + i] >= 0) heap_offer(hs + r * K, hp + r * K, K, os[r * K + i], op[r * K + i]);
    }
  }
}

void dsa_topk_finalize(const DsaTopkState& state, const TensorView& topk_indices, Stream stream) {
  check_cpu_stream(stream, "dsa_topk_finalize");
  check_state(state, -1, -1, "top-k state");
  check_cpu(topk_indices, "topk_indices");
  check_dtype(topk_indices, DType::kInt64, "topk_indices");
  check_shape(topk_indices, state.positions.shape(), "topk_indices");
  const std::int64_t K = state.scores.dim(2), rows = state.scores.dim(0) * state.scores.dim(1);
  const std::int64_t* hp = static_cast<const std::int64_t*>(state.positions.data());
  std::int64_t* out = static_cast<std::int64_t*>(topk_indices.data());
#pragma omp parallel
  {
    std::vector<std::int64_t> row;
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      row.clear();
      for (std::int64_t i = 0; i < K; ++i) {
        if (hp[r * K + i] >= 0) row.push_back(hp[r * K + i]);
      }
      std::sort(row.begin(), row.end());
      std::copy(row.begin(), row.end(), out + r * K);
      std::fill(out + r * K + static_cast<std::int64_t>(row.size()), out + (r + 1) * K, std::int64_t{-1});
    }
  }
}

void dsa_indexer_topk(const DsaIndexerArgs& args, const TensorView& topk_indices, Stream stream) {
  check_cpu_stream(stream, "dsa_indexer_topk");
  check_cpu(topk_indices, "topk_indices");
  SEQPAR_CHECK(topk_indices.ndim() == 3, "topk_indices must be [B, Sq, k], got ", shape_str(topk_indices.shape()));
  Tensor scores = Tensor::empty(topk_indices.shape(), DType::kFloat32, MemCategory::kWorkspace);
  Tensor positions = Tensor::empty(topk_indices.shape(), DType::kInt64, MemCategory::kWorkspace);
  const DsaTopkState state{scores.view(), positions.view()};
  dsa_topk_init(state, stream);
  dsa_indexer_topk_block(args, state, stream);
  dsa_topk_finalize(state, topk_indices, stream);
}

// ---- indexer loss -------------------------------------------------------------------------------------------------

namespace {

template <typename T>
void scores_selected_impl(const DsaIndexerArgs& a, const IndexerShape& s, const TensorView& topk,
                          const std::vector<std::int32_t>& valid, const TensorView& scores) {
  using Acc = acc_t<T>;
  const std::int64_t K = topk.dim(2);
  const T* q_idx = static_cast<const T*>(a.q_idx.data());
  const T* w = static_cast<const T*>(a.w.data());
  const T* k_idx = static_cast<const T*>(a.k_idx.data());
  const std::int64_t* idx = static_cast<const std::int64_t*>(topk.data());
  float* out = static_cast<float*>(scores.data());
  const std::int64_t rows = s.B * s.Sq;
#pragma omp parallel
  {
    std::vector<Acc> qbuf, wbuf, kT(static_cast<std::size_t>(kTile * s.Di)),
        sbuf(static_cast<std::size_t>(kTile * s.Hi));
    Acc tile_scores[kTile];
    const T* krows[kTile];
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / s.Sq;
      const Acc* q = nullptr;
      const Acc* wr = nullptr;
      for_each_selected_tile(
          idx + r * K, valid[r], s.k_pos, [](std::int64_t) { return true; },
          [&](const std::int64_t* slots, const std::int64_t* keys, std::int64_t n) {
            if (q == nullptr) {
              q = acc_row(q_idx + r * s.Hi * s.Di, s.Hi * s.Di, qbuf);
              wr = acc_row(w + r * s.Hi, s.Hi, wbuf);
            }
            for (std::int64_t j = 0; j < n; ++j) krows[j] = k_idx + (b * s.Sk + keys[j]) * s.Di;
            load_tile_transposed(krows, n, s.Di, kT.data());
            index_score_tile(q, wr, kT.data(), s.Hi, s.Di, sbuf.data(), tile_scores);
            for (std::int64_t j = 0; j < n; ++j) out[r * K + slots[j]] = static_cast<float>(tile_scores[j]);
          });
    }
  }
}

template <typename T>
void indexer_backward_impl(const DsaIndexerArgs& a, const IndexerShape& s, const TensorView& topk,
                           const std::vector<std::int32_t>& valid, const TensorView& dscores, const TensorView& dq_idx,
                           const TensorView& dw, const TensorView& dk_idx, bool accumulate) {
  using Acc = acc_t<T>;
  const std::int64_t K = topk.dim(2), Hi = s.Hi, Di = s.Di;
  const T* q_idx = static_cast<const T*>(a.q_idx.data());
  const T* w = static_cast<const T*>(a.w.data());
  const T* k_idx = static_cast<const T*>(a.k_idx.data());
  const std::int64_t* idx = static_cast<const std::int64_t*>(topk.data());
  const float* g_all = static_cast<const float*>(dscores.data());
  const std::int64_t rows = s.B * s.Sq;

  // Queries: dq_idx and dw of each row from the selected pairs inside the block.
#pragma omp parallel
  {
    std::vector<Acc> qbuf, wbuf, kbuf, dq(static_cast<std::size_t>(Hi * Di)), dwr(static_cast<std::size_t>(Hi));
    std::vector<Acc> kT(static_cast<std::size_t>(kTile * Di)), sbuf(static_cast<std::size_t>(kTile * Hi));
    const T* krows[kTile];
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / s.Sq;
      std::fill(dq.begin(), dq.end(), Acc(0));
      std::fill(dwr.begin(), dwr.end(), Acc(0));
      const Acc* q = acc_row(q_idx + r * Hi * Di, Hi * Di, qbuf);
      const Acc* wr = acc_row(w + r * Hi, Hi, wbuf);
      for_each_selected_tile(
          idx + r * K, valid[r], s.k_pos, [](std::int64_t) { return true; },
          [&](const std::int64_t* slots, const std::int64_t* keys, std::int64_t n) {
            for (std::int64_t j = 0; j < n; ++j) krows[j] = k_idx + (b * s.Sk + keys[j]) * Di;
            load_tile_transposed(krows, n, Di, kT.data());
            dot_tile(q, Hi, Di, kT.data(), sbuf.data());
            for (std::int64_t j = 0; j < n; ++j) {
              const Acc g = static_cast<Acc>(g_all[r * K + slots[j]]);
              if (g == Acc(0)) continue;
              const Acc* k = acc_row(krows[j], Di, kbuf);
              for (std::int64_t i = 0; i < Hi; ++i) {
                const Acc sd = sbuf[i * kTile + j];
                if (sd > Acc(0)) {
                  dwr[i] += g * sd;
                  axpy(g * wr[i], k, dq.data() + i * Di, Di);
                }
              }
            }
          });
      store_row(dq_idx, r * Hi * Di, dq.data(), Hi * Di, accumulate);
      store_row(dw, r * Hi, dwr.data(), Hi, accumulate);
    }
  }

  // Keys: dk_idx of each block key, summed over its selecting queries in increasing (b, t) (see KeyOwner).
  std::vector<Acc> dk_acc(static_cast<std::size_t>(s.B * s.Sk * Di), Acc(0));
#pragma omp parallel
  {
    const KeyOwner mine;
    std::vector<Acc> qbuf, wbuf, kT(static_cast<std::size_t>(kTile * Di)), sbuf(static_cast<std::size_t>(kTile * Hi));
    const T* krows[kTile];
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / s.Sq;
      const Acc* q = nullptr;
      const Acc* wr = nullptr;
      for_each_selected_tile(idx + r * K, valid[r], s.k_pos, mine,
                             [&](const std::int64_t* slots, const std::int64_t* keys, std::int64_t n) {
                               if (q == nullptr) {
                                 q = acc_row(q_idx + r * Hi * Di, Hi * Di, qbuf);
                                 wr = acc_row(w + r * Hi, Hi, wbuf);
                               }
                               for (std::int64_t j = 0; j < n; ++j) krows[j] = k_idx + (b * s.Sk + keys[j]) * Di;
                               load_tile_transposed(krows, n, Di, kT.data());
                               dot_tile(q, Hi, Di, kT.data(), sbuf.data());
                               for (std::int64_t j = 0; j < n; ++j) {
                                 const Acc g = static_cast<Acc>(g_all[r * K + slots[j]]);
                                 if (g == Acc(0)) continue;
                                 Acc* dk = dk_acc.data() + (b * s.Sk + keys[j]) * Di;
                                 for (std::int64_t i = 0; i < Hi; ++i) {
                                   if (sbuf[i * kTile + j] > Acc(0)) axpy(g * wr[i], q + i * Di, dk, Di);
                                 }
                               }
                             });
    }
  }
  const std::int64_t keys = s.B * s.Sk;
#pragma omp parallel for schedule(static)
  for (std::int64_t km = 0; km < keys; ++km) store_row(dk_idx, km * Di, dk_acc.data() + km * Di, Di, accumulate);
}

void check_slot_array(const TensorView& t, const TensorView& topk, const char* what) {
  check_cpu(t, what);
  check_dtype(t, DType::kFloat32, what);
  check_shape(t, topk.shape(), what);
}

}  // namespace

void dsa_indexer_scores_selected(const DsaIndexerArgs& args, const TensorView& topk_indices, const TensorView& scores,
                                 Stream stream) {
  check_cpu_stream(stream, "dsa_indexer_scores_selected");
  const IndexerShape s = check_indexer_args(args);
  const std::vector<std::int32_t> valid = check_topk_rows(topk_indices, s.B, s.Sq, s.q_pos, "topk_indices");
  check_slot_array(scores, topk_indices, "scores");
  dispatch_floating(args.q_idx.dtype(),
                    [&](auto tag) { scores_selected_impl<decltype(tag)>(args, s, topk_indices, valid, scores); });
}

double dsa_indexer_loss(const DsaIndexerLossArgs& args, const TensorView& dscores, Stream stream) {
  check_cpu_stream(stream, "dsa_indexer_loss");
  check_cpu(args.topk_indices, "topk_indices");
  check_dtype(args.topk_indices, DType::kInt64, "topk_indices");
  SEQPAR_CHECK(args.topk_indices.ndim() == 3, "topk_indices must be [B, Sq, k], got ",
               shape_str(args.topk_indices.shape()));
  check_slot_array(args.probs, args.topk_indices, "probs");
  check_slot_array(args.scores, args.topk_indices, "scores");
  const bool want_grad = !absent(dscores);
  if (want_grad) check_slot_array(dscores, args.topk_indices, "dscores");
  const std::int64_t K = args.topk_indices.dim(2);
  const std::int64_t rows = args.topk_indices.dim(0) * args.topk_indices.dim(1);
  const std::int64_t* idx = static_cast<const std::int64_t*>(args.topk_indices.data());
  const float* probs = static_cast<const float*>(args.probs.data());
  const float* sc = static_cast<const float*>(args.scores.data());
  float* g = want_grad ? static_cast<float*>(dscores.data()) : nullptr;
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
      if (want_grad) g[r * K + s] = static_cast<float>(args.grad_scale * grad);
    }
    row_loss[static_cast<std::size_t>(r)] = loss;
  }
  double total = 0.0;
  for (double v : row_loss) total += v;
  return total;
}

void dsa_indexer_backward(const DsaIndexerArgs& args, const TensorView& topk_indices, const TensorView& dscores,
                          const TensorView& dq_idx, const TensorView& dw, const TensorView& dk_idx, bool accumulate,
                          Stream stream) {
  check_cpu_stream(stream, "dsa_indexer_backward");
  const IndexerShape s = check_indexer_args(args);
  const std::vector<std::int32_t> valid = check_topk_rows(topk_indices, s.B, s.Sq, s.q_pos, "topk_indices");
  check_slot_array(dscores, topk_indices, "dscores");
  check_grad_output(dq_idx, args.q_idx.shape(), accumulate, "dq_idx");
  check_grad_output(dw, args.w.shape(), accumulate, "dw");
  check_grad_output(dk_idx, args.k_idx.shape(), accumulate, "dk_idx");
  dispatch_floating(args.q_idx.dtype(), [&](auto tag) {
    indexer_backward_impl<decltype(tag)>(args, s, topk_indices, valid, dscores, dq_idx, dw, dk_idx, accumulate);
  });
}

}  // namespace seqpar::attn
