// Internal to the CUDA ops table's .cu files: launch sizes, grid-stride loops and stream-ordered scratch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "runtime/cuda_check.h"

// for (t = this thread's first index; t < n; t += the grid's thread count)
#define SEQPAR_GRID_LOOP(t, n)                                                 \
  for (std::int64_t t = ::seqpar::attn::cuda::detail::thread_index(); t < (n); \
       t += ::seqpar::attn::cuda::detail::thread_stride())

namespace seqpar::attn::cuda::detail {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 1 << 20;  // grid-stride loops cover the rest

inline unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < kMaxBlocks ? (b > 0 ? b : 1) : kMaxBlocks);
}

__device__ inline std::int64_t thread_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline std::int64_t thread_stride() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }

// Stream-ordered scratch, freed (on the stream) at the end of the scope.
class Scratch {
 public:
  Scratch(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    SEQPAR_CHECK_CUDA(cudaMallocAsync(&p_, bytes > 0 ? bytes : 1, stream));
  }
  ~Scratch() { cudaFreeAsync(p_, stream_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename E>
  E* as() const {
    return static_cast<E*>(p_);
  }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace seqpar::attn::cuda::detail
