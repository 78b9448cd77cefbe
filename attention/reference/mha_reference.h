// Naive fp64 MHA / GQA attention that materialises the [Sq, Sk] score matrix. For tests only.
// Same shapes, positions and mask semantics as attention/mha.h; all tensors fp64 (lse [B, Hq, Sq] fp64).
#pragma once

#include "attention/mha.h"

namespace seqpar::attn::reference {

void mha_forward(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse);
// dq, dk, dv are overwritten (fp64).
void mha_backward(const MhaForwardArgs& args, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                  const TensorView& dv);

}  // namespace seqpar::attn::reference
