// The sort key of the CUDA table's top-k (ops_cuda_sort.cu), host-device so that a CPU test checks its order
// (test_ops_cuda_plan): an unsigned integer whose order is the scores' order (larger score, larger key), with -0 and +0
// equal and every NaN 0, below every other score (-inf included, whose key is positive). A stable sort by descending
// key then keeps the lower column first on ties, the training tie rule.
#pragma once

#include <cmath>
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

// The fp32 scores as the CUDA table hands them to FlashInfer's top-k (ops_cuda_sort.cu, fi_prepare_kernel): an
// injective, order-preserving map onto floats with every NaN below all of them, since FlashInfer orders raw bits
// (key(): its RadixTopKTraits<float>::ToOrdered, -0 below +0, NaN by its sign bit) and bins by an fp16 conversion
// that sends NaN to the top bin. +0 and -0 go to +0; a negative score (-inf included) one step toward zero (its bits
// minus one, the last into the slot -0 left free); a positive one to itself; NaN to -inf. Equal scores stay equal,
// so FlashInfer's tie rule (the smaller index) decides as the table's rule does; a NaN is picked only when a row has
// fewer than k other candidates, and the table drops it.
struct FlashInferInput {
  SEQPAR_HOST_DEVICE static float of(float x) {
    if (x == 0.0f) return 0.0f;
    if (x > 0.0f) return x;
    if (!(x < 0.0f)) return -HUGE_VALF;  // NaN
    std::uint32_t u = 0;
    std::memcpy(&u, &x, sizeof u);
    u -= 1u;
    float y = 0.0f;
    std::memcpy(&y, &u, sizeof y);
    return y;
  }
  SEQPAR_HOST_DEVICE static std::uint32_t key(float x) {
    std::uint32_t u = 0;
    std::memcpy(&u, &x, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
};

}  // namespace seqpar::attn::ops::cuda_plan
