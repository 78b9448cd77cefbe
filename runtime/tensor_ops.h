// Whole-tensor helpers on host memory used by the distributed code: dtype-converting copies, fp32 accumulation,
// fills. Element counts must match; shapes may differ (flat views). Host-synchronous.
#pragma once

#include "runtime/tensor.h"

namespace seqpar {

// dst = src converted to dst's dtype (round to nearest even for 16-bit targets). Between a host and a CUDA
// buffer (or two CUDA buffers) the dtypes must match and the copy is a synchronous cudaMemcpy.
void copy_convert(const TensorView& src, const TensorView& dst);
// dst += src, both fp32 (or both fp64), element-wise in index order (deterministic).
void add_inplace(const TensorView& dst, const TensorView& src);
// Every element of a floating tensor set to `value` (e.g. -inf for an empty lse).
void fill(const TensorView& dst, double value);

}  // namespace seqpar
