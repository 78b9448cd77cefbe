// Naive fp64 gated delta rule (token by token) and direct fp64 short causal conv, with hand-derived gradients.
// For tests only. Same shapes and semantics as attention/gdn.h; every tensor fp64 (states included), outputs
// overwritten, optional inputs / outputs may be empty.
//
// Recurrence (docs/design.md, "The gated delta recurrence"), per batch b and value head h, with q_t and k_t of key head
// h / (Hv / Hk) (dq and dk summed over the value heads that share a key head):
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t,
// after the optional L2 normalisation of q and k (eps kGdnL2NormEps) and the scale on q. With cu_seqlens (B = 1) each
// document runs that recurrence on its own tokens from its own state row, and the conv reads only its own document's
// inputs and conv state row (attention/gdn.h): the loops below go document by document, token by token.
// Backward: reverse mode of that recurrence with every state S_t kept (O(S K V) memory), written out step by step
// in gdn_reference.cc; the tests check it against central finite differences.
#pragma once

#include "../gdn.h"

namespace seqpar::attn::reference {

void gdn_forward(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state);
void gdn_backward(const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                  const TensorView& dg, const TensorView& dbeta, const TensorView& dinitial_state);

// y[b, t, c] = sum_w weight[c, w] xin[b, t + w, c] with xin = concat(initial_conv_state, x), then SiLU if asked.
void short_conv_forward(const ShortConvArgs& args, const TensorView& out, const TensorView& final_conv_state);
void short_conv_backward(const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                         const TensorView& dweight, const TensorView& dinitial_conv_state);

}  // namespace seqpar::attn::reference
