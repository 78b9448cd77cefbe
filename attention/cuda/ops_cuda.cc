// The CUDA ops table (ops_cuda.h): cuBLAS calls and memory here, kernels and CUB in ops_cuda_kernels.cu.
#include "attention/cuda/ops_cuda.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <map>
#include <tuple>
#include <type_traits>

#include "attention/cuda/ops_cuda_kernels.h"
#include "attention/cuda/ops_cuda_plan.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_staging.h"
#include "runtime/error.h"

namespace seqpar::attn::ops {
namespace {

namespace kern = seqpar::attn::cuda;

cublasOperation_t op_of(Trans t) { return t == Trans::kN ? CUBLAS_OP_N : CUBLAS_OP_T; }

template <typename T>
kern::BatchedMat<T> batched(Mat<T> m) {
  return {m.ptr, m.ld, m.so, m.si};
}

// Stream-ordered pointer arrays for one pointer-array cuBLAS call, freed on the stream after it.
class PointerArrays {
 public:
  PointerArrays(std::int64_t count, int arrays, cudaStream_t stream) : count_(count), stream_(stream) {
    SEQPAR_CHECK_CUDA(cudaMallocAsync(&p_, static_cast<std::size_t>(count * arrays) * sizeof(void*), stream));
  }
  ~PointerArrays() { cudaFreeAsync(p_, stream_); }
  PointerArrays(const PointerArrays&) = delete;
  PointerArrays& operator=(const PointerArrays&) = delete;
  // Array `i`, filled with the batch's matrix pointers of the operand starting at `base`.
  template <typename P>
  void** fill(int i, P* base, std::int64_t so, std::int64_t si, const Batch& b) {
    void** a = static_cast<void**>(p_) + i * count_;
    kern::batch_pointers(base, sizeof(P), so, si, b.outer, b.inner, a, stream_);
    return a;
  }

 private:
  void* p_ = nullptr;
  std::int64_t count_;
  cudaStream_t stream_;
};

// cuBLASLt descriptors of one matmul, destroyed at the end of the scope.
struct LtMatmul {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  LtMatmul() = default;
  LtMatmul(const LtMatmul&) = delete;
  LtMatmul& operator=(const LtMatmul&) = delete;
  ~LtMatmul() {
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

// An fp32 column-major layout [rows, cols] (ld) of `count` matrices `stride` apart.
cublasLtMatrixLayout_t lt_layout(std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t count,
                                 std::int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  SEQPAR_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, static_cast<std::uint64_t>(rows),
                                                 static_cast<std::uint64_t>(cols), ld));
  const std::int32_t n = static_cast<std::int32_t>(count);
  SEQPAR_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n));
  SEQPAR_CHECK_CUBLAS(
      cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
  return l;
}

// The descriptors of C' = relu(alpha op_a(A') op_b(B')), fp32 in, fp32 accumulation (no TF32), fp32 out: the
// column-major call of ops_cuda_plan.h's GemmCall g over `count` matrices with the given strides.
void lt_relu_matmul(LtMatmul& d, const cuda_plan::GemmCall& g, std::int64_t count, std::int64_t sa, std::int64_t sb,
                    std::int64_t sc) {
  SEQPAR_CHECK_CUBLAS(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = op_of(g.op_a), tb = op_of(g.op_b);
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_RELU;
  SEQPAR_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  SEQPAR_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  SEQPAR_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
  const bool na = g.op_a == Trans::kN, nb = g.op_b == Trans::kN;
  d.a = lt_layout(na ? g.m : g.k, na ? g.k : g.m, g.lda, count, sa);
  d.b = lt_layout(nb ? g.k : g.n, nb ? g.n : g.k, g.ldb, count, sb);
  d.c = lt_layout(g.m, g.n, g.ldc, count, sc);
}

template <typename T>
class CudaOps final : public Ops<T> {
 public:
  CudaOps(Device device, Stream stream) : device_(device.index), stream_(static_cast<cudaStream_t>(stream.handle)) {
    DeviceScope scope(device_);
    SEQPAR_CHECK_CUBLAS(cublasCreate(&handle_));
    SEQPAR_CHECK_CUBLAS(cublasSetStream(handle_, stream_));
    SEQPAR_CHECK_CUBLAS(cublasSetMathMode(handle_, CUBLAS_PEDANTIC_MATH));  // fp32 stays fp32 (no TF32)
    SEQPAR_CHECK_CUBLAS(cublasLtCreate(&lt_));
  }
  ~CudaOps() override {
    cublasLtDestroy(lt_);
    cublasDestroy(handle_);
  }
  CudaOps(const CudaOps&) = delete;
  CudaOps& operator=(const CudaOps&) = delete;

  const char* name() const override { return "cuda"; }
  Device device() const override { return Device::cuda(device_); }
  void* allocate(std::size_t bytes) override {
    DeviceScope scope(device_);
    void* p = nullptr;
    SEQPAR_CHECK_CUDA(cudaMallocAsync(&p, bytes > 0 ? bytes : 1, stream_));
    SEQPAR_CHECK_CUDA(cudaMemsetAsync(p, 0, bytes > 0 ? bytes : 1, stream_));
    return p;
  }
  void deallocate(void* p) override {  // called from destructors: never throws
    if (p == nullptr) return;
    int previous = 0;
    cudaGetDevice(&previous);
    if (previous != device_) cudaSetDevice(device_);
    cudaFreeAsync(p, stream_);
    if (previous != device_) cudaSetDevice(previous);
  }
  void upload(void* dst, const void* host, std::size_t bytes) override {
    if (bytes == 0) return;
    DeviceScope scope(device_);
    SEQPAR_CHECK_CUDA(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_));
    SEQPAR_CHECK_CUDA(cudaStreamSynchronize(stream_));
  }
  void download(void* host, const void* src, std::size_t bytes) override {
    DeviceScope scope(device_);
    if (bytes > 0) SEQPAR_CHECK_CUDA(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream_));
    SEQPAR_CHECK_CUDA(cudaStreamSynchronize(stream_));
  }

  void gemm(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, Mat<const T> a, Mat<const T> b,
            T beta, Mat<T> c, Batch batch) override {
    if (m <= 0 || n <= 0 || batch.count() <= 0) return;
    DeviceScope scope(device_);
    if (k <= 0) {  // C = beta C
      kern::scale_mats(m, n, beta, batched(c), batch.outer, batch.inner, stream_);
      return;
    }
    // the call's arguments: ops_cuda_plan.h (executed on the CPU by test_ops_cuda_plan)
    const cuda_plan::GemmCall g = cuda_plan::plan_gemm(ta, tb, m, n, k, cuda_plan::layout_of(a),
                                                       cuda_plan::layout_of(b), cuda_plan::layout_of(c), batch);
    if (g.strided) {
      if constexpr (std::is_same_v<T, float>)
        SEQPAR_CHECK_CUBLAS(cublasSgemmStridedBatched_64(handle_, op_of(g.op_a), op_of(g.op_b), g.m, g.n, g.k, &alpha,
                                                         b.ptr, g.lda, g.stride_a, a.ptr, g.ldb, g.stride_b, &beta,
                                                         c.ptr, g.ldc, g.stride_c, g.count));
      else
        SEQPAR_CHECK_CUBLAS(cublasDgemmStridedBatched_64(handle_, op_of(g.op_a), op_of(g.op_b), g.m, g.n, g.k, &alpha,
                                                         b.ptr, g.lda, g.stride_a, a.ptr, g.ldb, g.stride_b, &beta,
                                                         c.ptr, g.ldc, g.stride_c, g.count));
      return;
    }
    PointerArrays arrays(g.count, 3, stream_);
    const auto pa = reinterpret_cast<const T* const*>(arrays.fill(0, b.ptr, b.so, b.si, batch));
    const auto pb = reinterpret_cast<const T* const*>(arrays.fill(1, a.ptr, a.so, a.si, batch));
    const auto pc = reinterpret_cast<T* const*>(arrays.fill(2, c.ptr, c.so, c.si, batch));
    if constexpr (std::is_same_v<T, float>)
      SEQPAR_CHECK_CUBLAS(cublasSgemmBatched_64(handle_, op_of(g.op_a), op_of(g.op_b), g.m, g.n, g.k, &alpha, pa, g.lda,
                                                pb, g.ldb, &beta, pc, g.ldc, g.count));
    else
      SEQPAR_CHECK_CUBLAS(cublasDgemmBatched_64(handle_, op_of(g.op_a), op_of(g.op_b), g.m, g.n, g.k, &alpha, pa, g.lda,
                                                pb, g.ldb, &beta, pc, g.ldc, g.count));
  }

  void trsm_unit_lower(std::int64_t n, std::int64_t nrhs, Mat<const T> l, Mat<T> b, Batch batch) override {
    if (n <= 0 || nrhs <= 0 || batch.count() <= 0) return;
    DeviceScope scope(device_);
    // row-major L X = B is column-major X^T L^T = B^T: right side, L^T upper, unit diagonal (ops_cuda_plan.h)
    const cuda_plan::TrsmCall t =
        cuda_plan::plan_trsm(n, nrhs, cuda_plan::layout_of(l), cuda_plan::layout_of(b), batch);
    PointerArrays arrays(t.count, 2, stream_);
    const auto pl = reinterpret_cast<const T* const*>(arrays.fill(0, l.ptr, l.so, l.si, batch));
    const auto pb = reinterpret_cast<T* const*>(arrays.fill(1, b.ptr, b.so, b.si, batch));
    const T one = T(1);
    if constexpr (std::is_same_v<T, float>)
      SEQPAR_CHECK_CUBLAS(cublasStrsmBatched_64(handle_, CUBLAS_SIDE_RIGHT, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_N,
                                                CUBLAS_DIAG_UNIT, t.m, t.n, &one, pl, t.lda, pb, t.ldb, t.count));
    else
      SEQPAR_CHECK_CUBLAS(cublasDtrsmBatched_64(handle_, CUBLAS_SIDE_RIGHT, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_N,
                                                CUBLAS_DIAG_UNIT, t.m, t.n, &one, pl, t.lda, pb, t.ldb, t.count));
  }
  void copy(std::int64_t rows, std::int64_t cols, Mat<const T> src, Mat<T> dst, Batch batch) override {
    DeviceScope scope(device_);
    kern::copy_mats(rows, cols, batched(src), batched(dst), batch.outer, batch.inner, stream_);
  }
  void scaled_identity(std::int64_t n, const T* s, std::int64_t s_so, std::int64_t s_si, Mat<T> dst,
                       Batch batch) override {
    DeviceScope scope(device_);
    kern::scaled_identity(n, s, s_so, s_si, batched(dst), batch.outer, batch.inner, stream_);
  }

  void convert_in(const void* src, DType src_dtype, T* dst, std::int64_t n) override {
    DeviceScope scope(device_);
    kern::convert_in(src, src_dtype, dst, n, stream_);
  }
  void convert_out(const T* src, void* dst, DType dst_dtype, std::int64_t n) override {
    DeviceScope scope(device_);
    kern::convert_out(src, dst, dst_dtype, n, stream_);
  }

  void gather_rows(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src, const std::int64_t* idx,
                   T* dst, std::int64_t ld_dst) override {
    DeviceScope scope(device_);
    kern::gather_rows(rows, cols, src, ld_src, idx, dst, ld_dst, stream_);
  }
  void scatter_add_rows(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src,
                        const std::int64_t* idx, T* dst, std::int64_t ld_dst) override {
    DeviceScope scope(device_);
    kern::scatter_add_rows(rows, cols, src, ld_src, idx, dst, ld_dst, stream_);
  }
  void topk_rows(std::int64_t rows, std::int64_t n, std::int64_t k, const T* scores, std::int64_t ld,
                 const std::int64_t* lo, const std::int64_t* hi, std::int64_t* idx, T* val) override {
    DeviceScope scope(device_);
    kern::topk_rows(rows, n, k, scores, ld, lo, hi, idx, val, stream_);
  }

  void l2norm_scale_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, T eps, T s) override {
    DeviceScope scope(device_);
    kern::l2norm_scale_rows(rows, cols, x, ld, eps, s, stream_);
  }
  void relu_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld) override {
    DeviceScope scope(device_);
    kern::relu_rows(rows, cols, x, ld, stream_);
  }
  void softmax_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const std::int64_t* end,
                    std::int64_t end_div, T* row_max, T* row_sum) override {
    DeviceScope scope(device_);
    kern::softmax_rows(rows, cols, x, ld, end, end_div, row_max, row_sum, stream_);
  }
  void scale_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const T* s) override {
    DeviceScope scope(device_);
    kern::scale_rows(rows, cols, x, ld, s, stream_);
  }
  void cumsum_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld) override {
    DeviceScope scope(device_);
    kern::cumsum_rows(rows, cols, x, ld, stream_);
  }
  void gdn_chunk_scales(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* kscale, T* vscale,
                        T* qscale, T* kend, T* end_decay) override {
    DeviceScope scope(device_);
    kern::gdn_chunk_scales(chunks, C, gamma, beta, kscale, vscale, qscale, kend, end_decay, stream_);
  }
  void gdn_chunk_masks(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* a, T* qk) override {
    DeviceScope scope(device_);
    kern::gdn_chunk_masks(chunks, C, gamma, beta, a, qk, stream_);
  }

  void row_dots(std::int64_t rows, std::int64_t cols, const T* a, std::int64_t lda, const T* b, std::int64_t ldb,
                T* out) override {
    DeviceScope scope(device_);
    kern::row_dots(rows, cols, a, lda, b, ldb, out, stream_);
  }
  void l2norm_scale_backward_rows(std::int64_t rows, std::int64_t cols, const T* x, std::int64_t ldx, T* dy,
                                  std::int64_t ldy, T eps, T s) override {
    DeviceScope scope(device_);
    kern::l2norm_scale_backward_rows(rows, cols, x, ldx, dy, ldy, eps, s, stream_);
  }
  void gdn_chunk_masks_backward(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, const T* kk,
                                const T* qk, const T* dp, const T* da, T* dqk, T* dkk, T* dgamma, T* dbeta) override {
    DeviceScope scope(device_);
    kern::gdn_chunk_masks_backward(chunks, C, gamma, beta, kk, qk, dp, da, dqk, dkk, dgamma, dbeta, stream_);
  }
  void gdn_chunk_scales_backward(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, const T* dqq,
                                 const T* dkbk, const T* dvbv, const T* dktk, const T* sds, T* dgamma,
                                 T* dbeta) override {
    DeviceScope scope(device_);
    kern::gdn_chunk_scales_backward(chunks, C, gamma, beta, dqq, dkbk, dvbv, dktk, sds, dgamma, dbeta, stream_);
  }
  void short_conv_rows(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin, const std::int64_t* first,
                       const T* weight, bool silu, T* y) override {
    DeviceScope scope(device_);
    kern::short_conv_rows(rows, C, W, xin, first, weight, silu, y, stream_);
  }
  void short_conv_dpre_rows(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin, const std::int64_t* first,
                            const T* weight, bool silu, T* dy) override {
    DeviceScope scope(device_);
    kern::short_conv_dpre_rows(rows, C, W, xin, first, weight, silu, dy, stream_);
  }
  void short_conv_dx_rows(std::int64_t xrows, std::int64_t C, std::int64_t W, const T* dpre, const std::int64_t* src,
                          const T* weight, T* dxin) override {
    DeviceScope scope(device_);
    kern::short_conv_dx_rows(xrows, C, W, dpre, src, weight, dxin, stream_);
  }
  void short_conv_dweight(std::int64_t rows, std::int64_t C, std::int64_t W, const T* dpre, const T* xin,
                          const std::int64_t* first, T* dweight) override {
    DeviceScope scope(device_);
    kern::short_conv_dweight(rows, C, W, dpre, xin, first, dweight, stream_);
  }

  void gemm_fixed_order(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, Mat<const T> a,
                        Mat<const T> b, T beta, Mat<T> c, Batch batch) override {
    DeviceScope scope(device_);
    kern::gemm_fixed_order(ta == Trans::kT, tb == Trans::kT, m, n, k, alpha, batched(a), batched(b), beta, batched(c),
                           batch.outer, batch.inner, stream_);
  }
  void gemm_relu_fixed_order(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha,
                             Mat<const T> a, Mat<const T> b, Mat<T> c, Batch batch) override {
    if (m <= 0 || n <= 0 || batch.count() <= 0) return;
    DeviceScope scope(device_);
    if constexpr (std::is_same_v<T, float>) {
      if (k > 0) {
        lt_gemm_relu(ta, tb, m, n, k, alpha, a, b, c, batch);
        return;
      }
    }
    // fp64 (and k = 0: C = relu(0) = 0): the fixed-order kernel with the ReLU in its store
    kern::gemm_fixed_order(ta == Trans::kT, tb == Trans::kT, m, n, k, alpha, batched(a), batched(b), T(0), batched(c),
                           batch.outer, batch.inner, stream_, true);
  }
  void inverted_index(std::int64_t n_src, const std::int64_t* idx, std::int64_t n_dst, std::int64_t* offsets,
                      std::int64_t* list) override {
    DeviceScope scope(device_);
    kern::inverted_index(n_src, idx, n_dst, offsets, list, stream_);
  }
  void sum_rows_indexed(std::int64_t n_dst, std::int64_t cols, const T* src, std::int64_t ld_src,
                        const std::int64_t* offsets, const std::int64_t* list, T* dst, std::int64_t ld_dst) override {
    DeviceScope scope(device_);
    kern::sum_rows_indexed(n_dst, cols, src, ld_src, offsets, list, dst, ld_dst, stream_);
  }
  void topk_merge_rows(std::int64_t rows, std::int64_t k, T* s_a, std::int64_t* p_a, const T* s_b,
                       const std::int64_t* p_b) override {
    DeviceScope scope(device_);
    kern::topk_merge_rows(rows, k, s_a, p_a, s_b, p_b, stream_);
  }
  void dsa_probs_rows(std::int64_t rows, std::int64_t n, T* s, std::int64_t ld, const std::int64_t* mask,
                      std::int64_t mask_div, const T* lse_hi, const T* lse_lo) override {
    DeviceScope scope(device_);
    kern::dsa_probs_rows(rows, n, s, ld, mask, mask_div, lse_hi, lse_lo, stream_);
  }
  void dsa_dscore_rows(std::int64_t rows, std::int64_t n, const T* p, T* dp, std::int64_t ld, const T* delta) override {
    DeviceScope scope(device_);
    kern::dsa_dscore_rows(rows, n, p, dp, ld, delta, stream_);
  }
  void relu_head_sum_rows(std::int64_t queries, std::int64_t Hi, std::int64_t n, const T* s, const T* w,
                          T* out) override {
    DeviceScope scope(device_);
    kern::relu_head_sum_rows(queries, Hi, n, s, w, out, stream_);
  }
  void indexer_grad_rows(std::int64_t queries, std::int64_t Hi, std::int64_t n, T* s, const T* w, const T* g,
                         T* dw) override {
    DeviceScope scope(device_);
    kern::indexer_grad_rows(queries, Hi, n, s, w, g, dw, stream_);
  }
  void kl_rows(std::int64_t rows, std::int64_t k, const T* probs, const T* scores, const std::int64_t* idx,
               double grad_scale, T* dscores, double* loss) override {
    DeviceScope scope(device_);
    kern::kl_rows(rows, k, probs, scores, idx, grad_scale, dscores, loss, stream_);
  }

 private:
  // The one algorithm of every gemm_relu_fixed_order call with these transposes and this k: cuBLASLt's first heuristic
  // choice for a 1024 x 1024 product with 4-byte alignment and no workspace, then split-K forced off (one split, no
  // reduction scheme), so that every element of C is reduced over k by one kernel's fixed sequence whatever m, n and
  // the batch (edge tiles predicated). The heuristic is a function of the device, the library and these arguments,
  // so every table and every process on the device pins the same algorithm. A shape it cannot take is an error,
  // never a silent change of algorithm (which would break the op's bitwise promise).
  const cublasLtMatmulAlgo_t& pinned_relu_algo(const cuda_plan::GemmCall& g) {
    const auto key = std::make_tuple(static_cast<int>(g.op_a), static_cast<int>(g.op_b), g.k);
    const auto found = relu_algos_.find(key);
    if (found != relu_algos_.end()) return found->second;
    cuda_plan::GemmCall canon = g;
    canon.m = canon.n = 1024;
    canon.lda = g.op_a == Trans::kN ? canon.m : canon.k;
    canon.ldb = g.op_b == Trans::kN ? canon.k : canon.n;
    canon.ldc = canon.m;
    LtMatmul d;
    lt_relu_matmul(d, canon, 1, 0, 0, 0);
    cublasLtMatmulPreference_t pref = nullptr;
    SEQPAR_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    const std::uint64_t no_workspace = 0;
    const std::uint32_t align = 4;
    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    cublasStatus_t rc = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                             &no_workspace, sizeof no_workspace);
    for (const auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      if (rc == CUBLAS_STATUS_SUCCESS) rc = cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align);
    if (rc == CUBLAS_STATUS_SUCCESS)
      rc = cublasLtMatmulAlgoGetHeuristic(lt_, d.op, d.a, d.b, d.c, d.c, pref, 1, &result, &count);
    cublasLtMatmulPreferenceDestroy(pref);
    SEQPAR_CHECK_CUBLAS(rc);
    SEQPAR_CHECK(count > 0 && result.state == CUBLAS_STATUS_SUCCESS,
                 "gemm_relu_fixed_order: cuBLASLt has no fp32 ReLU-epilogue algorithm for k = ", g.k,
                 " without workspace");
    cublasLtMatmulAlgo_t algo = result.algo;
    const std::uint32_t one_split = 1, no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
    SEQPAR_CHECK_CUBLAS(
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one_split, sizeof one_split));
    SEQPAR_CHECK_CUBLAS(cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                                             &no_reduction, sizeof no_reduction));
    return relu_algos_.emplace(key, algo).first->second;
  }

  // gemm_relu_fixed_order in fp32: one cuBLASLt matmul with CUBLASLT_EPILOGUE_RELU per strided batch (the batch of
  // ops_cuda_plan.h's plan; a two-level batch that is not one stride is one call per outer index, inner strided).
  void lt_gemm_relu(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, Mat<const float> a,
                    Mat<const float> b, Mat<float> c, Batch batch) {
    const cuda_plan::GemmCall g = cuda_plan::plan_gemm(ta, tb, m, n, k, cuda_plan::layout_of(a),
                                                       cuda_plan::layout_of(b), cuda_plan::layout_of(c), batch);
    const cublasLtMatmulAlgo_t& algo = pinned_relu_algo(g);
    const std::int64_t calls = g.strided ? 1 : batch.outer, per_call = g.strided ? g.count : batch.inner;
    LtMatmul d;
    if (g.strided)
      lt_relu_matmul(d, g, per_call, g.stride_a, g.stride_b, g.stride_c);
    else
      lt_relu_matmul(d, g, per_call, b.si, a.si, c.si);
    cublasLtMatmulHeuristicResult_t check{};
    SEQPAR_CHECK(cublasLtMatmulAlgoCheck(lt_, d.op, d.a, d.b, d.c, d.c, &algo, &check) == CUBLAS_STATUS_SUCCESS,
                 "gemm_relu_fixed_order: the pinned cuBLASLt algorithm does not take m = ", m, ", n = ", n, ", k = ", k,
                 " (leading dims ", a.ld, ", ", b.ld, ", ", c.ld, "); another algorithm would break the op's bitwise "
                 "promise");
    const float beta = 0.0f;
    for (std::int64_t o = 0; o < calls; ++o)
      SEQPAR_CHECK_CUBLAS(cublasLtMatmul(lt_, d.op, &alpha, b.ptr + o * b.so, d.a, a.ptr + o * a.so, d.b, &beta,
                                         c.ptr + o * c.so, d.c, c.ptr + o * c.so, d.c, &algo, nullptr, 0, stream_));
  }

  int device_;
  cudaStream_t stream_;
  cublasHandle_t handle_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  std::map<std::tuple<int, int, std::int64_t>, cublasLtMatmulAlgo_t> relu_algos_;
};

void check_target(Device device, Stream stream) {
  SEQPAR_CHECK(device.is_cuda(), "cuda_ops: device must be a CUDA device, got ", device.str());
  SEQPAR_CHECK(stream.device == device, "cuda_ops: the stream is on ", stream.device.str(), ", the table on ",
               device.str());
  const int count = cuda_device_count();
  SEQPAR_CHECK(count > 0, "cuda_ops: ", cuda_unavailable_reason());
  SEQPAR_CHECK(device.index >= 0 && device.index < count, "cuda_ops: device ", device.str(), " does not exist (", count,
               " CUDA devices)");
}

}  // namespace

template <typename T>
std::unique_ptr<Ops<T>> cuda_ops(Device device, Stream stream) {
  check_target(device, stream);
  return std::make_unique<CudaOps<T>>(device, stream);
}
template std::unique_ptr<Ops<float>> cuda_ops<float>(Device, Stream);
template std::unique_ptr<Ops<double>> cuda_ops<double>(Device, Stream);

bool cuda_ops_built() { return true; }

}  // namespace seqpar::attn::ops
