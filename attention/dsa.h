// DSA (DeepSeek sparse attention) on one device: lightning indexer + top-k selection, sparse latent attention
// (absorbed MLA, one latent shared by all heads), and the indexer's KL training loss.
// Math: docs/design.md, "DSA indexer and selection", "Sparse latent attention", "DSA indexer loss"; block-wise use
// by a ring: "DSA under context parallelism"; packed rows: "DSA on packed rows"; precision: "DSA precision"; CPU
// kernels and their memory: "DSA CPU kernels" (DeepSeek-AI, "DeepSeek-V3.2-Exp", 2025).
//
// Every function takes ONE BLOCK of keys (index keys or latents) with their global positions, so that a
// context-parallel caller can feed blocks in any order. Selection: dsa_topk_init, dsa_indexer_topk_block per key
// block, dsa_topk_finalize. Attention: dsa_attention_forward per latent block (merged with attn::lse_merge), then
// dsa_attention_backward per block with the final out and lse. Indexer loss: probs and scores per block,
// dsa_indexer_loss per row, dsa_indexer_backward per block.
// Shapes: q [B, Sq, H, Dqk], c [B, Sk, Dqk], out [B, Sq, H, Dv], lse [B, H, Sq]; q_idx [B, Sq, Hi, Di],
// w [B, Sq, Hi], k_idx [B, Sk, Di]; topk_indices [B, Sq, k] int64 (ascending positions, -1 padded).
// Dtypes: fp32, bf16, fp16, fp64 storage; every array that crosses calls has the accumulator dtype (fp64 for fp64
// inputs, else fp32). A row with nothing selected gets lse = -inf, out = 0, no gradient and no loss.
// Synchronisation: host-synchronous; bitwise reproducible for any thread count. Scratch from the memory ledger.
// Errors: Error naming the tensor and the rule, before any work; CUDA tensors or streams fail with "DSA kernels
// have no CUDA implementation yet". The argument structs' validate() raise exactly the kernels' errors, no work.
#pragma once

#include <cstdint>
#include <span>

#include "../runtime/device.h"
#include "../runtime/tensor.h"

namespace seqpar::attn {

// DeepSeek-V3.2 defaults (config of DeepSeek-V3.2-Exp: 128 heads, kv_lora_rank 512 + rope 64, index_n_heads 64,
// index_head_dim 128, index_topk 2048).
inline constexpr std::int64_t kDsaNumHeads = 128;        // H
inline constexpr std::int64_t kDsaHeadDimQk = 576;       // Dqk = latent width (512 + 64 rope)
inline constexpr std::int64_t kDsaHeadDimV = 512;        // Dv = value width (first Dv latent columns)
inline constexpr std::int64_t kDsaIndexerNumHeads = 64;  // Hi
inline constexpr std::int64_t kDsaIndexerHeadDim = 128;  // Di
inline constexpr std::int64_t kDsaTopK = 2048;           // k

// ---- indexer and top-k selection ----------------------------------------------------------------------------------

struct DsaTopkState;

// The inputs of the indexer: q_idx, w, k_idx any floating dtype, all the same; doc_lo / doc_hi both empty or both
// of size Sq.
struct DsaIndexerArgs {
  TensorView q_idx;                     // [B, Sq, Hi, Di]
  TensorView w;                         // [B, Sq, Hi] per-head weights
  TensorView k_idx;                     // [B, Sk, Di] one key block (one head shared by all indexer heads)
  std::span<const std::int64_t> q_pos;  // [Sq] global positions, any order (empty: 0..Sq-1)
  std::span<const std::int64_t> k_pos;  // [Sk] global positions, strictly increasing (empty: 0..Sk-1)
  std::int64_t window = 0;  // > 0: keys with q_pos - k_pos >= window are not candidates of the selection; 0: none
  // Per query: the key positions [doc_lo[t], doc_hi[t]) of its document (packed rows, SequenceLayout::doc_bounds);
  // both empty: no document bound. Only the selection reads them (docs/design.md, "DSA on packed rows"). Views
  // kept alive by the caller for the call.
  std::span<const std::int64_t> doc_lo{}, doc_hi{};

  // The rules on these fields alone, no work. A context-parallel caller runs it on its local shapes before
  // anything is sent.
  // Errors: shapes, dtypes, devices, position counts, k_pos not strictly increasing.
  // Sync: host-only.
  void validate() const;

  // Every check dsa_indexer_topk_block makes on (this, state, stream), no work.
  // Errors: dsa_indexer_topk_block's.
  // Sync: host-only.
  void validate(const DsaTopkState& state, Stream stream = Stream::cpu()) const;
};

// The running top-k of every query: scores [B, Sq, k] of the accumulator dtype of the indexer inputs (fp64 for fp64
// inputs, so that ties are decided on the fp64 scores) and positions [B, Sq, k] int64, owned by the caller.
// The order of the entries inside a row is internal (a heap); only dsa_topk_finalize reads it. An empty slot has
// position -1 and score -inf. k may exceed the number of keys.
struct DsaTopkState {
  TensorView scores;     // [B, Sq, k] fp32, or fp64 for fp64 indexer inputs
  TensorView positions;  // [B, Sq, k] int64
};

// Sets every slot empty (position -1, score -inf).
// Args: state: scores fp32 or fp64.
// Errors: shapes, dtypes.
// Sync: host-synchronous.
void dsa_topk_init(const DsaTopkState& state, Stream stream = Stream::cpu());

// Scores the keys of one block that are visible to each query and merges them into `state` (docs/design.md,
// "DSA indexer and selection"). Memory: tile by tile, one accumulator-dtype copy of the key block and O(tile) extra
// memory per thread, no [Sq, Sk] matrix; with Sq <= 4, a decode step, the keys are read in place instead, and only
// a tile is converted for a storage dtype other than the accumulator's; the scores are bitwise the same either way.
// Args: every key position must be fed once over all calls.
// Errors: shapes, dtypes, q_pos / k_pos sizes, k_pos not strictly increasing.
// Sync: host-synchronous; bitwise reproducible for any thread count.
void dsa_indexer_topk_block(const DsaIndexerArgs& args, const DsaTopkState& state, Stream stream = Stream::cpu());

// Merges `other` into `state`.
// Args: other: same shapes and score dtype as state, disjoint key positions.
// Errors: shapes, dtypes.
// Sync: host-synchronous.
void dsa_topk_merge(const DsaTopkState& state, const DsaTopkState& other, Stream stream = Stream::cpu());

// The selection of each row.
// Args: topk_indices [B, Sq, k] int64; may be state.positions itself (in place).
// Returns: topk_indices: the selected global positions of each row in ascending order, then -1 padding.
// Errors: shapes, dtypes.
// Sync: host-synchronous.
void dsa_topk_finalize(const DsaTopkState& state, const TensorView& topk_indices, Stream stream = Stream::cpu());

// The scores of the selected keys, for the indexer loss (which reads them with topk_indices; the scores of the
// final running state are exactly the indexer's scores of the selected keys, so they need not be recomputed).
// Args: scores [B, Sq, k], the state's score dtype.
// Returns: scores: each selected key's in dsa_topk_finalize's order (ascending position), then 0 for the -1 padding.
// Errors: shapes, dtypes.
// Sync: host-synchronous.
void dsa_topk_selected_scores(const DsaTopkState& state, const TensorView& scores, Stream stream = Stream::cpu());

// Convenience for one key block: init + dsa_indexer_topk_block + finalize with a workspace state.
// Args: k = topk_indices.dim(2).
// Returns: topk_indices as dsa_topk_finalize.
// Errors: those of the three calls.
// Sync: host-synchronous.
void dsa_indexer_topk(const DsaIndexerArgs& args, const TensorView& topk_indices, Stream stream = Stream::cpu());

// ---- sparse latent attention --------------------------------------------------------------------------------------

// The inputs of the sparse latent attention: q, c any floating dtype, the same. Selected positions that are not in
// c_pos are simply not in this block.
struct DsaAttentionArgs {
  TensorView q;                         // [B, Sq, H, Dqk]
  TensorView c;                         // [B, Sk, Dqk] one latent block; value = c[..., :dim_v]
  TensorView topk_indices;              // [B, Sq, k] int64: per row, ascending distinct positions <= q_pos, then -1
  std::span<const std::int64_t> q_pos;  // [Sq] global positions, any order (empty: 0..Sq-1)
  std::span<const std::int64_t> c_pos;  // [Sk] global positions, strictly increasing (empty: 0..Sk-1)
  std::int64_t dim_v = kDsaHeadDimV;    // Dv, 1 <= Dv <= Dqk
  double scale = 0.0;                   // <= 0: 1 / sqrt(Dqk)

  // The rules on these fields alone, no work.
  // Errors: shapes, dtypes, devices, sizes, position counts, c_pos not strictly increasing, dim_v, scale, a topk
  //   row not ascending / not -1 padded, or a selected position after its query (> q_pos[t]).
  // Sync: host-only.
  void validate() const;

  // Every check dsa_attention_forward makes on (this, out, lse, stream), no work.
  // Errors: dsa_attention_forward's.
  // Sync: host-only.
  void validate(const TensorView& out, const TensorView& lse, Stream stream = Stream::cpu()) const;
};

// Forward over the selected positions inside this latent block (docs/design.md, "Sparse latent attention"; fp64
// lse: "DSA precision"). Work: 2 * H * (Dqk + Dv) flops per selected pair; extra memory O((H + 128) * Dqk) per
// thread.
// Args: out [B, Sq, H, Dv] any floating dtype (the block form passes the accumulator dtype); lse [B, H, Sq] of the
//   accumulator dtype of q or fp64. An fp64 lse is allowed for any inputs: fp64(row max) + log(fp64(row sum)) of
//   the accumulator-dtype max and sum, free of the fp32 rounding of lse (eps * |lse|), so that blocks merged in
//   fp64 agree with one call to the rounding of out (the backward and dsa_attention_probs read an fp64 lse
//   likewise, taking a - lse in fp64).
// Returns: out and lse, both overwritten.
// Errors: DsaAttentionArgs::validate's, and out's and lse's shapes and dtypes.
// Sync: host-synchronous; bitwise reproducible for any thread count.
void dsa_attention_forward(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse,
                           Stream stream = Stream::cpu());

// The inputs of dsa_attention_backward.
struct DsaAttentionBackwardArgs {
  DsaAttentionArgs fwd;  // as in the forward (this block)
  TensorView out;        // [B, Sq, H, Dv] the final (merged) output, any floating dtype
  TensorView dout;       // [B, Sq, H, Dv] any floating dtype
  TensorView lse;        // [B, H, Sq] accumulator dtype of q or fp64, the final lse
  TensorView delta;      // optional [B, H, Sq] accumulator dtype = rowsum(dout * out); computed when not given
  TensorView probs;      // optional [B, Sq, k] accumulator dtype: when given, also does dsa_attention_probs for this
                         // block (the backward computes p anyway), so that a ring gets step (a) of the indexer loss
                         // for free

  // Every check dsa_attention_backward makes on (this, dq, dc, accumulate, stream), no work.
  // Errors: dsa_attention_backward's.
  // Sync: host-only.
  void validate(const TensorView& dq, const TensorView& dc, bool accumulate, Stream stream = Stream::cpu()) const;
};

// Backward of one latent block with the final lse (docs/design.md, "MHA on one device" applied to the selected
// pairs; docs/design.md, "Sparse latent attention"). dc gets all Dqk columns from the scores and the first Dv from
// the value.
// Args: dq [B, Sq, H, Dqk], dc [B, Sk, Dqk]; accumulate = false: overwritten (any floating dtype);
//   accumulate = true: the accumulator dtype of q, the block's contributions are added.
// Returns: dq, dc (and probs when given). dc_j is summed over heads and then over queries in increasing (b, t)
//   order, so it does not depend on the thread count.
// Errors: as dsa_attention_forward, and the shapes and dtypes of out, dout, lse, delta, probs and the gradients.
// Sync: host-synchronous.
void dsa_attention_backward(const DsaAttentionBackwardArgs& args, const TensorView& dq, const TensorView& dc,
                            bool accumulate, Stream stream = Stream::cpu());

// delta = rowsum(dout * out) per (b, h, t).
// Args: delta [B, H, Sq]: fp32 or fp64, and fp64 when out or dout is fp64.
// Returns: delta, summed in delta's dtype.
// Errors: shapes, dtypes.
// Sync: host-synchronous.
void dsa_attention_delta(const TensorView& out, const TensorView& dout, const TensorView& delta,
                         Stream stream = Stream::cpu());

// Step (a) of the indexer loss, main-attention side: the head-summed probability of each slot selecting a position
// inside this block (docs/design.md, "DSA indexer loss"); other slots are left untouched. Heads are those of args.q.
// Args: lse [B, H, Sq] (accumulator dtype or fp64), the final lse; probs [B, Sq, k], accumulator dtype of q.
// Returns: probs.
// Errors: DsaAttentionArgs::validate's, and lse's and probs' shapes and dtypes.
// Sync: host-synchronous.
void dsa_attention_probs(const DsaAttentionArgs& args, const TensorView& lse, const TensorView& probs,
                         Stream stream = Stream::cpu());

// ---- indexer loss ------------------------------------------------------------------------------------------------

// Step (a), indexer side: the indexer score I_tj of each slot selecting a position j inside this key block
// (k_pos); other slots untouched.
// Args: topk_indices as in DsaAttentionArgs (checked the same way); scores [B, Sq, k], accumulator dtype of the
//   indexer inputs.
// Returns: scores.
// Errors: DsaIndexerArgs::validate's, topk_indices', and scores' shape and dtype.
// Sync: host-synchronous.
void dsa_indexer_scores_selected(const DsaIndexerArgs& args, const TensorView& topk_indices, const TensorView& scores,
                                 Stream stream = Stream::cpu());

// The inputs of dsa_indexer_loss.
struct DsaIndexerLossArgs {
  TensorView probs;         // [B, Sq, k] fp32 or fp64: head-summed main-attention probabilities of the selected slots
  TensorView scores;        // [B, Sq, k] probs' dtype: indexer scores I of the selected slots
  TensorView topk_indices;  // [B, Sq, k] int64; slots with -1 are ignored
  double grad_scale = 1.0;  // dscores = grad_scale * dL/dI (the upstream gradient of L)

  // Every check dsa_indexer_loss makes on (this, dscores, stream), no work.
  // Errors: dsa_indexer_loss's.
  // Sync: host-only.
  void validate(const TensorView& dscores, Stream stream = Stream::cpu()) const;
};

// Step (b): the KL loss per row and its gradient over the valid slots (docs/design.md, "DSA indexer loss"),
// computed in fp64.
// Args: dscores [B, Sq, k] (probs' dtype); may be a default TensorView when only the value is needed.
// Returns: sum_t L_t over all (b, t) of this call (fixed order); dscores overwritten (grad_scale times dL/dI, 0 on
//   -1 slots). A row with no valid slot adds 0.
// Errors: shapes and dtypes of probs, scores, topk_indices, dscores.
// Sync: host-synchronous.
double dsa_indexer_loss(const DsaIndexerLossArgs& args, const TensorView& dscores, Stream stream = Stream::cpu());

// Step (c), for one key block: dscores through the relu of each selected pair inside the block into q_idx, w and
// k_idx (docs/design.md, "DSA indexer loss").
// Args: dscores: accumulator dtype of the indexer inputs; dq_idx [B, Sq, Hi, Di], dw [B, Sq, Hi], dk_idx
//   [B, Sk, Di]; accumulate = false: overwritten (any floating dtype); true: the accumulator dtype, added.
// Returns: dq_idx, dw, dk_idx. dk_idx_j is summed over queries in increasing (b, t) order (thread-count
//   independent).
// Errors: DsaIndexerArgs::validate's, topk_indices', and the shapes and dtypes of dscores and the gradients.
// Sync: host-synchronous.
void dsa_indexer_backward(const DsaIndexerArgs& args, const TensorView& topk_indices, const TensorView& dscores,
                          const TensorView& dq_idx, const TensorView& dw, const TensorView& dk_idx, bool accumulate,
                          Stream stream = Stream::cpu());

}  // namespace seqpar::attn
