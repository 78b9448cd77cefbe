// Context-parallel (ring) attention for MHA / GQA over the ring group of the SP grid.
//
// Each rank holds q, k, v for the positions its layout gives (SequenceLayout::ring_shard_positions(ring_rank)) and
// gets exactly the rows of out, lse, dq, dk, dv that one rank computing the whole sequence would get.
// Packed and padded rows (docs/design.md section 15.3): positions are slots; each local query sees only the keys of
// its own document (attn::MaskSpec doc_lo / doc_hi from SequenceLayout::doc_bounds_of_slots), so the result of
// document d is that of d run alone; padding rows give out 0, lse -inf and gradients 0. A (K, V) block that shares
// no document with the local queries has no visible pair and is never computed (it still travels on). Packed
// layouts take B = 1.
//
// impl = p2p (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; online-softmax merge of
// FlashAttention-2): Q stays; the (K, V) block of rank src visits every rank, one hop per step over P steps; the
// next block's send/receive is posted before the current block is computed (double buffering). Block results are
// merged with attn::lse_merge into a running out of the accumulator dtype (accumulator_dtype: fp32, fp64 for
// fp64 storage) and a running lse in fp64, each block's lse also in fp64: the merge adds no error beyond one
// online-softmax pass over the same keys (an fp32 lse between steps would: its rounding, |lse| 2^-24, becomes a
// relative error of the merge weights, 1e-4 at logits of 1800). lse is rounded to its returned dtype once, at the
// end. Blocks with no visible key are never computed.
// Backward: (K, V) travel again; each block's (dK, dV) accumulator (accumulator dtype) follows it one step behind (a
// rank computes its contribution into a fresh buffer while the partial sum from upstream is in flight, then adds
// it), so that after P hops the sum of every rank's contribution arrives back at the block's owner. dQ accumulates
// locally in the accumulator dtype, using the saved final lse.
//
// impl = allgather (Megatron-style CP): all-gather K, V once and run one kernel call over the whole sequence in
// global order; the backward all-gathers K, V again and reduce-scatters dK, dV in the accumulator dtype.
//
// Sliding window (window W > 0, p2p): only the key rows some local query can see travel, directly from owner to user
// (WindowPlan, window_exchange in parallel/ring_pass.h, which states the schedule and its deadlock argument); the
// backward returns the (dK, dV) rows of each received block straight to its owner. Blocks no local query sees are
// neither sent, received nor computed; the all-gather implementation keeps its full traffic (a user choosing it asks
// for the whole K / V).
//
// Communication volume per rank (README): with kv = 2 * B * S_local * Hkv * D * sizeof(dtype) and
// dkv = 2 * B * S_local * Hkv * D * sizeof(accumulator dtype) (4; 8 for fp64):
//   p2p:       forward sends (P-1) kv; backward sends (P-1) kv + P dkv   (received: the same)
//   allgather: forward sends (P-1) kv; backward sends (P-1) kv + (P-1) dkv
//   p2p with window W: forward sends out_rows * kv_row; backward out_rows * kv_row + in_rows * dkv_row (received:
//     in_rows * kv_row, then in_rows * kv_row + out_rows * dkv_row), kv_row = kv / S_local, dkv_row = dkv / S_local,
//     out_rows = sum over dst != r of rows(dst, r), in_rows = sum over src != r of rows(r, src), where, with the layout
//     cut into chunks of c tokens (contiguous: c = S_local, chunk i on rank i; zigzag: c = S_local / 2, chunk i on
//     rank min(i, 2P-1-i); stripe: c = 1, token t on rank t mod P):
//       rows(dst, src) = sum over chunks b of src of clamp(W - 1 - (a - b - 1) c, 0, c),
//     a the first chunk after b owned by dst (no term when none). E.g. contiguous: rows(r+e, r) = clamp(W - 1 -
//     (e-1) S_local, 0, S_local); stripe (S_local >= 2): rows(dst, src) = [((dst - src) mod P) < W] (S_local, minus 1
//     when dst < src); zigzag with W <= S_local / 2: W - 1 rows to each ring neighbour that holds a later chunk.
// Message rounds (CpCounters::message_rounds, per call): P - 1 forward and P backward (P > 1) around the full ring;
// with a window the ring distances d with any rows(r + d, r) > 0 over the group, forward and backward alike.
// Counters (CpCounters): attention FLOPs executed (4 B Hq D per visible (q, k) pair forward; 2.5x that backward),
// ring bytes sent and received, exposed communication time (blocked in Work::wait, not hidden behind computation)
// and kernel time.
//
// Groups and layout: the layout must be built for the groups (SequenceLayout::for_groups). RingAttention runs over
// groups.ring on ring shards (seq_len / ring_size tokens, at layout.ring_shard_positions(ring_rank)): use it alone
// with ulysses_size = 1, or through UspAttention (parallel/usp.h), which runs the Ulysses exchange around it.
// Synchronisation: forward() and backward() are collective over the ring communicator and host-synchronous; kernels
// run on groups.stream.
// Memory: what backward needs (q, k, v, out in storage dtype; lse in the accumulator dtype) is owned by the
// returned context, in the saved_activation category; double buffers and travelling accumulators in comm_buffer;
// block results and the returned outputs in workspace. The object keeps no state between calls (cp_common.h).
// Errors (before any communication, identical on every rank): layout not built for the groups, shape / dtype
// mismatch, B != 1 with a packed layout, Hq % Hkv != 0, window without causal, non-finite scale, dropout p outside [0,
// 1) (constructor); a context that is empty, already used or made by another object; ranks of the ring group that
// disagree on the shapes or dtypes of q, k, v (backward: of the saved q, k, v and of dout) or on impl, causal, window,
// scale, the score modifiers, dropout or the layout, cu_seqlens included (AgreementCheck, parallel/cp_common.h: one
// all-reduce over the ring group on the first call of each configuration, before any data moves).
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

struct RingAttentionConfig {
  RingImpl impl = RingImpl::kP2P;
  bool causal = true;
  std::int64_t window = 0;  // > 0: sliding window (needs causal)
  float scale = 0.0f;       // <= 0: 1 / sqrt(D)
  // Soft-capping, ALiBi slopes and sinks ([Hq] of all query heads; views the caller keeps alive, e.g. the learned
  // sinks parameter). Under Ulysses / USP each rank uses the entries of its heads. A sink is counted once per row:
  // p2p applies it after the last block is merged (attn::mha_apply_sinks), all-gather in its one kernel call; the
  // backward uses the final lse with the sink, and dsinks (AttentionGrads) is summed over the local rows and
  // all-reduced over the ring group (and gathered over the Ulysses group by USP).
  attn::ScoreMods score_mods{};
  // Dropout on the attention probabilities (attention/dropout.h): p in [0, 1), 0 = off. The mask is keyed by the
  // global query head and global positions, so every grid and layout drops the same pairs as one rank.
  attn::DropoutSpec dropout{};
};

struct AttentionOutput {
  Tensor out;     // [B, S_local, Hq, D], dtype of q
  Tensor lse;     // [B, Hq, S_local], accumulator_dtype(dtype of q): fp32, fp64 for fp64
  CpContext ctx;  // what the backward needs; hand it to backward() of the object that made it
};

struct AttentionGrads {
  Tensor dq;      // [B, S_local, Hq, D], dtype of q
  Tensor dk;      // [B, S_local, Hkv, D]
  Tensor dv;      // [B, S_local, Hkv, D]
  Tensor dsinks;  // [Hq] of all query heads, identical on every rank (sum over the whole sequence), dtype of the
                  // sinks; empty when config.score_mods has no sinks
};

// The fields of an MHA forward (RingAttention, UspAttention) for the ranks' agreement check (AgreementCheck,
// parallel/cp_common.h): `call`, the configuration (impl, causal, window, scale), the layout, q, k and v.
Fingerprint mha_forward_fingerprint(std::string_view call, const RingAttentionConfig& config,
                                    const SequenceLayout& layout, const TensorView& q, const TensorView& k,
                                    const TensorView& v);

class RingAttention {
 public:
  // Validates the configuration and the layout against the groups here (collective-free).
  RingAttention(const CpGroups& groups, const SequenceLayout& layout, const RingAttentionConfig& config);

  // q [B, S_ring, Hq, D], k, v [B, S_ring, Hkv, D], S_ring = seq_len / ring_size, at positions().
  AttentionOutput forward(const TensorView& q, const TensorView& k, const TensorView& v);
  // dout [B, S_ring, Hq, D] with the context of a forward of this object (consumed and freed). Gradients in the
  // dtype of q.
  AttentionGrads backward(CpContext&& ctx, const TensorView& dout);

  // Lower-level entry points for composition: results written to caller-owned tensors (with the same agreement
  // check as forward() / backward()). head_offset: the global index of q's head 0 (USP passes ulysses_rank *
  // Hq_local), the head of the dropout key; kept in the context for the backward.
  CpContext forward_into(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                         const TensorView& lse, std::int64_t head_offset = 0);
  // dsinks: [Hq of q] (fp32 / fp64) when the configuration has sinks, else empty; all-reduced over the ring group.
  void backward_into(CpContext&& ctx, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                     const TensorView& dv, const TensorView& dsinks = {});

  const SequenceLayout& layout() const { return layout_; }
  const std::vector<std::int64_t>& positions() const { return positions_[rank_]; }
  const CpCounters& counters() const { return counters_; }
  void reset_counters() { counters_.reset(); }
  // The agreement checks of forward (forward_into) and backward (backward_into): how often each ran or was cached.
  const AgreementCheck& forward_agreement() const { return forward_agreement_; }
  const AgreementCheck& backward_agreement() const { return backward_agreement_; }

 private:
  friend class UspAttention;  // runs the unchecked bodies after its own check over the SP group
  struct Saved;
  // The agreement checks over the ring group (fingerprints of the call).
  void agree_forward(const TensorView& q, const TensorView& k, const TensorView& v);
  void agree_backward(const CpContext& ctx, const TensorView& dout);
  CpContext run_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& lse, std::int64_t head_offset);
  void run_backward(CpContext&& ctx, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                    const TensorView& dv, const TensorView& dsinks);
  // Every check of forward's inputs, the MHA kernels' own on the local shapes included; returns their device.
  Device validate(const TensorView& q, const TensorView& k, const TensorView& v, std::int64_t head_offset) const;
  // Buffers of a call on the device of the saved tensors, ordered on the groups' stream.
  DeviceAlloc alloc_for(const Saved& s) const;
  void forward_p2p(const Saved& s, const TensorView& out, const TensorView& lse);
  void forward_allgather(const Saved& s, const TensorView& out, const TensorView& lse);
  // delta = rowsum(dout * out) of the local rows.
  void backward_p2p(const Saved& s, const TensorView& dout, const TensorView& delta, const TensorView& dq,
                    const TensorView& dk, const TensorView& dv);
  void backward_allgather(const Saved& s, const TensorView& dout, const TensorView& delta, const TensorView& dq,
                          const TensorView& dk, const TensorView& dv);
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
  RingAttentionConfig config_;
  LayerId id_;
  int rank_, size_;
  std::vector<std::vector<std::int64_t>> positions_;  // ring shard positions of every ring rank
  std::vector<std::int64_t> global_order_;            // 0..S-1 (allgather: keys in global order)
  std::optional<WindowPlan> plan_;                    // p2p with a window: the rows each pair exchanges
  DocBounds doc_;  // packed or padded rows: each local query's document slots (empty: no document bound)
  CpCounters counters_;
  AgreementCheck forward_agreement_, backward_agreement_;
};

}  // namespace seqpar
