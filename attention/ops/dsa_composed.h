// The DSA indexer scores and top-k selection, and the sparse latent attention forward, (attention/dsa.h's
// dsa_indexer_topk over one key block: same arguments and semantics) written only as calls to an ops table
// (attention/ops/ops.h; docs/design.md, "The ops table"):
//   1. per batch row, one GEMM of the indexer logits [Sq Hi, Di] x [Di, Sk] (gemm_fixed_order: a pair's score is
//      bitwise the same in any key block, so blocks of any grid select what one call selects, ties included);
//   2. the ReLU-weighted head sum I[t, j] = sum_i w[t, i] relu(L[t, i, j]) (rowops::relu_head_sum_row);
//   3. top-k per query row over its candidate keys, which (k_pos strictly increasing) are one column range
//      [lo, hi): causal, inside the window, inside the query's document; ties to the lower position.
// The column ranges are found on the host by binary search over k_pos, and the selected columns are mapped to
// positions on the host (a device table would run both as small element kernels). Arithmetic in T = fp64 for fp64
// inputs, else fp32.
#pragma once

#include "../dsa.h"
#include "ops.h"

namespace seqpar::attn::ops {

// Args: topk_indices int64 [B, Sq, k] (k >= 1): selected global positions ascending, then -1; scores: optional
//   [B, Sq, Sk] of T, the indexer scores of every key (-inf outside the query's candidates).
// Errors: DsaIndexerArgs::validate's, and topk_indices / scores shapes and dtypes, before any work.
template <typename T>
void dsa_indexer_topk_composed(Ops<T>& ops, const DsaIndexerArgs& args, const TensorView& topk_indices,
                               const TensorView& scores = {});

// The sparse latent attention forward over one latent block (attn::dsa_attention_forward's arguments and semantics)
// composed the same way: the selected positions of each query that lie in this block (causal) are compacted to the
// front of its k slots and their latent rows gathered ([B Sq, k, Dqk]); scores [H, k] per query by a batched GEMM
// with the scale; softmax rows over each query's selected slots (lse); out = P c[:, :Dv] by a batched GEMM. The
// position -> row map and the compaction run on the host (small element kernels on a device).
// Args: out [B, Sq, H, Dv] any floating dtype; lse [B, H, Sq] of T, or fp64 = fp64(row max) + log(fp64(row sum)).
// Errors: DsaAttentionArgs::validate(out, lse)'s, before any work.
template <typename T>
void dsa_attention_forward_composed(Ops<T>& ops, const DsaAttentionArgs& args, const TensorView& out,
                                    const TensorView& lse);

// dsa_indexer_topk_block composed (its arguments and semantics): the block's candidates by the steps above, then
// merged into the running state by the table's topk_merge_rows. The state's rows are kept ascending by position
// (dsa_topk_finalize's order), the form topk_merge_rows reads and writes; the CPU kernel's heap order is another
// internal order, so a state is written by one path only (dsa_topk_init's empty state suits both).
template <typename T>
void dsa_topk_block_composed(Ops<T>& ops, const DsaIndexerArgs& args, const DsaTopkState& state);
// dsa_topk_merge composed: other's entries merged into state (both in the composed order), tie rule kept.
template <typename T>
void dsa_topk_merge_composed(Ops<T>& ops, const DsaTopkState& state, const DsaTopkState& other);
// The merge of a block's candidates s_b, p_b [rows, k] (table memory, ascending by position) into the state.
template <typename T>
void dsa_topk_merge_composed(Ops<T>& ops, const DsaTopkState& state, const T* s_b, const std::int64_t* p_b);

// dsa_attention_backward (and, with dout absent, dsa_attention_probs) over one latent block, composed (docs/design.md,
// "The ops table", DSA backward): the selected latent rows gathered slot by slot ([B Sq, k, Dqk], a zero row for a
// slot outside the block); s = scale q c_sel^T and p = exp(s - lse) with the final lse ([H, k] per query, batched
// GEMM and a row op); probs (when given) = the head sum of p at the slots in the block; dp = dout v_sel^T,
// ds = p (dp - delta); dq = scale ds c_sel; dc_sel = scale ds^T q + p^T dout (first Dv columns); dc by the inverted
// index of the slots' latent rows: each row sums the slots that selected it in ascending (b, t, slot) order, no
// atomics. Every per-slot value is computed in the slot's own place whatever block it lies in, so dc and probs of a
// block split are bitwise the one call's.
// Args: delta [B, H, Sq] of T (required with dout); lse [B, H, Sq] of T or fp64; dq, dc, probs as
//   dsa_attention_backward (checked by its boundary: DsaAttentionBackwardArgs::validate).
template <typename T>
void dsa_attention_backward_composed(Ops<T>& ops, const DsaAttentionArgs& args, const TensorView& lse,
                                     const TensorView& dout, const TensorView& delta, const TensorView& dq,
                                     const TensorView& dc, bool accumulate, const TensorView& probs);

// dsa_indexer_scores_selected composed: the selected index keys gathered slot by slot, logits q_idx k_sel^T per query
// (batched GEMM), the ReLU-weighted head sum (rowops::relu_head_sum_row); slots outside the block untouched.
template <typename T>
void dsa_indexer_scores_selected_composed(Ops<T>& ops, const DsaIndexerArgs& args, const TensorView& topk_indices,
                                          const TensorView& scores);
// dsa_indexer_backward composed: the logits as above, the logit gradients a_ij = g_j w_i [s_ij > 0] and dw
// (rowops::indexer_grad_row), dq_idx = a k_sel, dk_sel = a^T q_idx (batched GEMMs), dk_idx by the inverted index.
template <typename T>
void dsa_indexer_backward_composed(Ops<T>& ops, const DsaIndexerArgs& args, const TensorView& topk_indices,
                                   const TensorView& dscores, const TensorView& dq_idx, const TensorView& dw,
                                   const TensorView& dk_idx, bool accumulate);
// dsa_indexer_loss composed: rowops::kl_row per query in fp64, the row losses summed in row order.
template <typename T>
double dsa_indexer_loss_composed(Ops<T>& ops, const DsaIndexerLossArgs& args, const TensorView& dscores);

// The same on the CPU table of q_idx's (q's) arithmetic dtype.
void dsa_attention_forward_composed_cpu(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse);
void dsa_indexer_topk_composed_cpu(const DsaIndexerArgs& args, const TensorView& topk_indices,
                                   const TensorView& scores = {});
void dsa_topk_block_composed_cpu(const DsaIndexerArgs& args, const DsaTopkState& state);
void dsa_topk_merge_composed_cpu(const DsaTopkState& state, const DsaTopkState& other);
void dsa_attention_backward_composed_cpu(const DsaAttentionArgs& args, const TensorView& lse, const TensorView& dout,
                                         const TensorView& delta, const TensorView& dq, const TensorView& dc,
                                         bool accumulate, const TensorView& probs);
void dsa_indexer_scores_selected_composed_cpu(const DsaIndexerArgs& args, const TensorView& topk_indices,
                                              const TensorView& scores);
void dsa_indexer_backward_composed_cpu(const DsaIndexerArgs& args, const TensorView& topk_indices,
                                       const TensorView& dscores, const TensorView& dq_idx, const TensorView& dw,
                                       const TensorView& dk_idx, bool accumulate);
double dsa_indexer_loss_composed_cpu(const DsaIndexerLossArgs& args, const TensorView& dscores);

}  // namespace seqpar::attn::ops
