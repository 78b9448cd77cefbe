// Unit tests of the CPU ops table (attention/ops/ops.h, ops_cpu.h) and the row bodies it runs
// (attention/kernels/gdn_rows.h): every op against a naive fp64 loop written here, in fp64 (atol 1e-12) and fp32
// (atol 1e-5 relative to the operands' scale), including two-level batches with zero strides.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "attention/kernels/gdn_rows.h"
#include "attention/ops/ops_cpu.h"
#include "tests/util/ops_test_values.h"
#include "runtime/error.h"

namespace seqpar::attn::ops {
namespace {

using test::cast;
using test::rand_vec;
using test::tol;

template <typename T>
class OpsTest : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(OpsTest, Types);

TYPED_TEST(OpsTest, GemmTwoLevelBatchAllTransposes) {
  using T = TypeParam;
  Ops<T>& ops = cpu_ops<T>();
  const std::int64_t m = 5, n = 7, k = 6, outer = 3, inner = 4;
  for (Trans ta : {Trans::kN, Trans::kT})
    for (Trans tb : {Trans::kN, Trans::kT})
      for (bool b_broadcast : {false, true}) {
        // A: padded leading dim; B: one matrix per outer index when broadcast (inner stride 0).
        const std::int64_t lda = (ta == Trans::kN ? k : m) + 2, arows = ta == Trans::kN ? m : k;
        const std::int64_t ldb = (tb == Trans::kN ? n : k) + 1, brows = tb == Trans::kN ? k : n;
        const std::int64_t asz = arows * lda, bsz = brows * ldb, csz = m * n;
        const auto a64 = rand_vec(outer * inner * asz, 1), b64 = rand_vec(outer * inner * bsz, 2),
                   c64 = rand_vec(outer * inner * csz, 3);
        auto a = cast<T>(a64), b = cast<T>(b64), c = cast<T>(c64);
        const std::int64_t bsi = b_broadcast ? 0 : bsz;
        ops.gemm(ta, tb, m, n, k, T(0.5), Mat<const T>{a.data(), lda, inner * asz, asz},
                 Mat<const T>{b.data(), ldb, inner * bsz, bsi}, T(2), Mat<T>{c.data(), n, inner * csz, csz},
                 Batch{outer, inner});
        double err = 0.0;
        for (std::int64_t o = 0; o < outer; ++o)
          for (std::int64_t t = 0; t < inner; ++t) {
            const double* A = a64.data() + (o * inner + t) * asz;
            const double* Bm = b64.data() + o * inner * bsz + t * bsi;
            for (std::int64_t i = 0; i < m; ++i)
              for (std::int64_t j = 0; j < n; ++j) {
                double acc = 0.0;
                for (std::int64_t p = 0; p < k; ++p)
                  acc += (ta == Trans::kN ? A[i * lda + p] : A[p * lda + i]) *
                         (tb == Trans::kN ? Bm[p * ldb + j] : Bm[j * ldb + p]);
                const std::int64_t ci = (o * inner + t) * csz + i * n + j;
                err = std::max(err, std::abs(0.5 * acc + 2.0 * c64[ci] - static_cast<double>(c[ci])));
              }
          }
        EXPECT_LT(err, tol<T>()) << "ta " << int(ta) << " tb " << int(tb) << " broadcast " << b_broadcast;
      }
}

TYPED_TEST(OpsTest, GemmBetaZeroIgnoresNaN) {
  using T = TypeParam;
  std::vector<T> a{1, 2, 3, 4}, b{1, 0, 0, 1}, c(4, std::numeric_limits<T>::quiet_NaN());
  cpu_ops<T>().gemm(Trans::kN, Trans::kN, 2, 2, 2, T(1), Mat<const T>{a.data(), 2}, Mat<const T>{b.data(), 2}, T(0),
                    Mat<T>{c.data(), 2}, Batch{});
  EXPECT_EQ(std::vector<T>({1, 2, 3, 4}), c);
}

TYPED_TEST(OpsTest, TrsmUnitLowerSolves) {
  using T = TypeParam;
  const std::int64_t n = 9, nrhs = 5, batch = 4;
  auto l64 = rand_vec(batch * n * n, 4, -0.5, 0.5);
  // The diagonal and the upper part hold garbage the solve must not read.
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = i; j < n; ++j) l64[b * n * n + i * n + j] = 1e6 + j;
  const auto b64 = rand_vec(batch * n * nrhs, 5);
  auto l = cast<T>(l64), x = cast<T>(b64);
  cpu_ops<T>().trsm_unit_lower(n, nrhs, Mat<const T>{l.data(), n, 0, n * n}, Mat<T>{x.data(), nrhs, 0, n * nrhs},
                               Batch{1, batch});
  // residual of (I + strictLower(L)) X = B in fp64
  double err = 0.0;
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < nrhs; ++j) {
        double acc = x[b * n * nrhs + i * nrhs + j];
        for (std::int64_t p = 0; p < i; ++p) acc += l64[b * n * n + i * n + p] * x[b * n * nrhs + p * nrhs + j];
        err = std::max(err, std::abs(acc - b64[b * n * nrhs + i * nrhs + j]));
      }
  EXPECT_LT(err, 10 * tol<T>());
}

TYPED_TEST(OpsTest, ScanAffineMatchesSequentialComposition) {
  using T = TypeParam;
  const std::int64_t segs = 3, K = 4, V = 3;
  for (std::int64_t n : {1, 2, 3, 5, 8, 13, 16, 31, 33, 100}) {
    const auto m64 = rand_vec(segs * n * K * K, 6 + n, -0.6, 0.6), u64 = rand_vec(segs * n * K * V, 7 + n);
    auto m = cast<T>(m64), u = cast<T>(u64);
    scan_affine(cpu_ops<T>(), segs, n, K, V, Mat<T>{m.data(), K, n * K * K, K * K},
                Mat<T>{u.data(), V, n * K * V, K * V});
    double err = 0.0;
    for (std::int64_t s = 0; s < segs; ++s) {
      std::vector<double> pm(K * K, 0.0), pu(K * V, 0.0);
      for (std::int64_t i = 0; i < K; ++i) pm[i * K + i] = 1.0;  // identity map
      for (std::int64_t e = 0; e < n; ++e) {
        const double* M = m64.data() + (s * n + e) * K * K;
        const double* U = u64.data() + (s * n + e) * K * V;
        std::vector<double> nm(K * K, 0.0), nu(K * V, 0.0);
        for (std::int64_t i = 0; i < K; ++i) {
          for (std::int64_t j = 0; j < K; ++j)
            for (std::int64_t p = 0; p < K; ++p) nm[i * K + j] += M[i * K + p] * pm[p * K + j];
          for (std::int64_t j = 0; j < V; ++j) {
            nu[i * V + j] = U[i * V + j];
            for (std::int64_t p = 0; p < K; ++p) nu[i * V + j] += M[i * K + p] * pu[p * V + j];
          }
        }
        pm = nm;
        pu = nu;
        for (std::int64_t i = 0; i < K * K; ++i)
          err = std::max(err, std::abs(pm[i] - static_cast<double>(m[(s * n + e) * K * K + i])));
        for (std::int64_t i = 0; i < K * V; ++i)
          err = std::max(err, std::abs(pu[i] - static_cast<double>(u[(s * n + e) * K * V + i])));
      }
    }
    EXPECT_LT(err, 10 * tol<T>()) << "n = " << n;
  }
}

TYPED_TEST(OpsTest, TopkTieRuleRangesNaNAndPadding) {
  using T = TypeParam;
  const std::int64_t rows = 40, n = 23, k = 6;
  std::mt19937_64 rng(8);
  std::vector<T> s(rows * n);
  // few distinct values: many ties
  for (T& x : s) x = static_cast<T>(static_cast<int>(rng() % 5));
  s[3] = std::numeric_limits<T>::quiet_NaN();
  std::vector<std::int64_t> lo(rows), hi(rows);
  for (std::int64_t r = 0; r < rows; ++r) {
    lo[r] = static_cast<std::int64_t>(rng() % 30) - 3;
    hi[r] = lo[r] + static_cast<std::int64_t>(rng() % 12);
  }
  std::vector<std::int64_t> idx(rows * k);
  std::vector<T> val(rows * k);
  cpu_ops<T>().topk_rows(rows, n, k, s.data(), n, lo.data(), hi.data(), idx.data(), val.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    // reference: full stable sort by score descending (stable: lower column first on ties), take k, sort by column
    std::vector<std::int64_t> c;
    for (std::int64_t j = std::max<std::int64_t>(lo[r], 0); j < std::min(hi[r], n); ++j)
      if (!std::isnan(s[r * n + j])) c.push_back(j);
    std::stable_sort(c.begin(), c.end(), [&](std::int64_t a, std::int64_t b) { return s[r * n + a] > s[r * n + b]; });
    c.resize(std::min<std::size_t>(c.size(), k));
    std::sort(c.begin(), c.end());
    for (std::int64_t t = 0; t < k; ++t) {
      const std::int64_t want = t < static_cast<std::int64_t>(c.size()) ? c[t] : -1;
      ASSERT_EQ(want, idx[r * k + t]) << "row " << r << " slot " << t;
      if (want >= 0)
        EXPECT_EQ(s[r * n + want], val[r * k + t]);
      else
        EXPECT_EQ(-std::numeric_limits<T>::infinity(), val[r * k + t]);
    }
  }
}

TYPED_TEST(OpsTest, GatherAndDeterministicScatterAdd) {
  using T = TypeParam;
  const std::int64_t src_rows = 7, cols = 5, rows = 20, ld = 6;
  const auto src64 = rand_vec(src_rows * ld, 9);
  const auto src = cast<T>(src64);
  std::vector<std::int64_t> idx(rows);
  for (std::int64_t r = 0; r < rows; ++r) idx[r] = (r * 5) % 9 - 2;  // -2..6, repeats
  std::vector<T> g(rows * cols, T(7));
  cpu_ops<T>().gather_rows(rows, cols, src.data(), ld, idx.data(), g.data(), cols);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) EXPECT_EQ(idx[r] < 0 ? T(0) : src[idx[r] * ld + j], g[r * cols + j]);
  // scatter-add the gathered rows back: each target gets its sources in ascending r, so the sum is bitwise the
  // sequential one in T
  std::vector<T> dst(src_rows * cols, T(1)), want(src_rows * cols, T(1));
  cpu_ops<T>().scatter_add_rows(rows, cols, g.data(), cols, idx.data(), dst.data(), cols);
  for (std::int64_t r = 0; r < rows; ++r)
    if (idx[r] >= 0)
      for (std::int64_t j = 0; j < cols; ++j) want[idx[r] * cols + j] += g[r * cols + j];
  EXPECT_EQ(want, dst);
  double err = 0.0;  // and against the fp64 count times the value
  for (std::int64_t t = 0; t < src_rows; ++t) {
    const auto cnt = std::count(idx.begin(), idx.end(), t);
    for (std::int64_t j = 0; j < cols; ++j)
      err = std::max(err, std::abs(1.0 + cnt * static_cast<double>(src[t * ld + j]) - double(dst[t * cols + j])));
  }
  EXPECT_LT(err, 10 * tol<T>());
}

TYPED_TEST(OpsTest, RowKernelsMatchFormulas) {
  using T = TypeParam;
  Ops<T>& ops = cpu_ops<T>();
  const std::int64_t rows = 4, cols = 6, C = cols;
  const auto x64 = rand_vec(rows * cols, 10);
  // l2 norm with scale, and without normalisation
  for (double eps : {1e-6, -1.0}) {
    auto x = cast<T>(x64);
    ops.l2norm_scale_rows(rows, cols, x.data(), cols, T(eps), T(0.25));
    for (std::int64_t r = 0; r < rows; ++r) {
      double ss = 0.0;
      for (std::int64_t j = 0; j < cols; ++j) ss += x64[r * cols + j] * x64[r * cols + j];
      const double f = eps < 0 ? 0.25 : 0.25 / std::sqrt(ss + eps);
      for (std::int64_t j = 0; j < cols; ++j) EXPECT_NEAR(f * x64[r * cols + j], x[r * cols + j], tol<T>());
    }
  }
  // cumulative decay and the chunk scales and masks
  const auto g64 = rand_vec(rows * C, 11, -0.4, -0.01), b64 = rand_vec(rows * C, 12, 0.1, 0.9);
  auto gamma = cast<T>(g64);
  const auto beta = cast<T>(b64);
  ops.cumsum_rows(rows, C, gamma.data(), C);
  std::vector<double> gam(rows * C);
  for (std::int64_t r = 0; r < rows; ++r) {
    double acc = 0.0;
    for (std::int64_t j = 0; j < C; ++j) gam[r * C + j] = acc += g64[r * C + j];
  }
  for (std::int64_t i = 0; i < rows * C; ++i) EXPECT_NEAR(gam[i], gamma[i], tol<T>());
  std::vector<T> ks(rows * C), vs(rows * C), qs(rows * C), ke(rows * C), ed(rows);
  ops.gdn_chunk_scales(rows, C, gamma.data(), beta.data(), ks.data(), vs.data(), qs.data(), ke.data(), ed.data());
  const auto kk64 = rand_vec(rows * C * C, 13), qk64 = rand_vec(rows * C * C, 14);
  auto kk = cast<T>(kk64), qk = cast<T>(qk64);
  ops.gdn_chunk_masks(rows, C, gamma.data(), beta.data(), kk.data(), qk.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    const double* gm = gam.data() + r * C;
    EXPECT_NEAR(std::exp(gm[C - 1]), ed[r], tol<T>());
    for (std::int64_t i = 0; i < C; ++i) {
      const double bi = b64[r * C + i];
      EXPECT_NEAR(bi * std::exp(gm[i]), ks[r * C + i], tol<T>());
      EXPECT_NEAR(bi, vs[r * C + i], tol<T>());
      EXPECT_NEAR(std::exp(gm[i]), qs[r * C + i], tol<T>());
      EXPECT_NEAR(std::exp(gm[C - 1] - gm[i]), ke[r * C + i], tol<T>());
      for (std::int64_t j = 0; j < C; ++j) {
        const std::int64_t e = (r * C + i) * C + j;
        EXPECT_NEAR(j < i ? bi * std::exp(gm[i] - gm[j]) * kk64[e] : 0.0, kk[e], tol<T>());
        EXPECT_NEAR(j <= i ? std::exp(gm[i] - gm[j]) * qk64[e] : 0.0, qk[e], tol<T>());
      }
    }
  }
  // ReLU rows (NaN stays NaN)
  auto z = cast<T>(x64);
  z[1] = std::numeric_limits<T>::quiet_NaN();
  ops.relu_rows(rows, cols, z.data(), cols);
  EXPECT_TRUE(std::isnan(z[1]));
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    if (i != 1) {
      EXPECT_EQ(static_cast<T>(std::max(0.0, double(T(x64[i])))), z[i]);
    }
  }
  // softmax over each row's first end[r / 2] entries, against fp64
  {
    auto sm = cast<T>(x64);
    const std::vector<std::int64_t> end{6, 0};  // rows 0, 1: all six entries; rows 2, 3: none
    std::vector<T> mx(rows), sum(rows);
    ops.softmax_rows(rows, cols, sm.data(), cols, end.data(), 2, mx.data(), sum.data());
    for (std::int64_t r = 0; r < rows; ++r) {
      const double lse = double(mx[r]) + std::log(double(sum[r]));
      if (end[r / 2] == 0) {
        EXPECT_EQ(-std::numeric_limits<double>::infinity(), lse);
        for (std::int64_t j = 0; j < cols; ++j) EXPECT_EQ(T(0), sm[r * cols + j]);
        continue;
      }
      double z = 0.0;
      for (std::int64_t j = 0; j < cols; ++j) z += std::exp(double(T(x64[r * cols + j])));
      EXPECT_NEAR(std::log(z), lse, tol<T>());
      for (std::int64_t j = 0; j < cols; ++j)
        EXPECT_NEAR(std::exp(double(T(x64[r * cols + j]))) / z, sm[r * cols + j], tol<T>());
    }
  }
  // scale rows, scaled identity
  auto y = cast<T>(x64);
  const auto s = cast<T>(rand_vec(rows, 15));
  ops.scale_rows(rows, cols, y.data(), cols, s.data());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) EXPECT_NEAR(double(s[r]) * x64[r * cols + j], y[r * cols + j], tol<T>());
  std::vector<T> id(2 * 3 * 9, T(5));
  ops.scaled_identity(3, s.data(), 2, 1, Mat<T>{id.data(), 3, 27, 9}, Batch{2, 2});  // outer stride 27: 2 of 3 used
  for (std::int64_t o = 0; o < 2; ++o)
    for (std::int64_t t = 0; t < 2; ++t)
      for (std::int64_t i = 0; i < 3; ++i)
        for (std::int64_t j = 0; j < 3; ++j) EXPECT_EQ(i == j ? s[o * 2 + t] : T(0), id[o * 27 + t * 9 + i * 3 + j]);
  EXPECT_EQ(T(5), id[18]);  // the third matrix of the first outer block is untouched
}

// The backward's row kernels: row dots and the L2-norm backward against loops / the Jacobian written out; the chunk
// masks' backward against central differences of the forward masks (gdn_chunk_masks) in fp64; the scales' backward
// against its formula as a loop.
TYPED_TEST(OpsTest, BackwardRowKernels) {
  using T = TypeParam;
  Ops<T>& ops = cpu_ops<T>();
  const std::int64_t rows = 3, cols = 5, ld = 7;
  const auto a64 = rand_vec(rows * ld, 31), b64 = rand_vec(rows * ld, 32);
  const auto a = cast<T>(a64), b = cast<T>(b64);
  std::vector<T> dots(rows);
  ops.row_dots(rows, cols, a.data(), ld, b.data(), ld, dots.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    double want = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) want += double(a[r * ld + j]) * double(b[r * ld + j]);
    EXPECT_NEAR(want, dots[r], tol<T>());
  }
  // L2 norm backward: J^T dy with J_jl = s (delta_jl / n - x_j x_l / n^3), n = sqrt(|x|^2 + eps)
  for (double eps : {1e-6, -1.0}) {
    auto dy = cast<T>(b64);
    const double s = 0.7;
    ops.l2norm_scale_backward_rows(rows, cols, a.data(), ld, dy.data(), ld, T(eps), T(s));
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* x = a.data() + r * ld;
      double xx = 0.0;
      for (std::int64_t j = 0; j < cols; ++j) xx += double(x[j]) * double(x[j]);
      const double n = std::sqrt(xx + eps);
      for (std::int64_t l = 0; l < cols; ++l) {
        double want = 0.0;
        for (std::int64_t j = 0; j < cols; ++j) {
          const double jac = eps < 0 ? (j == l ? s : 0.0) : s * ((j == l ? 1.0 / n : 0.0) - x[j] * x[l] / (n * n * n));
          want += jac * double(T(b64[r * ld + j]));
        }
        EXPECT_NEAR(want, dy[r * ld + l], 10 * tol<T>()) << "eps " << eps << " row " << r << " col " << l;
      }
    }
  }
  // Masks backward: L = sum dp * qk_mask(gamma, qk) + sum da * wy_mask(gamma, beta, kk), differentiated by central
  // differences (fp64) in qk, kk, gamma and beta.
  const std::int64_t chunks = 2, C = 5, CC = C * C;
  auto g64 = rand_vec(chunks * C, 33, -0.5, 0.0), beta64 = rand_vec(chunks * C, 34, 0.1, 0.9);
  for (std::int64_t c = 0; c < chunks; ++c)
    for (std::int64_t i = 1; i < C; ++i) g64[c * C + i] += g64[c * C + i - 1];  // gamma: cumulative
  auto kk64 = rand_vec(chunks * CC, 35), qk64 = rand_vec(chunks * CC, 36);
  const auto dp64 = rand_vec(chunks * CC, 37), da64 = rand_vec(chunks * CC, 38);
  const auto loss = [&](const std::vector<double>& g, const std::vector<double>& be, const std::vector<double>& kk,
                        const std::vector<double>& qk) {
    std::vector<double> am = kk, qm = qk;
    cpu_ops<double>().gdn_chunk_masks(chunks, C, g.data(), be.data(), am.data(), qm.data());
    double l = 0.0;
    for (std::int64_t e = 0; e < chunks * CC; ++e) l += dp64[e] * qm[e] + da64[e] * am[e];
    return l;
  };
  const auto fd = [&](std::vector<double>& x, std::int64_t e) {
    const double h = 1e-6, x0 = x[e];
    x[e] = x0 + h;
    const double lp = loss(g64, beta64, kk64, qk64);
    x[e] = x0 - h;
    const double lm = loss(g64, beta64, kk64, qk64);
    x[e] = x0;
    return (lp - lm) / (2 * h);
  };
  std::vector<T> dqk(chunks * CC), dkk(chunks * CC), dgamma(chunks * C), dbeta(chunks * C);
  {
    const auto g = cast<T>(g64), be = cast<T>(beta64), kk = cast<T>(kk64), qk = cast<T>(qk64), dp = cast<T>(dp64),
               da = cast<T>(da64);
    ops.gdn_chunk_masks_backward(chunks, C, g.data(), be.data(), kk.data(), qk.data(), dp.data(), da.data(), dqk.data(),
                                 dkk.data(), dgamma.data(), dbeta.data());
  }
  const double ftol = std::is_same_v<T, double> ? 1e-8 : 1e-4;
  for (std::int64_t c = 0; c < chunks; ++c)
    for (std::int64_t i = 0; i < C; ++i) {
      EXPECT_NEAR(fd(g64, c * C + i), dgamma[c * C + i], ftol) << "dgamma " << c << " " << i;
      EXPECT_NEAR(fd(beta64, c * C + i), dbeta[c * C + i], ftol) << "dbeta " << c << " " << i;
      for (std::int64_t j = 0; j < C; ++j) {
        const std::int64_t e = c * CC + i * C + j, et = c * CC + j * C + i;
        EXPECT_NEAR(fd(qk64, e), dqk[e], ftol) << "dqk " << c << " " << i << " " << j;
        // dkk is the gradient of a symmetric k k^T: both entries' derivatives
        EXPECT_NEAR(fd(kk64, e) + (i == j ? 0.0 : fd(kk64, et)), dkk[e], ftol) << "dkk " << c << " " << i << " " << j;
      }
    }
  // Scales backward: its formula as a loop
  const auto d1 = rand_vec(chunks * C, 39), d2 = rand_vec(chunks * C, 40), d3 = rand_vec(chunks * C, 41),
             d4 = rand_vec(chunks * C, 42), sds64 = rand_vec(chunks, 43), dg0 = rand_vec(chunks * C, 44),
             db0 = rand_vec(chunks * C, 45);
  auto dg = cast<T>(dg0), db = cast<T>(db0);
  {
    const auto g = cast<T>(g64), be = cast<T>(beta64), q1 = cast<T>(d1), q2 = cast<T>(d2), q3 = cast<T>(d3),
               q4 = cast<T>(d4), sds = cast<T>(sds64);
    ops.gdn_chunk_scales_backward(chunks, C, g.data(), be.data(), q1.data(), q2.data(), q3.data(), q4.data(),
                                  sds.data(), dg.data(), db.data());
  }
  for (std::int64_t c = 0; c < chunks; ++c) {
    std::vector<double> dgam(C);
    double rsum = 0.0;
    for (std::int64_t i = 0; i < C; ++i) {
      const std::int64_t e = c * C + i;
      const double ex = std::exp(g64[e]);
      dgam[i] = dg0[e] + d1[e] + beta64[e] * ex * d2[e] - d4[e];
      EXPECT_NEAR(db0[e] + d3[e] + ex * d2[e], db[e], tol<T>());
      rsum += d4[e];
    }
    dgam[C - 1] += std::exp(g64[c * C + C - 1]) * sds64[c] + rsum;
    double acc = 0.0;
    for (std::int64_t i = C - 1; i >= 0; --i) {
      acc += dgam[i];
      EXPECT_NEAR(acc, dg[c * C + i], 10 * tol<T>()) << "dg " << c << " " << i;
    }
  }
}

// The DSA ops (attention/kernels/dsa_rows.h bodies) against loops written here.
TYPED_TEST(OpsTest, InvertedIndexSumsEachRowsSourcesInAscendingOrder) {
  using T = TypeParam;
  Ops<T>& ops = cpu_ops<T>();
  const std::int64_t n_src = 40, n_dst = 9, cols = 5, ld = 7;
  std::vector<std::int64_t> idx(n_src);
  for (std::int64_t r = 0; r < n_src; ++r) idx[r] = (r * 7) % 12 - 2;  // -2..9: -1, -2 and 9 (>= n_dst) in no list
  std::vector<std::int64_t> offsets(n_dst + 1), list(n_src, -7);
  ops.inverted_index(n_src, idx.data(), n_dst, offsets.data(), list.data());
  std::int64_t at = 0;
  for (std::int64_t d = 0; d < n_dst; ++d) {
    ASSERT_EQ(at, offsets[d]) << "dst " << d;
    for (std::int64_t r = 0; r < n_src; ++r) {
      if (idx[r] == d) {
        ASSERT_EQ(r, list[at++]) << "dst " << d;
      }
    }
  }
  ASSERT_EQ(at, offsets[n_dst]);
  // sums: bitwise the sequential sum in T over the list (first source, then the others), added to dst
  const auto src = cast<T>(rand_vec(n_src * ld, 21));
  std::vector<T> dst(n_dst * cols, T(0.5)), want(dst);
  ops.sum_rows_indexed(n_dst, cols, src.data(), ld, offsets.data(), list.data(), dst.data(), cols);
  for (std::int64_t d = 0; d < n_dst; ++d) {
    std::vector<T> acc;
    for (std::int64_t r = 0; r < n_src; ++r) {
      if (idx[r] != d) continue;
      if (acc.empty())
        acc.assign(src.begin() + r * ld, src.begin() + r * ld + cols);
      else
        for (std::int64_t j = 0; j < cols; ++j) acc[j] += src[r * ld + j];
    }
    for (std::int64_t j = 0; j < static_cast<std::int64_t>(acc.size()); ++j) want[d * cols + j] += acc[j];
  }
  EXPECT_EQ(want, dst);
}

TYPED_TEST(OpsTest, TopkMergeKeepsTheBestOfTheUnionWithTheTieRule) {
  using T = TypeParam;
  const std::int64_t rows = 60, k = 5;
  std::mt19937_64 rng(22);
  std::vector<T> sa(rows * k), sb(rows * k);
  std::vector<std::int64_t> pa(rows * k), pb(rows * k);
  std::vector<std::vector<std::pair<T, std::int64_t>>> all(rows);
  for (std::int64_t r = 0; r < rows; ++r) {
    // positions 0..29 dealt to a, b or neither; few distinct scores (ties), a few -inf scores (valid entries)
    std::vector<std::int64_t> la, lb;
    for (std::int64_t p = 0; p < 30; ++p) {
      const auto u = rng() % 8;
      if (u == 0 && std::ssize(la) < k) la.push_back(p);
      if (u == 1 && std::ssize(lb) < k) lb.push_back(p);
    }
    auto fill = [&](const std::vector<std::int64_t>& l, T* s, std::int64_t* p) {
      for (std::int64_t e = 0; e < k; ++e) {
        const bool v = e < std::ssize(l);
        p[e] = v ? l[e] : -1;
        s[e] = !v ? -std::numeric_limits<T>::infinity()
                  : (rng() % 9 == 0 ? -std::numeric_limits<T>::infinity() : static_cast<T>(rng() % 3));
        if (v) all[r].push_back({s[e], p[e]});
      }
    };
    fill(la, sa.data() + r * k, pa.data() + r * k);
    fill(lb, sb.data() + r * k, pb.data() + r * k);
  }
  cpu_ops<T>().topk_merge_rows(rows, k, sa.data(), pa.data(), sb.data(), pb.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    auto c = all[r];  // reference: sort by score descending, then position ascending; the first k by position
    std::sort(c.begin(), c.end(),
              [](auto x, auto y) { return x.first > y.first || (x.first == y.first && x.second < y.second); });
    c.resize(std::min<std::size_t>(c.size(), k));
    std::sort(c.begin(), c.end(), [](auto x, auto y) { return x.second < y.second; });
    for (std::int64_t t = 0; t < k; ++t) {
      const bool v = t < std::ssize(c);
      ASSERT_EQ(v ? c[t].second : -1, pa[r * k + t]) << "row " << r << " slot " << t;
      EXPECT_EQ(v ? c[t].first : -std::numeric_limits<T>::infinity(), sa[r * k + t]) << "row " << r << " slot " << t;
    }
  }
}

// The short conv's ops against loops: y = conv of W rows from first[r] (SiLU), the gradient before the SiLU, the
// input rows' gradients through src and the weight gradient, all in fp64 from the same rounded operands.
TYPED_TEST(OpsTest, ShortConvRowKernels) {
  using T = TypeParam;
  Ops<T>& ops = cpu_ops<T>();
  const std::int64_t C = 3, W = 3, xrows = 9, rows = 5;
  const std::vector<std::int64_t> first{0, 1, 2, 5, 6};  // two runs: rows 0..4 (3 outputs), rows 5..8 (2 outputs)
  const auto x64 = rand_vec(xrows * C, 51), w64 = rand_vec(C * W, 52), dy64 = rand_vec(rows * C, 53);
  const auto x = cast<T>(x64), w = cast<T>(w64);
  const auto pre = [&](std::int64_t r, std::int64_t c) {
    double acc = 0.0;
    for (std::int64_t k = 0; k < W; ++k) acc += double(w[c * W + k]) * double(x[(first[r] + k) * C + c]);
    return acc;
  };
  std::vector<T> y(rows * C);
  ops.short_conv_rows(rows, C, W, x.data(), first.data(), w.data(), true, y.data());
  auto dpre = cast<T>(dy64);
  ops.short_conv_dpre_rows(rows, C, W, x.data(), first.data(), w.data(), true, dpre.data());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < C; ++c) {
      const double v = pre(r, c), sg = 1.0 / (1.0 + std::exp(-v));
      EXPECT_NEAR(v * sg, y[r * C + c], tol<T>());
      EXPECT_NEAR(double(T(dy64[r * C + c])) * sg * (1.0 + v * (1.0 - sg)), dpre[r * C + c], tol<T>());
    }
  std::vector<std::int64_t> src(xrows * W, -1);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t k = 0; k < W; ++k) src[(first[r] + k) * W + k] = r;
  std::vector<T> dx(xrows * C), dw(C * W);
  ops.short_conv_dx_rows(xrows, C, W, dpre.data(), src.data(), w.data(), dx.data());
  ops.short_conv_dweight(rows, C, W, dpre.data(), x.data(), first.data(), dw.data());
  std::vector<double> dxw(xrows * C, 0.0), dww(C * W, 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t k = 0; k < W; ++k)
      for (std::int64_t c = 0; c < C; ++c) {
        dxw[(first[r] + k) * C + c] += double(w[c * W + k]) * double(dpre[r * C + c]);
        dww[c * W + k] += double(dpre[r * C + c]) * double(x[(first[r] + k) * C + c]);
      }
  for (std::int64_t i = 0; i < xrows * C; ++i) EXPECT_NEAR(dxw[i], dx[i], tol<T>()) << "dx " << i;
  for (std::int64_t i = 0; i < C * W; ++i) EXPECT_NEAR(dww[i], dw[i], tol<T>()) << "dweight " << i;
  // without SiLU the gradient passes unchanged
  auto same = cast<T>(dy64);
  ops.short_conv_dpre_rows(rows, C, W, x.data(), first.data(), w.data(), false, same.data());
  EXPECT_EQ(cast<T>(dy64), same);
}

TYPED_TEST(OpsTest, DsaRowOpsMatchFormulas) {
  using T = TypeParam;
  Ops<T>& ops = cpu_ops<T>();
  const std::int64_t Q = 3, H = 2, n = 7;
  const auto s64 = rand_vec(Q * H * n, 23, -3.0, 3.0), dp64 = rand_vec(Q * H * n, 24), w64 = rand_vec(Q * H, 25);
  std::vector<std::int64_t> mask(Q * n);
  for (std::int64_t i = 0; i < Q * n; ++i) mask[i] = i % 3 == 1 ? -1 : i;
  // p = exp(s - lse) on the unmasked slots, lse = hi + lo (the last row: lse = -inf)
  std::vector<double> lse64(Q * H);
  for (std::int64_t r = 0; r < Q * H; ++r) lse64[r] = r == Q * H - 1 ? -INFINITY : 1.0 + 0.3 * r + 1e-9;
  std::vector<T> hi(Q * H), lo(Q * H);
  for (std::int64_t r = 0; r < Q * H; ++r) {
    hi[r] = static_cast<T>(lse64[r]);
    lo[r] = std::isinf(lse64[r]) ? T(0) : static_cast<T>(lse64[r] - static_cast<double>(hi[r]));
  }
  auto p = cast<T>(s64);
  ops.dsa_probs_rows(Q * H, n, p.data(), n, mask.data(), H, hi.data(), lo.data());
  for (std::int64_t r = 0; r < Q * H; ++r)
    for (std::int64_t j = 0; j < n; ++j) {
      const bool on = mask[(r / H) * n + j] >= 0 && !std::isinf(lse64[r]);
      const double want = on ? std::exp(static_cast<double>(T(s64[r * n + j])) - lse64[r]) : 0.0;
      EXPECT_NEAR(want, p[r * n + j], tol<T>() * (1 + want)) << r << " " << j;
    }
  // ds = p (dp - delta)
  const std::vector<T> delta = cast<T>(rand_vec(Q * H, 26));
  auto ds = cast<T>(dp64);
  ops.dsa_dscore_rows(Q * H, n, p.data(), ds.data(), n, delta.data());
  for (std::int64_t i = 0; i < Q * H * n; ++i)
    EXPECT_NEAR(double(p[i]) * (dp64[i] - double(delta[i / n])), ds[i], tol<T>());
  // the ReLU-weighted head sum, and the indexer's logit gradients with dw
  const auto s = cast<T>(s64), w = cast<T>(w64), g = cast<T>(rand_vec(Q * n, 27));
  std::vector<T> out(Q * n), a(s), dw(Q * H);
  ops.relu_head_sum_rows(Q, H, n, s.data(), w.data(), out.data());
  ops.indexer_grad_rows(Q, H, n, a.data(), w.data(), g.data(), dw.data());
  for (std::int64_t q = 0; q < Q; ++q) {
    for (std::int64_t j = 0; j < n; ++j) {
      double want = 0.0;
      for (std::int64_t i = 0; i < H; ++i) want += w64[q * H + i] * std::max(0.0, s64[(q * H + i) * n + j]);
      EXPECT_NEAR(want, out[q * n + j], tol<T>() * 10);
    }
    for (std::int64_t i = 0; i < H; ++i) {
      double want_dw = 0.0;
      for (std::int64_t j = 0; j < n; ++j) {
        const double v = s64[(q * H + i) * n + j];
        want_dw += double(g[q * n + j]) * std::max(0.0, v);
        EXPECT_NEAR(v > 0 ? double(g[q * n + j]) * w64[q * H + i] : 0.0, a[(q * H + i) * n + j], tol<T>());
      }
      EXPECT_NEAR(want_dw, dw[q * H + i], tol<T>() * 10);
    }
  }
}

TYPED_TEST(OpsTest, KlRowsMatchTheFormula) {
  using T = TypeParam;
  const std::int64_t rows = 4, k = 6;
  const auto probs = cast<T>(rand_vec(rows * k, 28, 0.0, 1.0)), scores = cast<T>(rand_vec(rows * k, 29, -2.0, 2.0));
  std::vector<std::int64_t> idx(rows * k);
  for (std::int64_t i = 0; i < rows * k; ++i) idx[i] = (i % k) < k - 1 - (i / k) ? i : -1;  // row r: k - 1 - r valid
  std::vector<T> g(rows * k, T(9));
  std::vector<double> loss(rows);
  cpu_ops<T>().kl_rows(rows, k, probs.data(), scores.data(), idx.data(), 0.5, g.data(), loss.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    double z = 0.0, e = 0.0;
    for (std::int64_t j = 0; j < k; ++j)
      if (idx[r * k + j] >= 0) {
        z += probs[r * k + j];
        e += std::exp(double(scores[r * k + j]));
      }
    double want = 0.0;
    for (std::int64_t j = 0; j < k; ++j) {
      if (idx[r * k + j] < 0) {
        EXPECT_EQ(T(0), g[r * k + j]);
        continue;
      }
      const double pst = probs[r * k + j] / z, qv = std::exp(double(scores[r * k + j])) / e;
      want += pst * std::log(pst / qv);
      EXPECT_NEAR(0.5 * (qv - pst), g[r * k + j], tol<T>());
    }
    EXPECT_NEAR(want, loss[r], 1e-12 + (std::is_same_v<T, double> ? 1e-12 : 1e-6)) << "row " << r;
  }
}

// gemm_fixed_order: the product against fp64 loops (every transpose), and each element bitwise the same when computed
// in a product of another shape, at another place (rows and columns shifted, other neighbours, a batch).
TYPED_TEST(OpsTest, GemmFixedOrderIsExactAndIndependentOfShapeAndPlace) {
  using T = TypeParam;
  Ops<T>& ops = cpu_ops<T>();
  const std::int64_t m = 9, n = 37, k = 29;
  const auto a64 = rand_vec(m * k, 30), b64 = rand_vec(n * k, 31);
  const auto a = cast<T>(a64), b = cast<T>(b64);  // a [m, k], b [n, k] (the N T form of the scores)
  std::vector<T> c(m * n);
  ops.gemm_fixed_order(Trans::kN, Trans::kT, m, n, k, T(0.5), Mat<const T>{a.data(), k}, Mat<const T>{b.data(), k},
                       T(0), Mat<T>{c.data(), n}, Batch{});
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double want = 0.0;
      for (std::int64_t p = 0; p < k; ++p) want += double(a[i * k + p]) * double(b[j * k + p]);
      EXPECT_NEAR(0.5 * want, c[i * n + j], tol<T>() * 10) << i << " " << j;
    }
  // rows 2..6 against columns 5..22 as a batch of two identical products: the same bits
  const std::int64_t i0 = 2, mi = 5, j0 = 5, nj = 18;
  std::vector<T> sub(2 * mi * nj);
  ops.gemm_fixed_order(Trans::kN, Trans::kT, mi, nj, k, T(0.5), Mat<const T>{a.data() + i0 * k, k, 0, 0},
                       Mat<const T>{b.data() + j0 * k, k, 0, 0}, T(0), Mat<T>{sub.data(), nj, 0, mi * nj}, Batch{1, 2});
  for (std::int64_t e = 0; e < 2; ++e)
    for (std::int64_t i = 0; i < mi; ++i)
      for (std::int64_t j = 0; j < nj; ++j)
        ASSERT_EQ(c[(i0 + i) * n + j0 + j], sub[(e * mi + i) * nj + j]) << "row " << i0 + i << " col " << j0 + j;
  // the other transposes against gemm's (to rounding)
  for (Trans ta : {Trans::kN, Trans::kT})
    for (Trans tb : {Trans::kN, Trans::kT}) {
      const std::int64_t lda = ta == Trans::kN ? k : m, ldb = tb == Trans::kN ? n : k;
      const auto aa = cast<T>(rand_vec(m * k, 32)), bb = cast<T>(rand_vec(n * k, 33));
      std::vector<T> c1(m * n, T(1)), c2(m * n, T(1));
      ops.gemm(ta, tb, m, n, k, T(1), Mat<const T>{aa.data(), lda}, Mat<const T>{bb.data(), ldb}, T(2),
               Mat<T>{c1.data(), n}, Batch{});
      ops.gemm_fixed_order(ta, tb, m, n, k, T(1), Mat<const T>{aa.data(), lda}, Mat<const T>{bb.data(), ldb}, T(2),
                           Mat<T>{c2.data(), n}, Batch{});
      for (std::int64_t i = 0; i < m * n; ++i) EXPECT_NEAR(c1[i], c2[i], tol<T>() * 10);
    }
}

// A table without the DSA ops (a CUDA table still to write them) raises a named error when one is called.
TEST(OpsTable, MissingOpRaisesNamedError) {
  try {
    unsupported_op("cuda", "kl_rows");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ("ops table cuda does not support kl_rows", e.what());
  }
}

}  // namespace
}  // namespace seqpar::attn::ops
