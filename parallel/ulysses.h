// Ulysses all-to-all (Jacobs et al. 2023, "DeepSpeed Ulysses") and USP = Ulysses x Ring (Fang & Zhao 2024,
// "USP: A Unified Sequence Parallelism Approach"), DESIGN.md sections 3 and 4.
//
// Ulysses over Pu ranks turns the sequence-sharded [B, S_local, H, D] into the head-sharded
// [B, Pu * S_local, H / Pu, D]: rank u keeps heads [u H/Pu, (u+1) H/Pu) and receives the pieces of every rank of
// its Ulysses group, concatenated in Ulysses-rank order, which is exactly the ring shard of SequenceLayout. The
// inverse all-to-all restores the sequence-sharded layout.
//
// GQA: Hq % Pu == 0 is required. When Hkv % Pu == 0 the KV heads are split like the query heads. When Hkv < Pu
// and Pu % Hkv == 0, KV head h is replicated to the Pu / Hkv ranks whose query heads use it, and in the backward
// the gradients of the replicas are summed (in fp32) back into the one true dK / dV. Any other Hkv is an error
// naming Hq, Hkv and Pu. The head partition depends only on (Hq, Hkv, Pu).
//
// USP: Ulysses all-to-all over the Ulysses group, ring attention (p2p or allgather, any layout) over the ring
// group on the gathered ring shard, inverse all-to-all. Pu = 1 is pure ring, Pr = 1 pure Ulysses.
// Communication volume per rank (README): each all-to-all of a tensor of N bytes sends and receives
// (Pu - 1) / Pu * N; the ring part is RingAttention's formula with S_local = S / Pr and H / Pu heads.
#pragma once

#include <memory>

#include "parallel/ring_attention.h"

namespace seqpar {

// Head-count plan of the Ulysses split: errors (identical on every rank, before any communication) when the
// heads cannot be split.
struct UlyssesHeads {
  std::int64_t hq = 0, hkv = 0;  // global
  int ulysses_size = 1;
  std::int64_t hkv_expanded = 0;  // kv heads entering the all-to-all (hkv, or ulysses_size when replicated)
  std::int64_t replication = 1;   // ranks sharing each kv head (ulysses_size / hkv when hkv < ulysses_size)
  UlyssesHeads(std::int64_t hq, std::int64_t hkv, int ulysses_size);
};

// [B, S_local, H, D] -> [B, Pu * S_local, H / Pu, D] (scatter heads, gather sequence). Collective over `ulysses`.
void ulysses_scatter_heads(Communicator& ulysses, const TensorView& in, const TensorView& out);
// [B, Pu * S_local, H / Pu, D] -> [B, S_local, H, D], the exact inverse.
void ulysses_gather_heads(Communicator& ulysses, const TensorView& in, const TensorView& out);
// lse [B, H / Pu, Pu * S_local] -> [B, H, S_local] (the inverse all-to-all for [B, H, S] statistics).
void ulysses_gather_heads_bhs(Communicator& ulysses, const TensorView& in, const TensorView& out);

// KV replication for Hkv < Pu: [B, S, Hkv, D] -> [B, S, Hkv * r, D] with expanded head e = copy of head e / r;
// and the fp32 sum of replica gradients back: [B, S, Hkv * r, D] -> [B, S, Hkv, D] (any floating output dtype).
void replicate_kv_heads(const TensorView& in, std::int64_t replication, const TensorView& out);
void reduce_kv_replicas(const TensorView& in, std::int64_t replication, const TensorView& out);

struct UspCounters {
  AttentionCounters ring;           // attention FLOPs, ring bytes, ring exposed time
  std::int64_t a2a_bytes_sent = 0;  // all-to-all bytes (Ulysses group)
  std::int64_t a2a_bytes_received = 0;
  double a2a_s = 0;  // seconds in all-to-all (not overlapped)
  void reset() { *this = {}; }
};

class UspAttention {
 public:
  // `ulysses` (size Pu) and `ring` (size Pr) are this rank's groups of an SpGrid; `seq_len` the global length;
  // `config.layout` the ring layout (SequenceLayout(layout, seq_len, Pr, Pu) gives every rank's positions).
  UspAttention(Communicator& ulysses, Communicator& ring, std::int64_t seq_len, const RingAttentionConfig& config);

  // q [B, S / (Pu Pr), Hq, D], k, v [B, S / (Pu Pr), Hkv, D] at layout().positions(sp_rank); out like q,
  // lse [B, Hq, S_local] fp32. Collective over both groups; host-synchronous.
  AttentionOutput forward(const TensorView& q, const TensorView& k, const TensorView& v);
  // Gradients in the dtype of q; needs a preceding forward().
  AttentionGrads backward(const TensorView& dout);

  const SequenceLayout& layout() const { return layout_; }
  int sp_rank() const { return ring_.rank() * ulysses_.size() + ulysses_.rank(); }
  const std::vector<std::int64_t>& positions() const { return positions_; }
  UspCounters counters() const;
  void reset_counters();

 private:
  // Runs one all-to-all helper, adding its bytes and time to the counters.
  template <typename Fn>
  void timed_a2a(Fn&& fn);

  Communicator& ulysses_;
  Communicator& ring_;
  RingAttentionConfig config_;
  SequenceLayout layout_;
  std::vector<std::int64_t> positions_;
  RingAttention ring_attn_;
  std::unique_ptr<UlyssesHeads> heads_;
  Shape q_shape_;                    // of the last forward's q (what dout must match)
  DType q_dtype_ = DType::kFloat32;  // of the last forward's q (the gradients' dtype)
  UspCounters counters_;
};

}  // namespace seqpar
