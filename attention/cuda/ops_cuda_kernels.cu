// The CUDA ops table's element and row kernels (ops_cuda_kernels.h; the sorts are in ops_cuda_sort.cu). The row
// bodies are attention/kernels/gdn_rows.h, shared with the CPU table and tested there.
#include "attention/cuda/ops_cuda_common.cuh"
#include "attention/cuda/ops_cuda_kernels.h"
#include "attention/kernels/gdn_rows.h"
#include "runtime/cuda_check.h"

namespace seqpar::attn::cuda {
namespace {

using detail::blocks_for;
using detail::kThreads;

__global__ void batch_pointers_kernel(const char* base, std::size_t elem_bytes, std::int64_t so, std::int64_t si,
                                      std::int64_t count, std::int64_t inner, void** ptrs) {
  SEQPAR_GRID_LOOP(b, count) {
    const std::int64_t off = (b / inner) * so + (b % inner) * si;
    ptrs[b] = const_cast<char*>(base) + off * static_cast<std::int64_t>(elem_bytes);
  }
}

template <typename T>
__global__ void copy_kernel(std::int64_t rows, std::int64_t cols, BatchedMat<const T> src, BatchedMat<T> dst,
                            std::int64_t inner, std::int64_t total) {
  SEQPAR_GRID_LOOP(t, total) {
    const std::int64_t j = t % cols, i = (t / cols) % rows, b = t / (cols * rows);
    const std::int64_t o = b / inner, n = b % inner;
    dst.ptr[o * dst.so + n * dst.si + i * dst.ld + j] = src.ptr[o * src.so + n * src.si + i * src.ld + j];
  }
}

template <typename T>
__global__ void scale_kernel(std::int64_t rows, std::int64_t cols, T beta, BatchedMat<T> dst, std::int64_t inner,
                             std::int64_t total) {
  SEQPAR_GRID_LOOP(t, total) {
    const std::int64_t j = t % cols, i = (t / cols) % rows, b = t / (cols * rows);
    T& x = dst.ptr[(b / inner) * dst.so + (b % inner) * dst.si + i * dst.ld + j];
    x = beta == T(0) ? T(0) : beta * x;
  }
}

template <typename T>
__global__ void identity_kernel(std::int64_t n_dim, const T* s, std::int64_t s_so, std::int64_t s_si, BatchedMat<T> dst,
                                std::int64_t inner, std::int64_t total) {
  SEQPAR_GRID_LOOP(t, total) {
    const std::int64_t j = t % n_dim, i = (t / n_dim) % n_dim, b = t / (n_dim * n_dim);
    const std::int64_t o = b / inner, n = b % inner;
    dst.ptr[o * dst.so + n * dst.si + i * dst.ld + j] = i == j ? s[o * s_so + n * s_si] : T(0);
  }
}

template <typename T>
__global__ void convert_in_kernel(const void* src, DType src_dtype, T* dst, std::int64_t n) {
  SEQPAR_GRID_LOOP(t, n) { dst[t] = load_element<T>(src, src_dtype, static_cast<std::size_t>(t)); }
}

template <typename T>
__global__ void convert_out_kernel(const T* src, void* dst, DType dst_dtype, std::int64_t n) {
  SEQPAR_GRID_LOOP(t, n) { store_element<T>(src[t], dst, dst_dtype, static_cast<std::size_t>(t)); }
}

template <typename T>
__global__ void gather_kernel(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src,
                              const std::int64_t* idx, T* dst, std::int64_t ld_dst) {
  SEQPAR_GRID_LOOP(t, rows * cols) {
    const std::int64_t r = t / cols, j = t % cols, s = idx[r];
    dst[r * ld_dst + j] = s < 0 ? T(0) : src[s * ld_src + j];
  }
}

template <typename T>
__global__ void l2norm_kernel(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, T eps, T s) {
  SEQPAR_GRID_LOOP(r, rows) { rowops::l2norm_scale_row(x + r * ld, cols, eps, s); }
}
template <typename T>
__global__ void relu_kernel(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld) {
  SEQPAR_GRID_LOOP(t, rows * cols) { rowops::relu_row(x + (t / cols) * ld + t % cols, 1); }
}
template <typename T>
__global__ void softmax_kernel(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const std::int64_t* end,
                               std::int64_t end_div, T* row_max, T* row_sum) {
  SEQPAR_GRID_LOOP(r, rows) {
    rowops::softmax_prefix_row(x + r * ld, cols, end[r / end_div], row_max + r, row_sum + r);
  }
}
template <typename T>
__global__ void scale_rows_kernel(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const T* s) {
  SEQPAR_GRID_LOOP(t, rows * cols) { x[(t / cols) * ld + t % cols] *= s[t / cols]; }
}
template <typename T>
__global__ void cumsum_kernel(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld) {
  SEQPAR_GRID_LOOP(r, rows) { rowops::cumsum_row(x + r * ld, cols); }
}
template <typename T>
__global__ void chunk_scales_kernel(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* kscale,
                                    T* vscale, T* qscale, T* kend, T* end_decay) {
  SEQPAR_GRID_LOOP(c, chunks) {
    rowops::gdn_chunk_scales(gamma + c * C, beta + c * C, C, kscale + c * C, vscale + c * C, qscale + c * C,
                             kend + c * C, end_decay + c);
  }
}
template <typename T>
__global__ void chunk_masks_kernel(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* a, T* qk) {
  SEQPAR_GRID_LOOP(t, chunks * C) {
    const std::int64_t c = t / C, i = t % C;
    rowops::gdn_wy_row(a + t * C, i, C, gamma + c * C, beta[t]);
    rowops::gdn_qk_row(qk + t * C, i, C, gamma + c * C);
  }
}

}  // namespace

void batch_pointers(const void* base, std::size_t elem_bytes, std::int64_t so, std::int64_t si, std::int64_t outer,
                    std::int64_t inner, void** ptrs, cudaStream_t stream) {
  const std::int64_t count = outer * inner;
  if (count <= 0) return;
  batch_pointers_kernel<<<blocks_for(count), kThreads, 0, stream>>>(static_cast<const char*>(base), elem_bytes, so, si,
                                                                    count, inner, ptrs);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void copy_mats(std::int64_t rows, std::int64_t cols, BatchedMat<const T> src, BatchedMat<T> dst, std::int64_t outer,
               std::int64_t inner, cudaStream_t stream) {
  const std::int64_t total = rows * cols * outer * inner;
  if (rows <= 0 || cols <= 0 || total <= 0) return;
  copy_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(rows, cols, src, dst, inner, total);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void scale_mats(std::int64_t rows, std::int64_t cols, T beta, BatchedMat<T> dst, std::int64_t outer, std::int64_t inner,
                cudaStream_t stream) {
  const std::int64_t total = rows * cols * outer * inner;
  if (rows <= 0 || cols <= 0 || total <= 0) return;
  scale_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(rows, cols, beta, dst, inner, total);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void scaled_identity(std::int64_t n_dim, const T* s, std::int64_t s_so, std::int64_t s_si, BatchedMat<T> dst,
                     std::int64_t outer, std::int64_t inner, cudaStream_t stream) {
  const std::int64_t total = n_dim * n_dim * outer * inner;
  if (n_dim <= 0 || total <= 0) return;
  identity_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(n_dim, s, s_so, s_si, dst, inner, total);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void convert_in(const void* src, DType src_dtype, T* dst, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  convert_in_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(src, src_dtype, dst, n);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}
template <typename T>
void convert_out(const T* src, void* dst, DType dst_dtype, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  convert_out_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(src, dst, dst_dtype, n);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void gather_rows(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src, const std::int64_t* idx,
                 T* dst, std::int64_t ld_dst, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  gather_kernel<T><<<blocks_for(rows * cols), kThreads, 0, stream>>>(rows, cols, src, ld_src, idx, dst, ld_dst);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void l2norm_scale_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, T eps, T s, cudaStream_t stream) {
  if (rows <= 0) return;
  l2norm_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, cols, x, ld, eps, s);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}
template <typename T>
void relu_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  relu_kernel<T><<<blocks_for(rows * cols), kThreads, 0, stream>>>(rows, cols, x, ld);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}
template <typename T>
void softmax_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const std::int64_t* end,
                  std::int64_t end_div, T* row_max, T* row_sum, cudaStream_t stream) {
  if (rows <= 0) return;
  softmax_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, cols, x, ld, end, end_div, row_max, row_sum);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}
template <typename T>
void scale_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const T* s, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  scale_rows_kernel<T><<<blocks_for(rows * cols), kThreads, 0, stream>>>(rows, cols, x, ld, s);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}
template <typename T>
void cumsum_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, cudaStream_t stream) {
  if (rows <= 0) return;
  cumsum_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, cols, x, ld);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}
template <typename T>
void gdn_chunk_scales(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* kscale, T* vscale,
                      T* qscale, T* kend, T* end_decay, cudaStream_t stream) {
  if (chunks <= 0 || C <= 0) return;
  chunk_scales_kernel<T>
      <<<blocks_for(chunks), kThreads, 0, stream>>>(chunks, C, gamma, beta, kscale, vscale, qscale, kend, end_decay);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}
template <typename T>
void gdn_chunk_masks(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* a, T* qk,
                     cudaStream_t stream) {
  if (chunks <= 0 || C <= 0) return;
  chunk_masks_kernel<T><<<blocks_for(chunks * C), kThreads, 0, stream>>>(chunks, C, gamma, beta, a, qk);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

#define SEQPAR_OPS_CUDA_INSTANTIATE(T)                                                                                 \
  template void copy_mats<T>(std::int64_t, std::int64_t, BatchedMat<const T>, BatchedMat<T>, std::int64_t,             \
                             std::int64_t, cudaStream_t);                                                              \
  template void scale_mats<T>(std::int64_t, std::int64_t, T, BatchedMat<T>, std::int64_t, std::int64_t, cudaStream_t); \
  template void scaled_identity<T>(std::int64_t, const T*, std::int64_t, std::int64_t, BatchedMat<T>, std::int64_t,    \
                                   std::int64_t, cudaStream_t);                                                        \
  template void convert_in<T>(const void*, DType, T*, std::int64_t, cudaStream_t);                                     \
  template void convert_out<T>(const T*, void*, DType, std::int64_t, cudaStream_t);                                    \
  template void gather_rows<T>(std::int64_t, std::int64_t, const T*, std::int64_t, const std::int64_t*, T*,            \
                               std::int64_t, cudaStream_t);                                                            \
  template void l2norm_scale_rows<T>(std::int64_t, std::int64_t, T*, std::int64_t, T, T, cudaStream_t);                \
  template void relu_rows<T>(std::int64_t, std::int64_t, T*, std::int64_t, cudaStream_t);                              \
  template void softmax_rows<T>(std::int64_t, std::int64_t, T*, std::int64_t, const std::int64_t*, std::int64_t, T*,   \
                                T*, cudaStream_t);                                                                     \
  template void scale_rows<T>(std::int64_t, std::int64_t, T*, std::int64_t, const T*, cudaStream_t);                   \
  template void cumsum_rows<T>(std::int64_t, std::int64_t, T*, std::int64_t, cudaStream_t);                            \
  template void gdn_chunk_scales<T>(std::int64_t, std::int64_t, const T*, const T*, T*, T*, T*, T*, T*, cudaStream_t); \
  template void gdn_chunk_masks<T>(std::int64_t, std::int64_t, const T*, const T*, T*, T*, cudaStream_t);
SEQPAR_OPS_CUDA_INSTANTIATE(float)
SEQPAR_OPS_CUDA_INSTANTIATE(double)
#undef SEQPAR_OPS_CUDA_INSTANTIATE

}  // namespace seqpar::attn::cuda
