// The launch only: the pair body is attention/kernels/row_ops.h's rope_rotate_row_pair, shared with the CPU kernel
// (attention/cpu/rope_cpu.cc) and tested there.
#include "attention/cuda/rope_kernels.h"
#include "attention/kernels/row_ops.h"
#include "runtime/cuda_check.h"

namespace seqpar::attn::cuda {
namespace {

constexpr int kThreads = 128;

template <typename T>
__global__ void rope_rows_kernel(RopeRowsParams p) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.rows * p.half) return;
  const std::int64_t r = t / p.half, i = t % p.half, s = (r / p.heads) % p.seq;
  const T* c = static_cast<const T*>(p.cos_t);
  const T* sn = static_cast<const T*>(p.sin_t);
  rowops::rope_rotate_row_pair(static_cast<T*>(p.x) + r * p.dim, p.interleaved, p.offset, p.half, i,
                               c[s * p.half + i], sn[s * p.half + i]);
}

}  // namespace

void rope_rotate_rows(const RopeRowsParams& p, cudaStream_t stream) {
  const std::int64_t n = p.rows * p.half;
  if (n == 0) return;
  const auto blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  if (p.fp64) {
    rope_rows_kernel<double><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    rope_rows_kernel<float><<<blocks, kThreads, 0, stream>>>(p);
  }
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

}  // namespace seqpar::attn::cuda
