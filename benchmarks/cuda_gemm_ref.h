// The cuBLAS bf16 GEMM reference of the benchmarks on a CUDA device (kernel_bench --device cuda times it in every
// round beside the attention calls; sp_bench --device cuda once after its timed iterations), and the CUDA-event timer
// both use. CUDA builds only.
//
// SquareBf16Gemm: C = A B, n x n, bf16 inputs and output, fp32 accumulation (cublasGemmEx, CUBLAS_COMPUTE_32F), on
//   device buffers it owns (zeros: the time does not depend on the values), 2 n^3 FLOPs.
// Errors: a CUDA or cuBLAS failure (named by SEQPAR_CHECK_CUDA / SEQPAR_CHECK_CUBLAS).
// Sync: run() enqueues on the stream given at construction; CudaEventTimer::time waits for its stop event.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

#include "runtime/device.h"
#include "runtime/tensor.h"

namespace seqpar::bench {

// Two events on one stream: the seconds of a function's work on that stream.
class CudaEventTimer {
 public:
  explicit CudaEventTimer(cudaStream_t stream);
  ~CudaEventTimer();
  CudaEventTimer(const CudaEventTimer&) = delete;
  CudaEventTimer& operator=(const CudaEventTimer&) = delete;
  double time(const std::function<void()>& fn);

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

class SquareBf16Gemm {
 public:
  SquareBf16Gemm(std::int64_t n, Device d, cudaStream_t stream);
  ~SquareBf16Gemm();
  SquareBf16Gemm(const SquareBf16Gemm&) = delete;
  SquareBf16Gemm& operator=(const SquareBf16Gemm&) = delete;
  void run();
  double flops() const { return 2.0 * n_ * static_cast<double>(n_) * n_; }

 private:
  int n_;
  Tensor a_, b_, c_;
  cublasHandle_t handle_ = nullptr;
};

// TFLOP/s of the fastest of `rounds` timed n^3 GEMMs on a new stream of device d, after `warmup` untimed ones.
double square_bf16_gemm_tflops(std::int64_t n, Device d, int warmup, int rounds);

}  // namespace seqpar::bench
