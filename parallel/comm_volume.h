// Closed-form bytes each rank of MhaCp sends per call (docs/design.md, "MHA communication volume"): one definition
// for the tests that check them against the communicators' counters and for sp_plan, which predicts with them.
// Host-only arithmetic, no communication.
#pragma once

#include <cstdint>

#include "cp_common.h"

namespace seqpar {

// The shape of one MhaCp call: rows are slots of the layout (padding included: padded_len()).
struct MhaVolumeShape {
  std::int64_t batch = 1;
  std::int64_t padded_len = 0;  // slots of the whole row, S (SequenceLayout::padded_len())
  std::int64_t heads = 0, kv_heads = 0, head_dim = 0;
  std::int64_t storage_bytes = 4;  // element size of q, k, v, out (dtype_size)
  std::int64_t accum_bytes = 4;    // the accumulators' element size: 4, 8 for fp64 inputs
  int ring_size = 1, ulysses_size = 1;
  RingImpl impl = RingImpl::kP2P;
};

// Bytes one rank sends in one forward and one backward call: over the ring group (CpCounters::bytes_sent) and over
// the Ulysses group (CpCounters::a2a_bytes_sent). Without a sliding window (the windowed ring sends only visible
// rows: parallel/ring_pass.h WindowPlan). Received bytes are the same.
struct MhaVolume {
  std::int64_t ring_forward = 0, ring_backward = 0;
  std::int64_t a2a_forward = 0, a2a_backward = 0;
  std::int64_t forward() const { return ring_forward + a2a_forward; }
  std::int64_t backward() const { return ring_backward + a2a_backward; }
};

// KV heads after the Ulysses split's replication: Hkv, or Pu when Hkv < Pu (each KV head copied to the Pu / Hkv
// ranks whose query heads use it).
inline std::int64_t ulysses_kv_heads(std::int64_t kv_heads, int ulysses_size) {
  return kv_heads % ulysses_size == 0 ? kv_heads : ulysses_size;
}

// Ring (P ranks, S_ring = S / P, H / Pu heads): kv = 2 B S_ring (Hkv_e / Pu) D e, dkv the same in the accumulator
// dtype; p2p: forward (P-1) kv, backward (P-1) kv + P dkv (P > 1); all-gather: forward (P-1) kv, backward
// (P-1) (kv + dkv). Ulysses (Pu ranks, S_local = S / (Pu P)): each all-to-all of N bytes sends (Pu-1)/Pu N;
// forward q, k, v in and out, lse back; backward dout in and dq, dk, dv back (dk, dv in the accumulator dtype when
// the KV heads were replicated).
inline MhaVolume mha_volume(const MhaVolumeShape& s) {
  const std::int64_t P = s.ring_size, pu = s.ulysses_size;
  const std::int64_t hkv_e = ulysses_kv_heads(s.kv_heads, s.ulysses_size);
  const std::int64_t s_ring = s.padded_len / P, s_local = s_ring / pu;
  const std::int64_t kv_elems = 2 * s.batch * s_ring * (hkv_e / pu) * s.head_dim;
  const std::int64_t kv = kv_elems * s.storage_bytes, dkv = kv_elems * s.accum_bytes;
  MhaVolume v;
  v.ring_forward = (P - 1) * kv;
  v.ring_backward = s.impl == RingImpl::kP2P ? (P - 1) * kv + (P > 1 ? P : 0) * dkv : (P - 1) * (kv + dkv);
  const std::int64_t q = s.batch * s_local * s.heads * s.head_dim * s.storage_bytes;
  const std::int64_t k1 = s.batch * s_local * hkv_e * s.head_dim;  // one of k, v (elements)
  const std::int64_t kv_grad_bytes = s.kv_heads % pu == 0 ? s.storage_bytes : s.accum_bytes;
  const std::int64_t lse = s.batch * s.heads * s_local * s.accum_bytes;
  v.a2a_forward = (2 * q + 2 * k1 * s.storage_bytes + lse) * (pu - 1) / pu;
  v.a2a_backward = (2 * q + 2 * k1 * kv_grad_bytes) * (pu - 1) / pu;
  return v;
}

}  // namespace seqpar
