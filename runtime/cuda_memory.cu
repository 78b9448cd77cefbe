// Device memory for the ledger's allocator (CUDA builds only).
#include <cuda_runtime_api.h>

#include <cstddef>

#include "runtime/cuda_check.h"

namespace seqpar {

void* cuda_allocate(std::size_t bytes, int ordinal) {
  SEQPAR_CHECK_CUDA(cudaSetDevice(ordinal));
  void* ptr = nullptr;
  if (bytes > 0) SEQPAR_CHECK_CUDA(cudaMalloc(&ptr, bytes));
  return ptr == nullptr ? reinterpret_cast<void*>(alignof(std::max_align_t)) : ptr;  // non-null for 0 bytes
}

void cuda_free(void* ptr, int ordinal) {
  if (ptr == reinterpret_cast<void*>(alignof(std::max_align_t))) return;
  SEQPAR_CHECK_CUDA(cudaSetDevice(ordinal));
  SEQPAR_CHECK_CUDA(cudaFree(ptr));
}

// Ordered on `stream` (a cudaStream_t; nullptr: the default stream), which is synchronised before returning.
void cuda_memset_zero(void* ptr, std::size_t bytes, int ordinal, void* stream) {
  SEQPAR_CHECK_CUDA(cudaSetDevice(ordinal));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  SEQPAR_CHECK_CUDA(cudaMemsetAsync(ptr, 0, bytes, s));
  SEQPAR_CHECK_CUDA(cudaStreamSynchronize(s));
}

}  // namespace seqpar

namespace seqpar {

// Copies between any host / device buffers (unified addressing decides the direction), ordered on `stream` and
// synchronised before returning.
void cuda_copy(void* dst, const void* src, std::size_t bytes, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  SEQPAR_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  SEQPAR_CHECK_CUDA(cudaStreamSynchronize(s));
}

}  // namespace seqpar
