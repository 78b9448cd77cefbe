// CUDA launches of the element and row bodies of attention/kernels/row_ops.h (the bodies are shared with the CPU
// code and tested there; this file only launches them). Device pointers, fp32, contiguous; asynchronous on `stream`
// (errors of the launch are raised at once, errors of the execution at the next synchronising call). Built only
// with SEQPAR_WITH_CUDA; internal to attention/ (the MHA CUDA path calls them).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace seqpar::attn::cuda {

// out [B, S, H, D] and lse [B, H, S] merged in place with (out_b, lse_b) of the same shapes (rowops::lse_merge_*).
struct LseMergeParams {
  float* out = nullptr;
  float* lse = nullptr;
  const float* out_b = nullptr;
  const float* lse_b = nullptr;
  std::int64_t batch = 0, seq = 0, heads = 0, head_dim = 0;
};
void lse_merge_rows(const LseMergeParams& p, cudaStream_t stream);

// The same merge with each side's out and lse in fp32 or fp64 (out_fp64 for out and out_b, lse_fp64 for lse,
// lse_b_fp64 for lse_b), computed in fp64 and rounded once on store: what attn::lse_merge does on the host (the ring
// keeps out in the accumulator dtype and the lse in fp64).
struct LseMergeMixedParams {
  void* out = nullptr;
  void* lse = nullptr;
  const void* out_b = nullptr;
  const void* lse_b = nullptr;
  bool out_fp64 = false, out_b_fp64 = false, lse_fp64 = false, lse_b_fp64 = false;
  std::int64_t batch = 0, seq = 0, heads = 0, head_dim = 0;
};
void lse_merge_rows_mixed(const LseMergeMixedParams& p, cudaStream_t stream);

// Row r of scores [rows, n]: probs row r and lse[r] over the visible keys [begin[r], end[r]) (rowops::
// masked_softmax_row; empty rows: lse -inf, probs 0).
struct MaskedSoftmaxParams {
  const float* scores = nullptr;
  float* probs = nullptr;
  float* lse = nullptr;
  const std::int64_t* begin = nullptr;
  const std::int64_t* end = nullptr;
  std::int64_t rows = 0, n = 0;
};
void masked_softmax_rows(const MaskedSoftmaxParams& p, cudaStream_t stream);

// Rotate-half RoPE in place on x [rows, D] (pairs (i, i + D/2)), cos / sin [rows, D/2] per row; inverse = the
// backward (rowops::rope_rotate_pair / rope_unrotate_pair).
struct RopePairsParams {
  float* x = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
  std::int64_t rows = 0, head_dim = 0;
  bool inverse = false;
};
void rope_rotate_half_rows(const RopePairsParams& p, cudaStream_t stream);

}  // namespace seqpar::attn::cuda
