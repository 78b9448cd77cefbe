// The CUDA ops table's launches of the GDN backward and short-conv row bodies (ops_cuda_kernels.h): one thread per
// row, chunk row, chunk or channel; the bodies are attention/kernels/gdn_rows.h, shared with the CPU table and tested
// there.
#include "attention/cuda/ops_cuda_common.cuh"
#include "attention/cuda/ops_cuda_kernels.h"
#include "attention/kernels/gdn_rows.h"
#include "runtime/cuda_check.h"

namespace seqpar::attn::cuda {
namespace {

using detail::blocks_for;
using detail::kThreads;

template <typename T>
__global__ void row_dots_kernel(std::int64_t rows, std::int64_t cols, const T* a, std::int64_t lda, const T* b,
                                std::int64_t ldb, T* out) {
  SEQPAR_GRID_LOOP(r, rows) { out[r] = rowops::dot_row(a + r * lda, b + r * ldb, cols); }
}
template <typename T>
__global__ void l2norm_backward_kernel(std::int64_t rows, std::int64_t cols, const T* x, std::int64_t ldx, T* dy,
                                       std::int64_t ldy, T eps, T s) {
  SEQPAR_GRID_LOOP(r, rows) { rowops::l2norm_scale_backward_row(x + r * ldx, dy + r * ldy, cols, eps, s); }
}
template <typename T>
__global__ void masks_backward_kernel(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, const T* kk,
                                      const T* qk, const T* dp, const T* da, T* dqk, T* dkk, T* dgamma, T* dbeta) {
  SEQPAR_GRID_LOOP(t, chunks * C) {
    const std::int64_t c = t / C, i = t % C, m = c * C * C;
    rowops::gdn_masks_backward_row(i, C, gamma + c * C, beta + c * C, kk + m, qk + m, dp + m, da + m, dqk + m + i * C,
                                   dkk + m + i * C, dgamma + t, dbeta + t);
  }
}
template <typename T>
__global__ void scales_backward_kernel(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, const T* dqq,
                                       const T* dkbk, const T* dvbv, const T* dktk, const T* sds, T* dgamma, T* dbeta) {
  SEQPAR_GRID_LOOP(c, chunks) {
    const std::int64_t o = c * C;
    rowops::gdn_scales_backward(gamma + o, beta + o, C, dqq + o, dkbk + o, dvbv + o, dktk + o, sds[c], dgamma + o,
                                dbeta + o);
  }
}
template <typename T>
__global__ void conv_kernel(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin, const std::int64_t* first,
                            const T* weight, bool silu, T* y) {
  SEQPAR_GRID_LOOP(r, rows) { rowops::short_conv_row(xin + first[r] * C, C, W, weight, silu, y + r * C); }
}
template <typename T>
__global__ void conv_dpre_kernel(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin,
                                 const std::int64_t* first, const T* weight, bool silu, T* dy) {
  SEQPAR_GRID_LOOP(r, rows) { rowops::short_conv_dpre_row(xin + first[r] * C, C, W, weight, silu, dy + r * C); }
}
template <typename T>
__global__ void conv_dx_kernel(std::int64_t xrows, std::int64_t C, std::int64_t W, const T* dpre,
                               const std::int64_t* src, const T* weight, T* dxin) {
  SEQPAR_GRID_LOOP(j, xrows) { rowops::short_conv_dx_row(dpre, src + j * W, C, W, weight, dxin + j * C); }
}
template <typename T>
__global__ void conv_dweight_kernel(std::int64_t rows, std::int64_t C, std::int64_t W, const T* dpre, const T* xin,
                                    const std::int64_t* first, T* dweight) {
  SEQPAR_GRID_LOOP(c, C) { rowops::short_conv_dweight_channel(c, rows, C, W, dpre, xin, first, dweight); }
}

void check_launch() { SEQPAR_CHECK_CUDA(cudaGetLastError()); }

}  // namespace

template <typename T>
void row_dots(std::int64_t rows, std::int64_t cols, const T* a, std::int64_t lda, const T* b, std::int64_t ldb, T* out,
              cudaStream_t stream) {
  if (rows <= 0) return;
  row_dots_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, cols, a, lda, b, ldb, out);
  check_launch();
}
template <typename T>
void l2norm_scale_backward_rows(std::int64_t rows, std::int64_t cols, const T* x, std::int64_t ldx, T* dy,
                                std::int64_t ldy, T eps, T s, cudaStream_t stream) {
  if (rows <= 0) return;
  l2norm_backward_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, cols, x, ldx, dy, ldy, eps, s);
  check_launch();
}
template <typename T>
void gdn_chunk_masks_backward(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, const T* kk,
                              const T* qk, const T* dp, const T* da, T* dqk, T* dkk, T* dgamma, T* dbeta,
                              cudaStream_t stream) {
  if (chunks <= 0 || C <= 0) return;
  masks_backward_kernel<T><<<blocks_for(chunks * C), kThreads, 0, stream>>>(chunks, C, gamma, beta, kk, qk, dp, da, dqk,
                                                                            dkk, dgamma, dbeta);
  check_launch();
}
template <typename T>
void gdn_chunk_scales_backward(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, const T* dqq,
                               const T* dkbk, const T* dvbv, const T* dktk, const T* sds, T* dgamma, T* dbeta,
                               cudaStream_t stream) {
  if (chunks <= 0 || C <= 0) return;
  scales_backward_kernel<T>
      <<<blocks_for(chunks), kThreads, 0, stream>>>(chunks, C, gamma, beta, dqq, dkbk, dvbv, dktk, sds, dgamma, dbeta);
  check_launch();
}
template <typename T>
void short_conv_rows(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin, const std::int64_t* first,
                     const T* weight, bool silu, T* y, cudaStream_t stream) {
  if (rows <= 0) return;
  conv_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, C, W, xin, first, weight, silu, y);
  check_launch();
}
template <typename T>
void short_conv_dpre_rows(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin, const std::int64_t* first,
                          const T* weight, bool silu, T* dy, cudaStream_t stream) {
  if (rows <= 0) return;
  conv_dpre_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, C, W, xin, first, weight, silu, dy);
  check_launch();
}
template <typename T>
void short_conv_dx_rows(std::int64_t xrows, std::int64_t C, std::int64_t W, const T* dpre, const std::int64_t* src,
                        const T* weight, T* dxin, cudaStream_t stream) {
  if (xrows <= 0) return;
  conv_dx_kernel<T><<<blocks_for(xrows), kThreads, 0, stream>>>(xrows, C, W, dpre, src, weight, dxin);
  check_launch();
}
template <typename T>
void short_conv_dweight(std::int64_t rows, std::int64_t C, std::int64_t W, const T* dpre, const T* xin,
                        const std::int64_t* first, T* dweight, cudaStream_t stream) {
  if (C <= 0) return;
  conv_dweight_kernel<T><<<blocks_for(C), kThreads, 0, stream>>>(rows, C, W, dpre, xin, first, dweight);
  check_launch();
}

#define SEQPAR_OPS_CUDA_INSTANTIATE(T)                                                                                 \
  template void row_dots<T>(std::int64_t, std::int64_t, const T*, std::int64_t, const T*, std::int64_t, T*,            \
                            cudaStream_t);                                                                             \
  template void l2norm_scale_backward_rows<T>(std::int64_t, std::int64_t, const T*, std::int64_t, T*, std::int64_t, T, \
                                              T, cudaStream_t);                                                        \
  template void gdn_chunk_masks_backward<T>(std::int64_t, std::int64_t, const T*, const T*, const T*, const T*,        \
                                            const T*, const T*, T*, T*, T*, T*, cudaStream_t);                         \
  template void gdn_chunk_scales_backward<T>(std::int64_t, std::int64_t, const T*, const T*, const T*, const T*,       \
                                             const T*, const T*, const T*, T*, T*, cudaStream_t);                      \
  template void short_conv_rows<T>(std::int64_t, std::int64_t, std::int64_t, const T*, const std::int64_t*, const T*,  \
                                   bool, T*, cudaStream_t);                                                            \
  template void short_conv_dpre_rows<T>(std::int64_t, std::int64_t, std::int64_t, const T*, const std::int64_t*,       \
                                        const T*, bool, T*, cudaStream_t);                                             \
  template void short_conv_dx_rows<T>(std::int64_t, std::int64_t, std::int64_t, const T*, const std::int64_t*,         \
                                      const T*, T*, cudaStream_t);                                                     \
  template void short_conv_dweight<T>(std::int64_t, std::int64_t, std::int64_t, const T*, const T*,                    \
                                      const std::int64_t*, T*, cudaStream_t);
SEQPAR_OPS_CUDA_INSTANTIATE(float)
SEQPAR_OPS_CUDA_INSTANTIATE(double)
#undef SEQPAR_OPS_CUDA_INSTANTIATE

}  // namespace seqpar::attn::cuda
