// GDN (gated delta rule) on one device: chunked forward and backward, segment transitions (affine state maps) for
// context parallelism, and the short causal depthwise convolution that precedes it.
// Math: docs/design.md, "The gated delta recurrence", "The chunked GDN kernel" (Yang, Kautz, Hatamizadeh, "Gated
// Delta Networks", ICLR 2025); segment maps: "GDN segments"; how parallel/ uses them: "GDN chain and scan",
// "Short conv halo"; value heads on key heads: "Grouped value heads"; packed rows: "GDN on packed rows"; threads and
// memory: "GDN CPU kernels".
//
// Shapes: q, k, dq, dk [B, S, Hk, K]; v, out, dout, dv [B, S, Hv, V] (Hv a multiple of Hk); g, beta, dg, dbeta
// [B, S, Hv]; states and their gradients [B, Hv, K, V] ([N, Hv, K, V] with cu_seqlens); transitions M [B, Hv, K, K],
// U [B, Hv, K, V]. Row-major, contiguous host tensors.
// Dtypes: activations and their gradients any floating dtype; arithmetic in fp32, or fp64 when q is fp64. States,
// state gradients and transitions have the state dtype: fp32, or fp64 when q is fp64.
// Packed rows: cu_seqlens int64 [N+1] (B = 1; starts at 0, non-decreasing, ends at S); each document runs from its
// own initial_state[d] and nothing flows between documents.
// Synchronisation: host-synchronous; bitwise reproducible for any thread count. Scratch from the memory ledger.
// Errors: Error naming the tensor and the rule, before any work; CUDA tensors or streams fail with "GDN kernels have
// no CUDA implementation yet". The argument structs' validate() raise exactly the kernels' errors, no work.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../runtime/device.h"
#include "../runtime/tensor.h"

namespace seqpar::attn {

class GdnCache;

inline constexpr double kGdnL2NormEps = 1e-6;
inline constexpr std::int64_t kGdnDefaultChunkSize = 64;
// The longest chunk the kernels run: a larger chunk_size runs as chunks of kGdnMaxChunkSize tokens (the same
// recurrence; chunk boundaries only decide where the state is materialised). The chunked form does O(C (K + V + C))
// work per token for chunks of C tokens, so long chunks only add work: on the CPU kernel chunk 256 costs 3 to 4x
// chunk 64, and one chunk over 4096 tokens about 270x.
inline constexpr std::int64_t kGdnMaxChunkSize = 128;
// The chunk the kernels run for a chunk_size over seq_len tokens: min(chunk_size, kGdnMaxChunkSize, seq_len), at
// least 1 (what benchmarks report and their FLOP models count).
inline constexpr std::int64_t gdn_run_chunk_size(std::int64_t chunk_size, std::int64_t seq_len) {
  return std::max<std::int64_t>(1, std::min({chunk_size, kGdnMaxChunkSize, seq_len}));
}

// The inputs of gdn_forward (shapes and dtypes: the file comment).
struct GdnForwardArgs {
  TensorView q;              // [B, S, Hk, K]
  TensorView k;              // [B, S, Hk, K]
  TensorView v;              // [B, S, Hv, V], Hv a multiple of Hk
  TensorView g;              // [B, S, Hv] log decay (<= 0)
  TensorView beta;           // [B, S, Hv]
  TensorView initial_state;  // optional [B, Hv, K, V], state dtype; empty = zeros
  bool use_qk_l2norm = true;
  double scale = 0.0;  // <= 0: 1 / sqrt(K)
  std::int64_t chunk_size = kGdnDefaultChunkSize;
  // optional int64 [N+1]: a packed row of N documents (B = 1, T = S tokens; docs/design.md, "GDN on packed rows"). Then
  // initial_state, final_state and their gradients are [N, Hv, K, V].
  TensorView cu_seqlens = {};

  // The rules on these fields alone, no work. A context-parallel caller runs it on its local shapes before
  // anything is sent.
  // Errors: shapes, dtypes, devices, chunk_size, scale, the initial state, cu_seqlens (gdn_forward's errors).
  // Sync: host-only.
  void validate() const;

  // Every check gdn_forward makes on (this, out, final_state, stream), no work.
  // Errors: gdn_forward's.
  // Sync: host-only.
  void validate(const TensorView& out, const TensorView& final_state, Stream stream = Stream::cpu()) const;

  // Every check gdn_decode (attention/gdn_decode.h) makes on (cache, this, out, stream), no work.
  // Errors: gdn_decode's.
  // Sync: host-only.
  void validate(const GdnCache& cache, const TensorView& out, Stream stream = Stream::cpu()) const;
};

// The GdnForwardArgs of the five activations (initial_state empty, chunk_size the default).
// Returns: the args; nothing is checked here.
// Sync: host-only.
GdnForwardArgs gdn_args(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                        const TensorView& beta, bool use_qk_l2norm = true, double scale = 0.0);

// Chunked forward (docs/design.md, "The chunked GDN kernel").
// Args: out [B, S, Hv, V] any floating dtype; final_state [B, Hv, K, V] (state dtype; [N, Hv, K, V] with
//   cu_seqlens), may be empty to skip it. S = 0 is allowed (final_state = initial_state).
// Returns: out and final_state, overwritten.
// Errors (before any work): those of the file comment and GdnForwardArgs::validate; also when Hv is not a
//   positive multiple of Hk, and for a cu_seqlens that breaks a rule above (the message names the entry and the
//   rule); CUDA tensors or streams ("GDN kernels have no CUDA implementation yet").
// Sync: host-synchronous; bitwise reproducible for any thread count.
void gdn_forward(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state,
                 Stream stream = Stream::cpu());

// The inputs of gdn_backward.
struct GdnBackwardArgs {
  GdnForwardArgs fwd;       // the forward's inputs (the same initial_state)
  TensorView dout;          // [B, S, Hv, V] any floating dtype; may be empty (= zeros)
  TensorView dfinal_state;  // optional [B, Hv, K, V] ([N, Hv, K, V] with cu_seqlens) state dtype; empty = zeros

  // Every check gdn_backward makes on (this, dq, dk, dv, dg, dbeta, dinitial_state, stream), no work.
  // Errors: gdn_backward's.
  // Sync: host-only.
  void validate(const TensorView& dq, const TensorView& dk, const TensorView& dv, const TensorView& dg,
                const TensorView& dbeta, const TensorView& dinitial_state, Stream stream = Stream::cpu()) const;
};

// Gradients of sum(dout * out) + sum(dfinal_state * final_state) with respect to the raw (un-normalised) q and k,
// v, g, beta and initial_state; the L2 normalisation and the scale are differentiated through.
// Args: dq, dk [B, S, Hk, K] (summed over the value heads of each key head), dv [B, S, Hv, V], dg, dbeta
//   [B, S, Hv]: any floating dtype; dinitial_state [B, Hv, K, V], state dtype. Any output may be an empty view to
//   skip it; when dq, dk, dv, dg and dbeta are all empty only the reverse dS sweep runs (no forward sweep for the
//   chunk start states, no gradient of v, k, q, g, beta: about the cost of one forward, a quarter of the full
//   backward), which is what a scan-mode caller needs for the local part of dS_start. With fwd.cu_seqlens every
//   document is differentiated on its own rows (dinitial_state and dfinal_state [N, Hv, K, V]).
// Returns: every output given, overwritten. dinitial_state does not depend on v or initial_state.
// Errors: as gdn_forward, and the gradients' shapes and dtypes.
// Sync: host-synchronous; bitwise reproducible for any thread count.
void gdn_backward(const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                  const TensorView& dg, const TensorView& dbeta, const TensorView& dinitial_state,
                  Stream stream = Stream::cpu());

// ---- windows: a few heads of a longer tensor, in place ---------------------------------------------------------

// Value heads [head_begin, head_begin + num_heads) (with the key heads they read) over rows [row_begin, row_begin +
// num_rows) of every batch row.
struct GdnWindow {
  std::int64_t row_begin = 0, num_rows = 0, head_begin = 0, num_heads = 0;
};

// gdn_forward on a window of the tensors, read and written in place (no copy): for a caller that runs a few heads of
// a longer tensor at a time (parallel/gdn_cp.h's pipeline over value heads).
// Args: args as gdn_forward's over the whole tensors, cu_seqlens empty; args.initial_state and final_state
//   [B, num_heads, K, V] (state dtype), either may be empty; out [B, S, Hv, V] whole.
// Returns: the window of out (the rest untouched) and final_state; bitwise what gdn_forward gives on copies of the
//   window.
// Errors: gdn_forward's; num_rows or num_heads < 1, a window outside the tensors, cu_seqlens given.
// Sync: host-synchronous.
void gdn_forward_window(const GdnForwardArgs& args, const GdnWindow& window, const TensorView& out,
                        const TensorView& final_state, Stream stream = Stream::cpu());

// gdn_backward on a window likewise: dout read in the window; dv, dg, dbeta ([B, S, Hv, *] whole) written in the
// window; dq and dk are per value head, [B, S, Hv, K] (each value head's part, not summed over the value heads of a
// key head), written in the window; dinitial_state and args.dfinal_state [B, num_heads, K, V]. Any output may be
// empty, as for gdn_backward. Bitwise gdn_backward on copies of the window with one value head per key head.
// Errors: gdn_backward's and gdn_forward_window's.
// Sync: host-synchronous.
void gdn_backward_window(const GdnBackwardArgs& args, const GdnWindow& window, const TensorView& dq,
                         const TensorView& dk, const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                         const TensorView& dinitial_state, Stream stream = Stream::cpu());

// ---- work ahead: the part of a window that does not need its start (or end) state --------------------------------

// Work done for a window before the state it waits for is known, so that a context-parallel caller waiting for a
// neighbour's state can compute it meanwhile (parallel/gdn_cp.h). Forward: per chunk the decay cumsum, T =
// (I + A)^-1, W, U, K~ and the decay-masked scores P (docs/design.md, "The chunked GDN kernel"), which need no start
// state; what is left for the call is the state-dependent part (V' = U - W S, O, the state update). Backward: the
// forward sweep (every chunk's start state, from the window's known start state), which needs no dfinal_state.
// Owns its buffer (a value of gdn_ahead_bytes); made by gdn_forward_ahead / gdn_backward_ahead, advanced by
// gdn_ahead_step, used by the window calls that take it. Results with work ahead are bitwise those without.
struct GdnAhead {
  GdnWindow window;
  bool backward = false;
  std::int64_t num_chunks = 0, chunks_done = 0;
  Tensor buffer;  // the kernels' layout (attention/cpu/gdn_cpu.h); undefined under the test-mode route
  bool complete() const { return chunks_done >= num_chunks; }
};

// Work ahead for gdn_forward_window(args, window, ...): sized and allocated, nothing computed (chunks_done 0).
// Args: args as the window call's, except that initial_state is not read (it may be empty: the start state is what
//   the caller waits for).
// Errors: gdn_forward_window's on (args, window).
// Sync: host-only.
GdnAhead gdn_forward_ahead(const GdnForwardArgs& args, const GdnWindow& window);

// Work ahead for gdn_backward_window(args, window, ...) likewise; args.fwd.initial_state is the window's start state
// (read by gdn_ahead_step); args.dout and args.dfinal_state are not read.
// Errors: gdn_backward_window's on (args.fwd, window).
// Sync: host-only.
GdnAhead gdn_backward_ahead(const GdnBackwardArgs& args, const GdnWindow& window);

// Bytes of the buffer that gdn_forward_ahead (backward false) or gdn_backward_ahead would allocate, no allocation.
// Forward: C (3 K + V + C + 1) values of the compute dtype per chunk and value head; backward: K V per chunk.
// Errors: as gdn_forward_ahead.
// Sync: host-only.
std::int64_t gdn_ahead_bytes(const GdnForwardArgs& args, const GdnWindow& window, bool backward);

// Computes the next chunks of `ahead`: [chunks_done, min(chunks_done + max_chunks, num_chunks)).
// Args: the args `ahead` was made with (forward: GdnForwardArgs; backward: args.fwd), max_chunks >= 1.
// Returns: complete() afterwards. Under the test-mode route (gdn_hook.h) it computes nothing and returns true.
// Errors: the window's; max_chunks < 1.
// Sync: host-synchronous.
bool gdn_ahead_step(const GdnForwardArgs& args, GdnAhead& ahead, std::int64_t max_chunks,
                    Stream stream = Stream::cpu());

// gdn_forward_window and gdn_backward_window using the work ahead in `ahead` (made for the same args and window,
// any number of chunks done; null: none): the chunks done ahead are not computed again, the rest is. Bitwise the
// results of the calls without it. The backward completes the start states in ahead's buffer.
// Errors: those of the calls without it; an `ahead` of another window or direction.
// Sync: host-synchronous.
void gdn_forward_window(const GdnForwardArgs& args, const GdnWindow& window, const TensorView& out,
                        const TensorView& final_state, const GdnAhead* ahead, Stream stream = Stream::cpu());
void gdn_backward_window(const GdnBackwardArgs& args, const GdnWindow& window, const TensorView& dq,
                         const TensorView& dk, const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                         const TensorView& dinitial_state, GdnAhead* ahead, Stream stream = Stream::cpu());

// ---- segment transitions (affine state maps) --------------------------------------------------------------

// The affine map of the whole segment in `args` (docs/design.md, "The gated delta recurrence"): final_state =
// m * S_start + u for every S_start. Cost: a forward whose state has K + V columns.
// Args: m [B, Hv, K, K], u [B, Hv, K, V], state dtype; args.initial_state and args.cu_seqlens empty (a segment map
//   of a packed row is taken per piece between document starts).
// Returns: m and u; same chunking as gdn_forward, so m * S_start + u agrees with its final_state to rounding.
// Errors: gdn_forward's on args; a non-empty initial_state or cu_seqlens; m, u shapes and dtypes.
// Sync: host-synchronous.
void gdn_transition(const GdnForwardArgs& args, const TensorView& m, const TensorView& u,
                    Stream stream = Stream::cpu());

// Composes two segment maps: first segment 1, then segment 2.
// Args: all [B, H, K, K] / [B, H, K, V] in one state dtype (fp32 or fp64); the outputs may alias neither input.
// Returns: (m, u) = (m2, u2) o (m1, u1) = (m2 m1, m2 u1 + u2).
// Errors: shapes, dtypes, aliasing.
// Sync: host-synchronous.
void gdn_transition_compose(const TensorView& m2, const TensorView& u2, const TensorView& m1, const TensorView& u1,
                            const TensorView& m, const TensorView& u, Stream stream = Stream::cpu());

// Applies a segment map to a start state.
// Args: u may be empty; s_end may not alias s_start.
// Returns: s_end = m s_start + u (m s_start when u is empty).
// Errors: shapes, dtypes, aliasing.
// Sync: host-synchronous.
void gdn_transition_apply(const TensorView& m, const TensorView& u, const TensorView& s_start, const TensorView& s_end,
                          Stream stream = Stream::cpu());

// The adjoint a reverse scan needs.
// Args: local may be empty; ds_start may alias local but not ds_end.
// Returns: ds_start = m^T ds_end (+ local, when local is not empty).
// Errors: shapes, dtypes, aliasing.
// Sync: host-synchronous.
void gdn_transition_apply_adjoint(const TensorView& m, const TensorView& ds_end, const TensorView& local,
                                  const TensorView& ds_start, Stream stream = Stream::cpu());

// Transposes each map.
// Args: m, mt [B, H, K, K]; mt may not alias m.
// Returns: mt[b, h] = m[b, h]^T.
// Errors: shapes, dtypes, aliasing.
// Sync: host-synchronous.
void gdn_transition_transpose(const TensorView& m, const TensorView& mt, Stream stream = Stream::cpu());

// ---- short causal depthwise convolution ---------------------------------------------------------------------
//
// For x [B, S, C], weight [C, W] and the W-1 inputs before the segment xs = initial_conv_state [B, W-1, C]
// (zeros when empty), with xin = concat(xs, x) along the sequence:
//   y[b, t, c] = sum_{w < W} weight[c, w] xin[b, t + w, c]        (weight[c, W-1] multiplies the current token)
//   out = silu(y) = y * sigmoid(y) when use_silu, else y.
// final_conv_state [B, W-1, C] = the last W-1 rows of xin (what the next segment needs; valid also when S < W-1).
// Packed rows (cu_seqlens int64 [N+1], B = 1, the rules of gdn_forward): document d is convolved on its own, with
// xin = concat(initial_conv_state[d], x[cu_seqlens[d] : cu_seqlens[d+1]]): no output reads an input of another
// document. The conv states and their gradients are then [N, W-1, C] (a zero-length document: final_conv_state[d] =
// initial_conv_state[d], dinitial_conv_state[d] = 0).
// All tensors share x's dtype (any floating dtype); arithmetic in fp32 (fp64 for fp64). Threads: OpenMP over
// (batch, channel block); reductions over (b, t) run in a fixed order.

// The inputs of short_conv_forward / short_conv_backward.
struct ShortConvArgs {
  TensorView x;                   // [B, S, C]
  TensorView weight;              // [C, W], W >= 1
  TensorView initial_conv_state;  // optional [B, W-1, C] ([N, W-1, C] with cu_seqlens)
  bool use_silu = true;
  TensorView cu_seqlens = {};  // optional int64 [N+1]: a packed row of N documents (B = 1)

  // The rules on these fields alone, no work.
  // Errors: shapes, dtypes, devices, W, the initial conv state, cu_seqlens.
  // Sync: host-only.
  void validate() const;

  // Every check short_conv_forward makes on (this, out, final_conv_state, stream), no work.
  // Errors: short_conv_forward's.
  // Sync: host-only.
  void validate(const TensorView& out, const TensorView& final_conv_state, Stream stream = Stream::cpu()) const;

  // Every check short_conv_backward makes on (this, dout, dx, dweight, dinitial_conv_state, stream), no work.
  // Errors: short_conv_backward's.
  // Sync: host-only.
  void validate(const TensorView& dout, const TensorView& dx, const TensorView& dweight,
                const TensorView& dinitial_conv_state, Stream stream = Stream::cpu()) const;
};

// The convolution (definition above).
// Args: out [B, S, C]; final_conv_state ([B, W-1, C], [N, W-1, C] with cu_seqlens) may be empty to skip it.
// Returns: out and final_conv_state.
// Errors: ShortConvArgs::validate's, and the outputs' shapes and dtypes.
// Sync: host-synchronous; reductions in a fixed order.
void short_conv_forward(const ShortConvArgs& args, const TensorView& out, const TensorView& final_conv_state,
                        Stream stream = Stream::cpu());

// Gradients of sum(dout * out).
// Args: dx [B, S, C], dweight [C, W], dinitial_conv_state [B, W-1, C] or [N, W-1, C] with cu_seqlens; each may be
//   empty to skip it.
// Returns: the gradients given, all overwritten. The halo gradient dinitial_conv_state goes back to the owner of
//   those inputs (docs/design.md, "Short conv halo").
// Errors: ShortConvArgs::validate's, and dout's and the gradients' shapes and dtypes.
// Sync: host-synchronous; reductions over (b, t) in a fixed order.
void short_conv_backward(const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                         const TensorView& dweight, const TensorView& dinitial_conv_state,
                         Stream stream = Stream::cpu());

}  // namespace seqpar::attn
