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

void cuda_memset_zero(void* ptr, std::size_t bytes, int ordinal) {
  SEQPAR_CHECK_CUDA(cudaSetDevice(ordinal));
  SEQPAR_CHECK_CUDA(cudaMemset(ptr, 0, bytes));
}

}  // namespace seqpar

namespace seqpar {

// Copies between any host / device buffers (unified addressing decides the direction).
void cuda_copy(void* dst, const void* src, std::size_t bytes) {
  SEQPAR_CHECK_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
}

}  // namespace seqpar
