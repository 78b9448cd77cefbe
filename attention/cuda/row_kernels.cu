// Launches only: the bodies are attention/kernels/row_ops.h, shared with the CPU code.
#include "attention/cuda/row_kernels.h"
#include "attention/kernels/row_ops.h"
#include "runtime/cuda_check.h"

namespace seqpar::attn::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

__global__ void lse_merge_kernel(LseMergeParams p) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.batch * p.seq * p.heads) return;
  const std::int64_t b = t / (p.seq * p.heads), i = (t / p.heads) % p.seq, h = t % p.heads;
  const std::int64_t li = (b * p.heads + h) * p.seq + i;
  const rowops::MergeWeights<float> w = rowops::lse_merge_weights(p.lse[li], p.lse_b[li]);
  for (std::int64_t d = 0; d < p.head_dim; ++d)
    p.out[t * p.head_dim + d] = rowops::lse_merge_value(w, p.out[t * p.head_dim + d], p.out_b[t * p.head_dim + d]);
  p.lse[li] = w.lse;
}

__device__ double load_wide(const void* p, bool fp64, std::int64_t i) {
  return fp64 ? static_cast<const double*>(p)[i] : static_cast<double>(static_cast<const float*>(p)[i]);
}
__device__ void store_wide(void* p, bool fp64, std::int64_t i, double v) {
  if (fp64) {
    static_cast<double*>(p)[i] = v;
  } else {
    static_cast<float*>(p)[i] = static_cast<float>(v);
  }
}

// One (b, i, h) row per thread, in fp64 like the host's lse_merge.
__global__ void lse_merge_mixed_kernel(LseMergeMixedParams p) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.batch * p.seq * p.heads) return;
  const std::int64_t b = t / (p.seq * p.heads), i = (t / p.heads) % p.seq, h = t % p.heads;
  const std::int64_t li = (b * p.heads + h) * p.seq + i;
  const rowops::MergeWeights<double> w =
      rowops::lse_merge_weights(load_wide(p.lse, p.lse_fp64, li), load_wide(p.lse_b, p.lse_b_fp64, li));
  for (std::int64_t d = 0; d < p.head_dim; ++d) {
    const std::int64_t e = t * p.head_dim + d;
    store_wide(p.out, p.out_fp64, e,
               rowops::lse_merge_value(w, load_wide(p.out, p.out_fp64, e), load_wide(p.out_b, p.out_b_fp64, e)));
  }
  store_wide(p.lse, p.lse_fp64, li, w.lse);
}

__global__ void masked_softmax_kernel(MaskedSoftmaxParams p) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= p.rows) return;
  p.lse[r] = rowops::masked_softmax_row(p.scores + r * p.n, p.n, p.begin[r], p.end[r], p.probs + r * p.n);
}

__global__ void rope_kernel(RopePairsParams p) {
  const std::int64_t half = p.head_dim / 2;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.rows * half) return;
  const std::int64_t r = t / half, i = t % half;
  float* row = p.x + r * p.head_dim;
  const float c = p.cos[t], s = p.sin[t];
  if (p.inverse) {
    rowops::rope_unrotate_pair(row[i], row[i + half], c, s, row[i], row[i + half]);
  } else {
    rowops::rope_rotate_pair(row[i], row[i + half], c, s, row[i], row[i + half]);
  }
}

}  // namespace

void lse_merge_rows(const LseMergeParams& p, cudaStream_t stream) {
  const std::int64_t n = p.batch * p.seq * p.heads;
  if (n == 0) return;
  lse_merge_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

void lse_merge_rows_mixed(const LseMergeMixedParams& p, cudaStream_t stream) {
  const std::int64_t n = p.batch * p.seq * p.heads;
  if (n == 0) return;
  lse_merge_mixed_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

void masked_softmax_rows(const MaskedSoftmaxParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  masked_softmax_kernel<<<blocks_for(p.rows), kThreads, 0, stream>>>(p);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

void rope_rotate_half_rows(const RopePairsParams& p, cudaStream_t stream) {
  const std::int64_t n = p.rows * (p.head_dim / 2);
  if (n == 0) return;
  rope_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p);
  SEQPAR_CHECK_CUDA(cudaGetLastError());
}

}  // namespace seqpar::attn::cuda
