// The CUDA ops table's cuBLAS calls (attention/cuda/ops_cuda_plan.h) executed on the CPU, and its top-k algorithm
// (ops_cuda_sort.cu: stable sort by ops_cuda_keys.h's key, the first k non-NaN, re-sorted by column) emulated on the
// host against the CPU table's top-k: each planned
// gemm(Strided)Batched / trsmBatched call is run by a loop written from cuBLAS's documented column-major semantics,
// its matrices found the way the table finds them (one stride, or the pointer-array formula that its device kernel
// evaluates), and its result compared with the row-major fp64 loop of the ops table's contract (attention/ops/ops.h);
// the arguments also pass cuBLAS's argument rules (lda >= rows of the stored operand, ...), which a real call would
// refuse otherwise. Shapes: every transpose pair, non-square, padded leading dims, one-row operands with a leading dim
// below their width, two-level batches that are one strided batch and ones that are not (zero strides, gaps).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention/cuda/ops_cuda_keys.h"
#include "attention/cuda/ops_cuda_plan.h"
#include "attention/ops/ops_cpu.h"

namespace seqpar::attn::ops::cuda_plan {
namespace {

std::vector<double> rand_vec(std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (double& x : v) x = u(rng);
  return v;
}

// cuBLAS gemm, column-major: C[i + j ldc] = alpha sum_p op_a(A)(i, p) op_b(B)(p, j) + beta C (beta = 0: C not read),
// op(X)(i, p) = X[i + p ldx] (N) or X[p + i ldx] (T).
void cublas_gemm_ref(Trans op_a, Trans op_b, std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
                     const double* A, std::int64_t lda, const double* B, std::int64_t ldb, double beta, double* C,
                     std::int64_t ldc) {
  for (std::int64_t j = 0; j < n; ++j)
    for (std::int64_t i = 0; i < m; ++i) {
      double acc = 0.0;
      for (std::int64_t p = 0; p < k; ++p)
        acc += (op_a == Trans::kN ? A[i + p * lda] : A[p + i * lda]) *
               (op_b == Trans::kN ? B[p + j * ldb] : B[j + p * ldb]);
      C[i + j * ldc] = beta == 0.0 ? alpha * acc : alpha * acc + beta * C[i + j * ldc];
    }
}

// cuBLAS's argument rules for gemm (column-major A' is m x k for N, k x m for T; B' k x n for N, n x k for T).
void expect_valid(const GemmCall& g, const std::string& what) {
  EXPECT_GE(g.lda, std::max<std::int64_t>(1, g.op_a == Trans::kN ? g.m : g.k)) << what;
  EXPECT_GE(g.ldb, std::max<std::int64_t>(1, g.op_b == Trans::kN ? g.k : g.n)) << what;
  EXPECT_GE(g.ldc, std::max<std::int64_t>(1, g.m)) << what;
}

struct GemmCase {
  Trans ta, tb;
  std::int64_t m, n, k;
  Batch batch;
  int layout;  // 0: one strided batch; 1: B the same for every inner index; 2: gaps between outer blocks; 3: lds
               // below the width of one-row operands (m = 1)
};

void run_gemm(const GemmCase& t) {
  const std::string what = "ta " + std::to_string(int(t.ta)) + " tb " + std::to_string(int(t.tb)) + " m " +
                           std::to_string(t.m) + " n " + std::to_string(t.n) + " k " + std::to_string(t.k) +
                           " layout " + std::to_string(t.layout);
  const std::int64_t outer = t.batch.outer, inner = t.batch.inner;
  const std::int64_t arows = t.ta == Trans::kN ? t.m : t.k, acols = t.ta == Trans::kN ? t.k : t.m;
  const std::int64_t brows = t.tb == Trans::kN ? t.k : t.n, bcols = t.tb == Trans::kN ? t.n : t.k;
  Layout a{acols + 2, 0, 0}, b{bcols + 1, 0, 0}, c{t.n + 3, 0, 0};
  if (t.layout == 3) a.ld = 0, c.ld = 0;  // only row 0 of A and C exists (m = 1; A not transposed)
  const std::int64_t asz = std::max<std::int64_t>(arows * a.ld, acols), bsz = brows * b.ld,
                     csz = std::max<std::int64_t>(t.m * c.ld, t.n);
  const std::int64_t gap = t.layout == 2 ? 5 : 0;
  a.si = asz, a.so = inner * asz + gap;
  b.si = t.layout == 1 ? 0 : bsz, b.so = (t.layout == 1 ? bsz : inner * bsz) + gap;
  c.si = csz, c.so = inner * csz + gap;
  const auto A = rand_vec(outer * a.so, 1), B = rand_vec(outer * b.so, 2), C0 = rand_vec(outer * c.so, 3);
  // the table's contract, row-major: C = 0.5 op(A) op(B) + 2 C
  std::vector<double> want = C0;
  for (std::int64_t e = 0; e < t.batch.count(); ++e) {
    const double *Ae = A.data() + matrix_offset(a, t.batch, e), *Be = B.data() + matrix_offset(b, t.batch, e);
    double* Ce = want.data() + matrix_offset(c, t.batch, e);
    for (std::int64_t i = 0; i < t.m; ++i)
      for (std::int64_t j = 0; j < t.n; ++j) {
        double acc = 0.0;
        for (std::int64_t p = 0; p < t.k; ++p)
          acc += (t.ta == Trans::kN ? Ae[i * a.ld + p] : Ae[p * a.ld + i]) *
                 (t.tb == Trans::kN ? Be[p * b.ld + j] : Be[j * b.ld + p]);
        Ce[i * c.ld + j] = 0.5 * acc + 2.0 * Ce[i * c.ld + j];
      }
  }
  // the planned call
  const GemmCall g = plan_gemm(t.ta, t.tb, t.m, t.n, t.k, a, b, c, t.batch);
  expect_valid(g, what);
  EXPECT_EQ(t.batch.count(), g.count) << what;
  EXPECT_EQ(t.layout == 0 || t.layout == 3 || outer == 1 || inner == 1, g.strided) << what;
  std::vector<double> got = C0;
  for (std::int64_t e = 0; e < g.count; ++e) {
    // A' = our b, B' = our a
    const std::int64_t oa = g.strided ? e * g.stride_a : matrix_offset(b, t.batch, e);
    const std::int64_t ob = g.strided ? e * g.stride_b : matrix_offset(a, t.batch, e);
    const std::int64_t oc = g.strided ? e * g.stride_c : matrix_offset(c, t.batch, e);
    cublas_gemm_ref(g.op_a, g.op_b, g.m, g.n, g.k, 0.5, B.data() + oa, g.lda, A.data() + ob, g.ldb, 2.0,
                    got.data() + oc, g.ldc);
  }
  double err = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) err = std::max(err, std::abs(got[i] - want[i]));
  EXPECT_LT(err, 1e-12) << what;
}

TEST(OpsCudaPlan, GemmCallsGiveTheRowMajorProduct) {
  for (Trans ta : {Trans::kN, Trans::kT})
    for (Trans tb : {Trans::kN, Trans::kT}) {
      for (int layout = 0; layout < 3; ++layout) {
        run_gemm({ta, tb, 5, 7, 3, Batch{3, 4}, layout});
        run_gemm({ta, tb, 4, 2, 6, Batch{1, 5}, layout});  // outer 1: one strided batch whatever the layout
        run_gemm({ta, tb, 3, 6, 2, Batch{4, 1}, layout});  // inner 1: likewise
      }
      run_gemm({ta, tb, 1, 1, 1, Batch{2, 3}, 0});
    }
  for (Trans tb : {Trans::kN, Trans::kT}) run_gemm({Trans::kN, tb, 1, 6, 4, Batch{2, 3}, 3});
}

// cuBLAS trsm, side right, upper, no transpose, unit diagonal, alpha 1, column-major: X U = B for X [m, n] over B
// (ld ldb), U [n, n] (ld lda): column j of X = B[:, j] - sum_{p < j} X[:, p] U[p, j]; only U's strictly upper part
// read.
void cublas_trsm_ref(std::int64_t m, std::int64_t n, const double* U, std::int64_t lda, double* B, std::int64_t ldb) {
  for (std::int64_t j = 0; j < n; ++j)
    for (std::int64_t p = 0; p < j; ++p)
      for (std::int64_t i = 0; i < m; ++i) B[i + j * ldb] -= B[i + p * ldb] * U[p + j * lda];
}

TEST(OpsCudaPlan, TrsmCallSolvesTheRowMajorUnitLowerSystem) {
  const std::int64_t n = 6, nrhs = 5, outer = 2, inner = 3;
  const Layout l{8, n * 8, 0};  // one L per outer index
  const Layout b{7, inner * n * 7, n * 7};
  auto L = rand_vec(outer * l.so, 4);
  for (double& x : L) x *= 0.4;
  for (std::int64_t o = 0; o < outer; ++o)  // diagonal and above: NaN, never to be read
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = i; j < l.ld; ++j) L[o * l.so + i * l.ld + j] = std::nan("");
  const auto B0 = rand_vec(outer * b.so, 5);
  const TrsmCall t = plan_trsm(n, nrhs, l, b, Batch{outer, inner});
  EXPECT_GE(t.lda, std::max<std::int64_t>(1, t.n));  // cuBLAS: side right, lda >= n
  EXPECT_GE(t.ldb, std::max<std::int64_t>(1, t.m));
  EXPECT_EQ(nrhs, t.m);
  EXPECT_EQ(n, t.n);
  std::vector<double> X = B0;
  for (std::int64_t e = 0; e < t.count; ++e)
    cublas_trsm_ref(t.m, t.n, L.data() + matrix_offset(l, Batch{outer, inner}, e), t.lda,
                    X.data() + matrix_offset(b, Batch{outer, inner}, e), t.ldb);
  // the row-major contract: L X = B with L unit lower (strictly lower part), X in place of B [n, nrhs]
  double err = 0.0;
  for (std::int64_t e = 0; e < t.count; ++e) {
    const double* Le = L.data() + matrix_offset(l, Batch{outer, inner}, e);
    const std::int64_t ob = matrix_offset(b, Batch{outer, inner}, e);
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t j = 0; j < nrhs; ++j) {
        double lx = X[ob + i * b.ld + j];
        for (std::int64_t p = 0; p < i; ++p) lx += Le[i * l.ld + p] * X[ob + p * b.ld + j];
        err = std::max(err, std::abs(lx - B0[ob + i * b.ld + j]));
      }
      for (std::int64_t j = nrhs; j < b.ld; ++j) EXPECT_EQ(B0[ob + i * b.ld + j], X[ob + i * b.ld + j]);
    }
  }
  EXPECT_LT(err, 1e-12);
}

// rows x n scores drawn with `seed` from `pool` (ties, -0, NaN, infinities), row ranges [lo, hi) that may reach
// past either end or be empty, and the CPU table's top-k of them (want_idx, [rows, k], -1 padded): the rule each
// device path below must reproduce.
template <typename T>
struct TiedRows {
  std::vector<T> s;
  std::vector<std::int64_t> lo, hi, want_idx;
};

template <typename T>
TiedRows<T> tied_rows(std::int64_t rows, std::int64_t n, std::int64_t k, const std::vector<T>& pool,
                      std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  TiedRows<T> t{std::vector<T>(rows * n), std::vector<std::int64_t>(rows), std::vector<std::int64_t>(rows),
                std::vector<std::int64_t>(rows * k)};
  for (T& x : t.s) x = pool[rng() % pool.size()];
  for (std::int64_t r = 0; r < rows; ++r) {
    t.lo[r] = static_cast<std::int64_t>(rng() % 30) - 4;
    t.hi[r] = t.lo[r] + static_cast<std::int64_t>(rng() % 14) - 1;
  }
  std::vector<T> want_val(rows * k);
  cpu_ops<T>().topk_rows(rows, n, k, t.s.data(), n, t.lo.data(), t.hi.data(), t.want_idx.data(), want_val.data());
  return t;
}

template <typename T>
void check_topk_by_keys() {
  using Key = OrderedKey<T>;
  const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
  // the key's order is the scores' order; -0 = +0; NaN (either sign) is 0, below -inf
  const std::vector<T> ascending = {-inf, T(-3), T(-1e-30), T(-0.0), T(0.0), T(1e-30), T(2), inf};
  for (std::size_t i = 0; i + 1 < ascending.size(); ++i) {
    if (ascending[i] == ascending[i + 1])
      EXPECT_EQ(Key::of(ascending[i]), Key::of(ascending[i + 1])) << double(ascending[i]);
    else
      EXPECT_LT(Key::of(ascending[i]), Key::of(ascending[i + 1])) << double(ascending[i]);
  }
  EXPECT_EQ(0u, Key::of(nan));
  EXPECT_EQ(0u, Key::of(-nan));
  EXPECT_LT(0u, Key::of(-inf));
  // the algorithm against the CPU table on rows full of ties
  const std::int64_t rows = 64, n = 23, k = 6;
  const std::vector<T> pool = {T(2), T(1), T(0), T(-0.0), T(-1), -inf, inf, nan, T(0.5)};
  const TiedRows<T> t = tied_rows(rows, n, k, pool, 21);
  const std::vector<T>& s = t.s;
  const std::vector<std::int64_t>&lo = t.lo, &hi = t.hi, &want_idx = t.want_idx;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t b = std::clamp<std::int64_t>(lo[r], 0, n), e = std::clamp<std::int64_t>(hi[r], b, n);
    std::vector<std::int64_t> cols;
    for (std::int64_t j = b; j < e; ++j) cols.push_back(j);
    std::stable_sort(cols.begin(), cols.end(),
                     [&](std::int64_t x, std::int64_t y) { return Key::of(s[r * n + x]) > Key::of(s[r * n + y]); });
    std::vector<std::int64_t> chosen;
    for (std::size_t t = 0; t < cols.size() && static_cast<std::int64_t>(t) < k && Key::of(s[r * n + cols[t]]) != 0;
         ++t)
      chosen.push_back(cols[t]);
    std::sort(chosen.begin(), chosen.end());
    for (std::int64_t t = 0; t < k; ++t)
      EXPECT_EQ(t < static_cast<std::int64_t>(chosen.size()) ? chosen[t] : -1, want_idx[r * k + t])
          << "row " << r << " slot " << t;
  }
}

// The fp32 path through FlashInfer's top-k (ops_cuda_sort.cu): FlashInferInput keeps the scores' order and ties with
// every NaN below every score under FlashInfer's bit order; FlashInfer's rule (the k largest keys of each row's first
// len entries, ties to the smaller index) on the mapped rows, then dropping NaN and sorting by column, is the CPU
// table's top-k on rows full of ties, NaN, -0 and infinities.
TEST(OpsCudaPlan, TopkThroughFlashInferInputIsTheTableRule) {
  using F = FlashInferInput;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float tiny = std::numeric_limits<float>::denorm_min(), big = std::numeric_limits<float>::max();
  const std::vector<float> ascending = {-inf, -big, -3.0f, -tiny, -0.0f, 0.0f, tiny, 2.0f, big, inf};
  for (std::size_t i = 0; i < ascending.size(); ++i)
    for (std::size_t j = 0; j < ascending.size(); ++j) {
      const float a = ascending[i], b = ascending[j];
      EXPECT_EQ(a < b, F::key(F::of(a)) < F::key(F::of(b))) << a << " vs " << b;
      EXPECT_EQ(a == b, F::key(F::of(a)) == F::key(F::of(b))) << a << " vs " << b;
      EXPECT_LT(F::key(F::of(nan)), F::key(F::of(a))) << a;
      EXPECT_LT(F::key(F::of(-nan)), F::key(F::of(a))) << a;
    }
  EXPECT_EQ(F::of(-0.0f), 0.0f);
  EXPECT_FALSE(std::signbit(F::of(-0.0f)));
  const std::int64_t rows = 96, n = 23, k = 6;
  const std::vector<float> pool = {2.0f, 1.0f, 0.0f, -0.0f, -1.0f, -inf, inf, nan, 0.5f, -tiny, -big};
  const TiedRows<float> t = tied_rows(rows, n, k, pool, 22);
  const std::vector<float>& s = t.s;
  const std::vector<std::int64_t>&lo = t.lo, &hi = t.hi, &want_idx = t.want_idx;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t b = std::clamp<std::int64_t>(lo[r], 0, n), e = std::clamp<std::int64_t>(hi[r], b, n);
    // FlashInfer's selection on the mapped row [b, e): all of it when len <= k, else the k largest keys, ties to the
    // smaller index
    std::vector<std::int64_t> cols;
    for (std::int64_t j = 0; j < e - b; ++j) cols.push_back(j);
    std::stable_sort(cols.begin(), cols.end(), [&](std::int64_t x, std::int64_t y) {
      return F::key(F::of(s[r * n + b + x])) > F::key(F::of(s[r * n + b + y]));
    });
    if (static_cast<std::int64_t>(cols.size()) > k) cols.resize(k);
    std::vector<std::int64_t> chosen;  // the pick: absolute columns of non-NaN scores, by column
    for (const std::int64_t c : cols)
      if (!std::isnan(s[r * n + b + c])) chosen.push_back(b + c);
    std::sort(chosen.begin(), chosen.end());
    for (std::int64_t t = 0; t < k; ++t)
      EXPECT_EQ(t < static_cast<std::int64_t>(chosen.size()) ? chosen[t] : -1, want_idx[r * k + t])
          << "row " << r << " slot " << t;
  }
}

TEST(OpsCudaPlan, TopkBySortedKeysIsTheTableRule) {
  check_topk_by_keys<float>();
  check_topk_by_keys<double>();
}

}  // namespace
}  // namespace seqpar::attn::ops::cuda_plan
