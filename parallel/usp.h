// USP = Ulysses x Ring (Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach") for MHA / GQA / MQA:
// Ulysses all-to-all over the Ulysses group, ring attention over the ring group on the gathered ring shard, inverse
// all-to-all. Pu = 1 is pure ring (nothing exchanged or copied), Pr = 1 pure Ulysses.
// Math and schedules: docs/design.md, "USP", "Ulysses", "Ring attention"; bytes: "MHA communication volume";
// dropout under Ulysses: "Attention dropout"; packed and padded layouts: "MHA on packed rows".
//
// Counters (CpCounters): the ring's FLOPs, bytes and exposed time, plus the all-to-all bytes (a2a_bytes_*) and
// seconds (a2a_s).
#pragma once

#include <cstdint>
#include <vector>

#include "ring_attention.h"
#include "ulysses.h"
#include "../runtime/cp_grid.h"

namespace seqpar {

// One USP attention layer on this rank's groups (docs/design.md, "USP").
class MhaCp {
 public:
  // A layer over `groups`; the second form on the grid's Ulysses, ring and CP communicators (CpGroups::from(grid)),
  // the grid outliving the layer; the third with SequenceLayout::for_groups(grid's groups, seq_len, kind) (zigzag
  // by default).
  // Args: layout: SequenceLayout::for_groups(groups, seq_len, kind), gives every rank's positions.
  // Errors: the layout not built for the groups; those of RingAttention's constructor.
  // Sync: host-only, no communication.
  MhaCp(const CpGroups& groups, const SequenceLayout& layout, const MhaCpConfig& config);
  MhaCp(const CpGrid& grid, const SequenceLayout& layout, const MhaCpConfig& config = {});
  MhaCp(const CpGrid& grid, std::int64_t seq_len, const MhaCpConfig& config = {},
               LayoutKind kind = LayoutKind::kZigzag);

  // Forward: Ulysses all-to-all, ring attention on the gathered ring shard, inverse all-to-all.
  // Args: q [B, S / (Pu Pr), Hq, D], k, v [B, S / (Pu Pr), Hkv, D] at positions().
  // Returns: out like q (workspace), lse [B, Hq, S_local] (fp32, fp64 for fp64 inputs); the context owns what the
  //   backward needs (saved_activation).
  // Errors (before any communication, identical on every rank): heads not splittable over Pu (UlyssesHeads),
  //   shape / dtype mismatches; ranks of the CP group that disagree on shapes, dtypes, configuration or layout
  //   (AgreementCheck, parallel/cp_common.h).
  // Sync: collective over the Ulysses and ring groups (agreement: the CP group); host-synchronous.
  MhaCpOutput forward(const TensorView& q, const TensorView& k, const TensorView& v);

  // Backward with the context of a forward of this object (consumed and freed).
  // Args: dout like q, any floating dtype; dlse: optional [B, Hq, S_local] fp32 / fp64, the gradient of the loss
  //   with respect to lse (a loss that uses lse, attn::MhaBackwardArgs::dlse); empty: none.
  // Returns: gradients in the dtype of q.
  // Errors (before any communication, identical on every rank): as forward; a context that is empty, used or not
  //   this object's.
  // Sync: collective over the Ulysses and ring groups (agreement: the CP group); host-synchronous.
  MhaCpGrads backward(CpContext&& ctx, const TensorView& dout, const TensorView& dlse = {});

  // Accessors: the layout, this rank in the CP group, its positions; counters (CpCounters, the ring's plus the
  // all-to-all part) and reset_counters().
  // Sync: host-only.
  const SequenceLayout& layout() const { return layout_; }
  int cp_rank() const { return groups_.cp_rank(); }
  const std::vector<std::int64_t>& positions() const { return positions_; }
  CpCounters counters() const;
  void reset_counters();

  // The stream of the next calls' kernels and copies (CpGroups::stream; a device stream is also set on the
  // communicators during each call), e.g. the caller's current stream before each call (the Python binding passes
  // torch's). A context keeps no stream: a backward runs on the stream set when it is called.
  // Sync: host-only.
  void set_stream(Stream stream);
  Stream stream() const { return groups_.stream; }

  // The agreement checks of forward and backward (over the CP group): how often each ran or was cached.
  // Sync: host-only.
  const AgreementCheck& forward_agreement() const { return forward_agreement_; }
  const AgreementCheck& backward_agreement() const { return backward_agreement_; }

 private:
  struct Saved;

  CpGroups groups_;
  SequenceLayout layout_;
  MhaCpConfig config_;
  LayerId id_;
  std::vector<std::int64_t> positions_;
  RingAttention ring_attn_;
  CpCounters counters_;  // the all-to-all part; the ring's are ring_attn_'s
  AgreementCheck forward_agreement_, backward_agreement_;
};

}  // namespace seqpar
