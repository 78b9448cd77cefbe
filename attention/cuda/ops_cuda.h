// The CUDA ops table (attention/ops/ops.h) on one device and one stream: every op is issued on that stream, in call
// order; memory is stream-ordered (cudaMallocAsync / cudaFreeAsync on the stream, zero-filled by cudaMemsetAsync).
//   gemm             cuBLAS (fp32 without TF32: CUBLAS_PEDANTIC_MATH), row-major as the column-major transpose; a
//                    two-level batch is one cublas<t>gemmStridedBatched_64 when every operand's batch is one stride
//                    (outer = 1, inner = 1, or so = inner * si; a zero stride allowed for A and B), else one
//                    cublas<t>gemmBatched_64 over pointer arrays built on the device; k = 0 scales C by beta.
//   trsm_unit_lower  cublas<t>trsmBatched_64 (right side, upper, unit: the row-major L X = B transposed) over
//                    pointer arrays built on the device.
//   gather / scatter_add, copy, scaled_identity, the row kernels: one thread per element or row
//                    (ops_cuda_kernels.h); scatter_add through a stable CUB radix sort of (idx, r), deterministic,
//                    no floating-point atomics.
//   topk_rows        fp32 with k <= 2048 (and the device's shared memory for it), when the build found FlashInfer's
//                    headers (flashinfer-python's header-only flashinfer/topk.cuh, pinned, put in .deps/ by
//                    scripts/install_gpu_deps.sh; SEQPAR_OPS_WITH_FLASHINFER): each row's candidates [lo, hi) copied to
//                    the front of a scratch row through FlashInferInput (ops_cuda_keys.h), FlashInfer's FilteredTopK
//                    (deterministic, TopKTieBreak::Small), then the picked columns whose score is not NaN, sorted by
//                    column by CUB. Its result is the CUB path's: FlashInfer picks the k largest of the mapped row
//                    under its raw-bit order with ties to the smaller index; the map keeps the scores' order and
//                    ties (-0 = +0) and puts every NaN below every score, so the picked set is the unique k largest
//                    under (score descending, column ascending) over the non-NaN candidates, padded with NaN only when
//                    a row has fewer than k of them, and those are dropped (test_ops_cuda_plan runs this rule against
//                    the CPU table). Else (fp64, k > 2048, 2^31 or more columns, no headers): CUB's stable segmented
//                    sort of each row's candidate columns by an order-preserving key (NaN lowest), the first k non-NaN
//                    re-sorted by column.
//   the GDN backward, short-conv and DSA row ops: one-thread-per-row launches of the gdn_rows.h / dsa_rows.h bodies
//                    (ops_cuda_gdn.cu, ops_cuda_dsa.cu); gemm_fixed_order: one thread per element of C, one fused
//                    multiply-add per term in increasing k (not cuBLAS: slow, but the same bits in any shape);
//                    inverted_index: CUB's stable radix sort; topk_merge_rows: the union body, then topk_rows.
//   upload           cudaMemcpyAsync then a wait for the stream (the host buffer may be reused on return).
//   download         waits for the stream (the copy and all work before it).
//   gemm_relu_fixed_order  fp32: one cublasLtMatmul with CUBLASLT_EPILOGUE_RELU (fp32 in, CUBLAS_COMPUTE_32F: fp32
//                    accumulation, no TF32) per strided batch, on one pinned algorithm per (transposes, k): cuBLASLt's
//                    first heuristic choice for a 1024 x 1024 product with 4-byte alignment and no workspace, split-K
//                    then forced off; a shape that algorithm cannot take is an error, never another algorithm. fp64
//                    (and k = 0): gemm_fixed_order's kernel with the ReLU in its store; cuBLASLt documents its
//                    epilogues per type combination and this path stays the bitwise reference of the CPU table's
//                    (gemm_fixed_order, then relu_rows). The table holds fp32 for bf16 / fp16 data (converted on the
//                    host by the compositions), so the bf16 / fp16 cuBLASLt forms (the same call with CUDA_R_16BF /
//                    CUDA_R_16F layouts) wait for device-side bf16 inputs. Whether one algorithm gives an element the
//                    same bits in every shape (no stream-K or split of k hidden in the kernel) is checked on a GPU by
//                    test_ops_table (DsaOpsMatchLoopsAndBodies/cuda: a sub-block and a strided batch against the whole
//                    product, bitwise).
// Errors: a CUDA / cuBLAS failure throws seqpar::Error naming the call; ops report launch errors at once and execution
// errors at the next download. Compiled and never run on a GPU so far.
#pragma once

#include <memory>

#include "../../runtime/device.h"
#include "../../runtime/dtype.h"
#include "../ops/ops.h"

namespace seqpar::attn::ops {

// A table on `device` (CUDA) issuing on `stream` (its device must be `device`; handle nullptr = the legacy default
// stream). Throws when seqpar was built without CUDA, when no device is usable, or on a device mismatch.
template <typename T>
std::unique_ptr<Ops<T>> cuda_ops(Device device, Stream stream);

// Whether this build has the CUDA table (SEQPAR_WITH_CUDA).
bool cuda_ops_built();

// Calls f(table) with a CUDA table of the arithmetic dtype of `dtype` (fp64 for fp64 data, else fp32), as
// with_cpu_ops.
template <typename F>
void with_cuda_ops(DType dtype, Device device, Stream stream, F&& f) {
  if (dtype == DType::kFloat64)
    f(*cuda_ops<double>(device, stream));
  else
    f(*cuda_ops<float>(device, stream));
}

}  // namespace seqpar::attn::ops
