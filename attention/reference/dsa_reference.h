// Naive fp64 DSA for tests: materialised [Sq, Sk] indexer scores, full sort for the top-k, dense masked softmax for the
// sparse latent attention, and the indexer KL loss with its gradients. Same args structs, positions and semantics as
// attention/dsa.h (docs/design.md, "DeepSeek sparse attention"); every tensor is fp64 (lse [B, H, Sq] fp64), indices
// int64. The key block is the whole key set (one call); no tiling, no running state.
#pragma once

#include "../dsa.h"

namespace seqpar::attn::reference {

// scores [B, Sq, Sk] fp64: I_tj for the candidate keys of query t (visible, inside args.window if > 0), -inf for
// the others.
void dsa_indexer_scores(const DsaIndexerArgs& args, const TensorView& scores);

// topk_indices [B, Sq, k] int64: the k candidate keys with the largest score (ties to the smaller position), in
// ascending position order, padded with -1.
void dsa_indexer_topk(const DsaIndexerArgs& args, const TensorView& topk_indices);

// out [B, Sq, H, Dv], lse [B, H, Sq] (fp64): softmax of the dense scores masked to the selected positions.
void dsa_attention_forward(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse);

// dq [B, Sq, H, Dqk], dc [B, Sk, Dqk] (fp64, overwritten) for the upstream gradient dout [B, Sq, H, Dv].
void dsa_attention_backward(const DsaAttentionArgs& args, const TensorView& dout, const TensorView& dq,
                            const TensorView& dc);

// Indexer loss L = sum_{b,t} KL(p*_t || softmax(I_t over J_t)) with J_t = attn.topk_indices and p*_t the main
// attention probabilities summed over heads and L1-normalised over J_t. attn.c and idx.k_idx must describe the same
// keys (equal positions). Returns L; dq_idx, dw, dk_idx (fp64, overwritten) get dL/d(q_idx, w, k_idx) with J_t and
// p* held fixed; pass default TensorViews to skip the gradients.
double dsa_indexer_loss(const DsaAttentionArgs& attn, const DsaIndexerArgs& idx, const TensorView& dq_idx,
                        const TensorView& dw, const TensorView& dk_idx);

}  // namespace seqpar::attn::reference
