#include "benchmarks/cuda_gemm_ref.h"

#include <algorithm>

#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace seqpar::bench {

CudaEventTimer::CudaEventTimer(cudaStream_t stream) : stream_(stream) {
  SEQPAR_CHECK_CUDA(cudaEventCreate(&start_));
  SEQPAR_CHECK_CUDA(cudaEventCreate(&stop_));
}

CudaEventTimer::~CudaEventTimer() {
  cudaEventDestroy(start_);
  cudaEventDestroy(stop_);
}

double CudaEventTimer::time(const std::function<void()>& fn) {
  SEQPAR_CHECK_CUDA(cudaEventRecord(start_, stream_));
  fn();
  SEQPAR_CHECK_CUDA(cudaEventRecord(stop_, stream_));
  SEQPAR_CHECK_CUDA(cudaEventSynchronize(stop_));
  float ms = 0.0f;
  SEQPAR_CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
  return ms * 1e-3;
}

SquareBf16Gemm::SquareBf16Gemm(std::int64_t n, Device d, cudaStream_t stream)
    : n_(static_cast<int>(n)),
      a_(Tensor::zeros({n, n}, DType::kBFloat16, MemCategory::kWorkspace, d)),
      b_(Tensor::zeros({n, n}, DType::kBFloat16, MemCategory::kWorkspace, d)),
      c_(Tensor::empty({n, n}, DType::kBFloat16, MemCategory::kWorkspace, d)) {
  SEQPAR_CHECK_CUBLAS(cublasCreate(&handle_));
  SEQPAR_CHECK_CUBLAS(cublasSetStream(handle_, stream));
}

SquareBf16Gemm::~SquareBf16Gemm() { cublasDestroy(handle_); }

void SquareBf16Gemm::run() {
  const float alpha = 1.0f, beta = 0.0f;
  SEQPAR_CHECK_CUBLAS(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, n_, n_, n_, &alpha, a_.data(), CUDA_R_16BF, n_,
                                   b_.data(), CUDA_R_16BF, n_, &beta, c_.data(), CUDA_R_16BF, n_, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
}

double square_bf16_gemm_tflops(std::int64_t n, Device d, int warmup, int rounds) {
  SEQPAR_CHECK(n > 0 && rounds >= 1 && warmup >= 0, "square_bf16_gemm_tflops: n ", n, " and rounds ", rounds,
               " must be >= 1, warmup ", warmup, " >= 0");
  SEQPAR_CHECK_CUDA(cudaSetDevice(d.index));
  cudaStream_t stream = nullptr;
  SEQPAR_CHECK_CUDA(cudaStreamCreate(&stream));
  double best = 1e300;
  {
    CudaEventTimer timer(stream);
    SquareBf16Gemm gemm(n, d, stream);
    const std::function<void()> call = [&] { gemm.run(); };
    for (int i = 0; i < warmup; ++i) timer.time(call);
    for (int i = 0; i < rounds; ++i) best = std::min(best, timer.time(call));
    best = gemm.flops() / best / 1e12;
  }
  cudaStreamDestroy(stream);
  return best;
}

}  // namespace seqpar::bench
