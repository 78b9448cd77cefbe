// Internal to the CPU MHA kernels: a small SIMD layer, a vectorised exp2 and a register-blocked GEMM tile kernel.
//
// Simd<T> gives the vector type V of W lanes of T with load / store / fma / max / exp2 and the register-block shape
// (kMR rows x kNV vectors) of the GEMM micro-kernel. Three float back ends: AVX-512F (W = 16), AVX2 + FMA (W = 8)
// and portable scalar code (W = 1); double is always scalar (fp64 is the test / reference precision, not a fast
// path). Define SEQPAR_MHA_NO_AVX512 to force the AVX2 back end on an AVX-512 machine, SEQPAR_MHA_SCALAR to force
// the scalar one.
//
// exp2 (float vectors): x = n + f with n = round(x), |f| <= 1/2; 2^f by a degree-5 polynomial 1 + f q(f) fitted to
// minimise the relative error on [-1/2, 1/2] (Lawson's iteratively reweighted least squares: 9.2e-8 in exact
// arithmetic, below 2 fp32 ulp of 1.2e-7 with the Horner roundings; tested against std::exp2 to 4 ulp), 2^n added
// into the exponent field. Inputs below -125 give exactly 0 (so exp2(-inf) = 0 and no subnormal is ever produced);
// inputs are clamped above at 127; NaN gives NaN.
// Cody & Waite style range reduction and minimax fitting, see J.-M. Muller, "Elementary Functions", ch. 3 and 11.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if !defined(SEQPAR_MHA_SCALAR) && (defined(__AVX2__) || defined(__AVX512F__))
// GCC 12 reports -Wmaybe-uninitialized inside its own avx512fintrin.h (the _mm512_undefined_* pass-through operand
// of unmasked intrinsics, GCC bug 105593); the warning is about the header, not about this code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#endif

namespace seqpar::attn::cpu {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

template <typename T>
struct Simd;

// ---- scalar back end (double always; float when no AVX2) -----------------------------------------
template <typename T>
struct ScalarSimd {
  static constexpr int W = 1;
  static constexpr int kMR = 4;
  static constexpr int kNV = 4;
  static constexpr const char* kName = "scalar";
  using V = T;
  static V zero() { return T(0); }
  static V set1(T x) { return x; }
  static V load(const T* p) { return *p; }
  static void store(T* p, V v) { *p = v; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V max(V a, V b) { return a > b ? a : b; }
  static T reduce_add(V v) { return v; }
  static T reduce_max(V v) { return v; }
  // Same contract as the vector back ends: 0 below -125 (such terms are below the rounding of a softmax sum >= 1).
  static V exp2(V x) { return x < T(-125) ? T(0) : std::exp2(x); }
};

template <>
struct Simd<double> : ScalarSimd<double> {};

#if !defined(SEQPAR_MHA_SCALAR) && (defined(__AVX2__) || defined(__AVX512F__))
// Pieces shared by the AVX2 and AVX-512 back ends.
namespace simd_detail {

// The 2^f polynomial for f = x - round(x) in [-1/2, 1/2]: 1 + f q(f) with q of degree 4, Horner in S::fma from the
// highest coefficient. The constant term is exactly 1, so integral x give exact powers of two.
template <typename S>
inline typename S::V exp2_poly(typename S::V f) {
  constexpr float kCoeff[6] = {1.3264728746865996e-03f, 9.6715131819300610e-03f, 5.5507337445213020e-02f,
                               2.4022242077112552e-01f, 6.9314697759510550e-01f, 1.0f};
  typename S::V p = S::set1(kCoeff[0]);
  for (int i = 1; i < 6; ++i) p = S::fma(p, f, S::set1(kCoeff[i]));
  return p;
}

// 2^x (see the header comment): 0 below -125, clamped at 127, NaN stays NaN (a NaN score must not become a weight
// of 0 or of 2^127): the "not less than" predicate is true for NaN, and min returns its second operand, x, when
// either is NaN. Lanes below -125 (-inf included) are not clamped: whatever the polynomial and the exponent add make
// of them, the mask replaces it by 0.
template <typename S>
inline typename S::V exp2(typename S::V x) {
  const typename S::Mask live = S::not_less(x, -125.0f);
  x = S::min(S::set1(127.0f), x);
  const typename S::V n = S::round(x);
  return S::keep(live, S::times_pow2(exp2_poly<S>(S::sub(x, n)), n));
}

// Horizontal sum / max of the 8 lanes of v, halves first.
inline float reduce_add_256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max_256(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace simd_detail
#endif

#if !defined(SEQPAR_MHA_SCALAR) && defined(__AVX512F__) && !defined(SEQPAR_MHA_NO_AVX512)
template <>
struct Simd<float> {
  static constexpr int W = 16;
  static constexpr int kMR = 6;  // 6 x 4 zmm accumulators + 4 B loads + 1 broadcast of 32 registers
  static constexpr int kNV = 4;
  static constexpr const char* kName = "avx512";
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  // via AVX2 halves: GCC 12's _mm512_reduce_*_ps trip -Wmaybe-uninitialized
  static float reduce_add(V v) {
    return simd_detail::reduce_add_256(
        _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  static float reduce_max(V v) {
    return simd_detail::reduce_max_256(
        _mm256_max_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  // The pieces of simd_detail::exp2.
  using Mask = __mmask16;
  static Mask not_less(V x, float t) { return _mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_NLT_UQ); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V times_pow2(V p, V n) {  // p 2^n for integral n, by adding n to the exponent field
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
  }
  static V keep(Mask m, V r) { return _mm512_maskz_mov_ps(m, r); }
  static V exp2(V x) { return simd_detail::exp2<Simd>(x); }
};
#elif !defined(SEQPAR_MHA_SCALAR) && defined(__AVX2__) && defined(__FMA__)
template <>
struct Simd<float> {
  static constexpr int W = 8;
  static constexpr int kMR = 6;  // 6 x 2 ymm accumulators + 2 B loads + 1 broadcast of 16 registers
  static constexpr int kNV = 2;
  static constexpr const char* kName = "avx2";
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float reduce_add(V v) { return simd_detail::reduce_add_256(v); }
  static float reduce_max(V v) { return simd_detail::reduce_max_256(v); }
  using Mask = V;
  static Mask not_less(V x, float t) { return _mm256_cmp_ps(x, _mm256_set1_ps(t), _CMP_NLT_UQ); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V times_pow2(V p, V n) {
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
  }
  static V keep(Mask m, V r) { return _mm256_and_ps(r, m); }
  static V exp2(V x) { return simd_detail::exp2<Simd>(x); }
};
#else
template <>
struct Simd<float> : ScalarSimd<float> {};
#endif

// ---- GEMM tile: C[M, N] (=|+=) op(A) B -------------------------------------------------------------
// op(A) = A [M, K] row-major with leading dimension lda, or with kTransA the transpose of A stored [K, M] row-major
// (element (m, k) at A[k * lda + m]). B [K, N] and C [M, N] are row-major with leading dimensions ldb, ldc
// (elements). N must be a multiple of Simd<T>::W; M and K are any. Every element of C is reduced over k in
// increasing order, so results do not depend on the M / N blocking (nor on the thread count of the caller).
template <typename T, int MR, int NV, bool kAccumulate, bool kTransA>
inline void gemm_micro(int K, const T* __restrict A, int lda, const T* __restrict B, int ldb, T* __restrict C,
                       int ldc) {
  using S = Simd<T>;
  using V = typename S::V;
  constexpr int W = S::W;
  V c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = kAccumulate ? S::load(C + r * ldc + v * W) : S::zero();
  for (int k = 0; k < K; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = S::load(B + static_cast<std::int64_t>(k) * ldb + v * W);
    for (int r = 0; r < MR; ++r) {
      const V a = S::set1(kTransA ? A[static_cast<std::int64_t>(k) * lda + r] : A[r * lda + k]);
      for (int v = 0; v < NV; ++v) c[r][v] = S::fma(a, b[v], c[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) S::store(C + r * ldc + v * W, c[r][v]);
}

template <typename T, int MR, bool kAccumulate, bool kTransA>
inline void gemm_rows(int nv, int K, const T* A, int lda, const T* B, int ldb, T* C, int ldc) {
  static_assert(Simd<T>::kNV <= 4);
  switch (nv) {
    case 4:
      if constexpr (Simd<T>::kNV >= 4) gemm_micro<T, MR, 4, kAccumulate, kTransA>(K, A, lda, B, ldb, C, ldc);
      break;
    case 3:
      if constexpr (Simd<T>::kNV >= 3) gemm_micro<T, MR, 3, kAccumulate, kTransA>(K, A, lda, B, ldb, C, ldc);
      break;
    case 2:
      if constexpr (Simd<T>::kNV >= 2) gemm_micro<T, MR, 2, kAccumulate, kTransA>(K, A, lda, B, ldb, C, ldc);
      break;
    default: gemm_micro<T, MR, 1, kAccumulate, kTransA>(K, A, lda, B, ldb, C, ldc); break;
  }
}

template <typename T, bool kAccumulate, bool kTransA = false>
inline void gemm_tile(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T* C, int ldc) {
  using S = Simd<T>;
  constexpr int W = S::W;
  constexpr int MR = S::kMR;
  static_assert(MR <= 6);
  // start of rows m0 of op(A)
  auto a_at = [&](int m0) { return kTransA ? A + m0 : A + static_cast<std::int64_t>(m0) * lda; };
  for (int n0 = 0; n0 < N; n0 += S::kNV * W) {
    const int nv = std::min(S::kNV, (N - n0) / W);
    int m0 = 0;
    for (; m0 + MR <= M; m0 += MR)
      gemm_rows<T, MR, kAccumulate, kTransA>(nv, K, a_at(m0), lda, B + n0, ldb, C + m0 * ldc + n0, ldc);
    const T* a = a_at(m0);
    T* c = C + m0 * ldc + n0;
    switch (M - m0) {
      case 0: break;
      case 1: gemm_rows<T, 1, kAccumulate, kTransA>(nv, K, a, lda, B + n0, ldb, c, ldc); break;
      case 2: gemm_rows<T, 2, kAccumulate, kTransA>(nv, K, a, lda, B + n0, ldb, c, ldc); break;
      case 3: gemm_rows<T, 3, kAccumulate, kTransA>(nv, K, a, lda, B + n0, ldb, c, ldc); break;
      case 4: gemm_rows<T, 4, kAccumulate, kTransA>(nv, K, a, lda, B + n0, ldb, c, ldc); break;
      default: gemm_rows<T, 5, kAccumulate, kTransA>(nv, K, a, lda, B + n0, ldb, c, ldc); break;
    }
  }
}

}  // namespace seqpar::attn::cpu
