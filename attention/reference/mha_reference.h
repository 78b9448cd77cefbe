// Naive fp64 MHA / GQA attention that materialises the [Sq, Sk] score matrix. For tests only.
// Same shapes, positions, mask and score-modifier (ScoreMods) semantics as attention/mha.h; all tensors fp64 (lse [B,
// Hq, Sq] fp64). The mask is evaluated on the positions of every (query, key) pair (no index ranges, no tiles), and the
// backward uses the softmax Jacobian with the row sum over p_ij dp_ij computed from p (not from out), so that the
// reference shares no shortcut with the kernels. Cost O(B Hq Sq Sk D) time and O(Sq Sk) memory. Host-synchronous.
// Errors: Error for non-fp64 tensors or mismatched shapes.
#pragma once

#include "attention/mha.h"

namespace seqpar::attn::reference {

void mha_forward(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse);
// dout [B, Sq, Hq, D]; dq, dk, dv are overwritten (fp64). The lse is recomputed in fp64, not taken from a forward.
// dsinks [Hq] fp64 (overwritten) exactly when args.mods.sinks is given.
void mha_backward(const MhaForwardArgs& args, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                  const TensorView& dv, const TensorView& dsinks = {});

}  // namespace seqpar::attn::reference
