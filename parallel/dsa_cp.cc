#include "parallel/dsa_cp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "attention/mha.h"
#include "parallel/ring_pass.h"
#include "parallel/ulysses.h"
#include "runtime/logging.h"
#include "runtime/tensor_ops.h"
#include "runtime/timer.h"

namespace seqpar {
namespace {

constexpr int kTagIndexKeys = 301;  // 302: dk_idx accumulators
constexpr int kTagLatent = 303;     // 304: dc accumulators

// A block of keys at `k_pos` holds a key visible (causally) to some query at `q_pos` (both increasing).
bool any_visible(const std::vector<std::int64_t>& q_pos, const std::vector<std::int64_t>& k_pos) {
  return !q_pos.empty() && !k_pos.empty() && k_pos.front() <= q_pos.back();
}

// all_gather over `ulysses` of a [B, S_local, ...] tensor into [B, Pu * S_local, ...] (ring-shard order).
Tensor gather_sequence_pieces(Communicator& ulysses, const TensorView& local, MemCategory category) {
  const int pu = ulysses.size();
  Shape packed = local.shape();
  packed.insert(packed.begin(), pu);
  Tensor all = Tensor::empty(packed, local.dtype(), MemCategory::kCommBuffer);
  ulysses.all_gather(local, all.view())->wait();
  Shape out_shape = local.shape();
  out_shape[1] *= pu;
  Tensor out = Tensor::empty(out_shape, local.dtype(), category);
  const std::size_t piece = local.nbytes() / static_cast<std::size_t>(local.dim(0));  // one batch row's piece
  for (int u = 0; u < pu; ++u)
    for (std::int64_t b = 0; b < local.dim(0); ++b)
      std::memcpy(static_cast<char*>(out.data()) + (b * pu + u) * piece,
                  static_cast<const char*>(all.data()) + (u * local.dim(0) + b) * piece, piece);
  return out;
}

// The adjoint: [B, Pu * S_local, ...] fp32 partial sums on every Ulysses rank -> the sum of this rank's piece.
void reduce_scatter_sequence_pieces(Communicator& ulysses, const TensorView& ring_shard, const TensorView& local) {
  const int pu = ulysses.size();
  const std::int64_t B = ring_shard.dim(0);
  const std::size_t piece = local.nbytes() / static_cast<std::size_t>(B);
  Shape packed = local.shape();
  packed.insert(packed.begin(), pu);
  Tensor send = Tensor::empty(packed, ring_shard.dtype(), MemCategory::kCommBuffer);
  for (int u = 0; u < pu; ++u)
    for (std::int64_t b = 0; b < B; ++b)
      std::memcpy(static_cast<char*>(send.data()) + (u * B + b) * piece,
                  static_cast<const char*>(ring_shard.data()) + (b * pu + u) * piece, piece);
  ulysses.reduce_scatter(send.view(), local, ReduceOp::kSum)->wait();
}

// Scores of the selected keys in topk_indices order, from the final running top-k state: per row, the (position,
// score) pairs sorted by position with empty slots (-1) last, which is dsa_topk_finalize's order.
void selected_scores(const attn::DsaTopkState& state, const TensorView& scores) {
  const std::int64_t rows = state.positions.dim(0) * state.positions.dim(1), k = state.positions.dim(2);
  const std::int64_t* pos = state.positions.data_as<std::int64_t>();
  const float* sc = state.scores.data_as<float>();
  float* out = scores.data_as<float>();
  std::vector<std::int64_t> order(static_cast<std::size_t>(k));
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t* p = pos + r * k;
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      const std::int64_t pa = p[a] < 0 ? std::numeric_limits<std::int64_t>::max() : p[a];
      const std::int64_t pb = p[b] < 0 ? std::numeric_limits<std::int64_t>::max() : p[b];
      return pa < pb;
    });
    for (std::int64_t s = 0; s < k; ++s) out[r * k + s] = p[order[s]] < 0 ? 0.0f : sc[r * k + order[s]];
  }
}

}  // namespace

const char* dsa_select_mode_name(DsaSelectMode mode) { return mode == DsaSelectMode::kRing ? "ring" : "allgather"; }

DsaSelectMode parse_dsa_select_mode(std::string_view name) {
  if (name == "ring") return DsaSelectMode::kRing;
  if (name == "allgather") return DsaSelectMode::kAllGather;
  SEQPAR_THROW("DSA selection mode '", name, "' is not one of ring, allgather");
}

DsaContextParallel::DsaContextParallel(const SpGrid& grid, std::int64_t seq_len, const DsaCpConfig& config)
    : grid_(grid),
      config_(config),
      layout_(config.layout, seq_len, grid.config().ring_size, grid.config().ulysses_size),
      positions_(layout_.positions(grid.coords().sp_rank)) {
  SEQPAR_CHECK(config.topk >= 1, "DSA topk ", config.topk, " must be >= 1");
  SEQPAR_CHECK(config.dim_v >= 1, "DSA dim_v ", config.dim_v, " must be >= 1");
  SEQPAR_CHECK(std::isfinite(config.scale), "DSA scale ", config.scale, " must be finite (0 or less: 1/sqrt(Dqk))");
  for (int r = 0; r < layout_.num_ranks(); ++r) sp_positions_.push_back(layout_.positions(r));
  for (int r = 0; r < layout_.ring_size(); ++r) ring_positions_.push_back(layout_.ring_shard_positions(r));
}

DsaCpOutput DsaContextParallel::forward(const TensorView& q, const TensorView& c, const TensorView& q_idx,
                                        const TensorView& k_idx, const TensorView& w) {
  for (const TensorView* t : {&q, &c, &q_idx, &k_idx, &w}) check_cpu(*t, "DSA CP input");
  SEQPAR_CHECK(q.ndim() == 4 && c.ndim() == 3 && q_idx.ndim() == 4 && k_idx.ndim() == 3 && w.ndim() == 3, "DSA CP: q ",
               q.str(), ", c ", c.str(), ", q_idx ", q_idx.str(), ", k_idx ", k_idx.str(), ", w ", w.str(),
               " must be [B,S,H,Dqk], [B,S,Dqk], [B,S,Hi,Di], [B,S,Di], [B,S,Hi]");
  const std::int64_t B = q.dim(0), sl = q.dim(1), H = q.dim(2), dqk = q.dim(3), hi = q_idx.dim(2), di = q_idx.dim(3);
  SEQPAR_CHECK(sl == layout_.local_len(), "DSA CP: local sequence length ", sl, " must be seq_len ", layout_.seq_len(),
               " / (ring_size ", layout_.ring_size(), " x ulysses_size ", layout_.ulysses_size(),
               ") = ", layout_.local_len());
  check_shape(c, {B, sl, dqk}, "DSA CP c");
  check_shape(q_idx, {B, sl, hi, di}, "DSA CP q_idx");
  check_shape(k_idx, {B, sl, di}, "DSA CP k_idx");
  check_shape(w, {B, sl, hi}, "DSA CP w");
  SEQPAR_CHECK(config_.dim_v <= dqk, "DSA dim_v ", config_.dim_v, " must be <= Dqk ", dqk);
  const int pu = layout_.ulysses_size();
  SEQPAR_CHECK(H % pu == 0, "DSA CP: heads ", H, " must be divisible by ulysses_size ", pu);
  for (const TensorView* t : {&c, &q_idx, &k_idx, &w}) {
    SEQPAR_CHECK(t->dtype() == q.dtype(), "DSA CP: every input must have q's dtype ", dtype_name(q.dtype()), "; got ",
                 t->str());
  }
  Communicator& sp = grid_.sp();
  Communicator& ring = grid_.ring();
  Communicator& ulysses = grid_.ulysses();
  const std::int64_t before = sp.counters().bytes_sent + ring.counters().bytes_sent + ulysses.counters().bytes_sent;
  const std::int64_t k = config_.topk;

  // ---- selection over the SP group ----
  q_idx_ = Tensor::copy_of(q_idx, q_idx.dtype(), MemCategory::kSavedActivation);
  k_idx_ = Tensor::copy_of(k_idx, k_idx.dtype(), MemCategory::kSavedActivation);
  w_ = Tensor::copy_of(w, w.dtype(), MemCategory::kSavedActivation);
  Tensor scores = Tensor::empty({B, sl, k}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor state_pos = Tensor::empty({B, sl, k}, DType::kInt64, MemCategory::kWorkspace);
  const attn::DsaTopkState state{scores.view(), state_pos.view()};
  attn::dsa_topk_init(state);
  auto merge_block = [&](int src, const TensorView& block) {
    if (!any_visible(positions_, sp_positions_[src])) return;
    attn::DsaIndexerArgs a;
    a.q_idx = q_idx_.view();
    a.w = w_.view();
    a.k_idx = block;
    a.q_pos = positions_;
    a.k_pos = sp_positions_[src];
    const double t0 = wall_seconds();
    attn::dsa_indexer_topk_block(a, state);
    counters_.compute_s += wall_seconds() - t0;
  };
  if (config_.select == DsaSelectMode::kRing) {
    ring_circulate(sp, k_idx_.view(), kTagIndexKeys, merge_block, &counters_.exposed_comm_s);
  } else {
    const int n = sp.size();
    Tensor all = Tensor::empty({n, B, sl, di}, k_idx.dtype(), MemCategory::kCommBuffer);
    const double t0 = wall_seconds();
    sp.all_gather(k_idx_.view(), all.view())->wait();
    counters_.exposed_comm_s += wall_seconds() - t0;
    for (int src = 0; src < n; ++src) merge_block(src, all.view().slice0(src, src + 1).reshape({B, sl, di}));
  }
  topk_local_ = Tensor::empty({B, sl, k}, DType::kInt64, MemCategory::kSavedActivation);
  sel_scores_ = Tensor::empty({B, sl, k}, DType::kFloat32, MemCategory::kSavedActivation);
  selected_scores(state, sel_scores_.view());
  attn::dsa_topk_finalize(state, topk_local_.view());

  // ---- attention: heads over Ulysses, latent blocks over the ring ----
  const std::int64_t sr = layout_.ring_shard_len(), hl = H / pu, dv = config_.dim_v;
  double t0 = wall_seconds();
  q_h_ = Tensor::empty({B, sr, hl, dqk}, q.dtype(), MemCategory::kSavedActivation);
  ulysses_scatter_heads(ulysses, q, q_h_.view());
  c_ring_ = gather_sequence_pieces(ulysses, c, MemCategory::kSavedActivation);
  topk_ring_ = gather_sequence_pieces(ulysses, topk_local_.view(), MemCategory::kSavedActivation);
  counters_.exposed_comm_s += wall_seconds() - t0;

  const std::vector<std::int64_t>& my_ring_pos = ring_positions_[ring.rank()];
  Tensor acc = Tensor::zeros({B, sr, hl, dv}, DType::kFloat32, MemCategory::kWorkspace);
  lse_h_ = Tensor::empty({B, hl, sr}, DType::kFloat32, MemCategory::kSavedActivation);
  fill(lse_h_.view(), -std::numeric_limits<double>::infinity());
  Tensor block_out = Tensor::empty(acc.shape(), DType::kFloat32, MemCategory::kWorkspace);
  Tensor block_lse = Tensor::empty(lse_h_.shape(), DType::kFloat32, MemCategory::kWorkspace);
  ring_circulate(
      ring, c_ring_.view(), kTagLatent,
      [&](int src, const TensorView& block) {
        if (!any_visible(my_ring_pos, ring_positions_[src])) return;
        attn::DsaAttentionArgs a;
        a.q = q_h_.view();
        a.c = block;
        a.topk_indices = topk_ring_.view();
        a.q_pos = my_ring_pos;
        a.c_pos = ring_positions_[src];
        a.dim_v = dv;
        a.scale = config_.scale;
        const double t1 = wall_seconds();
        attn::dsa_attention_forward(a, block_out.view(), block_lse.view());
        attn::lse_merge(acc.view(), lse_h_.view(), block_out.view(), block_lse.view());
        counters_.compute_s += wall_seconds() - t1;
      },
      &counters_.exposed_comm_s);
  // Pairs attended: the selected positions of this rank's ring-shard queries (all blocks together).
  {
    const std::int64_t* t = topk_ring_.data_as<std::int64_t>();
    std::int64_t n_sel = 0;
    for (std::int64_t i = 0; i < topk_ring_.numel(); ++i) n_sel += t[i] >= 0;
    counters_.attention_pairs += static_cast<double>(n_sel) * static_cast<double>(hl);
  }
  out_h_ = Tensor::empty({B, sr, hl, dv}, q.dtype(), MemCategory::kSavedActivation);
  copy_convert(acc.view(), out_h_.view());

  DsaCpOutput o;
  o.out = Tensor::empty({B, sl, H, dv}, q.dtype(), MemCategory::kSavedActivation);
  o.lse = Tensor::empty({B, H, sl}, DType::kFloat32, MemCategory::kSavedActivation);
  t0 = wall_seconds();
  ulysses_gather_heads(ulysses, out_h_.view(), o.out.view());
  ulysses_gather_heads_bhs(ulysses, lse_h_.view(), o.lse.view());
  counters_.exposed_comm_s += wall_seconds() - t0;
  o.topk_indices = Tensor::copy_of(topk_local_.view(), DType::kInt64, MemCategory::kWorkspace);
  counters_.bytes_sent +=
      sp.counters().bytes_sent + ring.counters().bytes_sent + ulysses.counters().bytes_sent - before;
  SEQPAR_LOG(kDebug) << "DSA forward (" << dsa_select_mode_name(config_.select) << " selection, sp_rank "
                     << grid_.coords().sp_rank << "): q " << q.str() << ", topk " << k;
  has_forward_ = true;
  return o;
}

DsaCpGrads DsaContextParallel::backward(const TensorView& dout, float loss_grad_scale) {
  SEQPAR_CHECK(has_forward_, "DSA CP: backward() needs a preceding forward()");
  Communicator& sp = grid_.sp();
  Communicator& ring = grid_.ring();
  Communicator& ulysses = grid_.ulysses();
  const std::int64_t before = sp.counters().bytes_sent + ring.counters().bytes_sent + ulysses.counters().bytes_sent;
  const int pu = layout_.ulysses_size();
  const std::int64_t B = q_h_.dim(0), sr = q_h_.dim(1), hl = q_h_.dim(2), dqk = q_h_.dim(3), dv = out_h_.dim(3),
                     sl = layout_.local_len(), k = config_.topk, hi = q_idx_.dim(2), di = q_idx_.dim(3);
  const DType dtype = q_h_.dtype();
  check_cpu(dout, "DSA CP dout");
  check_shape(dout, {B, sl, hl * pu, dv}, "DSA CP dout");

  // ---- attention backward (ring), with the head-summed probabilities for the indexer loss ----
  double t0 = wall_seconds();
  Tensor dout_h = Tensor::empty({B, sr, hl, dv}, dout.dtype(), MemCategory::kWorkspace);
  ulysses_scatter_heads(ulysses, dout, dout_h.view());
  counters_.exposed_comm_s += wall_seconds() - t0;
  Tensor delta = Tensor::empty(lse_h_.shape(), DType::kFloat32, MemCategory::kWorkspace);
  attn::dsa_attention_delta(out_h_.view(), dout_h.view(), delta.view());
  Tensor probs_ring = Tensor::zeros({B, sr, k}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor dq_acc = Tensor::zeros(q_h_.shape(), DType::kFloat32, MemCategory::kWorkspace);
  Tensor dc_ring = Tensor::empty({B, sr, dqk}, DType::kFloat32, MemCategory::kWorkspace);
  const std::vector<std::int64_t>& my_ring_pos = ring_positions_[ring.rank()];
  ring_circulate_with_grad(
      ring, c_ring_.view(), {B, sr, dqk}, dc_ring.view(), kTagLatent,
      [&](int src, const TensorView& block, const TensorView& grad) {
        if (!any_visible(my_ring_pos, ring_positions_[src])) return;
        attn::DsaAttentionBackwardArgs a;
        a.fwd.q = q_h_.view();
        a.fwd.c = block;
        a.fwd.topk_indices = topk_ring_.view();
        a.fwd.q_pos = my_ring_pos;
        a.fwd.c_pos = ring_positions_[src];
        a.fwd.dim_v = dv;
        a.fwd.scale = config_.scale;
        a.out = out_h_.view();
        a.dout = dout_h.view();
        a.lse = lse_h_.view();
        a.delta = delta.view();
        a.probs = probs_ring.view();
        const double t1 = wall_seconds();
        attn::dsa_attention_backward(a, dq_acc.view(), grad, true);
        counters_.compute_s += wall_seconds() - t1;
      },
      &counters_.exposed_comm_s);

  DsaCpGrads g;
  t0 = wall_seconds();
  Tensor dq_h = Tensor::empty(q_h_.shape(), dtype, MemCategory::kWorkspace);
  copy_convert(dq_acc.view(), dq_h.view());
  g.dq = Tensor::empty({B, sl, hl * pu, dqk}, dtype, MemCategory::kWorkspace);
  ulysses_gather_heads(ulysses, dq_h.view(), g.dq.view());
  // dc and probs: sum the Ulysses ranks' head subsets and return each rank its own sequence piece.
  Tensor dc_local = Tensor::empty({B, sl, dqk}, DType::kFloat32, MemCategory::kWorkspace);
  reduce_scatter_sequence_pieces(ulysses, dc_ring.view(), dc_local.view());
  g.dc = Tensor::empty({B, sl, dqk}, dtype, MemCategory::kWorkspace);
  copy_convert(dc_local.view(), g.dc.view());
  Tensor probs = Tensor::empty({B, sl, k}, DType::kFloat32, MemCategory::kWorkspace);
  reduce_scatter_sequence_pieces(ulysses, probs_ring.view(), probs.view());
  counters_.exposed_comm_s += wall_seconds() - t0;

  // ---- indexer loss and its backward (SP group) ----
  Tensor dscores = Tensor::empty({B, sl, k}, DType::kFloat32, MemCategory::kWorkspace);
  attn::DsaIndexerLossArgs la;
  la.probs = probs.view();
  la.scores = sel_scores_.view();
  la.topk_indices = topk_local_.view();
  la.grad_scale = loss_grad_scale;
  double loss = attn::dsa_indexer_loss(la, dscores.view());
  sp.all_reduce(TensorView(&loss, DType::kFloat64, {1}), ReduceOp::kSum)->wait();
  g.loss = loss;

  Tensor dq_idx = Tensor::zeros({B, sl, hi, di}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor dw = Tensor::zeros({B, sl, hi}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor dk_idx = Tensor::empty({B, sl, di}, DType::kFloat32, MemCategory::kWorkspace);
  ring_circulate_with_grad(
      sp, k_idx_.view(), {B, sl, di}, dk_idx.view(), kTagIndexKeys,
      [&](int src, const TensorView& block, const TensorView& grad) {
        if (!any_visible(positions_, sp_positions_[src])) return;
        attn::DsaIndexerArgs a;
        a.q_idx = q_idx_.view();
        a.w = w_.view();
        a.k_idx = block;
        a.q_pos = positions_;
        a.k_pos = sp_positions_[src];
        const double t1 = wall_seconds();
        attn::dsa_indexer_backward(a, topk_local_.view(), dscores.view(), dq_idx.view(), dw.view(), grad, true);
        counters_.compute_s += wall_seconds() - t1;
      },
      &counters_.exposed_comm_s);
  g.dq_idx = Tensor::copy_of(dq_idx.view(), dtype, MemCategory::kWorkspace);
  g.dw = Tensor::copy_of(dw.view(), dtype, MemCategory::kWorkspace);
  g.dk_idx = Tensor::copy_of(dk_idx.view(), dtype, MemCategory::kWorkspace);
  counters_.bytes_sent +=
      sp.counters().bytes_sent + ring.counters().bytes_sent + ulysses.counters().bytes_sent - before;
  SEQPAR_LOG(kDebug) << "DSA backward (sp_rank " << grid_.coords().sp_rank << "): indexer loss " << g.loss;
  return g;
}

}  // namespace seqpar
