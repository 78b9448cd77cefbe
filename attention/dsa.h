// DSA (DeepSeek sparse attention) on one device: lightning indexer + top-k selection, sparse latent attention
// (absorbed MLA, one latent shared by all heads), and the indexer's KL training loss.
//
// Math (docs/design.md section 9; DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek
// Sparse Attention", 2025, eqs. for the lightning indexer, the top-k selection and the KL indexer loss):
//   indexer    I_tj = sum_i w_ti * relu(q_idx_ti . k_idx_j)          for keys j visible to query t
//   selection  J_t  = the k keys with the largest I_tj
//   attention  a_htj = scale * q_ht . c_j  (j in J_t),  lse_ht = log sum_j exp(a_htj),
//              o_ht = sum_j exp(a_htj - lse_ht) c_j[:Dv]               (value = first Dv columns of the latent)
//   loss       p*_tj = sum_h exp(a_htj - lse_ht), L1-normalised over J_t (detached)
//              L = sum_{b,t} KL(p*_t || softmax_{J_t}(I_t))            (a sum, not a mean; the caller scales it)
//              dI_tj = softmax_{J_t}(I_t)_j - p*_tj, then through the relu into q_idx, k_idx and w.
// The main output gets no gradient from L and the indexer none from the main output.
//
// Positions are global positions (std::span<const int64_t>; empty = 0, 1, 2, ...): token indices of an unpacked row,
// or the SLOT positions of a layout (parallel/layout.h) for packed and padded rows, so that topk_indices hold slot
// positions, like every other position of the library (map them to tokens with SequenceLayout::tokens_of_slots; inside
// a document a slot difference is a token distance). Key j is visible to query t iff pos_k(j) <= pos_q(t) and, with
// DsaIndexerArgs::doc_lo / doc_hi (packed rows, docs/design.md section 15.5), doc_lo[t] <= pos_k(j) < doc_hi[t]: the
// indexer scores, the top-k and hence the attention and the indexer loss see only the query's own document (top-k
// padded with -1 when the document prefix is shorter than k); a query with doc_lo >= doc_hi (a padding row) selects
// nothing: out 0, lse -inf, loss 0, no gradient. With DsaIndexerArgs::window W > 0, only keys with
// pos_q(t) - pos_k(j) < W are candidates of the selection (a sliding window for the indexer, counting inside the
// document; attention and loss follow the selection). The kernels narrow each query's candidate key range by binary
// search (keys are sorted), so the bounds cost no per-key test. Every function below
// takes ONE BLOCK of keys (index keys or latents) with their global positions, so that a context-parallel caller can
// feed blocks that arrive from other ranks, in any order:
//
//   Selection (per query block, keys in any number of blocks, any order):
//     dsa_topk_init(state)                                    scores = -inf, positions = -1
//     for each key block:  dsa_indexer_topk_block(args, state) merge the block's candidates into the running top-k
//     dsa_topk_finalize(state, topk_indices)                  ascending global positions, -1 padded
//   The selection order is the strict total order "larger score first, then smaller position", and a key's score
//   does not depend on the block it came in, so the result is bitwise independent of the split and the order.
//   (dsa_topk_merge merges two states, e.g. for a tree reduction.)
//
//   Attention forward (per latent block; the caller merges blocks with attn::lse_merge):
//     dsa_attention_forward(args_block, out_b, lse_b)         attends to the selected positions inside the block only
//   Attention backward (per latent block, with the FINAL out and lse):
//     dsa_attention_backward(args_block, dq, dc_block, accumulate = true)
//       dq (accumulator dtype) accumulates at the query's home; dc_block (accumulator dtype) is the block's latent
//       gradient, summed over heads and over every query of this call that selected the position; it travels home
//       with its block.
//
//   Indexer loss (three steps; every [B, Sq, k] array is indexed like topk_indices, O(Sq * k) memory):
//     (a) per block:  dsa_attention_probs(attn_args_block, lse, probs)       probs[b,t,s] = sum_h p_hts
//                     (or fused into the backward ring pass: DsaAttentionBackwardArgs::probs)
//                     dsa_indexer_scores_selected(idx_args_block, topk, scores)  scores[b,t,s] = I_ts
//         each writes only the slots s whose position lies in the block, so after every block has been seen each
//         array is complete (the blocks of a layout are disjoint). Under Ulysses, where heads are split, probs is
//         summed over the Ulysses group (all-reduce) before (b).
//     (b) combine, per query row, no communication:
//                     loss = dsa_indexer_loss({probs, scores, topk}, dscores)  p* = probs / sum_s probs;
//                     returns sum over the rows of this call (double); the caller sums over ranks.
//     (c) per block:  dsa_indexer_backward(idx_args_block, topk, dscores, dq_idx, dw, dk_idx_block, accumulate)
//                     dq_idx, dw accumulate at the query's home; dk_idx_block (accumulator dtype) travels home with
//                     its block.
//
// Layouts (row-major, contiguous, host memory): q [B, Sq, H, Dqk], c [B, Sk, Dqk], out [B, Sq, H, Dv],
// lse [B, H, Sq]; q_idx [B, Sq, Hi, Di], w [B, Sq, Hi], k_idx [B, Sk, Di]; topk_indices [B, Sq, k] int64.
// Precision: storage dtypes fp32, bf16, fp16, fp64. The ACCUMULATOR DTYPE (accumulator_dtype) is fp64 for fp64 inputs
// and fp32 for the others: all arithmetic runs in it, and every array that crosses calls (top-k scores, block out,
// lse, delta, dq, dc, dq_idx, dk_idx, dw when accumulated, probs, scores, dscores) has it. So fp64 inputs are fp64
// end to end: the indexer scores, the selection and its tie rule (on the fp64 scores: the selected set is the
// fp64 reference's), the attention and its lse, every gradient and the indexer loss. The indexer loss itself
// (step b) always reduces in fp64. Scales are given as float (DsaAttentionArgs::scale; 0 gives 1/sqrt(Dqk) exactly
// in the accumulator dtype).
// A query row with nothing selected (or nothing selected inside a block) gets lse = -inf, out = 0 and contributes
// nothing to any gradient or to the loss.
// Synchronisation: host-synchronous (the stream is an ordering token on the CPU).
// Determinism: bitwise the same results run to run, independent of the thread count (fixed reduction orders; key
// gradients are summed over queries in increasing query order).
// Extra memory (besides the caller's [B, Sq, k] arrays; never an [Sq, Sk] matrix): the top-k pass one accumulator-dtype
// copy of the key block ([B, Sk, Di], transposed in panels of 64 keys) and O(Hi * (Di + 64)) per thread; the
// attention forward O(H * Dqk + 128 * Dqk) per thread; the backward passes accumulate the block's key gradient
// (dc [B, Sk, Dqk] or dk_idx [B, Sk, Di]) in the output when it has the accumulator dtype, else in one
// accumulator-dtype copy, keep per-pair values of a chunk of query rows (at most the size of that gradient, or one
// row per thread when larger; at most 32 MiB) and use O(k * (H + Di) + 128 * Dqk) per thread (docs/design.md
// section 9.6). The key-gradient pass reads every query row of a chunk once per thread. All of it comes from the
// memory ledger (workspace) before any parallel region; a failed allocation raises Error "out of memory: ..." naming
// the bytes asked for and the ledger's totals.
// Errors: seqpar::Error naming the tensor and the rule, raised before any work. Tensors must be host tensors and the
// stream a CPU stream: a CUDA one fails with "DSA kernels have no CUDA implementation yet".
// Argument checks on their own: every kernel f below has a check_f with the same parameters that raises exactly the
// Error f would raise for them, and does no work (it reads topk_indices, whose rows are checked). A context-parallel
// caller runs them on its local shapes before anything is sent, so that every rank fails together.
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

struct DsaIndexerArgs {
  TensorView q_idx;                     // [B, Sq, Hi, Di]
  TensorView w;                         // [B, Sq, Hi] per-head weights
  TensorView k_idx;                     // [B, Sk, Di] one key block (one head shared by all indexer heads)
  std::span<const std::int64_t> q_pos;  // [Sq] global positions, any order (empty: 0..Sq-1)
  std::span<const std::int64_t> k_pos;  // [Sk] global positions, strictly increasing (empty: 0..Sk-1)
  std::int64_t window = 0;  // > 0: keys with q_pos - k_pos >= window are not candidates of the selection; 0: none
  // Per query: the key positions [doc_lo[t], doc_hi[t]) of its document (packed rows, SequenceLayout::doc_bounds);
  // both empty: no document bound. Only the selection reads them (see the header comment). Views kept alive by the
  // caller for the call.
  std::span<const std::int64_t> doc_lo{}, doc_hi{};
};
// q_idx, w, k_idx: any floating dtype, all the same. doc_lo / doc_hi: both empty or both of size Sq.

// The running top-k of every query: scores [B, Sq, k] of the accumulator dtype of the indexer inputs (fp64 for fp64
// inputs, so that ties are decided on the fp64 scores) and positions [B, Sq, k] int64, owned by the caller.
// The order of the entries inside a row is internal (a heap); only dsa_topk_finalize reads it. An empty slot has
// position -1 and score -inf. k may exceed the number of keys.
struct DsaTopkState {
  TensorView scores;     // [B, Sq, k] fp32, or fp64 for fp64 indexer inputs
  TensorView positions;  // [B, Sq, k] int64
};

// Sets every slot empty (scores fp32 or fp64).
void dsa_topk_init(const DsaTopkState& state, Stream stream = Stream::cpu());

// Scores the keys of one block that are visible to each query (tile by tile: one accumulator-dtype copy of the key
// block and O(tile) extra memory per thread, no [Sq, Sk] matrix; with Sq <= 4, a decode step, the keys are read in
// place instead, and only a tile is converted for a storage dtype other than the accumulator's) and merges them into
// `state`; the scores are bitwise the same either way. Every key position must be fed once over all calls. Errors:
// shapes, dtypes, q_pos / k_pos sizes, k_pos not strictly increasing.
void dsa_indexer_topk_block(const DsaIndexerArgs& args, const DsaTopkState& state, Stream stream = Stream::cpu());

// Merges `other` (same shapes and score dtype, disjoint key positions) into `state`.
void dsa_topk_merge(const DsaTopkState& state, const DsaTopkState& other, Stream stream = Stream::cpu());

// topk_indices [B, Sq, k] int64: the selected global positions of each row in ascending order, then -1 padding.
// topk_indices may be state.positions itself (in place).
void dsa_topk_finalize(const DsaTopkState& state, const TensorView& topk_indices, Stream stream = Stream::cpu());

// scores [B, Sq, k] (the state's score dtype): the score of each selected key in dsa_topk_finalize's order
// (ascending position), then 0 for the -1 padding. The indexer loss reads them with topk_indices (the scores of the
// final running state are exactly the indexer's scores of the selected keys, so they need not be recomputed).
void dsa_topk_selected_scores(const DsaTopkState& state, const TensorView& scores, Stream stream = Stream::cpu());

// Convenience for one key block: init + dsa_indexer_topk_block + finalize with a workspace state.
// k = topk_indices.dim(2).
void dsa_indexer_topk(const DsaIndexerArgs& args, const TensorView& topk_indices, Stream stream = Stream::cpu());

// ---- sparse latent attention --------------------------------------------------------------------------------------

struct DsaAttentionArgs {
  TensorView q;                         // [B, Sq, H, Dqk]
  TensorView c;                         // [B, Sk, Dqk] one latent block; value = c[..., :dim_v]
  TensorView topk_indices;              // [B, Sq, k] int64: per row, ascending distinct positions <= q_pos, then -1
  std::span<const std::int64_t> q_pos;  // [Sq] global positions, any order (empty: 0..Sq-1)
  std::span<const std::int64_t> c_pos;  // [Sk] global positions, strictly increasing (empty: 0..Sk-1)
  std::int64_t dim_v = kDsaHeadDimV;    // Dv, 1 <= Dv <= Dqk
  float scale = 0.0f;                   // <= 0: 1 / sqrt(Dqk)
};
// q, c: any floating dtype, the same. Selected positions that are not in c_pos are simply not in this block.
// Errors: shapes, dtypes, sizes, c_pos not strictly increasing, a topk row not ascending / not -1 padded, or a
// selected position after its query (> q_pos[t]).

// out [B, Sq, H, Dv] any floating dtype (the block form passes the accumulator dtype), lse [B, H, Sq] of the
// accumulator dtype of q or fp64; both overwritten with the result over the selected positions inside this block.
// An fp64 lse is allowed for any inputs: it is then fp64(row max) + log(fp64(row sum)) of the accumulator-dtype max
// and sum, free of the fp32 rounding of lse (eps * |lse|), so that blocks merged in fp64 agree with one call to the
// rounding of out (the backward and dsa_attention_probs read an fp64 lse likewise; p = exp(a - lse) takes the
// difference in fp64). Work: 2 * H * (Dqk + Dv) flops per selected pair; extra
// memory O((H + 128) * Dqk) per thread.
void dsa_attention_forward(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse,
                           Stream stream = Stream::cpu());

struct DsaAttentionBackwardArgs {
  DsaAttentionArgs fwd;  // as in the forward (this block)
  TensorView out;        // [B, Sq, H, Dv] the final (merged) output, any floating dtype
  TensorView dout;       // [B, Sq, H, Dv] any floating dtype
  TensorView lse;        // [B, H, Sq] accumulator dtype of q or fp64, the final lse
  TensorView delta;      // optional [B, H, Sq] accumulator dtype = rowsum(dout * out); computed when not given
  TensorView probs;      // optional [B, Sq, k] accumulator dtype: when given, also does dsa_attention_probs for this
                         // block (the backward computes p anyway), so that a ring gets step (a) of the indexer loss
                         // for free
};

// Backward of one latent block with the final lse (docs/design.md section 8.1 applied to the selected pairs):
//   p = exp(a - lse), dp = dout_h . c_j[:Dv], ds = p (dp - delta_h),
//   dq_h += scale ds c_j,  dc_j += scale ds q_h  (all Dqk columns)  +  p dout_h  (first Dv columns).
// dq [B, Sq, H, Dqk], dc [B, Sk, Dqk]. accumulate = false: overwritten (any floating dtype); accumulate = true:
// the accumulator dtype of q, the block's contributions are added. dc_j is summed over heads and then over queries in
// increasing (b, t) order, so it does not depend on the thread count.
void dsa_attention_backward(const DsaAttentionBackwardArgs& args, const TensorView& dq, const TensorView& dc,
                            bool accumulate, Stream stream = Stream::cpu());

// delta [B, H, Sq] = sum_d dout[b, t, h, d] * out[b, t, h, d], summed in delta's dtype: fp32 or fp64, and fp64
// when out or dout is fp64.
void dsa_attention_delta(const TensorView& out, const TensorView& dout, const TensorView& delta,
                         Stream stream = Stream::cpu());

// Step (a) of the indexer loss, main-attention side: probs [B, Sq, k] (accumulator dtype of q),
//   probs[b, t, s] = sum_h exp(scale q_ht . c_j - lse[b, h, t])   for slot s selecting position j inside this block;
// other slots are left untouched. lse [B, H, Sq] (accumulator dtype or fp64) must be the final lse. Heads are those
// of args.q.
void dsa_attention_probs(const DsaAttentionArgs& args, const TensorView& lse, const TensorView& probs,
                         Stream stream = Stream::cpu());

// ---- indexer loss ------------------------------------------------------------------------------------------------

// Step (a), indexer side: scores [B, Sq, k] (accumulator dtype of the indexer inputs), scores[b, t, s] = I_tj for
// slot s selecting position j inside this key block (k_pos); other slots untouched. topk_indices as in
// DsaAttentionArgs (checked the same way).
void dsa_indexer_scores_selected(const DsaIndexerArgs& args, const TensorView& topk_indices, const TensorView& scores,
                                 Stream stream = Stream::cpu());

struct DsaIndexerLossArgs {
  TensorView probs;         // [B, Sq, k] fp32 or fp64: head-summed main-attention probabilities of the selected slots
  TensorView scores;        // [B, Sq, k] probs' dtype: indexer scores I of the selected slots
  TensorView topk_indices;  // [B, Sq, k] int64; slots with -1 are ignored
  float grad_scale = 1.0f;  // dscores = grad_scale * dL/dI (the upstream gradient of L)
};

// Step (b): per row, p* = probs / sum_s probs over the valid slots, LI = logsumexp(scores) over them,
//   L_t = sum_s p*_s (log p*_s - (I_s - LI)), dscores_s = grad_scale (exp(I_s - LI) - p*_s), 0 on -1 slots.
// Computed in fp64; returns sum_t L_t over all (b, t) of this call (fixed order). dscores [B, Sq, k] (probs' dtype)
// is overwritten (may be a default TensorView when only the value is needed). A row with no valid slot adds 0.
double dsa_indexer_loss(const DsaIndexerLossArgs& args, const TensorView& dscores, Stream stream = Stream::cpu());

// Step (c), for one key block: with s = q_idx_ti . k_idx_j of each selected pair inside the block and g = dscores,
//   dw_ti += g relu(s),  and where s > 0:  dq_idx_ti += g w_ti k_idx_j,  dk_idx_j += g w_ti q_idx_ti.
// dscores: accumulator dtype of the indexer inputs. dq_idx [B, Sq, Hi, Di], dw [B, Sq, Hi], dk_idx [B, Sk, Di].
// accumulate = false: overwritten (any floating dtype); true: the accumulator dtype, added. dk_idx_j is summed over
// queries in increasing (b, t) order (thread-count independent).
void dsa_indexer_backward(const DsaIndexerArgs& args, const TensorView& topk_indices, const TensorView& dscores,
                          const TensorView& dq_idx, const TensorView& dw, const TensorView& dk_idx, bool accumulate,
                          Stream stream = Stream::cpu());

// ---- argument checks on their own (see the header comment) -------------------------------------------------------

// The argument structs alone: shapes, dtypes, devices, position counts, k_pos / c_pos strictly increasing, dim_v,
// scale and (for DsaAttentionArgs) every topk_indices row.
void check_dsa_indexer_args(const DsaIndexerArgs& args);
void check_dsa_attention_args(const DsaAttentionArgs& args);

void check_dsa_topk_init(const DsaTopkState& state, Stream stream = Stream::cpu());
void check_dsa_indexer_topk_block(const DsaIndexerArgs& args, const DsaTopkState& state, Stream stream = Stream::cpu());
void check_dsa_topk_merge(const DsaTopkState& state, const DsaTopkState& other, Stream stream = Stream::cpu());
void check_dsa_topk_finalize(const DsaTopkState& state, const TensorView& topk_indices, Stream stream = Stream::cpu());
void check_dsa_topk_selected_scores(const DsaTopkState& state, const TensorView& scores, Stream stream = Stream::cpu());
void check_dsa_indexer_topk(const DsaIndexerArgs& args, const TensorView& topk_indices, Stream stream = Stream::cpu());
void check_dsa_attention_forward(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse,
                                 Stream stream = Stream::cpu());
void check_dsa_attention_backward(const DsaAttentionBackwardArgs& args, const TensorView& dq, const TensorView& dc,
                                  bool accumulate, Stream stream = Stream::cpu());
void check_dsa_attention_delta(const TensorView& out, const TensorView& dout, const TensorView& delta,
                               Stream stream = Stream::cpu());
void check_dsa_attention_probs(const DsaAttentionArgs& args, const TensorView& lse, const TensorView& probs,
                               Stream stream = Stream::cpu());
void check_dsa_indexer_scores_selected(const DsaIndexerArgs& args, const TensorView& topk_indices,
                                       const TensorView& scores, Stream stream = Stream::cpu());
void check_dsa_indexer_loss(const DsaIndexerLossArgs& args, const TensorView& dscores, Stream stream = Stream::cpu());
void check_dsa_indexer_backward(const DsaIndexerArgs& args, const TensorView& topk_indices, const TensorView& dscores,
                                const TensorView& dq_idx, const TensorView& dw, const TensorView& dk_idx,
                                bool accumulate, Stream stream = Stream::cpu());

}  // namespace seqpar::attn
