// MHA / GQA / MQA flash attention on one device: forward with lse, backward, and the LSE merge.
//
// Math (docs/design.md section 8.1; FlashAttention-2, Dao 2023): for batch b, query head h, kv head h / (Hq / Hkv),
//   a_ij = scale * q_i . k_j            for visible keys j
//   lse_i = log sum_j exp(a_ij)         (natural log)
//   o_i   = sum_j exp(a_ij - lse_i) v_j
// Backward with the final lse and delta_i = dO_i . O_i:
//   p_ij = exp(a_ij - lse_i), dV_j += p_ij dO_i, ds_ij = p_ij (dO_i . v_j - delta_i),
//   dQ_i += scale ds_ij k_j, dK_j += scale ds_ij q_i.
// Because blocks of keys can be processed in any order with the final lse, a ring calls mha_backward once per key
// block, accumulating into dq / dk / dv of the accumulator dtype.
//
// Masks are on global positions (q_pos, k_pos: any non-decreasing int64 sequences, as produced by every layout's
// slots, parallel/layout.h; empty = 0, 1, 2, ...):
//   causal: key j visible to query i iff k_pos[j] <= q_pos[i]; window W > 0 adds q_pos[i] - k_pos[j] < W.
//   documents (packed rows, docs/design.md section 15.3; mask.doc_lo / doc_hi, [Sq] each, or both empty): key j is
//   visible to query i only if doc_lo[i] <= k_pos[j] < doc_hi[i], the slots of the query's own document (with or
//   without causal). The window then counts inside the document, from its own start. A query with doc_lo >= doc_hi
//   (a padding row) sees no key: out 0, lse -inf, no gradient.
// Because both sets are sorted, the keys visible to a query are one contiguous index range; the CPU kernels run
// tiles whose keys are all visible with no per-element mask test and skip tiles with no visible key.
// A query row with no visible key gets lse = -inf, out = 0 and contributes nothing to any gradient (no NaN).
// Dropout (args.dropout.p > 0; attention/dropout.h, FlashAttention with dropout): o_i = sum_j z_ij p_ij v_j with
// z_ij = keep_ij / (1 - p) from a counter-based generator on (seed, b, global head, q_pos, k_pos); lse stays the
// undropped one; backward dV_j += z_ij p_ij dO_i, ds_ij = p_ij (z_ij dO_i . v_j - delta_i) with delta of the dropped
// out. Nothing is stored between forward and backward: both regenerate the mask.
//
// Score modifiers (ScoreMods, all off by default), applied to every visible score before the softmax:
//   soft-capping (Gemma Team 2024, "Gemma 2", logit soft-capping): a_ij = cap * tanh(scale q_i . k_j / cap);
//     backward: ds_pre = ds * (1 - tanh^2) before the usual scale;
//   ALiBi (Press et al. 2022, "Train Short, Test Long"): a_ij += -slope_h * |q_pos[i] - k_pos[j]| on the global
//     positions (causal: q_pos - k_pos); slopes per query head, e.g. alibi_slopes(Hq) (the paper's geometric rule);
//   attention sinks (gpt-oss, OpenAI 2025; Xiao et al. 2023, "StreamingLLM"): a learned logit sink_h joins every
//     row's softmax denominator without a value: lse_total = logaddexp(lse, sink_h), out = exp(lse - lse_total) out.
//     The backward takes lse_total and the final out (delta = dO . O): dq, dk, dv need nothing else (the sink is a
//     key with a zero value), and dsinks_h = -sum_rows exp(sink_h - lse_total) delta (mha_sinks_backward).
//   A sink is applied once per row: a ring that merges key blocks leaves sinks out of the blocks and calls
//   mha_apply_sinks once on the merged result.
//
// Layouts: q, out, dout, dq [B, Sq, Hq, D]; k, v, dk, dv [B, Sk, Hkv, D]; lse, delta [B, Hq, Sq].
// All contiguous, row-major, host memory (the CUDA path lands with its own issue).
// Storage dtypes fp32, bf16, fp16, fp64; q, k, v share one dtype. The accumulator dtype (accumulator_dtype()) is
// fp64 for fp64 storage and fp32 otherwise: every score, running max / sum, output accumulator, lse, delta and
// recomputed probability is computed in it, and lse, delta and accumulate = true gradients are stored in it. An
// lse or delta may also be fp64 for 16-/32-bit storage (a merge keeps its running lse in fp64, see lse_merge);
// they are never narrower than the accumulator dtype.
// Synchronisation: host-synchronous (the stream argument is an ordering token on the CPU).
// Determinism: the same inputs give bitwise the same results, for any thread count (fixed reduction orders, no
// atomics; the CPU kernels' OpenMP work items each own their outputs).
// Extra memory: O(Sq + Sk) per (batch, head) worker plus fixed-size tiles; no [Sq, Sk] matrix. The forward converts
// K and V once per call (B Sk Hkv D elements each, compute dtype); the backward keeps a dK / dV partial per query
// head (2 B Hq Sk D elements, compute dtype) that is summed over each KV group in head order.
// Parallelism (CPU, OpenMP): forward over (batch, query head, query tile of 64); backward over (batch, query head).
// Accuracy: fp64 storage gives fp64 results (lse, delta and the recomputed P in fp64): out, lse, dq, dk, dv agree
// with the fp64 reference (attention/reference) to about 1e-13 relative at logits up to 1e4. For 32-/16-bit
// storage a stored fp32 lse is rounded to |lse| 2^-24 absolute, which the backward's recomputed P inherits as a
// relative error; pass an fp64 lse to avoid it.
// Errors: Error naming the tensor and the rule for any shape, dtype or position mismatch, raised before any work.
// Tensors must be host tensors and the stream a CPU stream: a CUDA one fails with "MHA kernels have no CUDA
// implementation yet". Per-thread scratch comes from the memory ledger (workspace) before any parallel region; a
// failed allocation raises Error "out of memory: ..." naming the bytes asked for and the ledger's totals.
// Argument checks on their own: every kernel f below has a check_f with the same parameters that raises exactly the
// Error f would raise for them, and does no work, so that a context-parallel caller can validate its local shapes
// before anything is sent and every rank fails together.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dropout.h"
#include "../runtime/device.h"
#include "../runtime/tensor.h"

namespace seqpar::attn {

struct MaskSpec {
  bool causal = false;
  std::int64_t window = 0;  // > 0: sliding window (requires causal); 0: none
  // Per query: the key positions [doc_lo[i], doc_hi[i]) of its document (SequenceLayout::doc_bounds); both empty: no
  // document bound. Views the caller keeps alive for the call.
  std::span<const std::int64_t> doc_lo, doc_hi;

  MaskSpec() = default;
  // {causal, window} as before the document bounds existed (no missing-initializer warnings), or all four.
  MaskSpec(bool causal_, std::int64_t window_ = 0, std::span<const std::int64_t> doc_lo_ = {},
           std::span<const std::int64_t> doc_hi_ = {})
      : causal(causal_), window(window_), doc_lo(doc_lo_), doc_hi(doc_hi_) {}
};

// Score modifiers of one call (see the header comment). Heads are those of the call's q (under Ulysses, a slice).
struct ScoreMods {
  float softcap = 0.0f;     // > 0: a <- softcap * tanh(a / softcap); 0: off (< 0 or non-finite: error)
  TensorView alibi_slopes;  // empty, or [Hq] fp32 / fp64 finite host: bias -slope_h |q_pos - k_pos|
  TensorView sinks;         // empty, or [Hq] fp32 / fp64 finite host: learned sink logit per query head
};

// ALiBi slopes of Press et al. 2022 (reference code, get_slopes): for H a power of two, slope_h = 2^(-8 (h+1) / H);
// otherwise the slopes of the largest power of two n < H followed by every other slope of 2n, H in all.
// Errors: num_heads < 1.
std::vector<float> alibi_slopes(std::int64_t num_heads);

struct MhaForwardArgs {
  TensorView q;                         // [B, Sq, Hq, D]
  TensorView k;                         // [B, Sk, Hkv, D]
  TensorView v;                         // [B, Sk, Hkv, D]
  std::span<const std::int64_t> q_pos;  // [Sq] global positions (empty: 0..Sq-1)
  std::span<const std::int64_t> k_pos;  // [Sk] global positions (empty: 0..Sk-1)
  MaskSpec mask;
  float scale = 0.0f;  // <= 0: 1 / sqrt(D)
  ScoreMods mods{};    // soft-capping, ALiBi, sinks (off by default)
  // Dropout on the probabilities (attention/dropout.h); p = 0 (the default) is off. The mask is keyed by the
  // global query head head_offset + h (a Ulysses rank holding heads [u Hq, (u+1) Hq) passes u Hq) and the global
  // positions q_pos / k_pos, so every caller that sees a pair regenerates the same keep decision.
  DropoutSpec dropout{};
  std::int64_t head_offset = 0;  // >= 0; read only when dropout.p > 0
};

// Forward. args: q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D] (one floating dtype, Hq % Hkv == 0, D > 0), positions
// of sizes Sq / Sk (or empty), mask (window >= 0; window > 0 requires causal), scale (<= 0: 1/sqrt(D), computed in
// double). out: [B, Sq, Hq, D], any floating dtype (the ring passes the accumulator dtype); lse: [B, Hq, Sq] of the
// accumulator dtype or fp64, natural log, -inf for rows with no visible key. Sk = 0 gives out = 0, lse = -inf.
// Both outputs are overwritten.
// Errors: Error for a non-4-d q / k, shape / dtype mismatches, Hq % Hkv != 0, wrong position counts, decreasing
// positions, window < 0 or a window without causal, doc_lo / doc_hi not both empty or both of size Sq, a non-CPU
// tensor or stream; mods: softcap < 0 or non-finite,
// slopes / sinks not [Hq] fp32 / fp64 or not finite; dropout p not a finite number in [0, 1), and with p > 0 a
// negative head_offset, positions outside [0, 2^32) or B, head_offset + Hq over 2^32. With mods.sinks, lse is
// lse_total and out is scaled by exp(lse - lse_total) (a row with no visible key: lse = sink_h, out = 0).
void mha_forward(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse,
                 Stream stream = Stream::cpu());

struct MhaBackwardArgs {
  MhaForwardArgs fwd;  // q, k, v, positions, mask, scale, mods, dropout, head_offset as in the forward (sinks are
                       // not read: see lse)
  TensorView out;      // [B, Sq, Hq, D] the final (merged) output, any floating dtype
  TensorView dout;     // [B, Sq, Hq, D] any floating dtype
  TensorView lse;      // [B, Hq, Sq] the final lse (with sinks: lse_total), accumulator dtype or fp64
  TensorView delta;    // optional [B, Hq, Sq] rowsum(dout * out), accumulator dtype or fp64; computed when empty
};

// Backward of one call (or one key block of a ring) with the final out / lse (docs/design.md section 8.1).
// args.out is read only when args.delta is empty (delta is then computed from out and dout as by
// mha_backward_delta). dq [B, Sq, Hq, D], dk / dv [B, Sk, Hkv, D]:
// accumulate = false: dq, dk, dv (any floating dtype) are overwritten.
// accumulate = true: dq, dk, dv must have the accumulator dtype and the block's contributions are added to them
// (the sum of a call per key block equals one call over all keys, up to rounding of that dtype).
// Rows with lse = -inf contribute nothing. Errors: as for mha_forward, plus shape / dtype mismatches of dout,
// lse, delta, out and the gradients, and gradients of another dtype than the accumulator dtype with
// accumulate = true.
void mha_backward(const MhaBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                  bool accumulate, Stream stream = Stream::cpu());

// delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d], summed in fp64 when out, dout or delta is fp64 and in
// fp32 otherwise. out, dout [B, S, H, D] any floating dtypes (same shape); delta [B, H, S] fp32 or fp64 (fp64 when
// out or dout is fp64), overwritten. FlashAttention-2 (Dao 2023), the row term D_i of Algorithm 2.
// Errors: shape / dtype mismatches, non-CPU tensors.
void mha_backward_delta(const TensorView& out, const TensorView& dout, const TensorView& delta,
                        Stream stream = Stream::cpu());

// Merges a block result into a running one, in place, over disjoint key sets:
//   lse = logaddexp(lse, lse_b); out = exp(lse_old - lse) out + exp(lse_b - lse) out_b.
// out [B, S, H, D], out_b the same shape: fp32 or fp64 each; lse, lse_b [B, H, S]: fp32 or fp64 each. Everything is
// computed in fp64 (lse = max + log1p(e), weights 1 / (1 + e) and e / (1 + e), e = exp(min - max), so there is no
// inf - inf and no cancellation) and rounded once into out and lse. Exact when either side is -inf (that side
// contributes nothing, even if its out holds garbage). Both sides -inf: lse = -inf, out = 0.
// Precision: the weights are exp of lse differences, so an lse rounded to fp32 (|lse| 2^-24 absolute, 1e-4 at
// |lse| = 1800) becomes a relative error of the merged out that one softmax pass over the same keys does not have.
// A merge that adds no error beyond one online-softmax pass keeps the running lse and the blocks' lse in fp64
// (mha_forward writes an fp64 lse on request) and out in the accumulator dtype; the ring (parallel/) does.
// Errors: dtypes other than fp32 / fp64, shape mismatches, non-CPU tensors.
void lse_merge(const TensorView& out, const TensorView& lse, const TensorView& out_b, const TensorView& lse_b,
               Stream stream = Stream::cpu());

// Sinks on a finished (merged) result, in place: lse_total = logaddexp(lse, sinks[h]), out *= exp(lse - lse_total),
// lse = lse_total, in fp64. out [B, S, H, D] fp32 / fp64; lse [B, H, S] fp32 / fp64; sinks [H] fp32 / fp64 finite.
// Call it once per row (after every key block is merged). Errors: shapes, dtypes, non-finite sinks, non-CPU.
void mha_apply_sinks(const TensorView& out, const TensorView& lse, const TensorView& sinks,
                     Stream stream = Stream::cpu());

// Gradient of the sinks over the rows given: dsinks[h] = -sum_{b, i} exp(sinks[h] - lse[b, h, i]) delta[b, h, i],
// summed in fp64 in (b, i) order. delta [B, H, S] = rowsum(dO * O) of the final out (mha_backward_delta); lse
// [B, H, S] the final lse_total; fp32 / fp64 each. dsinks [H] fp32 / fp64, overwritten. Rows with lse = -inf add 0.
// Under context parallelism each rank sums its rows and the caller all-reduces. Errors: shapes, dtypes, non-CPU.
void mha_sinks_backward(const TensorView& delta, const TensorView& lse, const TensorView& sinks,
                        const TensorView& dsinks, Stream stream = Stream::cpu());

// Number of (query, key) pairs visible under `mask` between the position sets: the work a forward call does,
// used for FLOP counters (forward FLOPs = 4 * B * Hq * D * visible_pairs). Unlike the kernels, the positions are
// taken as given: an empty span means no queries (keys); mask.doc_lo / doc_hi, when given, have q_pos.size() entries.
// Errors: decreasing positions, an invalid mask.
std::int64_t visible_pairs(std::span<const std::int64_t> q_pos, std::span<const std::int64_t> k_pos,
                           const MaskSpec& mask);

// ---- argument checks on their own (see the header comment) -------------------------------------------------------

// MhaForwardArgs alone: shapes, dtypes, devices, Hq % Hkv, positions (sizes, non-decreasing), mask and scale.
void check_mha_forward_args(const MhaForwardArgs& args);
void check_mha_forward(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse,
                       Stream stream = Stream::cpu());
void check_mha_backward(const MhaBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        bool accumulate, Stream stream = Stream::cpu());
void check_mha_backward_delta(const TensorView& out, const TensorView& dout, const TensorView& delta,
                              Stream stream = Stream::cpu());
void check_lse_merge(const TensorView& out, const TensorView& lse, const TensorView& out_b, const TensorView& lse_b,
                     Stream stream = Stream::cpu());
void check_mha_apply_sinks(const TensorView& out, const TensorView& lse, const TensorView& sinks,
                           Stream stream = Stream::cpu());
void check_mha_sinks_backward(const TensorView& delta, const TensorView& lse, const TensorView& sinks,
                              const TensorView& dsinks, Stream stream = Stream::cpu());

}  // namespace seqpar::attn
