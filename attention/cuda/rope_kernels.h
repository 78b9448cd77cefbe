// CUDA launch of the RoPE pair body (attention/kernels/row_ops.h, rope_rotate_row_pair; the CPU kernel runs the same
// body, attention/cpu/rope_cpu.cc). Device pointers, asynchronous on `stream` (launch errors raised at once). Built
// only with SEQPAR_WITH_CUDA; internal to attention/ (attention/rope.cc calls it for CUDA tensors).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace seqpar::attn::cuda {

// x [rows, dim] (rows = batch seq heads, row r at position index (r / heads) % seq), fp32 or fp64 (fp64 = true), in
// place: pair i of row r rotated by cos_t / sin_t [seq, half] of the same dtype (the attention factor and the
// backward's sign folded in), its columns rope_pair_columns(interleaved, offset, half, i).
struct RopeRowsParams {
  void* x = nullptr;
  const void* cos_t = nullptr;
  const void* sin_t = nullptr;
  bool fp64 = false;
  std::int64_t rows = 0, seq = 0, heads = 0, dim = 0, half = 0, offset = 0;
  bool interleaved = false;
};
void rope_rotate_rows(const RopeRowsParams& p, cudaStream_t stream);

}  // namespace seqpar::attn::cuda
