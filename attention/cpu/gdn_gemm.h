// Internal to the CPU GDN kernels (gdn_chunk.cc, gdn_transition.cc): the small row-major matrix products of a chunk
// and of the segment maps, C (+)= alpha op(A) op(B). fp32 runs on the register-blocked micro-kernel of the MHA kernels
// (mha_simd.h); fp64, the fp64 reference precision, on a portable two-row kernel. Every element of C is reduced over
// k in ascending order, so results never depend on the blocking or on the thread count. Not a public header.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "mha_simd.h"

namespace seqpar::attn::cpu::gdn {

// ---- small row-major matrix products (C (+)= alpha op(A) op(B)); inner loops run over contiguous memory ----------

// 32-byte vectors (GCC / Clang vector extensions; lowered to AVX2 here, to pairs of 16-byte registers elsewhere).
template <typename T>
struct Vec32;
template <>
struct Vec32<float> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct Vec32<double> {
  typedef double type __attribute__((vector_size(32)));
};

// C[m, n] (+)= alpha * op(A) B, op(A) = A [m, k] or (kTransA) A^T with A [k, m]. Two rows of C and a block of
// four vectors of columns are accumulated in registers over all of k; the rest of the columns take a scalar path.
// When a_lower, op(A) is lower triangular (zero above the diagonal, also stored as zero), and the k loop stops
// after the diagonal of the second row. The summation order is fixed (p ascending). The fp64 path, and the columns
// of an fp32 product that are not a multiple of the SIMD width.
template <typename T, bool kTransA>
void gemm_generic(std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a, std::int64_t lda, const T* b,
                  std::int64_t ldb, T* c, std::int64_t ldc, bool accumulate, bool a_lower) {
  using VT = typename Vec32<T>::type;
  constexpr std::int64_t kLanes = 32 / static_cast<std::int64_t>(sizeof(T));
  constexpr int kNV = 4;
  constexpr std::int64_t JB = kLanes * kNV;
  auto a_at = [&](std::int64_t i, std::int64_t p) { return kTransA ? a[p * lda + i] : a[i * lda + p]; };
  for (std::int64_t i0 = 0; i0 < m; i0 += 2) {
    const bool two = i0 + 1 < m;
    const std::int64_t kend = a_lower ? std::min(k, i0 + 2) : k;
    std::int64_t j0 = 0;
    for (; j0 + JB <= n; j0 += JB) {
      VT acc0[kNV] = {}, acc1[kNV] = {};
      for (std::int64_t p = 0; p < kend; ++p) {
        const T a0 = a_at(i0, p);
        const T a1 = two ? a_at(i0 + 1, p) : T(0);
        const T* bp = b + p * ldb + j0;
#pragma GCC unroll 4
        for (int v = 0; v < kNV; ++v) {
          VT bv;
          std::memcpy(&bv, bp + v * kLanes, sizeof(VT));
          acc0[v] += a0 * bv;
          acc1[v] += a1 * bv;
        }
      }
      for (int r = 0; r < (two ? 2 : 1); ++r) {
        T* cr = c + (i0 + r) * ldc + j0;
        const VT* acc = r == 0 ? acc0 : acc1;
#pragma GCC unroll 4
        for (int v = 0; v < kNV; ++v) {
          VT cv = alpha * acc[v];
          if (accumulate) {
            VT old;
            std::memcpy(&old, cr + v * kLanes, sizeof(VT));
            cv += old;
          }
          std::memcpy(cr + v * kLanes, &cv, sizeof(VT));
        }
      }
    }
    for (; j0 < n; ++j0) {
      T s0 = 0, s1 = 0;
      for (std::int64_t p = 0; p < kend; ++p) {
        const T bpj = b[p * ldb + j0];
        s0 += a_at(i0, p) * bpj;
        if (two) s1 += a_at(i0 + 1, p) * bpj;
      }
      T* c0 = c + i0 * ldc + j0;
      *c0 = (accumulate ? *c0 : T(0)) + alpha * s0;
      if (two) c0[ldc] = (accumulate ? c0[ldc] : T(0)) + alpha * s1;
    }
  }
}

// C[m, n] (+)= alpha * op(A) B as above, alpha = 1 or -1 (any other alpha, and fp64: gemm_generic). fp32: the
// register-blocked micro-kernel of the MHA kernels (mha_simd.h, kMR rows x kNV vectors of C in registers over all of
// k, k ascending) on the columns that fill whole vectors, gemm_generic on the rest. As in gemm_generic, a product
// that accumulates is summed on its own (in 64 x 64 blocks on the stack) and then added to C: summing the products
// onto C's old value would round them at C's magnitude. A lower-triangular op(A) is multiplied in full here (its upper
// part is stored as zeros). Every element of C is reduced over k in ascending order either way, so the result does
// not depend on the blocking or on the thread count.
template <typename T, bool kTransA>
void gemm(std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a, std::int64_t lda, const T* b,
          std::int64_t ldb, T* c, std::int64_t ldc, bool accumulate, bool a_lower) {
  if constexpr (std::is_same_v<T, float> && Simd<float>::W > 1) {
    constexpr std::int64_t W = Simd<float>::W, kBlock = 64;
    static_assert(kBlock % W == 0);
    const std::int64_t n_main = n / W * W;
    if (n_main > 0 && m > 0 && (alpha == T(1) || alpha == T(-1))) {
      const int ki = static_cast<int>(k), la = static_cast<int>(lda), lb = static_cast<int>(ldb);
      const bool neg = alpha == T(-1);
      if (!accumulate) {
        gemm_tile<float, false, kTransA>(static_cast<int>(m), static_cast<int>(n_main), ki, a, la, b, lb, c,
                                         static_cast<int>(ldc));
        if (neg) {
          for (std::int64_t i = 0; i < m; ++i) {
            for (std::int64_t j = 0; j < n_main; ++j) c[i * ldc + j] = -c[i * ldc + j];
          }
        }
      } else {
        alignas(64) float block[kBlock * kBlock];
        for (std::int64_t i0 = 0; i0 < m; i0 += kBlock) {
          const std::int64_t rows = std::min(kBlock, m - i0);
          const float* a0 = kTransA ? a + i0 : a + i0 * lda;
          for (std::int64_t j0 = 0; j0 < n_main; j0 += kBlock) {
            const std::int64_t cols = std::min(kBlock, n_main - j0);
            gemm_tile<float, false, kTransA>(static_cast<int>(rows), static_cast<int>(cols), ki, a0, la, b + j0, lb,
                                             block, static_cast<int>(kBlock));
            for (std::int64_t i = 0; i < rows; ++i) {
              float* ci = c + (i0 + i) * ldc + j0;
              const float* pi = block + i * kBlock;
              if (neg) {
                for (std::int64_t j = 0; j < cols; ++j) ci[j] -= pi[j];
              } else {
                for (std::int64_t j = 0; j < cols; ++j) ci[j] += pi[j];
              }
            }
          }
        }
      }
      if (n_main < n)
        gemm_generic<T, kTransA>(m, n - n_main, k, alpha, a, lda, b + n_main, ldb, c + n_main, ldc, accumulate,
                                 a_lower);
      return;
    }
  }
  gemm_generic<T, kTransA>(m, n, k, alpha, a, lda, b, ldb, c, ldc, accumulate, a_lower);
}

// C[m, n] (+)= alpha * A[m, k] B[k, n].
template <typename T>
void mm_nn(std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a, std::int64_t lda, const T* b,
           std::int64_t ldb, T* c, std::int64_t ldc, bool accumulate, bool a_lower = false) {
  gemm<T, false>(m, n, k, alpha, a, lda, b, ldb, c, ldc, accumulate, a_lower);
}

// C[m, n] (+)= alpha * A^T B with A [k, m], B [k, n].
template <typename T>
void mm_tn(std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a, std::int64_t lda, const T* b,
           std::int64_t ldb, T* c, std::int64_t ldc, bool accumulate) {
  gemm<T, true>(m, n, k, alpha, a, lda, b, ldb, c, ldc, accumulate, false);
}

// dst[j, i] = src[i, j] for src [rows, cols] (row stride lds), dst [cols, rows] (row stride ldd), in 16 x 16 tiles
// so that both sides stream through whole cache lines.
template <typename T>
void transpose(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t lds, T* dst, std::int64_t ldd) {
  constexpr std::int64_t kTile = 16;
  for (std::int64_t i0 = 0; i0 < rows; i0 += kTile) {
    const std::int64_t i1 = std::min(rows, i0 + kTile);
    for (std::int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const std::int64_t j1 = std::min(cols, j0 + kTile);
      for (std::int64_t j = j0; j < j1; ++j) {
        for (std::int64_t i = i0; i < i1; ++i) dst[j * ldd + i] = src[i * lds + j];
      }
    }
  }
}

// C[m, n] (+)= alpha * A B^T with A [m, k], B [n, k]: B is transposed into `bt` (n * k values, the worker's
// transpose buffer) so that the inner loop runs over contiguous memory like mm_nn.
template <typename T>
void mm_nt(std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a, std::int64_t lda, const T* b,
           std::int64_t ldb, T* c, std::int64_t ldc, bool accumulate, T* bt) {
  transpose(n, k, b, ldb, bt, n);
  mm_nn<T>(m, n, k, alpha, a, lda, bt, n, c, ldc, accumulate);
}

// sum_i a[i] b[i] in a fixed order: kLanes interleaved partial sums (the compiler keeps them in two vector registers;
// one running sum would serialise on the add latency, as strict floating point may not reassociate it), then the
// partial sums pairwise.
template <typename T>
T dot(const T* a, const T* b, std::int64_t n) {
  constexpr int kLanes = 128 / static_cast<int>(sizeof(T));
  T acc[kLanes] = {};
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma GCC unroll 32
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i + l < n; ++l) acc[l] += a[i + l] * b[i + l];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  }
  return acc[0];
}

}  // namespace seqpar::attn::cpu::gdn
