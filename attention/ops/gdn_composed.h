// The chunked GDN forward (attention/gdn.h's gdn_forward: same arguments, shapes and semantics) written only as
// calls to an ops table (attention/ops/ops.h), so the algorithm a GPU table will run is the one tested on the CPU.
// docs/design.md, "The ops table".
//
// With R = B Hv segments (batch row, value head) of N chunks of C tokens (a short last chunk is padded with tokens of
// beta = 0, g = 0, k = 0, which leave the state unchanged); a packed row (cu_seqlens) runs document by document, each
// as a row of its own, so that a document's result is bitwise the one it gets alone:
//   1. gather q, k (of key head h / (Hv / Hk)), v, g, beta into [R, N, C, *]; L2 norm and scale rows; gamma = the
//      per-chunk cumulative sum of g;
//   2. per chunk, batched GEMMs K K^T and Q K^T, masked by the decay rows (strictLower(beta_i e^(gamma_i - gamma_j))
//      and lower(e^(gamma_i - gamma_j))); W = (I + A)^-1 diag(beta e^gamma) K and U = (I + A)^-1 diag(beta) V by the
//      batched unit-lower triangular solve;
//   3. chunk maps M_c = e^(gamma_C) I - K~^T W, U_c = K~^T U (K~: keys decayed to the chunk end) by batched GEMMs;
//   4. the inclusive scan of (M_c, U_c) along each segment (ops::scan_affine), then S_{c+1} = M_pre,c S_0 + U_pre,c:
//      the start state of every chunk;
//   5. V' = U - W S_c, out = diag(e^gamma) Q S_c + (Q K^T masked) V' by batched GEMMs; out rows and final states
//      scattered back.
// Arithmetic in T = fp64 when q is fp64, else fp32 (inputs converted to T first). Inputs and outputs are host tensors,
// copied to and from the table's memory.
#pragma once

#include "../gdn.h"
#include "ops.h"

namespace seqpar::attn::ops {

// Errors: as attn::gdn_forward (the same argument checks), before any work.
template <typename T>
void gdn_forward_composed(Ops<T>& ops, const GdnForwardArgs& args, const TensorView& out,
                          const TensorView& final_state);

// attn::gdn_backward (same arguments, shapes and semantics) composed the same way (docs/design.md, "The ops table"):
// the prepared chunks above; per chunk the state-gradient map dS_start = M_c^T dS_end + L_c by batched GEMMs and its
// reverse scan (ops::scan_affine over the chunks in reverse order) for every chunk's dS_end (dinitial_state is the
// last element); when any of dq, dk, dv, dg, dbeta is asked for, the chunk start states by the forward's scan, then
// the chunk adjoints by batched GEMMs and the row kernels gdn_chunk_masks_backward / gdn_chunk_scales_backward, the
// per-value-head dq, dk scattered onto their key head (in value-head order) and taken through the L2 norm.
// Errors: as attn::gdn_backward (the same argument checks), before any work.
template <typename T>
void gdn_backward_composed(Ops<T>& ops, const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk,
                           const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                           const TensorView& dinitial_state);

// attn::gdn_transition composed the same way: (m, u) = the scan's last element.
// Errors: the argument checks of gdn_transition, before any work.
template <typename T>
void gdn_transition_composed(Ops<T>& ops, const GdnForwardArgs& args, const TensorView& m, const TensorView& u);

// out = op(m) x (+ addend): the segment-map algebra of attention/gdn.h as one batched GEMM over the B H maps
// (gdn_transition_compose is two calls: m2 m1, then m2 u1 + u2; _apply: m s + u; _apply_adjoint: m^T ds + local;
// _transpose: m^T times the identity). m [B, H, K, K]; x [B, H, K, N], or empty for the identity (N = K); addend
// empty or [B, H, K, N]; out [B, H, K, N]; all of the state dtype T. transpose_m: op(m) = m^T. Every input is read
// before out is written, so out may alias any of them.
// Errors: shapes and dtypes (the callers in attention/gdn.cc check them first).
template <typename T>
void gdn_map_product_composed(Ops<T>& ops, bool transpose_m, const TensorView& m, const TensorView& x,
                              const TensorView& addend, const TensorView& out);

// attn::short_conv_forward / short_conv_backward (same arguments, shapes and semantics; packed rows included) as
// table calls: the inputs of every document laid out after its W-1 conv state rows, one row kernel per output row
// (rowops::short_conv_row), the backward's gradient before the SiLU per output row, each input row's gradient from
// the output rows that read it, and the weight gradient per channel (attention/ops/gdn_conv_composed.cc).
// Arithmetic in fp64 for fp64 x, else fp32.
// Errors: as attn::short_conv_forward / _backward (the same argument checks), before any work.
template <typename T>
void short_conv_forward_composed(Ops<T>& ops, const ShortConvArgs& args, const TensorView& out,
                                 const TensorView& final_conv_state);
template <typename T>
void short_conv_backward_composed(Ops<T>& ops, const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                                  const TensorView& dweight, const TensorView& dinitial_conv_state);

// The same on the CPU table of q's arithmetic dtype (of m's dtype for the map product, of x's for the conv).
void gdn_forward_composed_cpu(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state);
void gdn_backward_composed_cpu(const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                               const TensorView& dinitial_state);
void gdn_transition_composed_cpu(const GdnForwardArgs& args, const TensorView& m, const TensorView& u);
void gdn_map_product_composed_cpu(bool transpose_m, const TensorView& m, const TensorView& x, const TensorView& addend,
                                  const TensorView& out);
void short_conv_forward_composed_cpu(const ShortConvArgs& args, const TensorView& out,
                                     const TensorView& final_conv_state);
void short_conv_backward_composed_cpu(const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                                      const TensorView& dweight, const TensorView& dinitial_conv_state);

}  // namespace seqpar::attn::ops
