// Launches only: the bodies are attention/fallback_attention.h and attention/kernels/row_ops.h, shared with the
// CPU code and tested there.
#include "attention/cuda/fallback_kernels.h"
#include "runtime/cuda_check.h"

namespace seqpar::attn::cuda {
namespace {

constexpr int kThreads = 128;

unsigned blocks_for(std::int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

template <typename T>
__global__ void softmax_kernel(fallback::RowBand band, fallback::RowMods mods, std::int64_t i0, std::int64_t rows, T* s,
                               T* lse) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  lse[r] = fallback::fallback_softmax_row(band, mods, i0 + r, s + r * band.sk, s + r * band.sk);
}

template <typename T>
__global__ void grad_kernel(fallback::RowBand band, fallback::RowMods mods, std::int64_t i0, std::int64_t rows,
                            const T* lse, const T* delta, T* s, T* dp) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  fallback::fallback_grad_row(band, mods, i0 + r, lse[r], delta[r], s + r * band.sk, dp + r * band.sk);
}

template <typename T>
__global__ void sink_kernel(double sink, std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse,
                            std::int64_t lse_stride) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  fallback::fallback_sink_row(sink, d, o + r * ldo, lse + r * lse_stride);
}

template <typename T>
__global__ void merge_kernel(std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse, const T* o_b,
                             std::int64_t ldo_b, const T* lse_b) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const rowops::MergeWeights<T> w = rowops::lse_merge_weights(lse[r], lse_b[r]);
  for (std::int64_t j = 0; j < d; ++j) o[r * ldo + j] = rowops::lse_merge_value(w, o[r * ldo + j], o_b[r * ldo_b + j]);
  lse[r] = w.lse;
}

template <typename T>
__global__ void delta_kernel(std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t d, const T* out,
                             const T* dout, T* delta) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= batch * seq * heads) return;
  const std::int64_t b = t / (seq * heads), i = (t / heads) % seq, h = t % heads;
  delta[(b * heads + h) * seq + i] = fallback::fallback_delta_row(out + t * d, dout + t * d, d);
}

}  // namespace

template <typename T>
void fallback_delta(std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t d, const T* out,
                    const T* dout, T* delta, cudaStream_t stream) {
  const std::int64_t n = batch * seq * heads;
  if (n == 0) return;
  delta_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(batch, seq, heads, d, out, dout, delta);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void fallback_softmax_rows(const fallback::RowBand& band, const fallback::RowMods& mods, std::int64_t i0,
                           std::int64_t rows, T* s, T* lse, cudaStream_t stream) {
  if (rows == 0) return;
  softmax_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(band, mods, i0, rows, s, lse);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void fallback_grad_rows(const fallback::RowBand& band, const fallback::RowMods& mods, std::int64_t i0,
                        std::int64_t rows, const T* lse, const T* delta, T* s, T* dp, cudaStream_t stream) {
  if (rows == 0) return;
  grad_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(band, mods, i0, rows, lse, delta, s, dp);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void fallback_sink_rows(double sink, std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse,
                        std::int64_t lse_stride, cudaStream_t stream) {
  if (rows == 0) return;
  sink_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(sink, rows, d, o, ldo, lse, lse_stride);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void fallback_merge_rows(std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse, const T* o_b,
                         std::int64_t ldo_b, const T* lse_b, cudaStream_t stream) {
  if (rows == 0) return;
  merge_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, d, o, ldo, lse, o_b, ldo_b, lse_b);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

#define SEQPAR_FALLBACK_INSTANTIATE(T)                                                                                \
  template void fallback_softmax_rows<T>(const fallback::RowBand&, const fallback::RowMods&, std::int64_t,           \
                                         std::int64_t, T*, T*, cudaStream_t);                                         \
  template void fallback_grad_rows<T>(const fallback::RowBand&, const fallback::RowMods&, std::int64_t, std::int64_t, \
                                      const T*, const T*, T*, T*, cudaStream_t);                                      \
  template void fallback_sink_rows<T>(double, std::int64_t, std::int64_t, T*, std::int64_t, T*, std::int64_t,         \
                                      cudaStream_t);                                                                  \
  template void fallback_merge_rows<T>(std::int64_t, std::int64_t, T*, std::int64_t, T*, const T*, std::int64_t,      \
                                       const T*, cudaStream_t);                                                       \
  template void fallback_delta<T>(std::int64_t, std::int64_t, std::int64_t, std::int64_t, const T*, const T*, T*,     \
                                  cudaStream_t);
SEQPAR_FALLBACK_INSTANTIATE(float)
SEQPAR_FALLBACK_INSTANTIATE(double)

}  // namespace seqpar::attn::cuda
