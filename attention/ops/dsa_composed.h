// The DSA indexer scores and top-k selection, and the sparse latent attention forward, (attention/dsa.h's
// dsa_indexer_topk over one key block: same arguments and semantics) written only as calls to an ops table
// (attention/ops/ops.h; docs/design.md, "The ops table"):
//   1. per batch row, one GEMM of the indexer logits [Sq Hi, Di] x [Di, Sk];
//   2. ReLU rows;
//   3. the weighted head sum I[t, :] = w[t, :] L[t] by a strided-batched [1, Hi] x [Hi, Sk] GEMM over (b, t);
//   4. top-k per query row over its candidate keys, which (k_pos strictly increasing) are one column range
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

// The same on the CPU table of q_idx's (q's) arithmetic dtype.
void dsa_attention_forward_composed_cpu(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse);
void dsa_indexer_topk_composed_cpu(const DsaIndexerArgs& args, const TensorView& topk_indices,
                                   const TensorView& scores = {});

}  // namespace seqpar::attn::ops
