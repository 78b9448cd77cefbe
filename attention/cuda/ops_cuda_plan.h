// How the CUDA ops table (ops_cuda.h) maps a table GEMM or triangular solve onto one cuBLAS call: the column-major
// arguments and the batch form, as plain data, so that a CPU test (test_ops_cuda_plan) executes the very calls the
// table makes with a loop written from cuBLAS's documented semantics and checks them against fp64 row-major loops.
// No CUDA here.
//
// Row-major C = op(A) op(B) (C [m, n]) is column-major C^T = op(B)^T op(A)^T: cuBLAS's first operand is our B, its
// second our A, its m our n, its n our m; a row-major operand with leading dim ld is its transpose column-major with
// the same ld, so the transpose flags carry over unchanged. A batch is one strided batch when every operand's matrix
// e = o * inner + n (o < outer, n < inner) sits at base + e * stride (outer = 1, inner = 1, or so = inner * si); else
// pointer arrays with matrix e at base + (e / inner) * so + (e % inner) * si.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../ops/ops.h"

namespace seqpar::attn::ops::cuda_plan {

// An operand's layout: leading dim, outer and inner batch strides (elements).
struct Layout {
  std::int64_t ld = 0, so = 0, si = 0;
};
template <typename P>
Layout layout_of(const Mat<P>& m) {
  return {m.ld, m.so, m.si};
}

// The one stride of a two-level batch that is one strided batch of outer * inner matrices, or false.
inline bool one_stride(const Layout& x, const Batch& b, std::int64_t& stride) {
  if (b.outer == 1) {
    stride = x.si;
  } else if (b.inner == 1) {
    stride = x.so;
  } else if (x.so == b.inner * x.si) {
    stride = x.si;
  } else {
    return false;
  }
  return true;
}

// cuBLAS wants ld >= the row-major column count (its rows) even for a one-row matrix, whose ld is never used.
inline std::int64_t usable_ld(std::int64_t ld, std::int64_t rows, std::int64_t cols) {
  return rows <= 1 ? std::max({ld, cols, std::int64_t{1}}) : ld;
}

// cublas<t>gemmStridedBatched_64 / gemmBatched_64 arguments: C' = alpha op_a(A') op_b(B') + beta C', A' = our b,
// B' = our a, C' = our c.
struct GemmCall {
  Trans op_a = Trans::kN, op_b = Trans::kN;
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  bool strided = false;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // when strided
  std::int64_t count = 0;
};

inline GemmCall plan_gemm(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, const Layout& a,
                          const Layout& b, const Layout& c, const Batch& batch) {
  GemmCall g;
  g.op_a = tb;
  g.op_b = ta;
  g.m = n;
  g.n = m;
  g.k = k;
  g.lda = usable_ld(b.ld, tb == Trans::kN ? k : n, tb == Trans::kN ? n : k);
  g.ldb = usable_ld(a.ld, ta == Trans::kN ? m : k, ta == Trans::kN ? k : m);
  g.ldc = usable_ld(c.ld, m, n);
  g.count = batch.count();
  g.strided = one_stride(b, batch, g.stride_a) && one_stride(a, batch, g.stride_b) && one_stride(c, batch, g.stride_c);
  return g;
}

// cublas<t>trsmBatched_64 arguments: side right, upper, no transpose, unit diagonal: X' U = alpha B' with U = our L
// (row-major lower = column-major upper, same ld) and B' = our b ([nrhs, n] column-major), alpha = 1.
struct TrsmCall {
  std::int64_t m = 0, n = 0;
  std::int64_t lda = 0, ldb = 0;
  std::int64_t count = 0;
};

inline TrsmCall plan_trsm(std::int64_t n, std::int64_t nrhs, const Layout& l, const Layout& b, const Batch& batch) {
  return {nrhs, n, usable_ld(l.ld, n, n), usable_ld(b.ld, n, nrhs), batch.count()};
}

// Matrix e of a two-level batch (the pointer-array form, also right for a strided batch).
inline std::int64_t matrix_offset(const Layout& x, const Batch& b, std::int64_t e) {
  return (e / b.inner) * x.so + (e % b.inner) * x.si;
}

}  // namespace seqpar::attn::ops::cuda_plan
