// CUDA launches behind the CUDA ops table (ops_cuda.h): the element and row kernels (bodies shared with the CPU table:
// attention/kernels/gdn_rows.h), the CUB-based top-k and scatter-add, and the pointer arrays of the batched cuBLAS
// calls. Device pointers, T = float or double, asynchronous on `stream` (launch errors raised at once, execution
// errors at the next synchronising call); scratch is stream-ordered (cudaMallocAsync / cudaFreeAsync on `stream`).
// Internal to attention/cuda/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "runtime/dtype.h"

namespace seqpar::attn::cuda {

// A batched matrix operand of the ops table (ops::Mat): element (i, j) of matrix (o, n) at
// ptr[o * so + n * si + i * ld + j], o < outer, n < inner.
template <typename P>
struct BatchedMat {
  P* ptr = nullptr;
  std::int64_t ld = 0, so = 0, si = 0;
};

// ptrs[b] = base + (b / inner) * so + (b % inner) * si (in elements of elem_bytes), b < outer * inner: the pointer
// array of a pointer-array cuBLAS call, built on the device (no host transfer).
void batch_pointers(const void* base, std::size_t elem_bytes, std::int64_t so, std::int64_t si, std::int64_t outer,
                    std::int64_t inner, void** ptrs, cudaStream_t stream);

// dst = src ([rows, cols] matrices of a two-level batch).
template <typename T>
void copy_mats(std::int64_t rows, std::int64_t cols, BatchedMat<const T> src, BatchedMat<T> dst, std::int64_t outer,
               std::int64_t inner, cudaStream_t stream);
// dst = beta dst (beta = 0: dst = 0, NaN included).
template <typename T>
void scale_mats(std::int64_t rows, std::int64_t cols, T beta, BatchedMat<T> dst, std::int64_t outer, std::int64_t inner,
                cudaStream_t stream);
// dst (o, n) = s[o * s_so + n * s_si] I ([n_dim, n_dim]).
template <typename T>
void scaled_identity(std::int64_t n_dim, const T* s, std::int64_t s_so, std::int64_t s_si, BatchedMat<T> dst,
                     std::int64_t outer, std::int64_t inner, cudaStream_t stream);

// ops::Ops::convert_in / convert_out: one thread per element, bodies runtime/dtype.h load_element / store_element.
template <typename T>
void convert_in(const void* src, DType src_dtype, T* dst, std::int64_t n, cudaStream_t stream);
template <typename T>
void convert_out(const T* src, void* dst, DType dst_dtype, std::int64_t n, cudaStream_t stream);

// ops::Ops::gather_rows / scatter_add_rows (idx: int64 on the device). scatter_add sorts (idx[r], r) with CUB's
// stable radix sort into an inverted index, then one thread per (destination row, column) adds the rows of its run
// in ascending r: deterministic, the CPU table's order of additions, no floating-point atomics.
template <typename T>
void gather_rows(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src, const std::int64_t* idx,
                 T* dst, std::int64_t ld_dst, cudaStream_t stream);
template <typename T>
void scatter_add_rows(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src, const std::int64_t* idx,
                      T* dst, std::int64_t ld_dst, cudaStream_t stream);

// ops::Ops::topk_rows: per row, CUB's stable segmented sort (DeviceSegmentedSort::StableSortPairsDescending) of the
// candidate columns [lo, hi) by an order-preserving unsigned key of the score (NaN below -inf, -0 = +0), so that
// ties keep the lower column; the first k non-NaN are re-sorted by column (DeviceSegmentedSort::SortKeys). Scratch
// O(rows n).
template <typename T>
void topk_rows(std::int64_t rows, std::int64_t n, std::int64_t k, const T* scores, std::int64_t ld,
               const std::int64_t* lo, const std::int64_t* hi, std::int64_t* idx, T* val, cudaStream_t stream);

// Row kernels, one thread per row (per element for relu / scale), bodies rowops:: of attention/kernels/gdn_rows.h.
template <typename T>
void l2norm_scale_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, T eps, T s, cudaStream_t stream);
template <typename T>
void relu_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, cudaStream_t stream);
template <typename T>
void softmax_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const std::int64_t* end,
                  std::int64_t end_div, T* row_max, T* row_sum, cudaStream_t stream);
template <typename T>
void scale_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const T* s, cudaStream_t stream);
template <typename T>
void cumsum_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, cudaStream_t stream);
template <typename T>
void gdn_chunk_scales(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* kscale, T* vscale,
                      T* qscale, T* kend, T* end_decay, cudaStream_t stream);
template <typename T>
void gdn_chunk_masks(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* a, T* qk,
                     cudaStream_t stream);

// ---- the GDN backward and the short conv: one thread per row, chunk row, chunk or channel (bodies: gdn_rows.h) ----
template <typename T>
void row_dots(std::int64_t rows, std::int64_t cols, const T* a, std::int64_t lda, const T* b, std::int64_t ldb, T* out,
              cudaStream_t stream);
template <typename T>
void l2norm_scale_backward_rows(std::int64_t rows, std::int64_t cols, const T* x, std::int64_t ldx, T* dy,
                                std::int64_t ldy, T eps, T s, cudaStream_t stream);
template <typename T>
void gdn_chunk_masks_backward(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, const T* kk,
                              const T* qk, const T* dp, const T* da, T* dqk, T* dkk, T* dgamma, T* dbeta,
                              cudaStream_t stream);
template <typename T>
void gdn_chunk_scales_backward(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, const T* dqq,
                               const T* dkbk, const T* dvbv, const T* dktk, const T* sds, T* dgamma, T* dbeta,
                               cudaStream_t stream);
template <typename T>
void short_conv_rows(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin, const std::int64_t* first,
                     const T* weight, bool silu, T* y, cudaStream_t stream);
template <typename T>
void short_conv_dpre_rows(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin, const std::int64_t* first,
                          const T* weight, bool silu, T* dy, cudaStream_t stream);
template <typename T>
void short_conv_dx_rows(std::int64_t xrows, std::int64_t C, std::int64_t W, const T* dpre, const std::int64_t* src,
                        const T* weight, T* dxin, cudaStream_t stream);
template <typename T>
void short_conv_dweight(std::int64_t rows, std::int64_t C, std::int64_t W, const T* dpre, const T* xin,
                        const std::int64_t* first, T* dweight, cudaStream_t stream);

// ---- DSA (ops_cuda_dsa.cu; bodies: dsa_rows.h) ----
// gemm_fixed_order: one thread per element of C, the sum over k in increasing order by one fused multiply-add per
// term (the same instructions for every element of every shape; not cuBLAS, so far slower than gemm); relu: C =
// relu(alpha op(A) op(B)) (beta ignored; NaN stays NaN), gemm_relu_fixed_order's fp64 form.
template <typename T>
void gemm_fixed_order(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, BatchedMat<const T> a,
                      BatchedMat<const T> b, T beta, BatchedMat<T> c, std::int64_t outer, std::int64_t inner,
                      cudaStream_t stream, bool relu = false);
// inverted_index: CUB's stable radix sort of (idx, r), then offsets by binary search per destination row.
void inverted_index(std::int64_t n_src, const std::int64_t* idx, std::int64_t n_dst, std::int64_t* offsets,
                    std::int64_t* list, cudaStream_t stream);
// sum_rows_indexed: one thread per (destination row, column), its list in order.
template <typename T>
void sum_rows_indexed(std::int64_t n_dst, std::int64_t cols, const T* src, std::int64_t ld_src,
                      const std::int64_t* offsets, const std::int64_t* list, T* dst, std::int64_t ld_dst,
                      cudaStream_t stream);
// topk_merge_rows: rowops::topk_union_row per row, topk_rows over the union's columns, a pick (NaN scores are never
// kept, as topk_rows').
template <typename T>
void topk_merge_rows(std::int64_t rows, std::int64_t k, T* s_a, std::int64_t* p_a, const T* s_b,
                     const std::int64_t* p_b, cudaStream_t stream);
template <typename T>
void dsa_probs_rows(std::int64_t rows, std::int64_t n, T* s, std::int64_t ld, const std::int64_t* mask,
                    std::int64_t mask_div, const T* lse_hi, const T* lse_lo, cudaStream_t stream);
template <typename T>
void dsa_dscore_rows(std::int64_t rows, std::int64_t n, const T* p, T* dp, std::int64_t ld, const T* delta,
                     cudaStream_t stream);
template <typename T>
void relu_head_sum_rows(std::int64_t queries, std::int64_t Hi, std::int64_t n, const T* s, const T* w, T* out,
                        cudaStream_t stream);
template <typename T>
void indexer_grad_rows(std::int64_t queries, std::int64_t Hi, std::int64_t n, T* s, const T* w, const T* g, T* dw,
                       cudaStream_t stream);
template <typename T>
void kl_rows(std::int64_t rows, std::int64_t k, const T* probs, const T* scores, const std::int64_t* idx,
             double grad_scale, T* dscores, double* loss, cudaStream_t stream);

// FlashInfer's filtered top-k (ops_cuda_topk_flashinfer.cu; built when .deps/flashinfer holds its headers:
// SEQPAR_OPS_WITH_FLASHINFER). usable: k <= 2048, 32-bit lengths, and the device has the shared memory it needs.
// select: per row r of x [rows, n] (fp32, row stride n), the columns of the k largest of its first len[r] entries
// (ties at the threshold to the smaller column), in any order, into sel [rows, k] (-1 past len[r]).
bool flashinfer_topk_usable(std::int64_t n, std::int64_t k);
void flashinfer_topk_select(float* x, const std::int32_t* len, std::int64_t rows, std::int64_t n, std::int64_t k,
                            std::int32_t* sel, cudaStream_t stream);

}  // namespace seqpar::attn::cuda
