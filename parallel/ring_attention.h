// Context-parallel (ring) attention for MHA / GQA over the ring group of the SP grid.
//
// Each rank holds q, k, v for the positions its layout gives (SequenceLayout::ring_shard_positions(ring_rank)) and
// gets exactly the rows of out, lse, dq, dk, dv that one rank computing the whole sequence would get.
//
// impl = p2p (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; online-softmax merge of
// FlashAttention-2): Q stays; the (K, V) block of rank src visits every rank, one hop per step over P steps; the
// next block's send/receive is posted before the current block is computed (double buffering). Block results are
// merged into fp32 (out, lse) with attn::lse_merge; blocks with no visible key are never computed.
// Backward: (K, V) travel again; each block's fp32 (dK, dV) accumulator follows it one step behind (a rank computes
// its contribution into a fresh buffer while the partial sum from upstream is in flight, then adds it), so that
// after P hops the sum of every rank's contribution arrives back at the block's owner. dQ accumulates locally in
// fp32, using the saved final lse.
//
// impl = allgather (Megatron-style CP): all-gather K, V once and run one kernel call over the whole sequence in
// global order; the backward all-gathers K, V again and reduce-scatters the fp32 dK, dV.
//
// Communication volume per rank (README): with kv = 2 * B * S_local * Hkv * D * sizeof(dtype) and
// dkv = 2 * B * S_local * Hkv * D * 4:
//   p2p:       forward sends (P-1) kv; backward sends (P-1) kv + P dkv   (received: the same)
//   allgather: forward sends (P-1) kv; backward sends (P-1) kv + (P-1) dkv
// Counters: attention FLOPs executed (4 B Hq D per visible (q, k) pair forward; 2.5x that backward), bytes sent and
// received, and exposed communication time (time blocked in Work::wait, i.e. not hidden behind computation).
//
// Synchronisation: forward() and backward() are collective over the ring communicator and host-synchronous.
// Memory: what backward needs (q, k, v, out in storage dtype; lse fp32) is kept in the saved_activation category;
// double buffers and travelling accumulators in comm_buffer; block results in workspace.
// Errors (before any communication, identical on every rank): layout divisibility, shape / dtype mismatch,
// Hq % Hkv != 0, window without causal, backward before forward.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/mha.h"
#include "parallel/layout.h"
#include "runtime/comm.h"

namespace seqpar {

enum class RingImpl : std::uint8_t { kP2P, kAllGather };
const char* ring_impl_name(RingImpl impl);  // "p2p", "allgather"
RingImpl parse_ring_impl(std::string_view name);

struct RingAttentionConfig {
  LayoutKind layout = LayoutKind::kZigzag;
  RingImpl impl = RingImpl::kP2P;
  bool causal = true;
  std::int64_t window = 0;  // > 0: sliding window (needs causal)
  float scale = 0.0f;       // <= 0: 1 / sqrt(D)
};

struct AttentionCounters {
  double flops = 0;  // attention FLOPs executed by this rank
  std::int64_t bytes_sent = 0;
  std::int64_t bytes_received = 0;
  double exposed_comm_s = 0;  // seconds blocked waiting for communication
  double compute_s = 0;       // seconds in attention kernels and merges
  void reset() { *this = {}; }
};

struct AttentionOutput {
  Tensor out;  // [B, S_local, Hq, D], dtype of q
  Tensor lse;  // [B, Hq, S_local] fp32
};

struct AttentionGrads {
  Tensor dq;  // [B, S_local, Hq, D], dtype of q
  Tensor dk;  // [B, S_local, Hkv, D]
  Tensor dv;  // [B, S_local, Hkv, D]
};

class RingAttention {
 public:
  // `ring` is the ring communicator (size P, rank = ring rank); `seq_len` the global sequence length of the
  // sequence whose ring shards the ranks hold. Validates the layout here (collective-free).
  RingAttention(Communicator& ring, std::int64_t seq_len, const RingAttentionConfig& config);

  // q [B, S_local, Hq, D], k, v [B, S_local, Hkv, D], S_local = seq_len / P. Saves what backward needs.
  AttentionOutput forward(const TensorView& q, const TensorView& k, const TensorView& v);
  // dout [B, S_local, Hq, D]; needs a preceding forward(). Gradients in the dtype of q.
  AttentionGrads backward(const TensorView& dout);

  // Lower-level entry points for composition (USP): results written to caller-owned tensors.
  void forward_into(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                    const TensorView& lse);
  void backward_into(const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv);

  const std::vector<std::int64_t>& positions() const { return positions_[rank_]; }
  const AttentionCounters& counters() const { return counters_; }
  void reset_counters() { counters_.reset(); }
  // Drops the saved activations.
  void release_saved();

 private:
  void validate(const TensorView& q, const TensorView& k, const TensorView& v) const;
  void forward_p2p(const TensorView& out, const TensorView& lse);
  void forward_allgather(const TensorView& out, const TensorView& lse);
  void backward_p2p(const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv);
  void backward_allgather(const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv);
  void wait(WorkHandle& work);  // counts the time blocked as exposed communication
  attn::MhaForwardArgs block_args(const TensorView& k, const TensorView& v, int src) const;

  Communicator& ring_;
  RingAttentionConfig config_;
  SequenceLayout layout_;
  int rank_, size_;
  std::vector<std::vector<std::int64_t>> positions_;  // positions of every ring rank
  std::vector<std::int64_t> global_order_;            // 0..S-1 (allgather: keys in global order)
  AttentionCounters counters_;
  // saved for backward
  Tensor saved_q_, saved_k_, saved_v_, saved_out_, saved_lse_;
  bool has_saved_ = false;
};

}  // namespace seqpar
