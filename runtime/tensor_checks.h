// Internal to seqpar: the tensor checks the library's boundaries share. Not part of the public API (the umbrella
// header <seqpar/seqpar.h> does not include it).
#pragma once

#include "tensor.h"

namespace seqpar {

// Each throws Error naming `what`, the expected and the found value.
void check_shape(const TensorView& t, const Shape& expected, const char* what);
void check_dtype(const TensorView& t, DType expected, const char* what);
void check_cpu(const TensorView& t, const char* what);

}  // namespace seqpar
