// The CUDA ops table's kernels (ops_cuda_kernels.h). The row bodies are attention/kernels/gdn_rows.h, shared with the
// CPU table and tested there; sorting is CUB's.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_sort.cuh>

#include "attention/cuda/ops_cuda_kernels.h"
#include "attention/kernels/gdn_rows.h"
#include "runtime/cuda_check.h"

namespace seqpar::attn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 1 << 20;  // grid-stride loops cover the rest

unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < kMaxBlocks ? (b > 0 ? b : 1) : kMaxBlocks);
}

__device__ std::int64_t thread_index() { return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ std::int64_t thread_stride() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }

#define SEQPAR_GRID_LOOP(t, n) for (std::int64_t t = thread_index(); t < (n); t += thread_stride())

// Stream-ordered scratch, freed (on the stream) at the end of the scope.
class Scratch {
 public:
  Scratch(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    SEQPAR_CHECK_CUDA(cudaMallocAsync(&p_, bytes > 0 ? bytes : 1, stream));
  }
  ~Scratch() { cudaFreeAsync(p_, stream_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename E>
  E* as() const {
    return static_cast<E*>(p_);
  }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_;
};

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
__global__ void gather_kernel(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src,
                              const std::int64_t* idx, T* dst, std::int64_t ld_dst) {
  SEQPAR_GRID_LOOP(t, rows * cols) {
    const std::int64_t r = t / cols, j = t % cols, s = idx[r];
    dst[r * ld_dst + j] = s < 0 ? T(0) : src[s * ld_src + j];
  }
}

__global__ void iota_kernel(std::int64_t n, std::int64_t* x) {
  SEQPAR_GRID_LOOP(t, n) { x[t] = t; }
}

// One thread per (sorted position p, column j): the first position of each destination row's run adds the run's
// source rows in ascending r (the sort is stable).
template <typename T>
__global__ void scatter_runs_kernel(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src,
                                    const std::int64_t* key, const std::int64_t* row, T* dst, std::int64_t ld_dst) {
  SEQPAR_GRID_LOOP(t, rows * cols) {
    const std::int64_t p = t / cols, j = t % cols, d = key[p];
    if (d < 0 || (p > 0 && key[p - 1] == d)) continue;
    T acc = dst[d * ld_dst + j];
    for (std::int64_t q = p; q < rows && key[q] == d; ++q) acc += src[row[q] * ld_src + j];
    dst[d * ld_dst + j] = acc;
  }
}

// Order-preserving unsigned keys: larger score, larger key; -0 and +0 equal; NaN 0, below every other score (-inf
// included, whose key is positive).
template <typename T>
struct OrderedKey;
template <>
struct OrderedKey<float> {
  using U = std::uint32_t;
  __device__ static U of(float x) {
    if (x != x) return 0;
    const U u = x == 0.0f ? 0u : __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
};
template <>
struct OrderedKey<double> {
  using U = unsigned long long;
  __device__ static U of(double x) {
    if (x != x) return 0;
    const U u = x == 0.0 ? 0ull : static_cast<U>(__double_as_longlong(x));
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
  }
};

template <typename T>
__global__ void topk_keys_kernel(std::int64_t rows, std::int64_t n, const T* scores, std::int64_t ld,
                                 const std::int64_t* lo, const std::int64_t* hi, typename OrderedKey<T>::U* keys,
                                 std::int64_t* cols, std::int64_t* begin, std::int64_t* end) {
  SEQPAR_GRID_LOOP(t, rows * n) {
    const std::int64_t r = t / n, j = t % n;
    keys[t] = OrderedKey<T>::of(scores[r * ld + j]);
    cols[t] = j;
    if (j == 0) {
      const std::int64_t b = lo[r] < 0 ? 0 : (lo[r] > n ? n : lo[r]);
      const std::int64_t e = hi[r] > n ? n : (hi[r] < b ? b : hi[r]);
      begin[r] = r * n + b;
      end[r] = r * n + e;
    }
  }
}

// Per row: the first k non-NaN of the sorted candidates (NaN keys, 0, sort last).
template <typename T>
__global__ void topk_take_kernel(std::int64_t rows, std::int64_t k, const typename OrderedKey<T>::U* keys,
                                 const std::int64_t* cols, const std::int64_t* begin, const std::int64_t* end,
                                 std::int64_t* chosen, std::int64_t* take, std::int64_t* begin2, std::int64_t* end2) {
  SEQPAR_GRID_LOOP(r, rows) {
    const std::int64_t len = end[r] - begin[r];
    std::int64_t t = 0;
    for (; t < k && t < len && keys[begin[r] + t] != 0; ++t) chosen[r * k + t] = cols[begin[r] + t];
    take[r] = t;
    begin2[r] = r * k;
    end2[r] = r * k + t;
  }
}

template <typename T>
__global__ void topk_write_kernel(std::int64_t rows, std::int64_t k, const T* scores, std::int64_t ld,
                                  const std::int64_t* sorted, const std::int64_t* take, std::int64_t* idx, T* val) {
  SEQPAR_GRID_LOOP(e, rows * k) {
    const std::int64_t r = e / k, t = e % k;
    const bool sel = t < take[r];
    const std::int64_t c = sel ? sorted[e] : -1;
    idx[e] = c;
    val[e] = sel ? scores[r * ld + c] : static_cast<T>(-HUGE_VAL);
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

#undef SEQPAR_GRID_LOOP

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
void gather_rows(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src, const std::int64_t* idx,
                 T* dst, std::int64_t ld_dst, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  gather_kernel<T><<<blocks_for(rows * cols), kThreads, 0, stream>>>(rows, cols, src, ld_src, idx, dst, ld_dst);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void scatter_add_rows(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src, const std::int64_t* idx,
                      T* dst, std::int64_t ld_dst, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  Scratch pairs(static_cast<std::size_t>(3 * rows) * sizeof(std::int64_t), stream);
  std::int64_t* row_in = pairs.as<std::int64_t>();
  std::int64_t* key_out = row_in + rows;
  std::int64_t* row_out = key_out + rows;
  iota_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(rows, row_in);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
  std::size_t bytes = 0;
  SEQPAR_CHECK_CUDA(
      cub::DeviceRadixSort::SortPairs(nullptr, bytes, idx, key_out, row_in, row_out, rows, 0, 64, stream));
  Scratch temp(bytes, stream);
  SEQPAR_CHECK_CUDA(
      cub::DeviceRadixSort::SortPairs(temp.as<void>(), bytes, idx, key_out, row_in, row_out, rows, 0, 64, stream));
  scatter_runs_kernel<T>
      <<<blocks_for(rows * cols), kThreads, 0, stream>>>(rows, cols, src, ld_src, key_out, row_out, dst, ld_dst);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void topk_rows(std::int64_t rows, std::int64_t n, std::int64_t k, const T* scores, std::int64_t ld,
               const std::int64_t* lo, const std::int64_t* hi, std::int64_t* idx, T* val, cudaStream_t stream) {
  if (rows <= 0 || k <= 0) return;
  using U = typename OrderedKey<T>::U;
  const std::int64_t items = rows * (n > 0 ? n : 0);
  // keys in / out [rows, n], columns in / out [rows, n], chosen / sorted [rows, k], take, begin, end, begin2, end2
  const std::size_t key_bytes = (static_cast<std::size_t>(2 * items) * sizeof(U) + 15) / 16 * 16;
  Scratch buf(key_bytes + static_cast<std::size_t>(2 * items + 2 * rows * k + 5 * rows) * sizeof(std::int64_t), stream);
  U* keys_in = buf.as<U>();
  U* keys_out = keys_in + items;
  std::int64_t* cols_in = reinterpret_cast<std::int64_t*>(buf.as<char>() + key_bytes);
  std::int64_t* cols_out = cols_in + items;
  std::int64_t* chosen = cols_out + items;
  std::int64_t* sorted = chosen + rows * k;
  std::int64_t* take = sorted + rows * k;
  std::int64_t* begin = take + rows;
  std::int64_t* end = begin + rows;
  std::int64_t* begin2 = end + rows;
  std::int64_t* end2 = begin2 + rows;
  SEQPAR_CHECK_CUDA(cudaMemsetAsync(begin, 0, static_cast<std::size_t>(2 * rows) * sizeof(std::int64_t), stream));
  if (items > 0) {
    topk_keys_kernel<T>
        <<<blocks_for(items), kThreads, 0, stream>>>(rows, n, scores, ld, lo, hi, keys_in, cols_in, begin, end);
    SEQPAR_CHECK_CUDA(cudaGetLastError());
    std::size_t bytes = 0;
    SEQPAR_CHECK_CUDA(cub::DeviceSegmentedSort::StableSortPairsDescending(nullptr, bytes, keys_in, keys_out, cols_in,
                                                                          cols_out, items, rows, begin, end, stream));
    Scratch temp(bytes, stream);
    SEQPAR_CHECK_CUDA(cub::DeviceSegmentedSort::StableSortPairsDescending(
        temp.as<void>(), bytes, keys_in, keys_out, cols_in, cols_out, items, rows, begin, end, stream));
  }
  topk_take_kernel<T>
      <<<blocks_for(rows), kThreads, 0, stream>>>(rows, k, keys_out, cols_out, begin, end, chosen, take, begin2, end2);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
  std::size_t bytes = 0;
  SEQPAR_CHECK_CUDA(
      cub::DeviceSegmentedSort::SortKeys(nullptr, bytes, chosen, sorted, rows * k, rows, begin2, end2, stream));
  Scratch temp(bytes, stream);
  SEQPAR_CHECK_CUDA(
      cub::DeviceSegmentedSort::SortKeys(temp.as<void>(), bytes, chosen, sorted, rows * k, rows, begin2, end2, stream));
  topk_write_kernel<T><<<blocks_for(rows * k), kThreads, 0, stream>>>(rows, k, scores, ld, sorted, take, idx, val);
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
  template void gather_rows<T>(std::int64_t, std::int64_t, const T*, std::int64_t, const std::int64_t*, T*,            \
                               std::int64_t, cudaStream_t);                                                            \
  template void scatter_add_rows<T>(std::int64_t, std::int64_t, const T*, std::int64_t, const std::int64_t*, T*,       \
                                    std::int64_t, cudaStream_t);                                                       \
  template void topk_rows<T>(std::int64_t, std::int64_t, std::int64_t, const T*, std::int64_t, const std::int64_t*,    \
                             const std::int64_t*, std::int64_t*, T*, cudaStream_t);                                    \
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
