// USP = Ulysses x Ring (Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach") for MHA / GQA / MQA:
// Ulysses all-to-all over the Ulysses group, ring attention over the ring group on the gathered ring shard, inverse
// all-to-all. Pu = 1 is pure ring (nothing exchanged or copied), Pr = 1 pure Ulysses.
// Math and schedules: docs/design.md, "USP", "Ulysses", "Ring attention"; bytes: "MHA communication volume";
// dropout under Ulysses: "Attention dropout"; packed and padded layouts: "MHA on packed rows".
//
// Counters (CpCounters): the ring's FLOPs, bytes and exposed time, plus the all-to-all bytes (a2a_bytes_*) and
// seconds (a2a_s).
// Synchronisation: forward() and backward() are collective over the Ulysses and ring groups and host-synchronous.
// Errors (before any communication, identical on every rank): the layout not built for the groups, heads not
// splittable over Pu (UlyssesHeads), shape / dtype mismatches, a context that is empty, used or not this object's;
// ranks of the SP group that disagree on shapes, dtypes, configuration or layout (AgreementCheck,
// parallel/cp_common.h).
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/ring_attention.h"
#include "parallel/ulysses.h"
#include "runtime/sp_grid.h"

namespace seqpar {

class UspAttention {
 public:
  // `layout` (SequenceLayout::for_groups(groups, seq_len, kind)) gives every rank's positions.
  UspAttention(const CpGroups& groups, const SequenceLayout& layout, const RingAttentionConfig& config);
  // The same on the grid's Ulysses, ring and SP communicators (CpGroups::from(grid)); the grid must outlive the
  // layer. `layout` as above.
  UspAttention(const SpGrid& grid, const SequenceLayout& layout, const RingAttentionConfig& config = {});
  // The same with SequenceLayout::for_groups(grid's groups, seq_len, kind) (zigzag by default).
  UspAttention(const SpGrid& grid, std::int64_t seq_len, const RingAttentionConfig& config = {},
               LayoutKind kind = LayoutKind::kZigzag);

  // q [B, S / (Pu Pr), Hq, D], k, v [B, S / (Pu Pr), Hkv, D] at positions(); out like q (workspace),
  // lse [B, Hq, S_local] (fp32, fp64 for fp64 inputs); the context owns what the backward needs (saved_activation).
  AttentionOutput forward(const TensorView& q, const TensorView& k, const TensorView& v);
  // dout like q (any floating dtype) with the context of a forward of this object (consumed and freed); gradients
  // in the dtype of q.
  // dlse: optional [B, Hq, S_local] fp32 / fp64, the gradient of the loss with respect to lse (a loss that uses lse,
  // attn::MhaBackwardArgs::dlse); empty: none.
  AttentionGrads backward(CpContext&& ctx, const TensorView& dout, const TensorView& dlse = {});

  const SequenceLayout& layout() const { return layout_; }
  int sp_rank() const { return groups_.sp_rank(); }
  const std::vector<std::int64_t>& positions() const { return positions_; }
  CpCounters counters() const;
  void reset_counters();
  // The agreement checks of forward and backward (over the SP group): how often each ran or was cached.
  const AgreementCheck& forward_agreement() const { return forward_agreement_; }
  const AgreementCheck& backward_agreement() const { return backward_agreement_; }

 private:
  struct Saved;

  CpGroups groups_;
  SequenceLayout layout_;
  RingAttentionConfig config_;
  LayerId id_;
  std::vector<std::int64_t> positions_;
  RingAttention ring_attn_;
  CpCounters counters_;  // the all-to-all part; the ring's are ring_attn_'s
  AgreementCheck forward_agreement_, backward_agreement_;
};

}  // namespace seqpar
