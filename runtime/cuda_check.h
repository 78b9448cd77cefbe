// Check macros for CUDA and NCCL calls (internal: included only by the .cc / .cu files that call CUDA or NCCL, so
// that public headers never pull in their headers). Each throws seqpar::Error naming the call, file:line and the
// library's own error string (the habit of NCCL's checks.h).
#pragma once

#include "error.h"

#if defined(SEQPAR_WITH_CUDA)
#include <cuda_runtime_api.h>
#define SEQPAR_CHECK_CUDA(call)                                                                                        \
  do {                                                                                                                 \
    cudaError_t seqpar_cuda_rc_ = (call);                                                                              \
    if (seqpar_cuda_rc_ != cudaSuccess) [[unlikely]] {                                                                 \
      ::seqpar::throw_error(__FILE__, __LINE__,                                                                        \
                            ::seqpar::str_cat("CUDA call ", #call, " failed: ", cudaGetErrorString(seqpar_cuda_rc_))); \
    }                                                                                                                  \
  } while (0)
#endif

#if defined(SEQPAR_WITH_NCCL)
#include <nccl.h>
// ncclInProgress is not a failure: non-blocking communicators return it while an operation is being set up.
#define SEQPAR_CHECK_NCCL(call)                                                                                        \
  do {                                                                                                                 \
    ncclResult_t seqpar_nccl_rc_ = (call);                                                                             \
    if (seqpar_nccl_rc_ != ncclSuccess && seqpar_nccl_rc_ != ncclInProgress) [[unlikely]] {                            \
      ::seqpar::throw_error(__FILE__, __LINE__,                                                                        \
                            ::seqpar::str_cat("NCCL call ", #call, " failed: ", ncclGetErrorString(seqpar_nccl_rc_))); \
    }                                                                                                                  \
  } while (0)
#endif

#if defined(SEQPAR_WITH_CUDA)
// cuBLAS: the caller includes <cublas_v2.h> (this header does not, so that only cuBLAS users pay for it).
#define SEQPAR_CHECK_CUBLAS(call)                                                                                      \
  do {                                                                                                                 \
    const cublasStatus_t seqpar_cublas_rc_ = (call);                                                                   \
    if (seqpar_cublas_rc_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                                                     \
      ::seqpar::throw_error(__FILE__, __LINE__,                                                                        \
                            ::seqpar::str_cat("cuBLAS call ", #call, " failed: ",                                      \
                                              cublasGetStatusString(seqpar_cublas_rc_)));                              \
    }                                                                                                                  \
  } while (0)
#endif
