// CUDA kernels of runtime/tensor_ops.h (CUDA builds only): the data movement of the distributed schedules on device
// buffers. Every call is ordered on the caller's stream and synchronises it before returning (the host-synchronous
// contract of tensor_ops.h); row indices are copied to the device first.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "runtime/cuda_check.h"
#include "runtime/elementwise.h"
#include "runtime/error.h"

namespace seqpar {
namespace {

constexpr int kThreads = 256;

cudaStream_t to_cuda(void* stream) { return static_cast<cudaStream_t>(stream); }

unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 ? (b < 1 ? 1 : b) : 65535);
}

template <typename T>
__global__ void add_kernel(T* dst, const T* src, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] += src[i];
}

template <typename T>
__global__ void add_scaled_kernel(T* dst, const T* src, T alpha, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = elementwise::add_scaled(dst[i], src[i], alpha);
}

template <typename T>
__global__ void fill_kernel(T* dst, T value, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = value;
}

// Element conversions: 16-bit targets round from fp32 (round to nearest even, like the host's convert()).
__device__ double load_value(const double* p, std::int64_t i) { return p[i]; }
__device__ double load_value(const float* p, std::int64_t i) { return p[i]; }
__device__ double load_value(const __nv_bfloat16* p, std::int64_t i) { return __bfloat162float(p[i]); }
__device__ double load_value(const __half* p, std::int64_t i) { return __half2float(p[i]); }
__device__ void store_value(double* p, std::int64_t i, double v) { p[i] = v; }
__device__ void store_value(float* p, std::int64_t i, double v) { p[i] = static_cast<float>(v); }
__device__ void store_value(__nv_bfloat16* p, std::int64_t i, double v) {
  p[i] = __float2bfloat16_rn(static_cast<float>(v));
}
__device__ void store_value(__half* p, std::int64_t i, double v) { p[i] = __float2half_rn(static_cast<float>(v)); }

template <typename S, typename D>
__global__ void convert_kernel(const S* src, D* dst, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    store_value(dst, i, load_value(src, i));
}

__global__ void count_nonnegative_kernel(const std::int64_t* src, std::int64_t n, unsigned long long* count) {
  unsigned long long mine = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    mine += src[i] >= 0 ? 1 : 0;
  if (mine != 0) atomicAdd(count, mine);
}

// Calls fn(p) with `ptr` cast to the element type of floating kind `kind` (0 fp64, 1 fp32, 2 bf16, 3 fp16).
template <typename P, typename Fn>
void with_floating_kind(P* ptr, int kind, Fn&& fn) {
  switch (kind) {
    case 0: fn(reinterpret_cast<double*>(ptr)); break;
    case 1: fn(reinterpret_cast<float*>(ptr)); break;
    case 2: fn(reinterpret_cast<__nv_bfloat16*>(ptr)); break;
    case 3: fn(reinterpret_cast<__half*>(ptr)); break;
    default: SEQPAR_THROW("copy_convert: dtype kind ", kind, " has no device conversion");
  }
}

// One byte per thread-iteration over (outer, i, byte): simple and dtype-agnostic.
__global__ void move_rows_kernel(const char* src, char* dst, std::int64_t outer, std::int64_t src_len,
                                 std::int64_t dst_len, std::int64_t row_bytes, const std::int64_t* index,
                                 std::int64_t n, bool gather) {
  const std::int64_t total = outer * n * row_bytes;
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t byte = t % row_bytes, i = (t / row_bytes) % n, o = t / (row_bytes * n);
    const std::int64_t si = gather ? index[i] : i, di = gather ? i : index[i];
    dst[(o * dst_len + di) * row_bytes + byte] = src[(o * src_len + si) * row_bytes + byte];
  }
}

// One thread per (outer, element of a destination row); the source rows are visited in increasing i (deterministic).
template <typename T>
__global__ void index_add_kernel(const T* src, T* dst, std::int64_t outer, std::int64_t src_len, std::int64_t dst_len,
                                 std::int64_t row_elems, const std::int64_t* index, std::int64_t n) {
  const std::int64_t total = outer * dst_len * row_elems;
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = t % row_elems, row = (t / row_elems) % dst_len, o = t / (row_elems * dst_len);
    T acc = dst[t];
    for (std::int64_t i = 0; i < n; ++i)
      if (index[i] == row) acc += src[(o * src_len + i) * row_elems + e];
    dst[t] = acc;
  }
}

__global__ void swap_kernel(const char* src, char* dst, std::int64_t a, std::int64_t b, std::int64_t rest) {
  const std::int64_t total = a * b * rest;
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t byte = t % rest, j = (t / rest) % b, i = t / (rest * b);
    dst[(j * a + i) * rest + byte] = src[t];
  }
}

// Device copy of a host index array, freed by the destructor.
struct DeviceIndex {
  std::int64_t* ptr = nullptr;
  DeviceIndex(const std::int64_t* host, std::int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    SEQPAR_CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&ptr), n * sizeof(std::int64_t), stream));
    SEQPAR_CHECK_CUDA(cudaMemcpyAsync(ptr, host, n * sizeof(std::int64_t), cudaMemcpyHostToDevice, stream));
  }
  void release(cudaStream_t stream) {
    if (ptr != nullptr) SEQPAR_CHECK_CUDA(cudaFreeAsync(ptr, stream));
    ptr = nullptr;
  }
};

void finish(cudaStream_t stream) {
  SEQPAR_CHECK_CUDA(cudaGetLastError());
  SEQPAR_CHECK_CUDA(cudaStreamSynchronize(stream));
}

}  // namespace

void cuda_add_inplace(void* dst, const void* src, std::int64_t n, bool fp64, void* stream) {
  if (n == 0) return;
  const cudaStream_t s = to_cuda(stream);
  if (fp64) {
    add_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<double*>(dst), static_cast<const double*>(src), n);
  } else {
    add_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<float*>(dst), static_cast<const float*>(src), n);
  }
  finish(s);
}

void cuda_add_scaled(void* dst, const void* src, std::int64_t n, bool fp64, double alpha, void* stream) {
  if (n == 0) return;
  const cudaStream_t s = to_cuda(stream);
  if (fp64) {
    add_scaled_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<double*>(dst), static_cast<const double*>(src),
                                                         alpha, n);
  } else {
    add_scaled_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<float*>(dst), static_cast<const float*>(src),
                                                         static_cast<float>(alpha), n);
  }
  finish(s);
}

// kind: 0 fp64, 1 fp32, 2 bf16, 3 fp16 (runtime/dtype.h is not included: nvcc compiles C++17).
void cuda_fill(void* dst, int kind, std::int64_t n, double value, void* stream) {
  if (n == 0) return;
  const cudaStream_t s = to_cuda(stream);
  switch (kind) {
    case 0: fill_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<double*>(dst), value, n); break;
    case 1:
      fill_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<float*>(dst), static_cast<float>(value), n);
      break;
    case 2:
      fill_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<__nv_bfloat16*>(dst),
                                                     __float2bfloat16(static_cast<float>(value)), n);
      break;
    case 3:
      fill_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<__half*>(dst), __float2half(static_cast<float>(value)),
                                                     n);
      break;
    default: SEQPAR_THROW("fill: dtype kind ", kind, " is not floating");
  }
  finish(s);
}

void cuda_convert(const void* src, int src_kind, void* dst, int dst_kind, std::int64_t n, void* stream) {
  if (n == 0) return;
  const cudaStream_t s = to_cuda(stream);
  with_floating_kind(const_cast<void*>(src), src_kind, [&](auto* sp) {
    with_floating_kind(dst, dst_kind, [&](auto* dp) { convert_kernel<<<blocks_for(n), kThreads, 0, s>>>(sp, dp, n); });
  });
  finish(s);
}

std::int64_t cuda_count_nonnegative(const std::int64_t* src, std::int64_t n, void* stream) {
  if (n == 0) return 0;
  const cudaStream_t s = to_cuda(stream);
  unsigned long long* count = nullptr;
  SEQPAR_CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&count), sizeof(unsigned long long), s));
  SEQPAR_CHECK_CUDA(cudaMemsetAsync(count, 0, sizeof(unsigned long long), s));
  count_nonnegative_kernel<<<blocks_for(n), kThreads, 0, s>>>(src, n, count);
  unsigned long long host = 0;
  SEQPAR_CHECK_CUDA(cudaMemcpyAsync(&host, count, sizeof(host), cudaMemcpyDeviceToHost, s));
  SEQPAR_CHECK_CUDA(cudaFreeAsync(count, s));
  finish(s);
  return static_cast<std::int64_t>(host);
}

void cuda_move_rows(const void* src, void* dst, std::int64_t outer, std::int64_t src_len, std::int64_t dst_len,
                    std::size_t row_bytes, const std::int64_t* index, std::int64_t n, bool gather, void* stream) {
  const std::int64_t total = outer * n * static_cast<std::int64_t>(row_bytes);
  if (total == 0) return;
  const cudaStream_t s = to_cuda(stream);
  DeviceIndex idx(index, n, s);
  move_rows_kernel<<<blocks_for(total), kThreads, 0, s>>>(static_cast<const char*>(src), static_cast<char*>(dst), outer,
                                                          src_len, dst_len, static_cast<std::int64_t>(row_bytes),
                                                          idx.ptr, n, gather);
  idx.release(s);
  finish(s);
}

void cuda_index_add_rows(const void* src, void* dst, std::int64_t outer, std::int64_t src_len, std::int64_t dst_len,
                         std::int64_t row_elems, bool fp64, const std::int64_t* index, std::int64_t n, void* stream) {
  const std::int64_t total = outer * dst_len * row_elems;
  if (total == 0 || n == 0) return;
  const cudaStream_t s = to_cuda(stream);
  DeviceIndex idx(index, n, s);
  if (fp64) {
    index_add_kernel<<<blocks_for(total), kThreads, 0, s>>>(static_cast<const double*>(src), static_cast<double*>(dst),
                                                            outer, src_len, dst_len, row_elems, idx.ptr, n);
  } else {
    index_add_kernel<<<blocks_for(total), kThreads, 0, s>>>(static_cast<const float*>(src), static_cast<float*>(dst),
                                                            outer, src_len, dst_len, row_elems, idx.ptr, n);
  }
  idx.release(s);
  finish(s);
}

void cuda_swap_outer_dims(const void* src, void* dst, std::int64_t a, std::int64_t b, std::size_t rest_bytes,
                          void* stream) {
  const std::int64_t total = a * b * static_cast<std::int64_t>(rest_bytes);
  if (total == 0) return;
  const cudaStream_t s = to_cuda(stream);
  swap_kernel<<<blocks_for(total), kThreads, 0, s>>>(static_cast<const char*>(src), static_cast<char*>(dst), a, b,
                                                     static_cast<std::int64_t>(rest_bytes));
  finish(s);
}

}  // namespace seqpar
