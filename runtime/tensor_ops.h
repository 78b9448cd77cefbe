// Whole-tensor operations used by the distributed schedules: dtype-converting copies, fp32 accumulation, fills,
// and the data movement of sharding and all-to-all packing (row gathers and scatters by index, a swap of two outer
// dimensions). Each dispatches on the tensors' device: host tensors run the loops here; CUDA tensors run the
// kernels of runtime/tensor_ops_cuda.cu (CUDA builds), ordered on `stream` and synchronised before returning.
// A mix of host and device tensors is an error, except in copy_convert. Element counts must match where stated;
// shapes are read as flat blocks (see each function). Host-synchronous.
#pragma once

#include <cstdint>
#include <span>

#include "device.h"
#include "tensor.h"

namespace seqpar {

// dst = src converted to dst's dtype (round to nearest even for 16-bit targets; fp64, fp32, bf16, fp16, and int64
// to int64). On one CUDA device any of these conversions runs as a kernel on `stream`; between a host and a CUDA
// buffer the dtypes must match and the copy is a cudaMemcpyAsync on `stream`, synchronised before returning.
void copy_convert(const TensorView& src, const TensorView& dst, Stream stream = Stream::cpu());
// dst += src, both fp32 (or both fp64), element-wise in index order (deterministic).
void add_inplace(const TensorView& dst, const TensorView& src, Stream stream = Stream::cpu());
// dst += alpha * src, both fp32 (or both fp64), element-wise (runtime/elementwise.h's add_scaled, alpha rounded to
// the dtype); alpha = -1 subtracts exactly (e.g. delta -= dlse in a backward).
void add_scaled_inplace(const TensorView& dst, const TensorView& src, double alpha, Stream stream = Stream::cpu());
// Every element of a floating tensor set to `value` (e.g. -inf for an empty lse).
void fill(const TensorView& dst, double value, Stream stream = Stream::cpu());

// The number of elements >= 0 of an int64 tensor (e.g. the selected slots of a -1 padded topk_indices), read back
// to the host: the explicit device-to-host read of a schedule that needs a count (CUDA: one reduction kernel and a
// copy of one value, on `stream`).
std::int64_t count_nonnegative(const TensorView& t, Stream stream = Stream::cpu());

// Row operations along dimension `dim` of tensors read as [outer, len, inner] (outer = product of the dims before
// `dim`, inner = product of the dims after it); src and dst share dtype, ndim and every dim but `dim`.
// gather_rows:    dst[o, i, :] = src[o, index[i], :]   (dst.dim(dim) == index.size())
// scatter_rows:   dst[o, index[i], :] = src[o, i, :]   (src.dim(dim) == index.size(); rows not named are untouched)
// index_add_rows: dst[o, index[i], :] += src[o, i, :]  (fp32 or fp64; i in increasing order: deterministic)
// Errors: dtype / rank / shape mismatches, an index outside [0, len).
void gather_rows(const TensorView& src, int dim, std::span<const std::int64_t> index, const TensorView& dst,
                 Stream stream = Stream::cpu());
void scatter_rows(const TensorView& src, int dim, std::span<const std::int64_t> index, const TensorView& dst,
                  Stream stream = Stream::cpu());
void index_add_rows(const TensorView& src, int dim, std::span<const std::int64_t> index, const TensorView& dst,
                    Stream stream = Stream::cpu());

// dst[j, i, :] = src[i, j, :] with src read as [a, b, rest] and dst as [b, a, rest] (rest = numel / (a b)): the
// packing of an all-to-all (send block j gathers every i's piece j) and its inverse. Same dtype and numel.
void swap_outer_dims(const TensorView& src, std::int64_t a, std::int64_t b, const TensorView& dst,
                     Stream stream = Stream::cpu());

}  // namespace seqpar
