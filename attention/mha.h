// MHA / GQA / MQA flash attention on one device: forward with lse, backward, the LSE merge and attention sinks.
// Math: docs/design.md, "MHA on one device" (FlashAttention-2, Dao 2023); masks on global positions and packed
// documents: "MHA on packed rows"; soft-capping, ALiBi, sinks: "Score modifiers"; dropout: "Attention dropout";
// lse precision and merges: "Precision of lse and merges".
//
// Shapes: q, out, dout, dq [B, Sq, Hq, D]; k, v, dk, dv [B, Sk, Hkv, D]; lse, delta [B, Hq, Sq]; Hq % Hkv == 0.
// Contiguous, row-major host tensors. Storage dtypes fp32, bf16, fp16, fp64 (q, k, v share one); the accumulator
// dtype (accumulator_dtype()) is fp64 for fp64 storage, else fp32; lse and delta have it or fp64.
// Positions (q_pos, k_pos): non-decreasing global int64 positions; empty means 0, 1, 2, ...
// A row with no visible key gets lse = -inf, out = 0 and contributes nothing to any gradient.
// Synchronisation: host-synchronous (the stream is an ordering token on the CPU); bitwise reproducible for any
// thread count. Scratch comes from the memory ledger (workspace); a failed allocation raises "out of memory: ...".
// Errors: Error naming the tensor and the rule, before any work. Each argument struct's validate() raises exactly
// the kernel's errors, with no work, so that a context-parallel caller can check its local shapes before anything
// is sent.
// Devices: in a CUDA build, mha_forward, mha_backward, their validate(), lse_merge and mha_backward_delta take CUDA
// tensors (every tensor and the stream on one device) and run attention/cuda/mha_cuda.h (soft-capping, ALiBi, sinks
// and dropout on its exact fallback; dlse refused); mha_apply_sinks and mha_sinks_backward take device out / lse /
// delta / dsinks with host sinks (sinks_backward reads [B, H, S] back to the host). Without CUDA a CUDA tensor or
// stream fails with "MHA kernels have no CUDA implementation yet".
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dropout.h"
#include "../runtime/device.h"
#include "../runtime/tensor.h"

namespace seqpar::attn {

// The mask of one call, on global positions (docs/design.md, "MHA on packed rows").
struct MaskSpec {
  bool causal = false;
  std::int64_t window = 0;  // > 0: sliding window (requires causal); 0: none
  // Per query: the key positions [doc_lo[i], doc_hi[i]) of its document (SequenceLayout::doc_bounds); both empty: no
  // document bound. Views the caller keeps alive for the call.
  std::span<const std::int64_t> doc_lo, doc_hi;

  MaskSpec() = default;
  // {causal, window}, or all four (no missing-initializer warnings).
  MaskSpec(bool causal_, std::int64_t window_ = 0, std::span<const std::int64_t> doc_lo_ = {},
           std::span<const std::int64_t> doc_hi_ = {})
      : causal(causal_), window(window_), doc_lo(doc_lo_), doc_hi(doc_hi_) {}
};

// Score modifiers of one call (docs/design.md, "Score modifiers"). Heads are those of the call's q (under Ulysses,
// a slice).
struct ScoreMods {
  double softcap = 0.0;     // > 0: a <- softcap * tanh(a / softcap); 0: off (< 0 or non-finite: error)
  TensorView alibi_slopes;  // empty, or [Hq] fp32 / fp64 finite host: bias -slope_h |q_pos - k_pos|
  TensorView sinks;         // empty, or [Hq] fp32 / fp64 finite host: learned sink logit per query head
};

// ALiBi slopes of Press et al. 2022 (reference code, get_slopes; docs/design.md, "Score modifiers").
// Returns: [num_heads] slopes: for H a power of two, slope_h = 2^(-8 (h+1) / H); otherwise the slopes of the
//   largest power of two n < H followed by every other slope of 2n, H in all.
// Errors: num_heads < 1.
// Sync: host-only.
std::vector<float> alibi_slopes(std::int64_t num_heads);

// The inputs of mha_forward.
struct MhaForwardArgs {
  TensorView q;                         // [B, Sq, Hq, D]
  TensorView k;                         // [B, Sk, Hkv, D]
  TensorView v;                         // [B, Sk, Hkv, D]
  std::span<const std::int64_t> q_pos = {};  // [Sq] global positions (empty: 0..Sq-1)
  std::span<const std::int64_t> k_pos = {};  // [Sk] global positions (empty: 0..Sk-1)
  MaskSpec mask{};
  double scale = 0.0;  // <= 0: 1 / sqrt(D)
  ScoreMods mods{};    // soft-capping, ALiBi, sinks (off by default)
  // Dropout on the probabilities (attention/dropout.h); p = 0 (the default) is off. The mask is keyed by the
  // global query head head_offset + h (a Ulysses rank holding heads [u Hq, (u+1) Hq) passes u Hq) and the global
  // positions q_pos / k_pos, so every caller that sees a pair regenerates the same keep decision.
  DropoutSpec dropout{};
  std::int64_t head_offset = 0;  // >= 0; read only when dropout.p > 0
  // [Sq] the token index of each query in the unpadded row, or -1 for a padding row (SequenceLayout::tokens_of_slots
  // of q_pos); empty: tokens = positions. Dropout keys its mask on tokens, so that a padded layout drops the pairs of
  // the unpadded row: query i is token q_tokens[i] and a key it sees, in its own document, token
  // k_pos[j] + q_tokens[i] - q_pos[i] (inside a document a slot difference is a token distance). Read only when
  // dropout.p > 0; every other rule reads position differences, which slots and tokens share.
  std::span<const std::int64_t> q_tokens{};
  // [Sq] / [Sk] or empty: the global positions ALiBi and dropout read instead of q_pos / k_pos, which then place
  // the mask alone. The lowered test mode (attention/lowering.h) runs each rectangle with local mask positions and
  // passes the rectangle's global ones here; empty (the default): q_pos / k_pos. Same rules as q_pos / k_pos.
  std::span<const std::int64_t> mod_q_pos{}, mod_k_pos{};

  // The rules of mha_forward on these fields alone (no outputs), no work. A context-parallel caller runs it on
  // its local shapes before anything is sent.
  // Errors: mha_forward's, on shapes, dtypes, devices, Hq % Hkv, positions, mask, scale, mods and dropout.
  // Sync: host-only.
  void validate() const;

  // Every check mha_forward makes on (this, out, lse, stream), no work.
  // Errors: mha_forward's.
  // Sync: host-only.
  void validate(const TensorView& out, const TensorView& lse, Stream stream = Stream::cpu()) const;
};

// Forward with lse (docs/design.md, "MHA on one device"; sinks: "Score modifiers").
// Args: q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D] (one floating dtype, Hq % Hkv == 0, D > 0); positions of sizes
//   Sq / Sk (or empty); mask: window >= 0, window > 0 requires causal; scale <= 0: 1/sqrt(D), computed in double;
//   out [B, Sq, Hq, D] any floating dtype (the ring passes the accumulator dtype); lse [B, Hq, Sq] of the
//   accumulator dtype or fp64.
// Returns: out and lse, both overwritten; lse natural log, -inf for rows with no visible key; Sk = 0 gives out = 0,
//   lse = -inf. With mods.sinks, lse is lse_total and out is scaled by exp(lse - lse_total) (a row with no visible
//   key: lse = sink_h, out = 0).
// Errors: a non-4-d q / k, shape / dtype mismatches, Hq % Hkv != 0, wrong position counts, decreasing positions,
//   window < 0 or a window without causal, doc_lo / doc_hi not both empty or both of size Sq, a non-CPU tensor or
//   stream; mods: softcap < 0 or non-finite, slopes / sinks not [Hq] fp32 / fp64 or not finite; dropout p not a
//   finite number in [0, 1), and with p > 0 a negative head_offset, positions outside [0, 2^32) or B,
//   head_offset + Hq over 2^32; "out of memory: ..." for scratch.
// Sync: host-synchronous (stream: an ordering token on the CPU); bitwise reproducible for any thread count.
void mha_forward(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse,
                 Stream stream = Stream::cpu());

// The inputs of mha_backward.
struct MhaBackwardArgs {
  MhaForwardArgs fwd;  // q, k, v, positions, mask, scale, mods, dropout, head_offset as in the forward (sinks are
                       // not read: see lse)
  // [B, Sq, Hq, D] the final (merged) output, any floating dtype. The CUDA path may recompute delta from out and
  // dout whenever out is given (cuDNN's backward does): pass out only when delta is empty or rowsum(dout * out).
  TensorView out;
  TensorView dout;     // [B, Sq, Hq, D] any floating dtype
  TensorView lse;      // [B, Hq, Sq] the final lse (with sinks: lse_total), accumulator dtype or fp64
  TensorView delta{};  // optional [B, Hq, Sq] rowsum(dout * out), accumulator dtype or fp64; computed when empty
  // optional [B, Hq, Sq] fp32 / fp64: the gradient of the loss with respect to lse (flash-attention's dlse); the
  // kernels run with delta - dlse (with sinks, dsinks takes the same delta - dlse); docs/design.md, "MHA on one
  // device". Empty: lse carries no gradient.
  TensorView dlse{};

  // Every check mha_backward makes on (this, dq, dk, dv, accumulate, stream), no work.
  // Errors: mha_backward's.
  // Sync: host-only.
  void validate(const TensorView& dq, const TensorView& dk, const TensorView& dv, bool accumulate,
                Stream stream = Stream::cpu()) const;
};

// Backward of one call (or one key block of a ring) with the final out / lse (docs/design.md, "MHA on one device").
// Args: args.out is read only when args.delta is empty (delta is then computed from out and dout as by
//   mha_backward_delta); dq [B, Sq, Hq, D], dk / dv [B, Sk, Hkv, D]; accumulate = false: dq, dk, dv (any floating
//   dtype) are overwritten; accumulate = true: dq, dk, dv must have the accumulator dtype and the block's
//   contributions are added to them (the sum of a call per key block equals one call over all keys, up to
//   rounding of that dtype).
// Returns: dq, dk, dv. Rows with lse = -inf contribute nothing.
// Errors: as for mha_forward, plus shape / dtype mismatches of dout, lse, delta, out and the gradients, and
//   gradients of another dtype than the accumulator dtype with accumulate = true.
// Sync: host-synchronous (stream: an ordering token on the CPU).
void mha_backward(const MhaBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                  bool accumulate, Stream stream = Stream::cpu());

// delta = rowsum(dout * out) per (b, h, i): FlashAttention-2 (Dao 2023), the row term D_i of Algorithm 2
// (docs/design.md, "MHA on one device").
// Args: out, dout [B, S, H, D] any floating dtypes (same shape); delta [B, H, S] fp32 or fp64 (fp64 when out or
//   dout is fp64).
// Returns: delta, overwritten; summed in fp64 when out, dout or delta is fp64 and in fp32 otherwise.
// Errors: shape / dtype mismatches, non-CPU tensors.
// Sync: host-synchronous.
void mha_backward_delta(const TensorView& out, const TensorView& dout, const TensorView& delta,
                        Stream stream = Stream::cpu());

// Merges a block result into a running one, in place, over disjoint key sets (the formula: docs/design.md, "MHA on
// one device"; its precision: docs/design.md, "Precision of lse and merges"). Computed in fp64 (no inf - inf, no
// cancellation) and rounded once into out and lse. An lse rounded to fp32 becomes a relative error of the merged
// out; a merge that adds no error beyond one online-softmax pass keeps the running lse and the blocks' lse in fp64
// (mha_forward writes an fp64 lse on request) and out in the accumulator dtype; the ring (parallel/) does.
// Args: out [B, S, H, D], out_b the same shape: fp32 or fp64 each; lse, lse_b [B, H, S]: fp32 or fp64 each.
// Returns: out and lse, merged. Exact when either side is -inf (that side contributes nothing, even if its out
//   holds garbage). Both sides -inf: lse = -inf, out = 0.
// Errors: dtypes other than fp32 / fp64, shape mismatches, non-CPU tensors.
// Sync: host-synchronous.
void lse_merge(const TensorView& out, const TensorView& lse, const TensorView& out_b, const TensorView& lse_b,
               Stream stream = Stream::cpu());

// Sinks on a finished (merged) result, in place, in fp64 (docs/design.md, "Score modifiers"). Call it once per
// row (after every key block is merged).
// Args: out [B, S, H, D] fp32 / fp64; lse [B, H, S] fp32 / fp64; sinks [H] fp32 / fp64 finite.
// Returns: out rescaled; lse = lse_total.
// Errors: shapes, dtypes, non-finite sinks, non-CPU.
// Sync: host-synchronous.
void mha_apply_sinks(const TensorView& out, const TensorView& lse, const TensorView& sinks,
                     Stream stream = Stream::cpu());

// The inputs of mha_sinks_backward.
struct MhaSinksBackwardArgs {
  TensorView delta;  // [B, H, S] rowsum(dO * O) of the final out (mha_backward_delta), fp32 / fp64
  TensorView lse;    // [B, H, S] the final lse_total, fp32 / fp64
  TensorView sinks;  // [H] fp32 / fp64 finite

  // Every check mha_sinks_backward makes on (this, dsinks, stream), no work.
  // Errors: mha_sinks_backward's.
  // Sync: host-only.
  void validate(const TensorView& dsinks, Stream stream = Stream::cpu()) const;
};

// Gradient of the sinks over the rows given (docs/design.md, "Score modifiers"), summed in fp64 in (b, i) order.
// Args: dsinks [H] fp32 / fp64.
// Returns: dsinks, overwritten. Rows with lse = -inf add 0.
// Errors: shapes, dtypes, non-CPU.
// Sync: host-synchronous; under context parallelism each rank sums its rows and the caller all-reduces.
void mha_sinks_backward(const MhaSinksBackwardArgs& args, const TensorView& dsinks, Stream stream = Stream::cpu());

// Number of (query, key) pairs visible under `mask` between the position sets: the work a forward call does,
// used for FLOP counters (forward FLOPs = 4 * B * Hq * D * visible_pairs).
// Args: unlike the kernels, the positions are taken as given: an empty span means no queries (keys);
//   mask.doc_lo / doc_hi, when given, have q_pos.size() entries.
// Returns: the pair count.
// Errors: decreasing positions, an invalid mask.
// Sync: host-only.
std::int64_t visible_pairs(std::span<const std::int64_t> q_pos, std::span<const std::int64_t> k_pos,
                           const MaskSpec& mask);

}  // namespace seqpar::attn
