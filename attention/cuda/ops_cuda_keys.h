// The sort key of the CUDA table's top-k (ops_cuda_sort.cu), host-device so that a CPU test checks its order
// (test_ops_cuda_plan): an unsigned integer whose order is the scores' order (larger score, larger key), with -0 and +0
// equal and every NaN 0, below every other score (-inf included, whose key is positive). A stable sort by descending
// key then keeps the lower column first on ties, the training tie rule.
#pragma once

#include <cstdint>
#include <cstring>

#include "../../runtime/host_device.h"

namespace seqpar::attn::ops::cuda_plan {

template <typename T>
struct OrderedKey;
template <>
struct OrderedKey<float> {
  using U = std::uint32_t;
  SEQPAR_HOST_DEVICE static U of(float x) {
    if (x != x) return 0;
    U u = 0;
    if (x != 0.0f) std::memcpy(&u, &x, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
};
template <>
struct OrderedKey<double> {
  using U = std::uint64_t;
  SEQPAR_HOST_DEVICE static U of(double x) {
    if (x != x) return 0;
    U u = 0;
    if (x != 0.0) std::memcpy(&u, &x, sizeof u);
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
  }
};

}  // namespace seqpar::attn::ops::cuda_plan
