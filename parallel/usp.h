// USP = Ulysses x Ring (Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach") for MHA / GQA / MQA:
// Ulysses all-to-all over the Ulysses group (parallel/ulysses.h), ring attention (p2p or allgather, any layout;
// parallel/ring_attention.h) over the ring group on the gathered ring shard, inverse all-to-all. Pu = 1 is pure
// ring (nothing is exchanged or copied: the ring reads the caller's q, k, v and writes out, lse and the gradients
// directly), Pr = 1 pure Ulysses.
//
// Communication volume per rank (README): each all-to-all of a tensor of N bytes sends and receives
// (Pu - 1) / Pu * N (q, k, v, out and lse forward; dout, dq, dk, dv backward; k, v replicated to Pu heads and their
// gradients in the accumulator dtype when Hkv < Pu); the ring part is RingAttention's formula with S_local = S / Pr
// and H / Pu heads.
// Counters (CpCounters): the ring's FLOPs, bytes and exposed time, plus the all-to-all bytes (a2a_bytes_*) and
// seconds (a2a_s).
// Synchronisation: forward() and backward() are collective over the Ulysses and ring groups and host-synchronous.
// Dropout (config.dropout): the ring runs on heads [u Hq / Pu, (u + 1) Hq / Pu) of Ulysses rank u and keys its
// mask by those global heads (RingAttention::forward_into's head_offset), so every grid drops the same pairs.
// Packed and padded layouts (docs/design.md section 15): the local tensors are the layout's padded pieces (positions
// are slots); every query attends inside its own document only, as in ring_attention.h, padding rows give out 0, lse
// -inf and gradients 0. A packed layout takes B = 1.
// Errors (before any communication, identical on every rank): the layout not built for the groups, heads not
// splittable over Pu (UlyssesHeads), shape / dtype mismatches, a context that is empty, used or not this object's;
// ranks of the SP group that disagree on the shapes or dtypes of q, k, v (backward: of the saved q and of dout) or
// on impl, causal, window, scale or the layout (AgreementCheck, parallel/cp_common.h: one all-reduce over the SP
// group on the first call of each configuration, before any data moves; the inner ring attention is not checked
// again).
#pragma once

#include <vector>

#include "ring_attention.h"
#include "ulysses.h"

namespace seqpar {

class UspAttention {
 public:
  // `layout` (SequenceLayout::for_groups(groups, seq_len, kind)) gives every rank's positions.
  UspAttention(const CpGroups& groups, const SequenceLayout& layout, const RingAttentionConfig& config);

  // q [B, S / (Pu Pr), Hq, D], k, v [B, S / (Pu Pr), Hkv, D] at positions(); out like q (workspace),
  // lse [B, Hq, S_local] (fp32, fp64 for fp64 inputs); the context owns what the backward needs (saved_activation).
  AttentionOutput forward(const TensorView& q, const TensorView& k, const TensorView& v);
  // dout like q (any floating dtype) with the context of a forward of this object (consumed and freed); gradients
  // in the dtype of q.
  AttentionGrads backward(CpContext&& ctx, const TensorView& dout);

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
