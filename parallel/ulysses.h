// The Ulysses exchange (Jacobs et al. 2023, "DeepSpeed Ulysses"), written once for every CP layer (MHA / USP, DSA,
// GDN): all-to-alls over the Ulysses group between the sequence-sharded and the head-sharded layouts.
//
// Over Pu ranks, the sequence-sharded [B, S_local, H, D] becomes the head-sharded [B, Pu * S_local, H / Pu, D]:
// rank u keeps heads [u H/Pu, (u+1) H/Pu) and receives the pieces of every rank of its Ulysses group, concatenated
// in Ulysses-rank order, which is exactly the ring shard of SequenceLayout. The inverse all-to-all restores the
// sequence-sharded layout.
//
// GQA (UlyssesHeads): Hq % Pu == 0 is required. When Hkv % Pu == 0 the KV heads are split like the query heads.
// When Hkv < Pu and Pu % Hkv == 0, KV head h is replicated to the Pu / Hkv ranks whose query heads use it, and in
// the backward the gradients of the replicas are summed (in fp32, or fp64 for fp64 gradients) back into the one
// true dK / dV. GDN uses the same plan with its value heads as Hq and its key heads (q and k) as Hkv. Any other Hkv is
// an error naming Hq, Hkv and Pu. The head partition depends only on (Hq, Hkv, Pu).
// Communication volume per rank (docs/design.md, "MHA communication volume"): each all-to-all of a tensor of N bytes sends and receives
// (Pu - 1) / Pu * N.
// Synchronisation: every call is collective over the Ulysses communicator and host-synchronous.
#pragma once

#include <cstdint>

#include "cp_common.h"
#include "../runtime/comm.h"
#include "../runtime/tensor.h"

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
void ulysses_scatter_heads(Communicator& ulysses, const TensorView& in, const TensorView& out,
                           Stream stream = Stream::cpu());
// [B, Pu * S_local, H / Pu, D] -> [B, S_local, H, D], the exact inverse.
void ulysses_gather_heads(Communicator& ulysses, const TensorView& in, const TensorView& out,
                          Stream stream = Stream::cpu());
// lse [B, H / Pu, Pu * S_local] -> [B, H, S_local] (the inverse all-to-all for [B, H, S] statistics).
void ulysses_gather_heads_bhs(Communicator& ulysses, const TensorView& in, const TensorView& out,
                              Stream stream = Stream::cpu());

// KV replication for Hkv < Pu: [B, S, Hkv, D] -> [B, S, Hkv * r, D] with expanded head e = copy of head e / r;
// and the sum of replica gradients back: [B, S, Hkv * r, D] (fp32 or fp64, the dtype of the sum) -> [B, S, Hkv, D]
// (any floating output dtype).
void replicate_kv_heads(const TensorView& in, std::int64_t replication, const TensorView& out,
                        Stream stream = Stream::cpu());
void reduce_kv_replicas(const TensorView& in, std::int64_t replication, const TensorView& out,
                        Stream stream = Stream::cpu());

// The exchanges a CP layer makes over its Ulysses group, each adding its bytes to counters.a2a_bytes_* and its
// seconds to counters.a2a_s (nothing is counted for a group of one, where every exchange is a local copy).
// Tensors of rank 3 ([B, S, H], per-head scalars) are exchanged like [B, S, H, 1].
class UlyssesExchange {
 public:
  UlyssesExchange(const CpGroups& groups, CpCounters& counters);

  // [B, S_local, H, *] -> [B, Pu S_local, H / Pu, *] (x's dtype), allocated in `category`.
  Tensor to_heads(const TensorView& x, MemCategory category = MemCategory::kWorkspace) const;
  // [B, Pu S_local, H / Pu, *] -> out [B, S_local, H, *] (same dtype).
  void to_sequence(const TensorView& x_h, const TensorView& out) const;
  // lse [B, H / Pu, Pu S_local] -> out [B, H, S_local].
  void lse_to_sequence(const TensorView& lse_h, const TensorView& lse) const;
  // k or v [B, S_local, Hkv, D] -> [B, Pu S_local, hkv_expanded / Pu, D], replicated first when Hkv < Pu;
  // allocated in `category`.
  Tensor kv_to_heads(const TensorView& kv, const UlyssesHeads& heads,
                     MemCategory category = MemCategory::kWorkspace) const;
  // The dK or dV of the head-sharded kv (fp32 or fp64 when replicated) -> out [B, S_local, Hkv, D], replicas summed
  // in that dtype.
  void kv_grad_to_sequence(const TensorView& dkv_h, const UlyssesHeads& heads, const TensorView& out) const;
  // All-gather of a [B, S_local, ...] piece into the ring shard [B, Pu S_local, ...] (Ulysses-rank order).
  Tensor gather_pieces(const TensorView& local, MemCategory category) const;
  // The adjoint: fp32 [B, Pu S_local, ...] partial sums on every rank -> out, the sum of this rank's piece.
  void reduce_scatter_pieces(const TensorView& ring_shard, const TensorView& out) const;
  // All-gather of [B, H / Pu, ...] head blocks into the full [B, H, ...] (Ulysses-rank order of heads).
  Tensor gather_heads_dim1(const TensorView& local) const;
  // Heads [u H/Pu, (u+1) H/Pu) of a full [B, H, ...] tensor, u = this rank (local copy, no communication).
  Tensor my_heads_dim1(const TensorView& full) const;

  int size() const { return ulysses_.size(); }

 private:
  // Runs `fn`, counting the Ulysses group's bytes and the seconds into the counters.
  template <typename Fn>
  void counted(Fn&& fn) const;

  Communicator& ulysses_;
  Stream stream_;
  CpCounters& counters_;
};

}  // namespace seqpar
