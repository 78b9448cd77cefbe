// SEQPAR_HOST_DEVICE marks a function that both the host compiler and nvcc compile: __host__ __device__ when the
// translation unit is compiled by nvcc (__CUDACC__), nothing otherwise. Element and row bodies written once with it
// (runtime/dtype.h conversions, attention/kernels/row_ops.h) run in the CPU kernels and tests and in CUDA kernels.
#pragma once

#if defined(__CUDACC__)
#define SEQPAR_HOST_DEVICE __host__ __device__
#else
#define SEQPAR_HOST_DEVICE
#endif
