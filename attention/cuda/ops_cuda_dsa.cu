// The CUDA ops table's DSA ops (ops_cuda_kernels.h): the fixed-order GEMM, the inverted index and the indexed row sums
// (CUB's stable radix sort; no floating-point atomics), the running top-k merge (the union row body, then the table's
// top-k), and launches of the DSA row bodies (attention/kernels/dsa_rows.h, shared with the CPU table and tested
// there), one thread per row or element.
#include <cub/device/device_radix_sort.cuh>

#include "attention/cuda/ops_cuda_common.cuh"
#include "attention/cuda/ops_cuda_kernels.h"
#include "attention/kernels/dsa_rows.h"
#include "runtime/cuda_check.h"

namespace seqpar::attn::cuda {
namespace {

using detail::blocks_for;
using detail::kThreads;
using detail::Scratch;

__device__ inline float fused_madd(float a, float b, float c) { return fmaf(a, b, c); }
__device__ inline double fused_madd(double a, double b, double c) { return fma(a, b, c); }

// One thread per element of C: the sum over p in increasing order by one fused multiply-add per term, the same
// instructions for every element of every shape.
template <typename T>
__global__ void gemm_fixed_kernel(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha,
                                  BatchedMat<const T> a, BatchedMat<const T> b, T beta, BatchedMat<T> c,
                                  std::int64_t inner, std::int64_t total, bool relu) {
  SEQPAR_GRID_LOOP(t, total) {
    const std::int64_t j = t % n, i = (t / n) % m, e = t / (m * n), o = e / inner, x = e % inner;
    const T* ap = a.ptr + o * a.so + x * a.si;
    const T* bp = b.ptr + o * b.so + x * b.si;
    const std::int64_t sa_i = ta ? 1 : a.ld, sa_p = ta ? a.ld : 1, sb_p = tb ? 1 : b.ld, sb_j = tb ? b.ld : 1;
    T acc = T(0);
    for (std::int64_t p = 0; p < k; ++p) acc = fused_madd(ap[i * sa_i + p * sa_p], bp[p * sb_p + j * sb_j], acc);
    T& cij = c.ptr[o * c.so + x * c.si + i * c.ld + j];
    if (relu) {
      const T v = alpha * acc;
      cij = v < T(0) ? T(0) : v;  // NaN stays NaN (relu_rows' rule)
    } else {
      cij = beta == T(0) ? alpha * acc : alpha * acc + beta * cij;
    }
  }
}

__global__ void iota_kernel(std::int64_t n, std::int64_t* x) {
  SEQPAR_GRID_LOOP(t, n) { x[t] = t; }
}

// The first sorted position whose key is >= v.
__device__ inline std::int64_t lower_bound(const std::int64_t* keys, std::int64_t n, std::int64_t v) {
  std::int64_t lo = 0, hi = n;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// offsets[d] = (first key >= d) - (first key >= 0), d <= n_dst; list = the rows of keys in [0, n_dst), in sorted order.
__global__ void inverted_offsets_kernel(std::int64_t n_src, const std::int64_t* keys, std::int64_t n_dst,
                                        std::int64_t* offsets) {
  SEQPAR_GRID_LOOP(d, n_dst + 1) { offsets[d] = lower_bound(keys, n_src, d) - lower_bound(keys, n_src, 0); }
}
__global__ void inverted_list_kernel(std::int64_t n_src, const std::int64_t* keys, const std::int64_t* rows,
                                     std::int64_t n_dst, std::int64_t* list) {
  const std::int64_t first = lower_bound(keys, n_src, 0), last = lower_bound(keys, n_src, n_dst);
  SEQPAR_GRID_LOOP(t, last - first) { list[t] = rows[first + t]; }
}

// One thread per (dst row, column): the rows of its list summed in list order, then added to dst (the CPU table's
// order of additions).
template <typename T>
__global__ void sum_indexed_kernel(std::int64_t n_dst, std::int64_t cols, const T* src, std::int64_t ld_src,
                                   const std::int64_t* offsets, const std::int64_t* list, T* dst, std::int64_t ld_dst) {
  SEQPAR_GRID_LOOP(t, n_dst * cols) {
    const std::int64_t d = t / cols, j = t % cols, b = offsets[d], e = offsets[d + 1];
    if (b == e) continue;
    T acc = src[list[b] * ld_src + j];
    for (std::int64_t i = b + 1; i < e; ++i) acc += src[list[i] * ld_src + j];
    dst[d * ld_dst + j] += acc;
  }
}

template <typename T>
__global__ void topk_union_kernel(std::int64_t rows, std::int64_t k, const T* s_a, const std::int64_t* p_a,
                                  const T* s_b, const std::int64_t* p_b, T* us, std::int64_t* up, std::int64_t* lo,
                                  std::int64_t* hi) {
  SEQPAR_GRID_LOOP(r, rows) {
    lo[r] = 0;
    hi[r] =
        rowops::topk_union_row(k, s_a + r * k, p_a + r * k, s_b + r * k, p_b + r * k, us + r * 2 * k, up + r * 2 * k);
  }
}
template <typename T>
__global__ void topk_pick_kernel(std::int64_t rows, std::int64_t k, const std::int64_t* col, const T* val,
                                 const std::int64_t* up, T* s_a, std::int64_t* p_a) {
  SEQPAR_GRID_LOOP(e, rows * k) {
    const std::int64_t r = e / k, c = col[e];
    s_a[e] = val[e];
    p_a[e] = c < 0 ? -1 : up[r * 2 * k + c];
  }
}

template <typename T>
__global__ void probs_kernel(std::int64_t rows, std::int64_t n, T* s, std::int64_t ld, const std::int64_t* mask,
                             std::int64_t mask_div, const T* lse_hi, const T* lse_lo) {
  SEQPAR_GRID_LOOP(r, rows) { rowops::dsa_probs_row(s + r * ld, n, mask + (r / mask_div) * n, lse_hi[r], lse_lo[r]); }
}
template <typename T>
__global__ void dscore_kernel(std::int64_t rows, std::int64_t n, const T* p, T* dp, std::int64_t ld, const T* delta) {
  SEQPAR_GRID_LOOP(r, rows) { rowops::dsa_dscore_row(p + r * ld, dp + r * ld, n, delta[r]); }
}
// One thread per (query, key): relu_head_sum_row over that one column (the same sum over heads in ascending order).
template <typename T>
__global__ void head_sum_kernel(std::int64_t queries, std::int64_t Hi, std::int64_t n, const T* s, const T* w, T* out) {
  SEQPAR_GRID_LOOP(t, queries * n) {
    const std::int64_t q = t / n, j = t % n;
    rowops::relu_head_sum_row(s + q * Hi * n + j, n, Hi, std::int64_t{1}, w + q * Hi, out + t);
  }
}
template <typename T>
__global__ void indexer_grad_kernel(std::int64_t queries, std::int64_t Hi, std::int64_t n, T* s, const T* w, const T* g,
                                    T* dw) {
  SEQPAR_GRID_LOOP(t, queries * Hi) { dw[t] = rowops::indexer_grad_row(s + t * n, n, w[t], g + (t / Hi) * n); }
}
template <typename T>
__global__ void kl_kernel(std::int64_t rows, std::int64_t k, const T* probs, const T* scores, const std::int64_t* idx,
                          double grad_scale, T* dscores, double* loss) {
  SEQPAR_GRID_LOOP(r, rows) {
    loss[r] = rowops::kl_row(probs + r * k, scores + r * k, idx + r * k, k, grad_scale,
                             dscores != nullptr ? dscores + r * k : nullptr);
  }
}

void check_launch() { SEQPAR_CHECK_CUDA(cudaGetLastError()); }

}  // namespace

template <typename T>
void gemm_fixed_order(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, BatchedMat<const T> a,
                      BatchedMat<const T> b, T beta, BatchedMat<T> c, std::int64_t outer, std::int64_t inner,
                      cudaStream_t stream, bool relu) {
  const std::int64_t total = m * n * outer * inner;
  if (m <= 0 || n <= 0 || total <= 0) return;
  gemm_fixed_kernel<T>
      <<<blocks_for(total), kThreads, 0, stream>>>(ta, tb, m, n, k > 0 ? k : 0, alpha, a, b, beta, c, inner, total, relu);
  check_launch();
}

void inverted_index(std::int64_t n_src, const std::int64_t* idx, std::int64_t n_dst, std::int64_t* offsets,
                    std::int64_t* list, cudaStream_t stream) {
  if (n_dst < 0) return;
  if (n_src <= 0) {
    SEQPAR_CHECK_CUDA(cudaMemsetAsync(offsets, 0, static_cast<std::size_t>(n_dst + 1) * sizeof(std::int64_t), stream));
    return;
  }
  Scratch pairs(static_cast<std::size_t>(3 * n_src) * sizeof(std::int64_t), stream);
  std::int64_t* row_in = pairs.as<std::int64_t>();
  std::int64_t* key_out = row_in + n_src;
  std::int64_t* row_out = key_out + n_src;
  iota_kernel<<<blocks_for(n_src), kThreads, 0, stream>>>(n_src, row_in);
  check_launch();
  std::size_t bytes = 0;
  SEQPAR_CHECK_CUDA(
      cub::DeviceRadixSort::SortPairs(nullptr, bytes, idx, key_out, row_in, row_out, n_src, 0, 64, stream));
  Scratch temp(bytes, stream);
  SEQPAR_CHECK_CUDA(
      cub::DeviceRadixSort::SortPairs(temp.as<void>(), bytes, idx, key_out, row_in, row_out, n_src, 0, 64, stream));
  inverted_offsets_kernel<<<blocks_for(n_dst + 1), kThreads, 0, stream>>>(n_src, key_out, n_dst, offsets);
  check_launch();
  inverted_list_kernel<<<blocks_for(n_src), kThreads, 0, stream>>>(n_src, key_out, row_out, n_dst, list);
  check_launch();
}

template <typename T>
void sum_rows_indexed(std::int64_t n_dst, std::int64_t cols, const T* src, std::int64_t ld_src,
                      const std::int64_t* offsets, const std::int64_t* list, T* dst, std::int64_t ld_dst,
                      cudaStream_t stream) {
  if (n_dst <= 0 || cols <= 0) return;
  sum_indexed_kernel<T>
      <<<blocks_for(n_dst * cols), kThreads, 0, stream>>>(n_dst, cols, src, ld_src, offsets, list, dst, ld_dst);
  check_launch();
}

template <typename T>
void topk_merge_rows(std::int64_t rows, std::int64_t k, T* s_a, std::int64_t* p_a, const T* s_b,
                     const std::int64_t* p_b, cudaStream_t stream) {
  if (rows <= 0 || k <= 0) return;
  // the union [rows, 2k] (zeroed first: the columns past a row's length are read, never selected), its [0, length)
  // ranges, then the selection's columns and scores [rows, k]
  const std::size_t nu = static_cast<std::size_t>(rows * 2 * k), ns = static_cast<std::size_t>(rows * k);
  const std::size_t s_bytes = (nu * sizeof(T) + 15) / 16 * 16, v_bytes = (ns * sizeof(T) + 15) / 16 * 16;
  const std::size_t bytes = s_bytes + v_bytes + (nu + ns + 2 * static_cast<std::size_t>(rows)) * sizeof(std::int64_t);
  Scratch buf(bytes, stream);
  SEQPAR_CHECK_CUDA(cudaMemsetAsync(buf.as<void>(), 0, bytes, stream));
  T* us = buf.as<T>();
  T* val = reinterpret_cast<T*>(buf.as<char>() + s_bytes);
  std::int64_t* up = reinterpret_cast<std::int64_t*>(buf.as<char>() + s_bytes + v_bytes);
  std::int64_t* col = up + nu;
  std::int64_t* lo = col + ns;
  std::int64_t* hi = lo + rows;
  topk_union_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, k, s_a, p_a, s_b, p_b, us, up, lo, hi);
  check_launch();
  topk_rows(rows, 2 * k, k, us, 2 * k, lo, hi, col, val, stream);
  topk_pick_kernel<T><<<blocks_for(rows * k), kThreads, 0, stream>>>(rows, k, col, val, up, s_a, p_a);
  check_launch();
}

template <typename T>
void dsa_probs_rows(std::int64_t rows, std::int64_t n, T* s, std::int64_t ld, const std::int64_t* mask,
                    std::int64_t mask_div, const T* lse_hi, const T* lse_lo, cudaStream_t stream) {
  if (rows <= 0) return;
  probs_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, n, s, ld, mask, mask_div, lse_hi, lse_lo);
  check_launch();
}
template <typename T>
void dsa_dscore_rows(std::int64_t rows, std::int64_t n, const T* p, T* dp, std::int64_t ld, const T* delta,
                     cudaStream_t stream) {
  if (rows <= 0) return;
  dscore_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, n, p, dp, ld, delta);
  check_launch();
}
template <typename T>
void relu_head_sum_rows(std::int64_t queries, std::int64_t Hi, std::int64_t n, const T* s, const T* w, T* out,
                        cudaStream_t stream) {
  if (queries <= 0 || n <= 0) return;
  head_sum_kernel<T><<<blocks_for(queries * n), kThreads, 0, stream>>>(queries, Hi, n, s, w, out);
  check_launch();
}
template <typename T>
void indexer_grad_rows(std::int64_t queries, std::int64_t Hi, std::int64_t n, T* s, const T* w, const T* g, T* dw,
                       cudaStream_t stream) {
  if (queries <= 0 || Hi <= 0) return;
  indexer_grad_kernel<T><<<blocks_for(queries * Hi), kThreads, 0, stream>>>(queries, Hi, n, s, w, g, dw);
  check_launch();
}
template <typename T>
void kl_rows(std::int64_t rows, std::int64_t k, const T* probs, const T* scores, const std::int64_t* idx,
             double grad_scale, T* dscores, double* loss, cudaStream_t stream) {
  if (rows <= 0) return;
  kl_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(rows, k, probs, scores, idx, grad_scale, dscores, loss);
  check_launch();
}

#define SEQPAR_OPS_CUDA_INSTANTIATE(T)                                                                                 \
  template void gemm_fixed_order<T>(bool, bool, std::int64_t, std::int64_t, std::int64_t, T, BatchedMat<const T>,      \
                                    BatchedMat<const T>, T, BatchedMat<T>, std::int64_t, std::int64_t, cudaStream_t,   \
                                    bool);                                                                             \
  template void sum_rows_indexed<T>(std::int64_t, std::int64_t, const T*, std::int64_t, const std::int64_t*,           \
                                    const std::int64_t*, T*, std::int64_t, cudaStream_t);                              \
  template void topk_merge_rows<T>(std::int64_t, std::int64_t, T*, std::int64_t*, const T*, const std::int64_t*,       \
                                   cudaStream_t);                                                                      \
  template void dsa_probs_rows<T>(std::int64_t, std::int64_t, T*, std::int64_t, const std::int64_t*, std::int64_t,     \
                                  const T*, const T*, cudaStream_t);                                                   \
  template void dsa_dscore_rows<T>(std::int64_t, std::int64_t, const T*, T*, std::int64_t, const T*, cudaStream_t);    \
  template void relu_head_sum_rows<T>(std::int64_t, std::int64_t, std::int64_t, const T*, const T*, T*, cudaStream_t); \
  template void indexer_grad_rows<T>(std::int64_t, std::int64_t, std::int64_t, T*, const T*, const T*, T*,             \
                                     cudaStream_t);                                                                    \
  template void kl_rows<T>(std::int64_t, std::int64_t, const T*, const T*, const std::int64_t*, double, T*, double*,   \
                           cudaStream_t);
SEQPAR_OPS_CUDA_INSTANTIATE(float)
SEQPAR_OPS_CUDA_INSTANTIATE(double)
#undef SEQPAR_OPS_CUDA_INSTANTIATE

}  // namespace seqpar::attn::cuda
