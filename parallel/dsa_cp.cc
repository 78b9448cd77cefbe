#include "parallel/dsa_cp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "attention/mha.h"
#include "parallel/ring_pass.h"
#include "parallel/ulysses.h"
#include "runtime/logging.h"
#include "runtime/tensor_checks.h"
#include "runtime/tensor_ops.h"

namespace seqpar {
namespace {

constexpr int kTagIndexKeys = 301;  // 302: dk_idx accumulators
constexpr int kTagLatent = 303;     // 304: dc accumulators

// A block of keys at `k_pos` holds a candidate of some query at `q_pos` (increasing): a key visible causally, inside
// the window when window > 0, and inside the query's document [doc.lo, doc.hi) for packed and padded rows (doc empty:
// no document bound). Selected keys are candidates, so this also tells which latent blocks hold selections; a block
// that shares no document with the local queries is skipped (it still travels on).
bool any_candidate(std::span<const std::int64_t> q_pos, const DocBounds& doc, std::span<const std::int64_t> k_pos,
                   std::int64_t window) {
  if (q_pos.empty() || k_pos.empty() || k_pos.front() > q_pos.back()) return false;
  if (window <= 0 && doc.lo.empty()) return true;
  for (std::size_t t = 0; t < q_pos.size(); ++t) {  // the first key at or after the query's lowest candidate
    std::int64_t lo = window > 0 ? q_pos[t] - window + 1 : k_pos.front(), hi = q_pos[t] + 1;
    if (!doc.lo.empty()) {
      lo = std::max(lo, doc.lo[t]);
      hi = std::min(hi, doc.hi[t]);
    }
    const auto k = std::lower_bound(k_pos.begin(), k_pos.end(), lo);
    if (k != k_pos.end() && *k < hi) return true;
  }
  return false;
}

attn::DsaIndexerArgs indexer_args(const TensorView& q_idx, const TensorView& w, const TensorView& k_idx,
                                  std::span<const std::int64_t> q_pos, std::span<const std::int64_t> k_pos,
                                  const DocBounds& doc, std::int64_t window = 0) {
  attn::DsaIndexerArgs a{q_idx, w, k_idx, q_pos, k_pos, window};
  a.doc_lo = doc.lo;
  a.doc_hi = doc.hi;
  return a;
}

}  // namespace

void dsa_topk_slots_to_tokens(const SequenceLayout& layout, const TensorView& topk_indices) {
  SEQPAR_CHECK(topk_indices.dtype() == DType::kInt64 && topk_indices.device().is_cpu(),
               "dsa_topk_slots_to_tokens: topk_indices ", topk_indices.str(), " must be an int64 host tensor");
  std::int64_t* t = static_cast<std::int64_t*>(topk_indices.data());
  for (std::int64_t i = 0; i < topk_indices.numel(); ++i)
    if (t[i] >= 0) t[i] = layout.token_of_slot(t[i]);
}

struct DsaCp::Saved {
  Tensor q_h, c_ring, topk_ring, out_h, lse_h;     // head-sharded attention side
  Tensor q_idx, k_idx, w, topk_local, sel_scores;  // sequence-sharded indexer side
};

void allocate_naming_topk(const char* who, std::int64_t topk, std::int64_t keys, const std::function<void()>& allocate) {
  try {
    allocate();
  } catch (const Error& e) {
    SEQPAR_THROW(who, ": topk ", topk, ": the top-k selection's buffers (topk entries per query row) cannot be made; ",
                 "a query selects among at most ", keys, " keys, a larger topk adds only -1 padding (", e.message(),
                 ")");
  }
}

DsaCp::DsaCp(const CpGroups& groups, const SequenceLayout& layout, const DsaCpConfig& config)
    : CpLayerBase(groups, layout, "DSA CP"), config_(config) {
  SEQPAR_CHECK(config.topk >= 1, "DSA topk ", config.topk, " must be >= 1");
  SEQPAR_CHECK(config.dim_v >= 1, "DSA dim_v ", config.dim_v, " must be >= 1");
  SEQPAR_CHECK(std::isfinite(config.scale), "DSA scale ", config.scale, " must be finite (0 or less: 1/sqrt(Dqk))");
  SEQPAR_CHECK(config.window >= 0, "DSA window ", config.window, " must be >= 0 (0: no window)");
  for (int r = 0; r < layout_.num_ranks(); ++r) cp_positions_.push_back(layout_.positions(r));
  for (int r = 0; r < layout_.ring_size(); ++r) ring_positions_.push_back(layout_.ring_shard_positions(r));
  if (layout_.is_packed() || layout_.has_padding()) {  // unpacked, unpadded rows: no document bound (one document)
    doc_ = layout_.doc_bounds_of_slots(positions_);
    ring_doc_ = layout_.doc_bounds_of_slots(ring_positions_[groups_.ring.rank()]);
  }
  if (config.window > 0 && config.select == DsaSelectMode::kRing) {
    // packed or padded: rows of other documents and padding rows are never sent
    select_plan_.emplace(cp_positions_, groups_.cp.rank(), config.window, window_doc_bounds(layout_, cp_positions_));
  }
}

DsaCpOutput DsaCp::forward(const TensorView& q, const TensorView& c, const TensorView& q_idx,
                                        const TensorView& k_idx, const TensorView& w) {
  {
    Fingerprint fp = fingerprint("DSA CP forward");
    fp.add_text("select", dsa_select_mode_name(config_.select))
        .add_int("topk", config_.topk)
        .add_int("dim_v", config_.dim_v)
        .add_real("scale", config_.scale)
        .add_int("window", config_.window)
        .add_tensors({{"q", q}, {"c", c}, {"q_idx", q_idx}, {"k_idx", k_idx}, {"w", w}});
    agree(forward_agreement_, fp);
  }
  const DeviceAlloc alloc{common_device({q, c, q_idx, k_idx, w}, "DSA CP forward"), groups_.stream};
  validate_forward(q, c, q_idx, k_idx, w);
  const std::int64_t B = q.dim(0), sl = q.dim(1), H = q.dim(2);
  const CommStreamScope stream_scope(groups_);
  const CommMeter meter(groups_, counters_);
  const UlyssesExchange a2a(groups_, counters_);
  const std::int64_t k = config_.topk;
  const DType acc_dtype = accumulator_dtype(q.dtype());  // of the top-k scores, the merge state and lse
  auto s = std::make_shared<Saved>();

  // ---- selection over the CP group ----
  select_topk(*s, q_idx, k_idx, w, alloc);

  // ---- attention: heads over Ulysses, latent blocks over the ring ----
  const std::int64_t dv = config_.dim_v;
  s->q_h = a2a.to_heads(q, MemCategory::kSavedActivation);
  s->c_ring = a2a.gather_pieces(c, MemCategory::kSavedActivation);
  s->topk_ring = a2a.gather_pieces(s->topk_local.view(), MemCategory::kSavedActivation);

  attend_latent(*s, alloc);

  DsaCpOutput o;
  o.out = alloc.empty({B, sl, H, dv}, q.dtype(), MemCategory::kWorkspace);
  o.lse = alloc.empty({B, H, sl}, acc_dtype, MemCategory::kWorkspace);
  a2a.to_sequence(s->out_h.view(), o.out.view());
  a2a.lse_to_sequence(s->lse_h.view(), o.lse.view());
  o.topk_indices = alloc.copy_of(s->topk_local.view(), DType::kInt64, MemCategory::kWorkspace);
  SEQPAR_LOG(kDebug) << "DSA forward (" << dsa_select_mode_name(config_.select) << " selection, cp_rank "
                     << groups_.cp_rank() << "): q " << q.str() << ", topk " << k;
  o.ctx = CpContext::make(id_, "DSA CP", std::move(s));
  return o;
}

// Every check of forward's inputs, the indexer kernel's own on the local shapes included, before anything is
// allocated or sent.
void DsaCp::validate_forward(const TensorView& q, const TensorView& c, const TensorView& q_idx,
                                          const TensorView& k_idx, const TensorView& w) const {
  SEQPAR_CHECK(q.ndim() == 4 && c.ndim() == 3 && q_idx.ndim() == 4 && k_idx.ndim() == 3 && w.ndim() == 3, "DSA CP: q ",
               q.str(), ", c ", c.str(), ", q_idx ", q_idx.str(), ", k_idx ", k_idx.str(), ", w ", w.str(),
               " must be [B,S,H,Dqk], [B,S,Dqk], [B,S,Hi,Di], [B,S,Di], [B,S,Hi]");
  const std::int64_t B = q.dim(0), sl = q.dim(1), H = q.dim(2), dqk = q.dim(3), hi = q_idx.dim(2), di = q_idx.dim(3);
  SEQPAR_CHECK(sl == layout_.local_len(), "DSA CP: local sequence length ", sl, " must be the layout's padded length ",
               layout_.padded_len(), " / (ring_size ", layout_.ring_size(), " x ulysses_size ", layout_.ulysses_size(),
               ") = ", layout_.local_len());
  check_sequence_tensor(layout_, q, sl, 1, "DSA CP", "q");
  check_shape(c, {B, sl, dqk}, "DSA CP c");
  check_shape(q_idx, {B, sl, hi, di}, "DSA CP q_idx");
  check_shape(k_idx, {B, sl, di}, "DSA CP k_idx");
  check_shape(w, {B, sl, hi}, "DSA CP w");
  SEQPAR_CHECK(H >= 1 && dqk >= 1 && hi >= 1 && di >= 1, "DSA CP: heads H ", H, ", head dim Dqk ", dqk,
               ", indexer heads Hi ", hi, " and indexer dim Di ", di, " must all be >= 1 (q ", q.str(), ", q_idx ",
               q_idx.str(), ")");
  SEQPAR_CHECK(config_.dim_v <= dqk, "DSA dim_v ", config_.dim_v, " must be <= Dqk ", dqk);
  const int pu = layout_.ulysses_size();
  SEQPAR_CHECK(H % pu == 0, "DSA CP: heads ", H, " must be divisible by ulysses_size ", pu);
  for (const TensorView* t : {&c, &q_idx, &k_idx, &w}) {
    SEQPAR_CHECK(t->dtype() == q.dtype(), "DSA CP: every input must have q's dtype ", dtype_name(q.dtype()), "; got ",
                 t->str());
  }
  // The kernels' own checks on the local shapes (devices included) before anything is allocated or sent.
  indexer_args(q_idx, w, k_idx, positions_, positions_, doc_).validate();
}

// The selection over the CP group: every local query's top-k keys of the whole row (the index keys circulate over a
// ring, or travel only where a window lets a query see them, or are all-gathered); fills s.q_idx, k_idx, w (saved
// copies), topk_local and sel_scores.
void DsaCp::select_topk(Saved& saved, const TensorView& q_idx, const TensorView& k_idx,
                                     const TensorView& w, const DeviceAlloc& alloc) {
  Saved* const s = &saved;
  const Stream stream = groups_.stream;
  Communicator& sp = groups_.cp;
  const std::int64_t B = q_idx.dim(0), sl = q_idx.dim(1), di = q_idx.dim(3), k = config_.topk;
  const DType acc_dtype = accumulator_dtype(q_idx.dtype());  // of the top-k scores
  s->q_idx = alloc.copy_of(q_idx, q_idx.dtype(), MemCategory::kSavedActivation);
  s->k_idx = alloc.copy_of(k_idx, k_idx.dtype(), MemCategory::kSavedActivation);
  s->w = alloc.copy_of(w, w.dtype(), MemCategory::kSavedActivation);
  Tensor scores, state_pos;  // before any message: a topk too large to hold fails here, naming topk
  allocate_naming_topk("DSA CP forward", k, layout_.padded_len(), [&] {
    scores = alloc.empty({B, sl, k}, acc_dtype, MemCategory::kWorkspace);
    state_pos = alloc.empty({B, sl, k}, DType::kInt64, MemCategory::kWorkspace);
  });
  const attn::DsaTopkState state{scores.view(), state_pos.view()};
  attn::dsa_topk_init(state, stream);
  auto merge_keys = [&](const TensorView& block, std::span<const std::int64_t> k_pos) {
    if (!any_candidate(positions_, doc_, k_pos, config_.window)) return;
    const ScopedTimer timer(counters_.compute_s);
    attn::dsa_indexer_topk_block(indexer_args(s->q_idx, s->w, block, positions_, k_pos, doc_, config_.window), state,
                                 stream);
  };
  auto merge_block = [&](int src, const TensorView& block) { merge_keys(block, cp_positions_[src]); };
  if (select_plan_) {  // a window: only the index-key rows some local query can see travel
    window_exchange(
        sp, *select_plan_, s->k_idx.view(), kTagIndexKeys,
        [&](int src, const TensorView& block, std::span<const std::int64_t> rows) {
          merge_keys(block, positions_of_rows(cp_positions_[src], rows));
        },
        &counters_.exposed_comm_s, stream);
    counters_.message_rounds += static_cast<std::int64_t>(select_plan_->rounds().size());
  } else if (config_.select == DsaSelectMode::kRing) {
    ring_circulate(sp, s->k_idx.view(), kTagIndexKeys, merge_block, &counters_.exposed_comm_s, stream);
    counters_.message_rounds += sp.size() - 1;
  } else {  // one all-gather: no ring rounds (as MHA's allgather impl)
    const int n = sp.size();
    Tensor all = alloc.empty({n, B, sl, di}, k_idx.dtype(), MemCategory::kCommBuffer);
    WorkHandle gather = sp.all_gather(s->k_idx.view(), all.view());
    timed_wait(sp, gather, &counters_.exposed_comm_s);
    for (int src = 0; src < n; ++src) merge_block(src, all.view().slice0(src, src + 1).reshape({B, sl, di}));
  }
  s->topk_local = alloc.empty({B, sl, k}, DType::kInt64, MemCategory::kSavedActivation);
  s->sel_scores = alloc.empty({B, sl, k}, acc_dtype, MemCategory::kSavedActivation);
  attn::dsa_topk_selected_scores(state, s->sel_scores.view(), stream);
  attn::dsa_topk_finalize(state, s->topk_local.view(), stream);
}

// The attention: this rank's heads of its ring shard's queries against the latent blocks circulating over the ring,
// merged block by block; fills s.lse_h and s.out_h.
void DsaCp::attend_latent(Saved& saved, const DeviceAlloc& alloc) {
  Saved* const s = &saved;
  const Stream stream = groups_.stream;
  const std::int64_t B = s->q_h.dim(0), sr = layout_.ring_shard_len(), hl = s->q_h.dim(2), dv = config_.dim_v;
  const DType acc_dtype = accumulator_dtype(s->q_h.dtype());  // of the merge state and lse
  const std::vector<std::int64_t>& my_ring_pos = ring_positions_[groups_.ring.rank()];
  // The merge state (as in RingAttention): out in the accumulator dtype, the running lse and every block's lse in
  // fp64 (the DSA kernels write an fp64 lse for any inputs), so the merge weights carry no rounding of an fp32 lse;
  // rounded once into lse_h (the accumulator dtype) after the last block.
  Tensor acc = alloc.zeros({B, sr, hl, dv}, acc_dtype, MemCategory::kWorkspace);
  Tensor acc_lse = alloc.empty({B, hl, sr}, DType::kFloat64, MemCategory::kWorkspace);
  fill(acc_lse.view(), -std::numeric_limits<double>::infinity(), stream);
  Tensor block_out = alloc.empty(acc.shape(), acc_dtype, MemCategory::kWorkspace);
  Tensor block_lse = alloc.empty(acc_lse.shape(), DType::kFloat64, MemCategory::kWorkspace);
  ring_circulate(
      groups_.ring, s->c_ring.view(), kTagLatent,
      [&](int src, const TensorView& block) {
        if (!any_candidate(my_ring_pos, ring_doc_, ring_positions_[src], config_.window)) return;
        attn::DsaAttentionArgs a;
        a.q = s->q_h.view();
        a.c = block;
        a.topk_indices = s->topk_ring.view();
        a.q_pos = my_ring_pos;
        a.c_pos = ring_positions_[src];
        a.dim_v = dv;
        a.scale = config_.scale;
        const ScopedTimer timer(counters_.compute_s);
        attn::dsa_attention_forward(a, block_out.view(), block_lse.view(), stream);
        attn::lse_merge(acc.view(), acc_lse.view(), block_out.view(), block_lse.view(), stream);
      },
      &counters_.exposed_comm_s, stream);
  counters_.message_rounds += groups_.ring.size() - 1;
  s->lse_h = alloc.copy_of(acc_lse.view(), acc_dtype, MemCategory::kSavedActivation);
  // Pairs attended: the selected positions of this rank's ring-shard queries (all blocks together).
  counters_.attention_pairs +=
      static_cast<double>(count_nonnegative(s->topk_ring.view(), stream)) * static_cast<double>(hl);
  s->out_h = alloc.empty({B, sr, hl, dv}, s->q_h.dtype(), MemCategory::kSavedActivation);
  alloc.copy_convert(acc.view(), s->out_h.view());
}

DsaCpGrads DsaCp::backward(CpContext&& ctx, const TensorView& dout, double loss_grad_scale) {
  const std::shared_ptr<Saved> s = ctx.peek<Saved>(id_, "DSA CP");
  {
    Fingerprint fp = fingerprint("DSA CP backward");
    fp.add_tensor("saved q (head-sharded)", s->q_h.view())
        .add_tensor("saved q_idx", s->q_idx.view())
        .add_tensor("dout", dout)
        .add_real("loss_grad_scale", loss_grad_scale);
    agree(backward_agreement_, fp);
  }
  const int pu = layout_.ulysses_size();
  const std::int64_t B = s->q_h.dim(0), sr = s->q_h.dim(1), hl = s->q_h.dim(2), dqk = s->q_h.dim(3),
                     dv = s->out_h.dim(3), sl = layout_.local_len(), k = config_.topk;
  const DType dtype = s->q_h.dtype(), acc_dtype = accumulator_dtype(dtype);
  const DeviceAlloc alloc{common_device({s->q_h.view(), dout}, "DSA CP backward (saved tensors, dout)"),
                          groups_.stream};
  check_grad_input(dout, {B, sl, hl * pu, dv}, "DSA CP dout");
  ctx.consume<Saved>(id_, "DSA CP");
  const CommStreamScope stream_scope(groups_);
  const CommMeter meter(groups_, counters_);
  const UlyssesExchange a2a(groups_, counters_);
  const Stream stream = groups_.stream;

  // ---- attention backward (ring), with the head-summed probabilities for the indexer loss ----
  Tensor dout_h = a2a.to_heads(dout);
  Tensor delta = alloc.empty(s->lse_h.shape(), acc_dtype, MemCategory::kWorkspace);
  attn::dsa_attention_delta(s->out_h.view(), dout_h.view(), delta.view(), stream);
  Tensor probs_ring = alloc.zeros({B, sr, k}, acc_dtype, MemCategory::kWorkspace);
  Tensor dq_acc = alloc.zeros(s->q_h.shape(), acc_dtype, MemCategory::kWorkspace);
  Tensor dc_ring = alloc.empty({B, sr, dqk}, acc_dtype, MemCategory::kWorkspace);
  const std::vector<std::int64_t>& my_ring_pos = ring_positions_[groups_.ring.rank()];
  ring_circulate_with_grad(
      groups_.ring, s->c_ring.view(), {B, sr, dqk}, dc_ring.view(), kTagLatent,
      [&](int src, const TensorView& block, const TensorView& grad) {
        if (!any_candidate(my_ring_pos, ring_doc_, ring_positions_[src], config_.window)) return;
        attn::DsaAttentionBackwardArgs a;
        a.fwd.q = s->q_h.view();
        a.fwd.c = block;
        a.fwd.topk_indices = s->topk_ring.view();
        a.fwd.q_pos = my_ring_pos;
        a.fwd.c_pos = ring_positions_[src];
        a.fwd.dim_v = dv;
        a.fwd.scale = config_.scale;
        a.out = s->out_h.view();
        a.dout = dout_h.view();
        a.lse = s->lse_h.view();
        a.delta = delta.view();
        a.probs = probs_ring.view();
        const ScopedTimer timer(counters_.compute_s);
        attn::dsa_attention_backward(a, dq_acc.view(), grad, true, stream);
      },
      &counters_.exposed_comm_s, stream);
  counters_.message_rounds += groups_.ring.size() > 1 ? groups_.ring.size() : 0;  // the gradients' last hop home

  DsaCpGrads g;
  Tensor dq_h = alloc.empty(s->q_h.shape(), dtype, MemCategory::kWorkspace);
  alloc.copy_convert(dq_acc.view(), dq_h.view());
  g.dq = alloc.empty({B, sl, hl * pu, dqk}, dtype, MemCategory::kWorkspace);
  a2a.to_sequence(dq_h.view(), g.dq.view());
  // dc and probs: sum the Ulysses ranks' head subsets and return each rank its own sequence piece.
  Tensor dc_local = alloc.empty({B, sl, dqk}, acc_dtype, MemCategory::kWorkspace);
  a2a.reduce_scatter_pieces(dc_ring.view(), dc_local.view());
  g.dc = alloc.empty({B, sl, dqk}, dtype, MemCategory::kWorkspace);
  alloc.copy_convert(dc_local.view(), g.dc.view());
  Tensor probs = alloc.empty({B, sl, k}, acc_dtype, MemCategory::kWorkspace);
  a2a.reduce_scatter_pieces(probs_ring.view(), probs.view());

  // ---- indexer loss and its backward (CP group) ----
  indexer_backward(*s, probs.view(), loss_grad_scale, alloc, g);
  SEQPAR_LOG(kDebug) << "DSA backward (cp_rank " << groups_.cp_rank() << "): indexer loss " << g.loss;
  return g;
}

// The indexer loss of the local queries (KL of the indexer's distribution from `probs`, the head-summed attention
// probabilities [B, S_local, k]) summed over the CP group into g.loss, and its backward into g.dq_idx, dw, dk_idx (the
// index keys circulate over the CP group with their gradients).
void DsaCp::indexer_backward(const Saved& saved, const TensorView& probs, double loss_grad_scale,
                             const DeviceAlloc& alloc, DsaCpGrads& g) {
  const Saved* const s = &saved;
  const Stream stream = groups_.stream;
  Communicator& sp = groups_.cp;
  const std::int64_t B = s->q_idx.dim(0), sl = s->q_idx.dim(1), k = config_.topk, hi = s->q_idx.dim(2),
                     di = s->q_idx.dim(3);
  const DType dtype = s->q_h.dtype(), acc_dtype = accumulator_dtype(dtype);
  Tensor dscores = alloc.empty({B, sl, k}, acc_dtype, MemCategory::kWorkspace);
  attn::DsaIndexerLossArgs la;
  la.probs = probs;
  la.scores = s->sel_scores.view();
  la.topk_indices = s->topk_local.view();
  la.grad_scale = loss_grad_scale;
  double loss = attn::dsa_indexer_loss(la, dscores.view(), stream);
  // The loss is summed over the CP group in a buffer on the tensors' device; its one value comes back explicitly.
  const TensorView loss_host(&loss, DType::kFloat64, {1});
  Tensor loss_sum = alloc.empty({1}, DType::kFloat64, MemCategory::kCommBuffer);
  alloc.copy_convert(loss_host, loss_sum.view());
  WorkHandle reduce = sp.all_reduce(loss_sum.view(), ReduceOp::kSum);
  timed_wait(sp, reduce, &counters_.exposed_comm_s);
  alloc.copy_convert(loss_sum.view(), loss_host);
  g.loss = loss;

  Tensor dq_idx = alloc.zeros({B, sl, hi, di}, acc_dtype, MemCategory::kWorkspace);
  Tensor dw = alloc.zeros({B, sl, hi}, acc_dtype, MemCategory::kWorkspace);
  Tensor dk_idx = alloc.empty({B, sl, di}, acc_dtype, MemCategory::kWorkspace);
  ring_circulate_with_grad(
      sp, s->k_idx.view(), {B, sl, di}, dk_idx.view(), kTagIndexKeys,
      [&](int src, const TensorView& block, const TensorView& grad) {
        if (!any_candidate(positions_, doc_, cp_positions_[src], config_.window)) return;
        const ScopedTimer timer(counters_.compute_s);
        attn::dsa_indexer_backward(indexer_args(s->q_idx, s->w, block, positions_, cp_positions_[src], doc_),
                                   s->topk_local.view(), dscores.view(), dq_idx.view(), dw.view(), grad, true, stream);
      },
      &counters_.exposed_comm_s, stream);
  counters_.message_rounds += sp.size() > 1 ? sp.size() : 0;
  g.dq_idx = alloc.copy_of(dq_idx.view(), dtype, MemCategory::kWorkspace);
  g.dw = alloc.copy_of(dw.view(), dtype, MemCategory::kWorkspace);
  g.dk_idx = alloc.copy_of(dk_idx.view(), dtype, MemCategory::kWorkspace);
}

}  // namespace seqpar
