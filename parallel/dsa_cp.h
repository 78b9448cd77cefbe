// DSA (DeepSeek sparse attention) under context parallelism (DESIGN.md section 5).
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
// softmax (attn::lse_merge). The backward sends the fp32 dc accumulators home with their blocks
// (ring_circulate_with_grad); dc and the head-summed attention probabilities of the ring shard are reduce-scattered
// over the Ulysses group back to the sequence-sharded layout.
//
// Indexer loss (KL(p* || softmax(I)) summed over all queries; DESIGN.md section 5): p* comes from the main
// attention probabilities, which the attention backward produces for free, so the loss value and all gradients
// come out of backward(). The index-key gradients travel home with the index-key blocks like dK / dV.
//
// Synchronisation: forward() and backward() are collective over the grid's Ulysses, ring and SP communicators and
// host-synchronous. Errors (before any communication, identical on every rank): layout divisibility, heads not
// divisible by ulysses_size, shapes / dtypes, topk < 1, dim_v outside [1, Dqk], backward before forward.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "attention/dsa.h"
#include "parallel/layout.h"
#include "runtime/sp_grid.h"

namespace seqpar {

enum class DsaSelectMode : std::uint8_t { kRing, kAllGather };
const char* dsa_select_mode_name(DsaSelectMode mode);  // "ring", "allgather"
DsaSelectMode parse_dsa_select_mode(std::string_view name);

struct DsaCpConfig {
  LayoutKind layout = LayoutKind::kZigzag;
  DsaSelectMode select = DsaSelectMode::kRing;
  std::int64_t topk = attn::kDsaTopK;
  std::int64_t dim_v = attn::kDsaHeadDimV;
  float scale = 0.0f;  // <= 0: 1 / sqrt(Dqk)
};

struct DsaCpOutput {
  Tensor out;           // [B, S_local, H, Dv], dtype of q
  Tensor lse;           // [B, H, S_local] fp32
  Tensor topk_indices;  // [B, S_local, topk] int64 global positions, ascending, -1 padded
};

struct DsaCpGrads {
  Tensor dq;        // [B, S_local, H, Dqk]
  Tensor dc;        // [B, S_local, Dqk]
  Tensor dq_idx;    // [B, S_local, Hi, Di]
  Tensor dk_idx;    // [B, S_local, Di]
  Tensor dw;        // [B, S_local, Hi]
  double loss = 0;  // indexer KL loss summed over the whole sequence (the same on every rank)
};

struct DsaCpCounters {
  double attention_pairs = 0;   // (query, selected key) pairs attended by this rank
  std::int64_t bytes_sent = 0;  // all groups
  double exposed_comm_s = 0;
  double compute_s = 0;
  void reset() { *this = {}; }
};

class DsaContextParallel {
 public:
  DsaContextParallel(const SpGrid& grid, std::int64_t seq_len, const DsaCpConfig& config);

  // q [B, S_local, H, Dqk], c [B, S_local, Dqk], q_idx [B, S_local, Hi, Di], k_idx [B, S_local, Di],
  // w [B, S_local, Hi], all one dtype, at positions(); S_local = seq_len / (ulysses_size * ring_size).
  DsaCpOutput forward(const TensorView& q, const TensorView& c, const TensorView& q_idx, const TensorView& k_idx,
                      const TensorView& w);
  // dout [B, S_local, H, Dv]; loss_grad_scale multiplies the indexer loss gradient (the caller's loss weight).
  DsaCpGrads backward(const TensorView& dout, float loss_grad_scale = 1.0f);

  const SequenceLayout& layout() const { return layout_; }
  const std::vector<std::int64_t>& positions() const { return positions_; }
  const DsaCpCounters& counters() const { return counters_; }
  void reset_counters() { counters_.reset(); }

 private:
  const SpGrid& grid_;
  DsaCpConfig config_;
  SequenceLayout layout_;
  std::vector<std::int64_t> positions_;                    // this SP rank's positions
  std::vector<std::vector<std::int64_t>> sp_positions_;    // every SP rank's positions
  std::vector<std::vector<std::int64_t>> ring_positions_;  // every ring rank's ring shard
  DsaCpCounters counters_;
  // saved for backward
  Tensor q_h_, c_ring_, topk_ring_, out_h_, lse_h_;     // head-sharded attention side
  Tensor q_idx_, k_idx_, w_, topk_local_, sel_scores_;  // sequence-sharded indexer side
  bool has_forward_ = false;
};

}  // namespace seqpar
