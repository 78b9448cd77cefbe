// GDN (gated delta rule) on one device: chunked forward and backward, segment transitions (affine state maps) for
// context parallelism, and the short causal depthwise convolution that precedes it.
//
// Math (docs/design.md section 10; Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025; chunked WY / UT
// form after Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", NeurIPS 2024;
// the L2 normalisation x * rsqrt(sum x^2 + eps) as fla-org/flash-linear-attention's l2norm (fla/modules/l2norm), read
// for the math only).
// Heads: q and k have Hk key heads, v, g and beta Hv value heads, Hv a multiple of Hk; value head h reads key head
// h / (Hv / Hk) (Qwen3-Next's gated delta layer, whose reference repeats q and k with repeat_interleave). The
// recurrence, its state and its output belong to the value head; dq and dk of a key head are the sums over the
// Hv / Hk value heads that read it. Hk = Hv is the plain one-to-one case.
// Per batch b and value head h, with state S_t in R^{K x V} (S_0 = initial_state, or 0) and q_t, k_t of key head
// h / (Hv / Hk):
//   q_t <- scale * q_t / sqrt(|q_t|^2 + eps),  k_t <- k_t / sqrt(|k_t|^2 + eps)     (when use_qk_l2norm; eps = 1e-6)
//   q_t <- scale * q_t                                                              (when not)
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t,   final_state = S_S.
// scale defaults to 1 / sqrt(K). g_t is the log decay (<= 0 expected, not checked); beta_t is normally in (0, 1).
// Each step is affine in the state, so a segment is one map  S_end = M S_start + U  and maps compose as
//   (M2, U2) o (M1, U1) = (M2 M1, M2 U1 + U2).
// The kernel processes chunks of chunk_size tokens (the last one may be shorter): within a chunk, with
// gamma_t = sum_{s<=t} g_s, A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j (i > j), T = (I + A)^-1,
// W = T diag(beta exp(gamma)) K, U = T diag(beta) V, V' = U - W S_0,
// O = diag(exp(gamma)) Q S_0 + ((Q K^T) * L) V', S_C = exp(gamma_C) S_0 + K~^T V'  (K~_j = exp(gamma_C - gamma_j) k_j).
// The backward recomputes these per chunk (start states are recomputed in a forward sweep) and runs the chunks in
// reverse, carrying dS.
//
// Layouts (row-major, contiguous, host memory): q, k, dq, dk [B, S, Hk, K]; v, out, dout, dv [B, S, Hv, V];
// g, beta, dg, dbeta [B, S, Hv]; states and their gradients [B, Hv, K, V]; transitions M [B, Hv, K, K],
// U [B, Hv, K, V].
// Dtypes: activations and their gradients may each be any floating dtype (fp32, bf16, fp16, fp64); arithmetic is in
// fp32, or fp64 when q is fp64 (then every accumulator and scratch buffer is fp64). States, state gradients and
// transitions have the "state dtype": fp32, or fp64 when q is fp64 (docs/design.md section 3: what crosses ranks is
// fp32 or wider).
// Threads: OpenMP over (batch, value head); every output element is written by one worker in a fixed order, so
// results are bitwise reproducible for any thread count. With Hv > Hk the backward writes each value head's dq and
// dk contribution to a compute-dtype workspace [B, S, Hv, K] and sums the Hv / Hk contributions of a key head in
// value-head order afterwards.
// Synchronisation: host-synchronous (the stream argument is an ordering token on the CPU).
// Extra memory: per worker O(chunk_size * (chunk_size + K + V) + K * V) scratch; the backward also keeps the start
// state of every chunk of one (batch, head): ceil(S / chunk_size) * K * V values, and with Hv > Hk the two
// [B, S, Hv, K] contribution buffers of dq and dk (only those requested). Scratch comes from the memory
// ledger (workspace) and is allocated before the parallel region; a failed allocation raises Error
// "out of memory: ..." naming the bytes asked for and the ledger's totals by category.
// Errors: Error naming the tensor and the rule, for any shape / dtype / device mismatch, Hv not a positive multiple of
// Hk, or chunk_size < 1, raised before any work. Tensors must be host tensors and the stream a CPU stream: a CUDA one
// fails with "GDN kernels have no CUDA implementation yet".
// Argument checks on their own: every kernel f below has a check_f with the same parameters that raises exactly the
// Error f would raise for them, and does no work, so that a context-parallel caller can validate its local shapes
// before anything is sent and every rank fails together.
//
// Packed rows (cu_seqlens; flash-linear-attention's chunk_gated_delta_rule convention; docs/design.md section 15.4):
// with GdnForwardArgs::cu_seqlens = int64 [N+1] the tensors hold one row (B = 1) of T tokens packed from N documents,
// document d being rows [cu_seqlens[d], cu_seqlens[d+1]). Every document runs the recurrence above on its own rows
// from its own start state initial_state[d] (zeros when initial_state is empty), and nothing flows from one document
// into the next. States and their gradients are then [N, Hv, K, V]: final_state[d] is document d's end state,
// dinitial_state[d] its start-state gradient, dfinal_state[d] the gradient arriving at its end state. A zero-length
// document has final_state[d] = initial_state[d] and dinitial_state[d] = dfinal_state[d]. cu_seqlens must start at 0,
// be non-decreasing (so no entry is negative) and end at T; N >= 0 (N = 0 only for T = 0). B > 1 with cu_seqlens is
// an error (pack the batch into one row instead).
//
// Use under context parallelism (parallel/, docs/design.md sections 10.4, 10.5):
//   chain: gdn_forward with initial_state = received state, send final_state on; backward: gdn_backward with
//          dfinal_state = received gradient, send dinitial_state back.
//   scan:  forward: gdn_transition per segment -> exclusive scan with gdn_transition_compose -> gdn_forward with the
//          start state (gdn_transition_apply gives it from a scanned map and the global initial state).
//          backward: gdn_backward with dfinal_state empty and only dinitial_state requested (the dS sweep
//          only, about the cost of one forward) gives the local part L; the reverse exclusive scan of the maps (M^T, L)
//          (gdn_transition_transpose, gdn_transition_compose) gives dS_end of each segment; then the full gdn_backward
//          with that dfinal_state. dS_start = M^T dS_end + L, which gdn_transition_apply_adjoint computes directly. No
//          gradient flows through (M, U) themselves: once every segment has its true start state and dS_end, its
//          gradients are exactly those of the chain, so the scan only changes who computes the states.
//   conv halo: short_conv_forward with initial_conv_state = the W-1 inputs before the segment (final_conv_state of
//          the previous segment in global order); short_conv_backward's dinitial_conv_state is added to the dx of
//          whichever inputs those were.
#pragma once

#include <cstdint>

#include "../runtime/device.h"
#include "../runtime/tensor.h"

namespace seqpar::attn {

inline constexpr double kGdnL2NormEps = 1e-6;
inline constexpr std::int64_t kGdnDefaultChunkSize = 64;

struct GdnForwardArgs {
  TensorView q;              // [B, S, Hk, K]
  TensorView k;              // [B, S, Hk, K]
  TensorView v;              // [B, S, Hv, V], Hv a multiple of Hk
  TensorView g;              // [B, S, Hv] log decay (<= 0)
  TensorView beta;           // [B, S, Hv]
  TensorView initial_state;  // optional [B, Hv, K, V], state dtype; empty = zeros
  bool use_qk_l2norm = true;
  float scale = 0.0f;  // <= 0: 1 / sqrt(K)
  std::int64_t chunk_size = kGdnDefaultChunkSize;
  // optional int64 [N+1]: a packed row of N documents (B = 1, T = S tokens; see the header comment). Then
  // initial_state, final_state and their gradients are [N, Hv, K, V].
  TensorView cu_seqlens = {};
};

// The GdnForwardArgs of the five activations (initial_state empty, chunk_size the default).
GdnForwardArgs gdn_args(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                        const TensorView& beta, bool use_qk_l2norm = true, float scale = 0.0f);

// out [B, S, Hv, V] (any floating dtype); final_state [B, Hv, K, V] (state dtype; [N, Hv, K, V] with cu_seqlens), may
// be empty to skip it. S = 0 is allowed (final_state = initial_state). Errors also when Hv is not a positive multiple
// of Hk, and for a cu_seqlens that breaks a rule above (the message names the entry and the rule).
void gdn_forward(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state,
                 Stream stream = Stream::cpu());

struct GdnBackwardArgs {
  GdnForwardArgs fwd;       // the forward's inputs (the same initial_state)
  TensorView dout;          // [B, S, Hv, V] any floating dtype; may be empty (= zeros)
  TensorView dfinal_state;  // optional [B, Hv, K, V] ([N, Hv, K, V] with cu_seqlens) state dtype; empty = zeros
};

// Gradients of sum(dout * out) + sum(dfinal_state * final_state) with respect to the raw (un-normalised) q and k,
// v, g, beta and initial_state; the L2 normalisation and the scale are differentiated through. dq, dk [B, S, Hk, K]
// (summed over the value heads of each key head), dv [B, S, Hv, V], dg, dbeta [B, S, Hv], dinitial_state
// [B, Hv, K, V]. Every output is overwritten. dq, dk, dv, dg, dbeta: any floating dtype; dinitial_state: state dtype.
// Any output may be an empty view to skip it; when dq, dk, dv, dg and dbeta are all empty only the reverse dS sweep
// runs (no forward sweep for the chunk start states, no gradient of v, k, q, g, beta: about the cost of one forward, a
// quarter of the full backward), which is what a scan-mode caller needs for the local part of dS_start. dinitial_state
// does not depend on v or initial_state. With fwd.cu_seqlens every document is differentiated on its own rows
// (dinitial_state and dfinal_state [N, Hv, K, V]).
void gdn_backward(const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                  const TensorView& dg, const TensorView& dbeta, const TensorView& dinitial_state,
                  Stream stream = Stream::cpu());

// ---- segment transitions (affine state maps) --------------------------------------------------------------

// The map of the whole segment in `args` from a zero start: final_state = m * S_start + u for every S_start.
// m [B, Hv, K, K], u [B, Hv, K, V], state dtype; args.initial_state must be empty. Same chunking as gdn_forward, so
// m * S_start + u agrees with gdn_forward's final_state to rounding. Cost: a forward whose state has K + V columns.
// args.cu_seqlens must be empty (a segment map of a packed row is taken per piece between document starts).
void gdn_transition(const GdnForwardArgs& args, const TensorView& m, const TensorView& u,
                    Stream stream = Stream::cpu());

// (m, u) = (m2, u2) o (m1, u1) = (m2 m1, m2 u1 + u2): first segment 1, then segment 2. All [B, H, K, K] /
// [B, H, K, V] in one state dtype (fp32 or fp64). The outputs may alias neither input.
void gdn_transition_compose(const TensorView& m2, const TensorView& u2, const TensorView& m1, const TensorView& u1,
                            const TensorView& m, const TensorView& u, Stream stream = Stream::cpu());

// s_end = m s_start + u (u may be empty: s_end = m s_start). s_end may not alias s_start.
void gdn_transition_apply(const TensorView& m, const TensorView& u, const TensorView& s_start, const TensorView& s_end,
                          Stream stream = Stream::cpu());

// ds_start = m^T ds_end (+ local, when local is not empty): the adjoint a reverse scan needs.
// ds_start may alias local but not ds_end.
void gdn_transition_apply_adjoint(const TensorView& m, const TensorView& ds_end, const TensorView& local,
                                  const TensorView& ds_start, Stream stream = Stream::cpu());

// mt[b, h] = m[b, h]^T ([B, H, K, K]); mt may not alias m.
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

struct ShortConvArgs {
  TensorView x;                   // [B, S, C]
  TensorView weight;              // [C, W], W >= 1
  TensorView initial_conv_state;  // optional [B, W-1, C] ([N, W-1, C] with cu_seqlens)
  bool use_silu = true;
  TensorView cu_seqlens = {};  // optional int64 [N+1]: a packed row of N documents (B = 1)
};

// out [B, S, C]; final_conv_state ([B, W-1, C], [N, W-1, C] with cu_seqlens) may be empty to skip it.
void short_conv_forward(const ShortConvArgs& args, const TensorView& out, const TensorView& final_conv_state,
                        Stream stream = Stream::cpu());

// Gradients of sum(dout * out): dx [B, S, C], dweight [C, W], dinitial_conv_state [B, W-1, C] or [N, W-1, C] with
// cu_seqlens (each may be empty
// to skip it; all overwritten). The halo gradient dinitial_conv_state goes back to the owner of those inputs.
void short_conv_backward(const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                         const TensorView& dweight, const TensorView& dinitial_conv_state,
                         Stream stream = Stream::cpu());

// ---- argument checks on their own (see the header comment) -------------------------------------------------------

// The argument structs alone: shapes, dtypes, devices, chunk_size, scale, the initial states.
void check_gdn_forward_args(const GdnForwardArgs& args);
void check_short_conv_args(const ShortConvArgs& args);

void check_gdn_forward(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state,
                       Stream stream = Stream::cpu());
void check_gdn_backward(const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const TensorView& dg, const TensorView& dbeta, const TensorView& dinitial_state,
                        Stream stream = Stream::cpu());
void check_gdn_transition(const GdnForwardArgs& args, const TensorView& m, const TensorView& u,
                          Stream stream = Stream::cpu());
void check_gdn_transition_compose(const TensorView& m2, const TensorView& u2, const TensorView& m1,
                                  const TensorView& u1, const TensorView& m, const TensorView& u,
                                  Stream stream = Stream::cpu());
void check_gdn_transition_apply(const TensorView& m, const TensorView& u, const TensorView& s_start,
                                const TensorView& s_end, Stream stream = Stream::cpu());
void check_gdn_transition_apply_adjoint(const TensorView& m, const TensorView& ds_end, const TensorView& local,
                                        const TensorView& ds_start, Stream stream = Stream::cpu());
void check_gdn_transition_transpose(const TensorView& m, const TensorView& mt, Stream stream = Stream::cpu());
void check_short_conv_forward(const ShortConvArgs& args, const TensorView& out, const TensorView& final_conv_state,
                              Stream stream = Stream::cpu());
void check_short_conv_backward(const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                               const TensorView& dweight, const TensorView& dinitial_conv_state,
                               Stream stream = Stream::cpu());

}  // namespace seqpar::attn
