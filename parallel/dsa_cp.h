// DSA (DeepSeek sparse attention) under context parallelism (docs/design.md section 9.4).
//
// Selection runs in the sequence-sharded layout over the whole SP group (indexer heads are never split, so no
// cross-head reduction is needed): the index keys travel around the SP group (ring_circulate) and each rank merges
// each block's candidates into its running top-k per local query; or, in all-gather mode, the index keys are
// gathered once. Both give bitwise identical topk_indices because the selection order is a strict total order on
// (score, position) that does not depend on how the keys are split (attention/dsa.h).
//
// Attention: the query heads are split over the Ulysses group by all-to-all; the latent (shared by all heads) and the
// selected indices of the ring shard are all-gathered over the Ulysses group; the latent blocks then travel around
// the ring group and each rank attends only to its selected positions inside each block, merging with the online
// softmax (attn::lse_merge). The backward sends the dc accumulators home with their blocks
// (ring_circulate_with_grad); dc and the head-summed attention probabilities of the ring shard are reduce-scattered
// over the Ulysses group back to the sequence-sharded layout.
//
// Window (DsaCpConfig::window W > 0): the indexer's candidates of query t are the keys with t - W < pos <= t
// (attn::DsaIndexerArgs::window); ring selection then moves only the index-key rows some local query can see
// (WindowPlan, window_exchange in parallel/ring_pass.h), and every ring pass skips the computation of blocks with no
// candidate of a local query. The latent ring and the backward's index-key ring still circulate whole blocks.
//
// Indexer loss (KL(p* || softmax(I)) summed over all queries; docs/design.md section 9.3): p* comes from the main
// attention probabilities, which the attention backward produces for free, so the loss value and all gradients
// come out of backward(). The index-key gradients travel home with the index-key blocks like dK / dV.
//
// Packed and padded rows (docs/design.md section 15.5; any SequenceLayout, parallel/layout.h): the indexer scores,
// the top-k and the indexer loss of a query see only its own document (attn::DsaIndexerArgs::doc_lo / doc_hi from
// the layout's doc_bounds), so the sparse attention attends only inside it; topk_indices hold SLOT positions
// (layout().tokens_of_slots maps them to token indices; a document's k-th slot is its k-th token) and are -1 padded
// when the document prefix is shorter than topk. Padding rows select nothing: out 0, lse -inf, no loss, gradients 0.
// Every ring step skips the scoring or attention of a block that holds no candidate of a local query (a block of
// other documents still travels on). cu_seqlens that differ between ranks fail in the agreement check (the layout's
// digest is part of the fingerprint) before any message of the call.
//
// Precision: every scratch array (top-k scores, the attention merge state and lse, delta, probs, the loss arrays and
// every gradient accumulator, including those that travel) has the kernels' accumulator dtype
// (accumulator_dtype): fp64 for fp64 inputs, fp32 otherwise.
//
// Counters (CpCounters): attention_pairs, bytes over the ring and SP groups (bytes_*) and the Ulysses group (a2a_*),
// exposed ring / SP wait time, Ulysses exchange time (a2a_s) and kernel time.
// Synchronisation: forward() and backward() are collective over the groups' Ulysses, ring and SP communicators and
// host-synchronous; kernels run on groups.stream. The object keeps no state between calls: the forward's context
// owns the saved tensors (saved_activation) until the backward consumes it.
// Errors (before any communication, identical on every rank): the layout not built for the groups, heads not
// divisible by ulysses_size, shapes / dtypes, topk < 1, dim_v outside [1, Dqk]; a context that is empty, already
// used or made by another object; ranks of the SP group that disagree on the inputs' shapes and dtypes, select,
// topk, dim_v, scale or the layout (backward: the saved shapes, dout, loss_grad_scale) (AgreementCheck,
// parallel/cp_common.h: one all-reduce over the SP group on the first call of each configuration).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "../attention/dsa.h"
#include "cp_common.h"
#include "layout.h"
#include "ring_pass.h"

namespace seqpar {

struct DsaCpConfig {
  DsaSelectMode select = DsaSelectMode::kRing;
  std::int64_t topk = attn::kDsaTopK;
  std::int64_t dim_v = attn::kDsaHeadDimV;
  float scale = 0.0f;  // <= 0: 1 / sqrt(Dqk)
  // > 0: the indexer's candidates of query t are the keys with 0 <= t - k_pos < window (attn::DsaIndexerArgs::window);
  // the selection then moves only the index-key rows a rank's queries can see (WindowPlan, parallel/ring_pass.h).
  std::int64_t window = 0;
};

struct DsaCpOutput {
  Tensor out;           // [B, S_local, H, Dv], dtype of q
  Tensor lse;           // [B, H, S_local] accumulator_dtype of q (fp64 for fp64 inputs, else fp32)
  Tensor topk_indices;  // [B, S_local, topk] int64 global SLOT positions (layout()), ascending, -1 padded
  CpContext ctx;        // what the backward needs; hand it to backward() of the object that made it
};

struct DsaCpGrads {
  Tensor dq;        // [B, S_local, H, Dqk]
  Tensor dc;        // [B, S_local, Dqk]
  Tensor dq_idx;    // [B, S_local, Hi, Di]
  Tensor dk_idx;    // [B, S_local, Di]
  Tensor dw;        // [B, S_local, Hi]
  double loss = 0;  // indexer KL loss summed over the whole sequence (the same on every rank)
};

// Rewrites topk_indices ([..., k] int64 host tensor, e.g. DsaCpOutput::topk_indices) in place from slot positions of
// `layout` to token indices of the user's row (SequenceLayout::token_of_slot; selected slots always hold tokens);
// -1 stays -1. No communication. Errors: a non-int64 or non-host tensor.
void dsa_topk_slots_to_tokens(const SequenceLayout& layout, const TensorView& topk_indices);

class DsaContextParallel : public CpLayerBase {
 public:
  DsaContextParallel(const CpGroups& groups, const SequenceLayout& layout, const DsaCpConfig& config);

  // q [B, S_local, H, Dqk], c [B, S_local, Dqk], q_idx [B, S_local, Hi, Di], k_idx [B, S_local, Di],
  // w [B, S_local, Hi], all one dtype, at positions(); S_local = layout().local_len() (padded_len / (ulysses_size *
  // ring_size)); B = 1 for a packed layout. Padding rows (token_index -1) should be zero (shard_sequence makes them
  // so); they select nothing whatever they hold.
  DsaCpOutput forward(const TensorView& q, const TensorView& c, const TensorView& q_idx, const TensorView& k_idx,
                      const TensorView& w);
  // The context of a forward of this object (consumed and freed); dout [B, S_local, H, Dv]; loss_grad_scale
  // multiplies the indexer loss gradient (the caller's loss weight).
  DsaCpGrads backward(CpContext&& ctx, const TensorView& dout, float loss_grad_scale = 1.0f);

  // layout(), positions(), counters(), reset_counters(): CpLayerBase.

 private:
  struct Saved;
  void validate_forward(const TensorView& q, const TensorView& c, const TensorView& q_idx, const TensorView& k_idx,
                        const TensorView& w) const;
  void select_topk(Saved& saved, const TensorView& q_idx, const TensorView& k_idx, const TensorView& w,
                   const DeviceAlloc& alloc);
  void attend_latent(Saved& saved, const DeviceAlloc& alloc);
  void indexer_backward(const Saved& saved, const TensorView& probs, float loss_grad_scale, const DeviceAlloc& alloc,
                        DsaCpGrads& g);

  DsaCpConfig config_;
  std::vector<std::vector<std::int64_t>> sp_positions_;    // every SP rank's positions
  std::vector<std::vector<std::int64_t>> ring_positions_;  // every ring rank's ring shard
  std::optional<WindowPlan> select_plan_;                  // ring selection with a window (over the SP group)
  DocBounds doc_, ring_doc_;  // packed or padded rows: document bounds of positions() and of the ring shard; else empty
};

}  // namespace seqpar
