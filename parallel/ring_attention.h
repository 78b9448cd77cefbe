// Context-parallel (ring) attention for MHA / GQA over the ring group of the SP grid: each rank holds q, k, v at the
// positions its layout gives and gets exactly the rows of out, lse, dq, dk, dv that one rank computing the whole
// sequence would get.
// Math and schedules: docs/design.md, "Ring attention" (p2p, Liu et al. 2023: double-buffered K/V, fp64 running
// lse, travelling dK/dV accumulators), "Ring attention by all-gather", "Sliding-window ring" (WindowPlan), "MHA
// communication volume" (bytes and message rounds per implementation and layout), "MHA on packed rows".
//
// Use it alone with ulysses_size = 1, or through MhaCp (parallel/usp.h). Packed layouts take B = 1.
// Counters (CpCounters): attention FLOPs, ring bytes, exposed communication time, kernel time.
// Memory: the returned context owns what backward needs (saved_activation); double buffers and travelling
// accumulators in comm_buffer; outputs in workspace.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "../attention/mha.h"
#include "cp_common.h"
#include "layout.h"
#include "ring_pass.h"
#include "../runtime/comm.h"

namespace seqpar {

// The configuration of RingAttention and MhaCp (the same on every rank).
struct MhaCpConfig {
  RingImpl impl = RingImpl::kP2P;
  bool causal = true;
  std::int64_t window = 0;  // > 0: sliding window (needs causal)
  double scale = 0.0;       // <= 0: 1 / sqrt(D)
  // Soft-capping, ALiBi slopes and sinks ([Hq] of all query heads; views the caller keeps alive, e.g. the learned
  // sinks parameter). Under Ulysses / USP each rank uses the entries of its heads. A sink is counted once per row:
  // p2p applies it after the last block is merged (attn::mha_apply_sinks), all-gather in its one kernel call; the
  // backward uses the final lse with the sink, and dsinks (MhaCpGrads) is summed over the local rows and
  // all-reduced over the ring group (and gathered over the Ulysses group by USP).
  attn::ScoreMods score_mods{};
  // Dropout on the attention probabilities (attention/dropout.h): p in [0, 1), 0 = off. The mask is keyed by the
  // global query head and global positions, so every grid and layout drops the same pairs as one rank.
  attn::DropoutSpec dropout{};
};

// What forward() returns.
struct MhaCpOutput {
  Tensor out;     // [B, S_local, Hq, D], dtype of q
  Tensor lse;     // [B, Hq, S_local], accumulator_dtype(dtype of q): fp32, fp64 for fp64
  CpContext ctx;  // what the backward needs; hand it to backward() of the object that made it
};

// What backward() returns.
struct MhaCpGrads {
  Tensor dq;      // [B, S_local, Hq, D], dtype of q
  Tensor dk;      // [B, S_local, Hkv, D]
  Tensor dv;      // [B, S_local, Hkv, D]
  Tensor dsinks;  // [Hq] of all query heads, identical on every rank (sum over the whole sequence), dtype of the
                  // sinks; empty when config.score_mods has no sinks
};

// The fields of an MHA forward (RingAttention, MhaCp) for the ranks' agreement check (AgreementCheck,
// parallel/cp_common.h).
// Returns: the fingerprint of `call`, the configuration (impl, causal, window, scale), the layout, q, k and v.
// Sync: host-only, no communication.
Fingerprint mha_forward_fingerprint(std::string_view call, const MhaCpConfig& config,
                                    const SequenceLayout& layout, const TensorView& q, const TensorView& k,
                                    const TensorView& v);

// Ring attention on this rank's ring group (docs/design.md, "Ring attention").
class RingAttention {
 public:
  // Validates the configuration and the layout against the groups here.
  // Errors: layout not built for the groups, window < 0, window without causal, non-finite scale, softcap < 0 or
  //   non-finite, dropout p outside [0, 1).
  // Sync: host-only, collective-free.
  RingAttention(const CpGroups& groups, const SequenceLayout& layout, const MhaCpConfig& config);

  // Forward over the whole sequence, this rank's rows.
  // Args: q [B, S_ring, Hq, D], k, v [B, S_ring, Hkv, D], S_ring = seq_len / ring_size, at positions().
  // Returns: MhaCpOutput; the context owns what backward needs.
  // Errors (before any communication, identical on every rank): shape / dtype mismatch, B != 1 with a packed
  //   layout, Hq % Hkv != 0; ranks that disagree on shapes, dtypes, configuration or layout (AgreementCheck,
  //   parallel/cp_common.h).
  // Sync: collective over the ring communicator; host-synchronous; kernels run on groups.stream.
  MhaCpOutput forward(const TensorView& q, const TensorView& k, const TensorView& v);

  // Backward with the context of a forward of this object (consumed and freed).
  // Args: dout [B, S_ring, Hq, D]; dlse: optional [B, Hq, S_ring] fp32 / fp64, the gradient of the loss with
  //   respect to lse (attn::MhaBackwardArgs).
  // Returns: MhaCpGrads, in the dtype of q.
  // Errors (before any communication, identical on every rank): as forward; a context that is empty, used or
  //   another object's.
  // Sync: collective over the ring communicator; host-synchronous; kernels run on groups.stream.
  MhaCpGrads backward(CpContext&& ctx, const TensorView& dout, const TensorView& dlse = {});

  // Lower-level entry points for composition: results written to caller-owned tensors (with the same agreement
  // check as forward() / backward()).
  // Args: head_offset: the global index of q's head 0 (USP passes ulysses_rank * Hq_local), the head of the
  //   dropout key; kept in the context for the backward. dsinks: [Hq of q] (fp32 / fp64) when the configuration
  //   has sinks, else empty.
  // Returns: forward_into: the context; out, lse, dq, dk, dv, dsinks written. dsinks is all-reduced over the ring
  //   group.
  // Errors: as forward() / backward(), and the output tensors' shapes and dtypes.
  // Sync: collective over the ring communicator; host-synchronous.
  CpContext forward_into(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                         const TensorView& lse, std::int64_t head_offset = 0);
  void backward_into(CpContext&& ctx, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                     const TensorView& dv, const TensorView& dsinks = {}, const TensorView& dlse = {});

  // Accessors: the layout, this rank's ring shard positions, the counters (CpCounters) and reset_counters().
  // Sync: host-only.
  const SequenceLayout& layout() const { return layout_; }
  const std::vector<std::int64_t>& positions() const { return positions_[rank_]; }
  const CpCounters& counters() const { return counters_; }
  void reset_counters() { counters_.reset(); }

  // The stream of the next calls' kernels and copies (CpGroups::stream), as MhaCp::set_stream.
  // Sync: host-only.
  void set_stream(Stream stream) { groups_.stream = stream; }

  // The agreement checks of forward (forward_into) and backward (backward_into): how often each ran or was cached.
  // Sync: host-only.
  const AgreementCheck& forward_agreement() const { return forward_agreement_; }
  const AgreementCheck& backward_agreement() const { return backward_agreement_; }

 private:
  friend class MhaCp;  // runs the unchecked bodies after its own check over the CP group
  struct Saved;
  // The agreement checks over the ring group (fingerprints of the call).
  void agree_forward(const TensorView& q, const TensorView& k, const TensorView& v);
  void agree_backward(const CpContext& ctx, const TensorView& dout);
  CpContext run_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& lse, std::int64_t head_offset);
  void run_backward(CpContext&& ctx, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                    const TensorView& dv, const TensorView& dsinks, const TensorView& dlse = {});
  // Every check of forward's inputs, the MHA kernels' own on the local shapes included; returns their device.
  Device validate(const TensorView& q, const TensorView& k, const TensorView& v, std::int64_t head_offset) const;
  // Buffers of a call on the device of the saved tensors, ordered on the groups' stream.
  DeviceAlloc alloc_for(const Saved& s) const;
  void forward_p2p(const Saved& s, const TensorView& out, const TensorView& lse);
  void forward_allgather(const Saved& s, const TensorView& out, const TensorView& lse);
  // delta = rowsum(dout * out) of the local rows (minus dlse; 0 on padding rows); out: the saved out while delta
  // is exactly rowsum(dout * out), else empty (attn::MhaBackwardArgs::out).
  void backward_p2p(const Saved& s, const TensorView& out, const TensorView& dout, const TensorView& delta,
                    const TensorView& dq, const TensorView& dk, const TensorView& dv);
  void backward_allgather(const Saved& s, const TensorView& out, const TensorView& dout, const TensorView& delta,
                          const TensorView& dq, const TensorView& dk, const TensorView& dv);
  // The mask of this rank's queries: causal, window, and for packed or padded rows the document bounds (doc_).
  attn::MaskSpec mask() const { return {config_.causal, config_.window, doc_.lo, doc_.hi}; }
  // Forward arguments of one key block (score modifiers without the sinks: those join once per row).
  attn::MhaForwardArgs block_args(const Saved& s, const TensorView& k, const TensorView& v,
                                  std::span<const std::int64_t> k_pos) const;
  // dsinks of the local rows (from the final lse and delta), all-reduced over the ring group.
  void sinks_grad(const Saved& s, const TensorView& delta, const TensorView& dsinks);
  // (K, V) of every ring rank in global order, [B, S, Hkv, D] each (all-gather into k_full, v_full), and the
  // forward arguments of this rank's queries against them.
  attn::MhaForwardArgs gather_kv_global(const Saved& s, Tensor& k_full, Tensor& v_full);

  CpGroups groups_;
  SequenceLayout layout_;
  MhaCpConfig config_;
  LayerId id_;
  int rank_, size_;
  std::vector<std::vector<std::int64_t>> positions_;  // ring shard positions of every ring rank
  std::vector<std::int64_t> global_order_;            // 0..S-1 (allgather: keys in global order)
  std::optional<WindowPlan> plan_;                    // p2p with a window: the rows each pair exchanges
  DocBounds doc_;  // packed or padded rows: each local query's document slots (empty: no document bound)
  std::vector<std::int64_t> tokens_;  // packed or padded rows: each local query's token (-1: padding), for dropout
  CpCounters counters_;
  AgreementCheck forward_agreement_, backward_agreement_;
};

}  // namespace seqpar
