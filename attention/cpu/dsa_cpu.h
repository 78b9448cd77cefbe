// Internal: the CPU DSA kernels behind attention/dsa.h. Arguments are validated by attention/dsa.cc, which passes
// the validated sizes and positions along; not a public header.
#pragma once

#include <cstdint>
#include <vector>

#include "../dsa.h"

namespace seqpar::attn::cpu {

// Validated sizes of DsaIndexerArgs; positions resolved (empty spans become 0..n-1).
struct DsaIndexerShape {
  std::int64_t B = 0, Sq = 0, Hi = 0, Di = 0, Sk = 0;
  std::vector<std::int64_t> q_pos, k_pos;
};

// Validated sizes of DsaAttentionArgs; `valid` is the number of selected (non -1) slots of each topk row.
struct DsaAttentionShape {
  std::int64_t B = 0, Sq = 0, H = 0, Dqk = 0, Dv = 0, Sk = 0, K = 0;
  double scale = 0.0;  // resolved: exact 1/sqrt(Dqk) in fp64 for the default
  std::vector<std::int64_t> q_pos, c_pos;
  std::vector<std::int32_t> valid;
};

void dsa_topk_init_cpu(const DsaTopkState& state);
void dsa_indexer_topk_block_cpu(const DsaIndexerArgs& args, const DsaIndexerShape& s, const DsaTopkState& state);
void dsa_topk_merge_cpu(const DsaTopkState& state, const DsaTopkState& other);
void dsa_topk_finalize_cpu(const DsaTopkState& state, const TensorView& topk_indices);
void dsa_topk_selected_scores_cpu(const DsaTopkState& state, const TensorView& scores);
void dsa_indexer_scores_selected_cpu(const DsaIndexerArgs& args, const DsaIndexerShape& s,
                                     const TensorView& topk_indices, const std::vector<std::int32_t>& valid,
                                     const TensorView& scores);
double dsa_indexer_loss_cpu(const DsaIndexerLossArgs& args, const TensorView& dscores);
void dsa_indexer_backward_cpu(const DsaIndexerArgs& args, const DsaIndexerShape& s, const TensorView& topk_indices,
                              const std::vector<std::int32_t>& valid, const TensorView& dscores,
                              const TensorView& dq_idx, const TensorView& dw, const TensorView& dk_idx,
                              bool accumulate);

void dsa_attention_forward_cpu(const DsaAttentionArgs& args, const DsaAttentionShape& s, const TensorView& out,
                               const TensorView& lse);
// delta [B, H, Sq] (fp32 or fp64, computed in its dtype) of out, dout [B, Sq, H, Dv].
void dsa_attention_delta_cpu(const TensorView& out, const TensorView& dout, const TensorView& delta);
// dout absent: probabilities only (into probs). probs may be absent. lse, delta [B, H, Sq] and probs are of the
// accumulator dtype of args.q (delta is read when dout is given).
void dsa_attention_backward_cpu(const DsaAttentionArgs& args, const DsaAttentionShape& s, const TensorView& lse,
                                const TensorView& dout, const TensorView& delta, const TensorView& dq,
                                const TensorView& dc, bool accumulate, const TensorView& probs);

}  // namespace seqpar::attn::cpu
