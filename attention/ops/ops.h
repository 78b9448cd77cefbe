// The ops table: the few device operations that the composed GDN and DSA algorithms are written in, so that one
// composition runs on the CPU (ops_cpu.h: OpenBLAS and loops, tested here) and on a GPU (attention/cuda/ops_cuda.h:
// cuBLAS strided / pointer-array batched GEMM and trsm, cuBLASLt, CUB, FlashInfer's top-k). docs/design.md, "The ops
// table".
//
// Conventions: row-major matrices; T is float or double (arithmetic and accumulation in T). Every pointer handed to
// an op is memory of the table's device (Memory::device()): a table buffer (allocate / upload) or the data of a
// tensor on that device, used in place (attention/ops/staging.h); convert_in / convert_out convert other dtypes
// there. Calls are ordered (a CUDA table issues them on one stream); download waits for the work before it.
//
// Batches are two-level: matrix (o, n), o < outer, n < inner, of an operand starts at ptr + o * so + n * si (a
// stride may be 0: the same matrix for every n). A one-level strided batch is outer = 1; a CUDA table maps a
// two-level batch to one strided-batched call when so = inner * si for every operand, else to a pointer-array call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../../runtime/device.h"
#include "../../runtime/dtype.h"

namespace seqpar::attn::ops {

// Raises "ops table <table> does not support <op>" (an Error).
[[noreturn]] void unsupported_op(const char* table, const char* op);

enum class Trans { kN, kT };

struct Batch {
  std::int64_t outer = 1, inner = 1;
  std::int64_t count() const { return outer * inner; }
};

// A batched matrix operand: element (i, j) of matrix (o, n) at ptr[o * so + n * si + i * ld + j].
template <typename P>
struct Mat {
  P* ptr = nullptr;
  std::int64_t ld = 0;
  std::int64_t so = 0;  // outer stride
  std::int64_t si = 0;  // inner stride
  P* at(std::int64_t o, std::int64_t n) const { return ptr + o * so + n * si; }
};

// Device memory of a table, not typed.
class Memory {
 public:
  virtual ~Memory() = default;
  virtual const char* name() const = 0;
  // The device this memory lives on (the CPU table: Device::cpu(); a CUDA table: its CUDA device). A tensor on this
  // device is directly addressable by the table's ops (attention/ops/staging.h uses it in place).
  virtual Device device() const = 0;
  virtual void* allocate(std::size_t bytes) = 0;  // zero-filled
  virtual void deallocate(void* p) = 0;
  virtual void upload(void* dst, const void* host, std::size_t bytes) = 0;
  virtual void download(void* host, const void* src, std::size_t bytes) = 0;
};

// A typed buffer of a table's memory, freed with it.
template <typename E>
class Buffer {
 public:
  Buffer(Memory& mem, std::int64_t count)
      : mem_(&mem),
        n_(count),
        p_(static_cast<E*>(mem.allocate(static_cast<std::size_t>(count > 0 ? count : 1) * sizeof(E)))) {}
  Buffer(Memory& mem, const std::vector<E>& host) : Buffer(mem, static_cast<std::int64_t>(host.size())) {
    if (!host.empty()) mem.upload(p_, host.data(), host.size() * sizeof(E));
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { mem_->deallocate(p_); }
  E* get() const { return p_; }
  std::int64_t size() const { return n_; }

 private:
  Memory* mem_;
  std::int64_t n_;
  E* p_;
};

template <typename T>
class Ops : public Memory {
 public:
  // ---- linear algebra ----
  // C = alpha op(A) op(B) + beta C for every matrix of the batch; op(A) [m, k], op(B) [k, n], C [m, n]. beta = 0
  // ignores C's old contents (NaN included).
  virtual void gemm(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, Mat<const T> a,
                    Mat<const T> b, T beta, Mat<T> c, Batch batch) = 0;
  // Solves L X = B in place of B [n, nrhs], L [n, n] unit lower triangular: only L's strictly lower part is read
  // (the diagonal is taken as 1). cuBLAS: trsm batched (left, lower, no transpose, unit diagonal).
  virtual void trsm_unit_lower(std::int64_t n, std::int64_t nrhs, Mat<const T> l, Mat<T> b, Batch batch) = 0;
  // dst = src, [rows, cols] matrices.
  virtual void copy(std::int64_t rows, std::int64_t cols, Mat<const T> src, Mat<T> dst, Batch batch) = 0;
  // dst[i, i] = s[o * s_so + n * s_si], every other element 0: [n, n] matrices.
  virtual void scaled_identity(std::int64_t n, const T* s, std::int64_t s_so, std::int64_t s_si, Mat<T> dst,
                               Batch batch) = 0;

  // ---- element conversions (bodies: runtime/dtype.h load_element / store_element) ----
  // dst[i] = src[i] converted from src_dtype (fp64, fp32, bf16 or fp16) to T, i < n; src is memory of this table
  // (a tensor on device(), or a buffer). Bitwise the host conversion runtime/dtype.h convert().
  virtual void convert_in(const void* src, DType src_dtype, T* dst, std::int64_t n) = 0;
  // dst[i] = src[i] converted from T to dst_dtype (round to nearest even, fp64 -> bf16 / fp16 rounded once).
  virtual void convert_out(const T* src, void* dst, DType dst_dtype, std::int64_t n) = 0;

  // ---- gather / scatter ----
  // dst row r = src row idx[r] (rows of width cols, leading dims ld_src / ld_dst); idx[r] < 0 gives a zero row.
  virtual void gather_rows(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src,
                           const std::int64_t* idx, T* dst, std::int64_t ld_dst) = 0;
  // dst row idx[r] += src row r (idx[r] < 0: skipped). Deterministic: every dst row receives its contributions in
  // ascending r (a CUDA table sorts (idx, r) into an inverted index; no floating-point atomics).
  virtual void scatter_add_rows(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src,
                                const std::int64_t* idx, T* dst, std::int64_t ld_dst) = 0;

  // ---- selection ----
  // Per row r of scores [rows, n] (leading dim ld): the k largest of the columns [lo[r], hi[r]) (clamped to
  // [0, n)); ties go to the lower column (the training tie rule). idx [rows, k]: the selected columns in ascending
  // order, then -1; val [rows, k]: their scores in that order, then -inf. NaN scores are never selected.
  virtual void topk_rows(std::int64_t rows, std::int64_t n, std::int64_t k, const T* scores, std::int64_t ld,
                         const std::int64_t* lo, const std::int64_t* hi, std::int64_t* idx, T* val) = 0;

  // ---- row / element kernels (bodies: attention/kernels/gdn_rows.h) ----
  // x row r <- s x / sqrt(|x|^2 + eps) (eps < 0: x <- s x).
  virtual void l2norm_scale_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, T eps, T s) = 0;
  // x <- max(x, 0) elementwise (NaN stays NaN).
  virtual void relu_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld) = 0;
  // Row r of x becomes the softmax of its first end[r / end_div] entries (0 elsewhere); row_max[r], row_sum[r]: the
  // maximum and sum of exp(x - max) of those entries, lse = row_max + log(row_sum) (formed by the caller, in any
  // dtype); a row with no entry (or only -inf) gets p = 0, row_max = -inf, row_sum = 0 (body:
  // rowops::softmax_prefix_row).
  virtual void softmax_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const std::int64_t* end,
                            std::int64_t end_div, T* row_max, T* row_sum) = 0;
  // x row r *= s[r].
  virtual void scale_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const T* s) = 0;
  // Inclusive prefix sum of each row.
  virtual void cumsum_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld) = 0;
  // Per chunk c of C tokens (gamma, beta [chunks, C]): rowops::gdn_chunk_scales into kscale, vscale, qscale, kend
  // [chunks, C] and end_decay [chunks].
  virtual void gdn_chunk_scales(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* kscale,
                                T* vscale, T* qscale, T* kend, T* end_decay) = 0;
  // Per chunk c: a [chunks, C, C] (k_i . k_j in, rowops::gdn_wy_row out) and qk [chunks, C, C] (q_i . k_j in,
  // rowops::gdn_qk_row out).
  virtual void gdn_chunk_masks(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* a, T* qk) = 0;

  // ---- the backward's row kernels (bodies: attention/kernels/gdn_rows.h) ----
  // out[r] = a row r . b row r ([rows, cols], leading dims lda, ldb).
  virtual void row_dots(std::int64_t rows, std::int64_t cols, const T* a, std::int64_t lda, const T* b,
                        std::int64_t ldb, T* out) = 0;
  // dy row r <- the gradient through l2norm_scale_rows at the raw row x r (rowops::l2norm_scale_backward_row).
  virtual void l2norm_scale_backward_rows(std::int64_t rows, std::int64_t cols, const T* x, std::int64_t ldx, T* dy,
                                          std::int64_t ldy, T eps, T s) = 0;
  // Per chunk c, every row i: rowops::gdn_masks_backward_row over the chunk's [C, C] matrices kk, qk (the raw
  // products), dp, da (the masked products' gradients) into dqk, dkk [chunks, C, C] and dgamma, dbeta [chunks, C]
  // (overwritten). The outputs may alias no input.
  virtual void gdn_chunk_masks_backward(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, const T* kk,
                                        const T* qk, const T* dp, const T* da, T* dqk, T* dkk, T* dgamma, T* dbeta) = 0;
  // Per chunk c: rowops::gdn_scales_backward (gamma, beta, dqq, dkbk, dvbv, dktk, dgamma, dbeta [chunks, C]; sds
  // [chunks]); dgamma becomes dg.
  virtual void gdn_chunk_scales_backward(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta,
                                         const T* dqq, const T* dkbk, const T* dvbv, const T* dktk, const T* sds,
                                         T* dgamma, T* dbeta) = 0;

  // ---- the short causal depthwise conv (bodies: attention/kernels/gdn_rows.h), weight [C, W] ----
  // y row r = rowops::short_conv_row over xin rows first[r] .. first[r] + W - 1 (xin, y: rows of C).
  virtual void short_conv_rows(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin,
                               const std::int64_t* first, const T* weight, bool silu, T* y) = 0;
  // dy row r <- rowops::short_conv_dpre_row (the gradient before the SiLU) at the same inputs.
  virtual void short_conv_dpre_rows(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin,
                                    const std::int64_t* first, const T* weight, bool silu, T* dy) = 0;
  // dxin row j = rowops::short_conv_dx_row with src [xrows, W] (row j: the output row reading it as its w-th input,
  // or -1); dpre [*, C].
  virtual void short_conv_dx_rows(std::int64_t xrows, std::int64_t C, std::int64_t W, const T* dpre,
                                  const std::int64_t* src, const T* weight, T* dxin) = 0;
  // dweight [C, W] = rowops::short_conv_dweight_channel for every channel (a fixed order over the rows).
  virtual void short_conv_dweight(std::int64_t rows, std::int64_t C, std::int64_t W, const T* dpre, const T* xin,
                                  const std::int64_t* first, T* dweight) = 0;

  // ---- DSA (bodies: attention/kernels/dsa_rows.h) ----
  // A table that does not implement one of these raises "ops table <name> does not support <op>" when it is called.
  // gemm with one more promise: every element of C is reduced over k in increasing order by the same instructions
  // whatever m, n, the batch and the element's place in C (no split of k, one kernel for every shape), so that a
  // value does not depend on the product it was computed in. The DSA indexer scores use it: a pair's score, and so the
  // tie rule's outcome, is then bitwise the same in any key block of any grid. CUDA: one pinned cuBLASLt algorithm
  // without split-K (edge tiles predicated, not a different kernel).
  virtual void gemm_fixed_order(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha,
                                Mat<const T> a, Mat<const T> b, T beta, Mat<T> c, Batch batch) {
    unsupported_op(this->name(), "gemm_fixed_order");
  }
  // C = relu(alpha op(A) op(B)) for every matrix of the batch (C's old contents ignored), with gemm_fixed_order's
  // promise among this op's own calls: an element's bits do not depend on m, n, the batch or its place in C. The DSA
  // indexer logits, whose consumers (relu_head_sum_rows, indexer_grad_rows) read only relu(s) and s > 0, so that the
  // fused ReLU changes none of their results. A NaN product gives NaN or 0 (table-dependent; both read as "not
  // positive"). Default (the CPU table, the reference): gemm_fixed_order with beta = 0, then relu_rows on every matrix.
  // CUDA: fp32, one cuBLASLt matmul with the ReLU epilogue on one pinned algorithm without split-K; fp64, the
  // fixed-order kernel of gemm_fixed_order with the ReLU in its store.
  virtual void gemm_relu_fixed_order(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha,
                                     Mat<const T> a, Mat<const T> b, Mat<T> c, Batch batch) {
    gemm_fixed_order(ta, tb, m, n, k, alpha, a, b, T(0), c, batch);
    if (m <= 0 || n <= 0) return;
    for (std::int64_t o = 0; o < batch.outer; ++o)
      for (std::int64_t e = 0; e < batch.inner; ++e) relu_rows(m, n, c.at(o, e), c.ld);
  }
  // The inverted index of a row map idx [n_src]: for every dst row d < n_dst, the src rows r with idx[r] = d in
  // ascending r, as offsets [n_dst + 1] and list [n_src] (list[offsets[d] .. offsets[d + 1]) are d's rows; idx[r] < 0
  // is in no list). CUDA: a stable radix sort of (idx, r) pairs and a scan of the row counts.
  virtual void inverted_index(std::int64_t n_src, const std::int64_t* idx, std::int64_t n_dst, std::int64_t* offsets,
                              std::int64_t* list) {
    unsupported_op(this->name(), "inverted_index");
  }
  // dst row d += (the src rows list[offsets[d]], list[offsets[d] + 1], ... summed in that order): one owner per dst
  // row, no floating-point atomics, so the sums are bitwise the same for any schedule.
  virtual void sum_rows_indexed(std::int64_t n_dst, std::int64_t cols, const T* src, std::int64_t ld_src,
                                const std::int64_t* offsets, const std::int64_t* list, T* dst, std::int64_t ld_dst) {
    unsupported_op(this->name(), "sum_rows_indexed");
  }
  // Per row r: the running top-k (s_a, p_a) [rows, k] and a block's candidates (s_b, p_b) [rows, k], each ascending by
  // position with position -1 / score -inf padding at the end, positions distinct between them: (s_a, p_a) <- the k
  // best of their union by the training tie rule (rowops::topk_better), ascending by position, then padding.
  // CUDA: rowops::topk_union_row per row, the table's top-k over the union's columns, a pick.
  virtual void topk_merge_rows(std::int64_t rows, std::int64_t k, T* s_a, std::int64_t* p_a, const T* s_b,
                               const std::int64_t* p_b) {
    unsupported_op(this->name(), "topk_merge_rows");
  }
  // Row r of s [rows, n] (leading dim ld) <- rowops::dsa_probs_row with mask row r / mask_div of mask [., n] and
  // lse = lse_hi[r] + lse_lo[r].
  virtual void dsa_probs_rows(std::int64_t rows, std::int64_t n, T* s, std::int64_t ld, const std::int64_t* mask,
                              std::int64_t mask_div, const T* lse_hi, const T* lse_lo) {
    unsupported_op(this->name(), "dsa_probs_rows");
  }
  // Row r of dp [rows, n] <- p (dp - delta[r]) elementwise (rowops::dsa_dscore_row); p, dp with leading dim ld.
  virtual void dsa_dscore_rows(std::int64_t rows, std::int64_t n, const T* p, T* dp, std::int64_t ld, const T* delta) {
    unsupported_op(this->name(), "dsa_dscore_rows");
  }
  // Per query q: out [queries, n] row q = rowops::relu_head_sum_row of s [queries, Hi, n] matrix q and w [queries, Hi]
  // row q.
  virtual void relu_head_sum_rows(std::int64_t queries, std::int64_t Hi, std::int64_t n, const T* s, const T* w,
                                  T* out) {
    unsupported_op(this->name(), "relu_head_sum_rows");
  }
  // Per query q and head i: rowops::indexer_grad_row on row i of s [queries, Hi, n] matrix q (in place: the logit
  // gradients) with w [queries, Hi] and g [queries, n] row q; dw [queries, Hi] <- its return values.
  virtual void indexer_grad_rows(std::int64_t queries, std::int64_t Hi, std::int64_t n, T* s, const T* w, const T* g,
                                 T* dw) {
    unsupported_op(this->name(), "indexer_grad_rows");
  }
  // Per row r of [rows, k]: loss[r] = rowops::kl_row(probs, scores, idx, grad_scale, dscores) (dscores may be null).
  virtual void kl_rows(std::int64_t rows, std::int64_t k, const T* probs, const T* scores, const std::int64_t* idx,
                       double grad_scale, T* dscores, double* loss) {
    unsupported_op(this->name(), "kl_rows");
  }
};

// The inclusive scan of affine maps x -> M x + U along each of `segments` sequences of n elements (M [K, K],
// U [K, V]): element i becomes (M_i, U_i) o ... o (M_0, U_0) = (M_i ... M_0, M_i (...) + U_i). Composed from the
// table's batched GEMMs and copies in about 2 log2(n) rounds (Brent-Kung), about 2 n K^2 (K + V) multiply-adds per
// segment. m, u: element (s, i) at ptr + s * so + i * si.
template <typename T>
void scan_affine(Ops<T>& ops, std::int64_t segments, std::int64_t n, std::int64_t K, std::int64_t V, Mat<T> m,
                 Mat<T> u);

}  // namespace seqpar::attn::ops
