// The CUDA ops table's sort-based ops (ops_cuda_kernels.h): the deterministic scatter-add and top-k on CUB's
// sorts (a translation unit of its own, compiled in parallel with the rest: CUB's sorts are most of the CUDA
// compile time).
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_sort.cuh>

#include <type_traits>

#include "attention/cuda/ops_cuda_common.cuh"
#include "attention/cuda/ops_cuda_kernels.h"
#include "attention/cuda/ops_cuda_keys.h"
#include "runtime/cuda_check.h"

namespace seqpar::attn::cuda {
namespace {

using detail::blocks_for;
using detail::kThreads;
using detail::Scratch;

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

using ops::cuda_plan::OrderedKey;  // ops_cuda_keys.h

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

#if defined(SEQPAR_OPS_WITH_FLASHINFER)
// FlashInfer's input: row r's candidates [lo, hi) at the front of row r of x [rows, n], each score mapped by
// FlashInferInput (ops_cuda_keys.h: order kept, ties kept, NaN below everything); columns past the row's length -inf
// (never read).
__global__ void fi_prepare_kernel(std::int64_t rows, std::int64_t n, const float* scores, std::int64_t ld,
                                  const std::int64_t* lo, const std::int64_t* hi, float* x, std::int32_t* len,
                                  std::int64_t* base) {
  SEQPAR_GRID_LOOP(t, rows * n) {
    const std::int64_t r = t / n, j = t % n;
    const std::int64_t b = lo[r] < 0 ? 0 : (lo[r] > n ? n : lo[r]);
    const std::int64_t e = hi[r] > n ? n : (hi[r] < b ? b : hi[r]);
    if (j == 0) {
      len[r] = static_cast<std::int32_t>(e - b);
      base[r] = b;
    }
    x[t] = j < e - b ? ops::cuda_plan::FlashInferInput::of(scores[r * ld + b + j]) : -HUGE_VALF;
  }
}

// Per row: the selected columns that are candidates with a non-NaN score, as absolute columns at the front of
// chosen [rows, k], their count in take, and the ranges [r k, r k + take) for the sort by column.
__global__ void fi_pick_kernel(std::int64_t rows, std::int64_t k, const float* scores, std::int64_t ld,
                               const std::int32_t* sel, const std::int32_t* len, const std::int64_t* base,
                               std::int64_t* chosen, std::int64_t* take, std::int64_t* begin2, std::int64_t* end2) {
  SEQPAR_GRID_LOOP(r, rows) {
    std::int64_t t = 0;
    for (std::int64_t i = 0; i < k; ++i) {
      const std::int64_t c = sel[r * k + i];
      if (c < 0 || c >= len[r]) continue;
      const float v = scores[r * ld + base[r] + c];
      if (v != v) continue;
      chosen[r * k + t++] = base[r] + c;
    }
    take[r] = t;
    begin2[r] = r * k;
    end2[r] = r * k + t;
  }
}
#endif

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

}  // namespace

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

// The selection's columns at the front of chosen [rows, k] (take per row) sorted by column into `sorted`, then written
// out with their scores (the tail of both paths below).
template <typename T>
void topk_sort_write(std::int64_t rows, std::int64_t k, const T* scores, std::int64_t ld, std::int64_t* chosen,
                     std::int64_t* sorted, const std::int64_t* take, const std::int64_t* begin2,
                     const std::int64_t* end2, std::int64_t* idx, T* val, cudaStream_t stream) {
  std::size_t bytes = 0;
  SEQPAR_CHECK_CUDA(
      cub::DeviceSegmentedSort::SortKeys(nullptr, bytes, chosen, sorted, rows * k, rows, begin2, end2, stream));
  Scratch temp(bytes, stream);
  SEQPAR_CHECK_CUDA(
      cub::DeviceSegmentedSort::SortKeys(temp.as<void>(), bytes, chosen, sorted, rows * k, rows, begin2, end2, stream));
  topk_write_kernel<T><<<blocks_for(rows * k), kThreads, 0, stream>>>(rows, k, scores, ld, sorted, take, idx, val);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

#if defined(SEQPAR_OPS_WITH_FLASHINFER)
// fp32 rows through FlashInfer's filtered top-k (see fi_prepare_kernel), then the pick and the sort by column.
static bool topk_rows_flashinfer(std::int64_t rows, std::int64_t n, std::int64_t k, const float* scores, std::int64_t ld,
                          const std::int64_t* lo, const std::int64_t* hi, std::int64_t* idx, float* val,
                          cudaStream_t stream) {
  if (!flashinfer_topk_usable(n, k)) return false;
  // x [rows, n], sel [rows, k], len (int32) [rows]; base, take, begin2, end2 [rows], chosen / sorted [rows, k]
  const std::size_t f_bytes = (static_cast<std::size_t>(rows * n) * sizeof(float) + 15) / 16 * 16;
  const std::size_t i_bytes = (static_cast<std::size_t>(rows * k + rows) * sizeof(std::int32_t) + 15) / 16 * 16;
  Scratch buf(f_bytes + i_bytes + static_cast<std::size_t>(4 * rows + 2 * rows * k) * sizeof(std::int64_t), stream);
  float* x = buf.as<float>();
  std::int32_t* sel = reinterpret_cast<std::int32_t*>(buf.as<char>() + f_bytes);
  std::int32_t* len = sel + rows * k;
  std::int64_t* base = reinterpret_cast<std::int64_t*>(buf.as<char>() + f_bytes + i_bytes);
  std::int64_t* take = base + rows;
  std::int64_t* begin2 = take + rows;
  std::int64_t* end2 = begin2 + rows;
  std::int64_t* chosen = end2 + rows;
  std::int64_t* sorted = chosen + rows * k;
  fi_prepare_kernel<<<blocks_for(rows * n), kThreads, 0, stream>>>(rows, n, scores, ld, lo, hi, x, len, base);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
  flashinfer_topk_select(x, len, rows, n, k, sel, stream);
  fi_pick_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(rows, k, scores, ld, sel, len, base, chosen, take, begin2,
                                                            end2);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
  topk_sort_write<float>(rows, k, scores, ld, chosen, sorted, take, begin2, end2, idx, val, stream);
  return true;
}
#endif

template <typename T>
void topk_rows(std::int64_t rows, std::int64_t n, std::int64_t k, const T* scores, std::int64_t ld,
               const std::int64_t* lo, const std::int64_t* hi, std::int64_t* idx, T* val, cudaStream_t stream) {
  if (rows <= 0 || k <= 0) return;
#if defined(SEQPAR_OPS_WITH_FLASHINFER)
  if constexpr (std::is_same_v<T, float>) {
    if (topk_rows_flashinfer(rows, n, k, scores, ld, lo, hi, idx, val, stream)) return;
  }
#endif
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
  topk_sort_write<T>(rows, k, scores, ld, chosen, sorted, take, begin2, end2, idx, val, stream);
}

#define SEQPAR_OPS_CUDA_INSTANTIATE(T)                                                                              \
  template void scatter_add_rows<T>(std::int64_t, std::int64_t, const T*, std::int64_t, const std::int64_t*, T*,    \
                                    std::int64_t, cudaStream_t);                                                    \
  template void topk_rows<T>(std::int64_t, std::int64_t, std::int64_t, const T*, std::int64_t, const std::int64_t*, \
                             const std::int64_t*, std::int64_t*, T*, cudaStream_t);
SEQPAR_OPS_CUDA_INSTANTIATE(float)
SEQPAR_OPS_CUDA_INSTANTIATE(double)
#undef SEQPAR_OPS_CUDA_INSTANTIATE

}  // namespace seqpar::attn::cuda
