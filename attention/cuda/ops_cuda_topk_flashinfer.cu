// FlashInfer's filtered top-k (flashinfer/topk.cuh from flashinfer-python, header-only, put in the ignored
// .deps/flashinfer by scripts/install_gpu_deps.sh) behind the CUDA table's fp32 topk_rows (ops_cuda_kernels.h,
// ops_cuda.h). A translation unit of its own: the header's include path (as a system path) stays on this file.
#include <flashinfer/math.cuh>  // first: topk.cuh's headers use its helpers without including it
#include <flashinfer/topk.cuh>

#include "attention/cuda/ops_cuda_kernels.h"
#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace seqpar::attn::cuda {

bool flashinfer_topk_usable(std::int64_t n, std::int64_t k) {
  return k >= 1 && k <= static_cast<std::int64_t>(flashinfer::sampling::FILTERED_TOPK_MAX_K) && n >= 1 &&
         n <= 0x7fffffff && flashinfer::sampling::CanImplementFilteredTopK();
}

void flashinfer_topk_select(float* x, const std::int32_t* len, std::int64_t rows, std::int64_t n, std::int64_t k,
                            std::int32_t* sel, cudaStream_t stream) {
  SEQPAR_CHECK(rows <= 0x7fffffff, "topk_rows: FlashInfer's top-k takes at most 2^31 - 1 rows, got ", rows);
  // deterministic, ties at the threshold to the smaller index (TopKTieBreak::Small); values not written
  SEQPAR_CHECK_CUDA((flashinfer::sampling::FilteredTopK<float, std::int32_t>(
      x, sel, nullptr, len, static_cast<std::uint32_t>(rows), static_cast<std::uint32_t>(k),
      static_cast<std::uint32_t>(n), true, flashinfer::sampling::TopKTieBreak::Small, stream)));
}

}  // namespace seqpar::attn::cuda
