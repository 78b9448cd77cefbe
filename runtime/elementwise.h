// Element bodies of runtime/tensor_ops.h written once for the CPU loops and the CUDA kernels (SEQPAR_HOST_DEVICE):
// tensor_ops.cc calls them per element on the host, tensor_ops_cuda.cu per element in a kernel; the CPU tests
// (test_tensor_ops) check them against closed forms. Nothing here allocates or throws.
#pragma once

#include "host_device.h"

namespace seqpar::elementwise {

// d + alpha * s in T (one rounding of the product, one of the sum; alpha = 1 or -1 is exact, so d + s and d - s
// are bitwise the plain sum and difference).
template <typename T>
SEQPAR_HOST_DEVICE inline T add_scaled(T d, T s, T alpha) {
  return d + alpha * s;
}

}  // namespace seqpar::elementwise
