// Every op of the ops table (attention/ops/ops.h) through the table's own memory (upload, op, download), for each
// table: the CPU table always; the CUDA table (attention/cuda/ops_cuda.h) when SEQPAR_TEST_DEVICE=cuda and a device
// is usable (scripts/gpu_check.sh), else skipped with the reason. Each op against an fp64 loop written here (or an
// exact rule: selection, copies, the order of a scatter's additions) at odd shapes: non-square, padded leading dims,
// transposes, two-level batches with zero strides and with strides that are not one strided batch (a CUDA table's
// pointer-array path), empty ranges, NaN and -inf. Tolerances: fp64 1e-12, fp32 2e-5, relative to the operands' scale
// (cuBLAS may order its sums differently from OpenBLAS).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/cuda/ops_cuda.h"
#include "attention/kernels/dsa_rows.h"
#include "attention/kernels/gdn_rows.h"
#include "attention/ops/ops_cpu.h"
#include "tests/util/ops_test_values.h"
#include "runtime/error.h"

namespace seqpar::attn::ops {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

using test::cast;
using test::rand_vec;
using test::tol;

// rand_vec's values rounded to T (the values a table of T sees), as fp64: the inputs of the row-op checks below.
template <typename T>
std::vector<double> rand_as(std::int64_t n, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::vector<double> v = rand_vec(n, seed, lo, hi);
  for (double& x : v) x = double(T(x));
  return v;
}

// A table's result `got` against its fp64 body `want`, element by element to 10 tol<T>() x max(1, |want|).
template <typename T>
void expect_close(const std::vector<double>& want, const std::vector<T>& got, const char* what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (std::size_t e = 0; e < want.size(); ++e)
    EXPECT_NEAR(want[e], double(got[e]), 10 * tol<T>() * std::max(1.0, std::abs(want[e])))
        << what << " element " << e << " fp" << 8 * sizeof(T);
}

// The table under test ("cpu" or "cuda"), or why it cannot run here.
std::string cuda_skip_reason() {
  const char* env = std::getenv("SEQPAR_TEST_DEVICE");
  const std::string dev = env == nullptr ? "" : env;
  // A mistyped value ("gpu", "CUDA") fails rather than skipping: the CUDA cases would pass as skipped unnoticed.
  if (dev != "cuda" && dev != "cpu" && !dev.empty()) return "SEQPAR_TEST_DEVICE=" + dev + " must be cpu or cuda";
  if (dev != "cuda") return "the CUDA table runs only with SEQPAR_TEST_DEVICE=cuda (scripts/gpu_check.sh on a GPU)";
  if (!cuda_ops_built()) return "SEQPAR_TEST_DEVICE=cuda, but seqpar was built without CUDA";
  const std::string why = cuda_unavailable_reason();
  return why.empty() ? "" : "SEQPAR_TEST_DEVICE=cuda: " + why;
}

class OpsTable : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "cuda") {
      const std::string why = cuda_skip_reason();
      if (why.find("must be cpu or cuda") != std::string::npos) FAIL() << why;
      if (!why.empty()) GTEST_SKIP() << why;
      f32_ = cuda_ops<float>(Device::cuda(0), Stream{Device::cuda(0), nullptr});
      f64_ = cuda_ops<double>(Device::cuda(0), Stream{Device::cuda(0), nullptr});
    }
  }
  template <typename T>
  Ops<T>& table() {
    if constexpr (std::is_same_v<T, float>)
      return f32_ ? *f32_ : cpu_ops_f32();
    else
      return f64_ ? *f64_ : cpu_ops_f64();
  }
  template <typename E, typename T>
  std::vector<E> get(Ops<T>& ops, const Buffer<E>& b) {
    std::vector<E> h(static_cast<std::size_t>(b.size()));
    ops.download(h.data(), b.get(), h.size() * sizeof(E));
    return h;
  }

  template <typename T>
  void gemm_case(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, Batch batch, bool b_broadcast,
                 bool outer_gap, T beta, bool c_nan, const std::string& what);

  std::unique_ptr<Ops<float>> f32_;
  std::unique_ptr<Ops<double>> f64_;
};

// C = 0.5 op(A) op(B) + beta C over a two-level batch. A: padded leading dim; B: the same matrix for every inner
// index when b_broadcast (si = 0); outer_gap: a gap between outer blocks (so != inner * si: not one strided batch).
template <typename T>
void OpsTable::gemm_case(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, Batch batch,
                         bool b_broadcast, bool outer_gap, T beta, bool c_nan, const std::string& what) {
  Ops<T>& ops = table<T>();
  const std::int64_t outer = batch.outer, inner = batch.inner;
  const std::int64_t arows = ta == Trans::kN ? m : k, acols = ta == Trans::kN ? k : m;
  const std::int64_t brows = tb == Trans::kN ? k : n, bcols = tb == Trans::kN ? n : k;
  const std::int64_t lda = acols + 2, ldb = bcols + 1, ldc = n + 3;
  const std::int64_t asz = std::max<std::int64_t>(arows * lda, 1), bsz = std::max<std::int64_t>(brows * ldb, 1),
                     csz = m * ldc;
  const std::int64_t gap = outer_gap ? 5 : 0;
  const std::int64_t aso = inner * asz + gap, bso = (b_broadcast ? bsz : inner * bsz) + gap, cso = inner * csz + gap;
  const std::int64_t bsi = b_broadcast ? 0 : bsz;
  auto a64 = rand_vec(outer * aso, 1), b64 = rand_vec(outer * bso, 2), c64 = rand_vec(outer * cso, 3);
  if (c_nan) std::fill(c64.begin(), c64.end(), kNaN);
  const Buffer<T> a(ops, cast<T>(a64)), b(ops, cast<T>(b64));
  Buffer<T> c(ops, cast<T>(c64));
  ops.gemm(ta, tb, m, n, k, T(0.5), Mat<const T>{a.get(), lda, aso, asz}, Mat<const T>{b.get(), ldb, bso, bsi}, beta,
           Mat<T>{c.get(), ldc, cso, csz}, batch);
  const std::vector<T> got = get(ops, c);
  double err = 0.0;
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t t = 0; t < inner; ++t) {
      const double* A = a64.data() + o * aso + t * asz;
      const double* B = b64.data() + o * bso + t * bsi;
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          double acc = 0.0;
          for (std::int64_t p = 0; p < k; ++p)
            acc += static_cast<double>(static_cast<T>(ta == Trans::kN ? A[i * lda + p] : A[p * lda + i])) *
                   static_cast<double>(static_cast<T>(tb == Trans::kN ? B[p * ldb + j] : B[j * ldb + p]));
          const std::size_t ci = static_cast<std::size_t>(o * cso + t * csz + i * ldc + j);
          const double old = beta == T(0) ? 0.0 : double(beta) * double(static_cast<T>(c64[ci]));
          err = std::max(err, std::abs(0.5 * acc + old - double(got[ci])));
        }
    }
  EXPECT_LT(err, tol<T>() * std::max<std::int64_t>(k, 1)) << what;
  // the gaps between outer blocks and the padding columns are untouched
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t t = 0; t < inner; ++t)
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = n; j < ldc; ++j) {
          const std::size_t ci = static_cast<std::size_t>(o * cso + t * csz + i * ldc + j);
          EXPECT_TRUE(std::isnan(got[ci]) ? std::isnan(c64[ci]) : double(got[ci]) == double(T(c64[ci]))) << what;
        }
}

TEST_P(OpsTable, GemmTransposesBatchesAndBeta) {
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    for (Trans ta : {Trans::kN, Trans::kT})
      for (Trans tb : {Trans::kN, Trans::kT})
        for (int layout = 0; layout < 4; ++layout) {
          // 0: one strided batch; 1: B broadcast over inner (si 0); 2: gaps between outer blocks; 3: outer only
          const Batch batch = layout == 3 ? Batch{3, 1} : Batch{3, 4};
          const std::string what = std::string(sizeof(T) == 8 ? "fp64" : "fp32") + " ta " + std::to_string(int(ta)) +
                                   " tb " + std::to_string(int(tb)) + " layout " + std::to_string(layout);
          gemm_case<T>(ta, tb, 5, 7, 3, batch, layout == 1, layout == 2, T(2), false, what);
        }
    // beta 0 ignores NaN in C; k = 0 is C = beta C; 1 x 1 x 1 with B broadcast
    gemm_case<T>(Trans::kN, Trans::kT, 4, 6, 9, Batch{2, 3}, false, true, T(0), true, "beta 0, NaN C");
    gemm_case<T>(Trans::kN, Trans::kN, 4, 6, 0, Batch{2, 3}, false, false, T(2), false, "k 0");
    gemm_case<T>(Trans::kN, Trans::kN, 4, 6, 0, Batch{2, 3}, false, false, T(0), true, "k 0, beta 0, NaN C");
    gemm_case<T>(Trans::kT, Trans::kN, 1, 1, 1, Batch{1, 5}, true, false, T(1), false, "1x1x1");
  };
  run(0.0f);
  run(0.0);
}

// convert_in / convert_out of every floating dtype through the table's memory, bitwise the host conversion
// (runtime/dtype.h convert()): random values over many binades, signed zeros, +-inf, NaN, fp32 / fp16 subnormals,
// bf16 / fp16 ties and values just off them.
template <typename T>
void convert_case(Ops<T>& ops) {
  std::vector<double> v = rand_vec(997, 5);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::ldexp(v[i], static_cast<int>(i % 61) - 30);
  for (double x : {0.0, -0.0, kInf, -kInf, kNaN, 1e-45, -3e-40, 6e-8, 1.0 + 0x1p-8, 1.0 + 0x1p-8 + 0x1p-40,
                   1.0 + 0x1p-11, -(1.0 + 0x1p-11 - 0x1p-40), 65520.0, 3.5e38, 1e300})
    v.push_back(x);
  const std::int64_t n = static_cast<std::int64_t>(v.size());
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const std::size_t bytes = static_cast<std::size_t>(n) * dtype_size(dt);
    std::vector<unsigned char> src(bytes), want_out(bytes), got_out(bytes);
    convert(v.data(), DType::kFloat64, src.data(), dt, static_cast<std::size_t>(n));
    // in: dt -> T
    Buffer<unsigned char> raw(ops, static_cast<std::int64_t>(bytes));
    ops.upload(raw.get(), src.data(), bytes);
    Buffer<T> t(ops, n);
    ops.convert_in(raw.get(), dt, t.get(), n);
    std::vector<T> got_in(static_cast<std::size_t>(n)), want_in(got_in.size());
    ops.download(got_in.data(), t.get(), got_in.size() * sizeof(T));
    convert(src.data(), dt, want_in.data(), dtype_v<T>, static_cast<std::size_t>(n));
    EXPECT_EQ(std::memcmp(got_in.data(), want_in.data(), got_in.size() * sizeof(T)), 0)
        << ops.name() << " convert_in " << dtype_name(dt) << " -> " << dtype_name(dtype_v<T>);
    // out: T (v rounded to T) -> dt
    const std::vector<T> vt = cast<T>(v);
    const Buffer<T> tb(ops, vt);
    Buffer<unsigned char> out(ops, static_cast<std::int64_t>(bytes));
    ops.convert_out(tb.get(), out.get(), dt, n);
    ops.download(got_out.data(), out.get(), bytes);
    convert(vt.data(), dtype_v<T>, want_out.data(), dt, static_cast<std::size_t>(n));
    EXPECT_EQ(std::memcmp(got_out.data(), want_out.data(), bytes), 0)
        << ops.name() << " convert_out " << dtype_name(dtype_v<T>) << " -> " << dtype_name(dt);
  }
}

TEST_P(OpsTable, ConvertInAndOutAreTheHostConversion) {
  convert_case(table<float>());
  convert_case(table<double>());
  EXPECT_EQ(table<float>().device(), GetParam() == "cuda" ? Device::cuda(0) : Device::cpu());
}

TEST_P(OpsTable, TrsmUnitLowerIgnoresDiagonalAndUpper) {
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    Ops<T>& ops = table<T>();
    const std::int64_t n = 6, nrhs = 5, ldl = 8, ldb = 7, outer = 2, inner = 3;
    // L: one per outer index (inner stride 0), diagonal and upper part garbage (NaN) that must not be read
    auto l64 = rand_vec(outer * n * ldl, 4, -0.4, 0.4);
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t j = i; j < ldl; ++j) l64[o * n * ldl + i * ldl + j] = kNaN;
    const auto b64 = rand_vec(outer * inner * n * ldb, 5);
    const Buffer<T> l(ops, cast<T>(l64));
    Buffer<T> b(ops, cast<T>(b64));
    ops.trsm_unit_lower(n, nrhs, Mat<const T>{l.get(), ldl, n * ldl, 0}, Mat<T>{b.get(), ldb, inner * n * ldb, n * ldb},
                        Batch{outer, inner});
    const auto x = get(ops, b);
    double err = 0.0;  // residual L X - B in fp64 over the solved columns; padding columns unchanged
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t t = 0; t < inner; ++t) {
        const std::int64_t base = (o * inner + t) * n * ldb;
        for (std::int64_t i = 0; i < n; ++i) {
          for (std::int64_t j = 0; j < nrhs; ++j) {
            double lx = double(x[base + i * ldb + j]);
            for (std::int64_t p = 0; p < i; ++p)
              lx += double(T(l64[o * n * ldl + i * ldl + p])) * double(x[base + p * ldb + j]);
            err = std::max(err, std::abs(lx - double(T(b64[base + i * ldb + j]))));
          }
          for (std::int64_t j = nrhs; j < ldb; ++j) EXPECT_EQ(T(b64[base + i * ldb + j]), x[base + i * ldb + j]);
        }
      }
    EXPECT_LT(err, 10 * tol<T>()) << sizeof(T);
  };
  run(0.0f);
  run(0.0);
}

TEST_P(OpsTable, CopyAndScaledIdentityTwoLevel) {
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    Ops<T>& ops = table<T>();
    const std::int64_t rows = 3, cols = 4, outer = 2, inner = 3, lds = 6, ldd = 5;
    const std::int64_t sso = inner * rows * lds + 7, dso = inner * rows * ldd + 2;
    const auto s64 = rand_vec(outer * sso, 6), d64 = rand_vec(outer * dso, 7);
    const Buffer<T> s(ops, cast<T>(s64));
    Buffer<T> d(ops, cast<T>(d64));
    ops.copy(rows, cols, Mat<const T>{s.get(), lds, sso, rows * lds}, Mat<T>{d.get(), ldd, dso, rows * ldd},
             Batch{outer, inner});
    auto want = cast<T>(d64);
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t t = 0; t < inner; ++t)
        for (std::int64_t i = 0; i < rows; ++i)
          for (std::int64_t j = 0; j < cols; ++j)
            want[o * dso + t * rows * ldd + i * ldd + j] = T(s64[o * sso + t * rows * lds + i * lds + j]);
    EXPECT_EQ(want, get(ops, d));
    // identity scaled by s[o * 3 + t * 0]: one scale per outer index
    const std::int64_t n = 4, ld = 5;
    const auto sc64 = rand_vec(outer * 3, 8);
    const Buffer<T> sc(ops, cast<T>(sc64));
    Buffer<T> id(ops, cast<T>(rand_vec(outer * inner * n * ld, 9)));
    auto before = get(ops, id);
    ops.scaled_identity(n, sc.get(), 3, 0, Mat<T>{id.get(), ld, inner * n * ld, n * ld}, Batch{outer, inner});
    const auto got = get(ops, id);
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t t = 0; t < inner; ++t)
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int64_t j = 0; j < ld; ++j) {
            const std::int64_t e = (o * inner + t) * n * ld + i * ld + j;
            const T want_e = j >= n ? before[e] : (i == j ? T(sc64[o * 3]) : T(0));
            EXPECT_EQ(want_e, got[e]) << "o " << o << " t " << t << " (" << i << ", " << j << ")";
          }
  };
  run(0.0f);
  run(0.0);
}

TEST_P(OpsTable, GatherAndScatterAddInAscendingRowOrder) {
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    Ops<T>& ops = table<T>();
    const std::int64_t src_rows = 7, cols = 5, rows = 41, ld = 6, ldg = 8;
    // magnitudes 1e-8 .. 1e8: the sum of a row's contributions depends on their order
    std::vector<double> s64 = rand_vec(src_rows * ld, 10);
    for (std::size_t e = 0; e < s64.size(); ++e) s64[e] *= std::pow(10.0, double(e % 17) - 8.0);
    std::vector<std::int64_t> idx(rows);
    for (std::int64_t r = 0; r < rows; ++r) idx[r] = (r * 5) % 9 - 2;  // -2..6, repeats, out of order
    const Buffer<T> s(ops, cast<T>(s64));
    const Buffer<std::int64_t> di(ops, idx);
    Buffer<T> g(ops, rows * ldg);
    ops.gather_rows(rows, cols, s.get(), ld, di.get(), g.get(), ldg);
    const auto got = get(ops, g);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < ldg; ++j)
        EXPECT_EQ(j >= cols || idx[r] < 0 ? T(0) : T(s64[idx[r] * ld + j]), got[r * ldg + j]) << r << ", " << j;
    // scatter-add rows r (scaled by r + 1, so that every contribution differs) into dst = 1
    std::vector<T> src(rows * ldg);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < ldg; ++j) src[r * ldg + j] = got[r * ldg + j] * T(r + 1);
    const Buffer<T> dsrc(ops, src);
    Buffer<T> dst(ops, std::vector<T>(src_rows * cols, T(1)));
    ops.scatter_add_rows(rows, cols, dsrc.get(), ldg, di.get(), dst.get(), cols);
    std::vector<T> want(src_rows * cols, T(1));
    for (std::int64_t r = 0; r < rows; ++r)
      if (idx[r] >= 0)
        for (std::int64_t j = 0; j < cols; ++j) want[idx[r] * cols + j] += src[r * ldg + j];
    EXPECT_EQ(want, get(ops, dst)) << "the sequential sum in ascending r, bitwise";
  };
  run(0.0f);
  run(0.0);
}

TEST_P(OpsTable, TopkTiesRangesNaNInfAndSignedZero) {
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    Ops<T>& ops = table<T>();
    const std::int64_t rows = 57, n = 29, ld = 31, k = 7;
    std::mt19937_64 rng(13);
    std::vector<T> s(rows * ld, std::numeric_limits<T>::quiet_NaN());
    const T pool[] = {T(2),   T(1), T(0), T(-0.0), T(-1), T(-kInf), T(kInf), std::numeric_limits<T>::quiet_NaN(),
                      T(0.5), T(-3)};
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < n; ++j) s[r * ld + j] = pool[rng() % 10];  // many ties
    std::vector<std::int64_t> lo(rows), hi(rows);
    for (std::int64_t r = 0; r < rows; ++r) {
      lo[r] = static_cast<std::int64_t>(rng() % 36) - 4;
      hi[r] = lo[r] + static_cast<std::int64_t>(rng() % 14) - 1;  // some empty, some past n
    }
    const Buffer<T> ds(ops, s);
    const Buffer<std::int64_t> dlo(ops, lo), dhi(ops, hi);
    Buffer<std::int64_t> di(ops, rows * k);
    Buffer<T> dv(ops, rows * k);
    ops.topk_rows(rows, n, k, ds.get(), ld, dlo.get(), dhi.get(), di.get(), dv.get());
    const auto idx = get(ops, di);
    const auto val = get(ops, dv);
    for (std::int64_t r = 0; r < rows; ++r) {
      // reference: k rounds of "the best remaining candidate" (larger score, then lower column; -0 == +0)
      std::vector<std::int64_t> chosen;
      std::vector<bool> used(n, false);
      for (std::int64_t t = 0; t < k; ++t) {
        std::int64_t best = -1;
        for (std::int64_t j = std::max<std::int64_t>(lo[r], 0); j < std::min(hi[r], n); ++j) {
          const double x = double(s[r * ld + j]);
          if (used[j] || std::isnan(x)) continue;
          if (best < 0 || x > double(s[r * ld + best])) best = j;
        }
        if (best < 0) break;
        used[best] = true;
        chosen.push_back(best);
      }
      std::sort(chosen.begin(), chosen.end());
      for (std::int64_t t = 0; t < k; ++t) {
        const bool sel = t < static_cast<std::int64_t>(chosen.size());
        ASSERT_EQ(sel ? chosen[t] : -1, idx[r * k + t])
            << "row " << r << " slot " << t << " [" << lo[r] << ", " << hi[r] << ")";
        const T want = sel ? s[r * ld + chosen[t]] : T(-kInf);
        EXPECT_TRUE(want == val[r * k + t] && std::signbit(want) == std::signbit(val[r * k + t]))
            << "row " << r << " slot " << t;
      }
    }
  };
  run(0.0f);
  run(0.0);
}

TEST_P(OpsTable, RowKernelsMatchFormulas) {
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    Ops<T>& ops = table<T>();
    const std::int64_t rows = 5, cols = 7, ld = 9;
    const auto x64 = rand_vec(rows * ld, 14, -2.0, 2.0);
    const auto close = [&](double want, T got, const char* what, std::int64_t e) {
      EXPECT_NEAR(want, double(got), tol<T>() * std::max(1.0, std::abs(want))) << what << " element " << e;
    };
    for (const double eps : {1e-6, -1.0}) {  // l2 norm and scale; eps < 0: scale only
      Buffer<T> x(ops, cast<T>(x64));
      ops.l2norm_scale_rows(rows, cols, x.get(), ld, T(eps), T(0.7));
      const auto got = get(ops, x);
      for (std::int64_t r = 0; r < rows; ++r) {
        double ss = 0.0;
        for (std::int64_t j = 0; j < cols; ++j) ss += double(T(x64[r * ld + j])) * double(T(x64[r * ld + j]));
        const double f = eps < 0 ? 0.7 : 0.7 / std::sqrt(ss + double(T(eps)));
        for (std::int64_t j = 0; j < ld; ++j)
          close(j < cols ? f * double(T(x64[r * ld + j])) : double(T(x64[r * ld + j])), got[r * ld + j], "l2norm",
                r * ld + j);
      }
    }
    {  // relu (NaN stays NaN), scale_rows, cumsum_rows
      auto xr = cast<T>(x64);
      xr[3] = std::numeric_limits<T>::quiet_NaN();
      Buffer<T> x(ops, xr);
      ops.relu_rows(rows, cols, x.get(), ld);
      const auto got = get(ops, x);
      for (std::int64_t e = 0; e < rows * ld; ++e) {
        if (e == 3) {
          EXPECT_TRUE(std::isnan(got[e]));
          continue;
        }
        EXPECT_EQ(e % ld < cols ? std::max(xr[e], T(0)) : xr[e], got[e]) << "relu element " << e;
      }
      const auto s64 = rand_vec(rows, 15);
      const Buffer<T> s(ops, cast<T>(s64));
      Buffer<T> y(ops, cast<T>(x64)), z(ops, cast<T>(x64));
      ops.scale_rows(rows, cols, y.get(), ld, s.get());
      ops.cumsum_rows(rows, cols, z.get(), ld);
      const auto gy = get(ops, y), gz = get(ops, z);
      for (std::int64_t r = 0; r < rows; ++r) {
        double acc = 0.0;
        for (std::int64_t j = 0; j < ld; ++j) {
          const double v = double(T(x64[r * ld + j]));
          acc += v;
          close(j < cols ? v * double(T(s64[r])) : v, gy[r * ld + j], "scale_rows", r * ld + j);
          close(j < cols ? acc : v, gz[r * ld + j], "cumsum_rows", r * ld + j);
        }
      }
    }
    {  // softmax over each row's prefix end[r / 2]: 0 (empty), 3, past cols; a row of -inf
      auto xs = cast<T>(x64);
      for (std::int64_t j = 0; j < cols; ++j) xs[4 * ld + j] = T(-kInf);
      const std::vector<std::int64_t> end = {0, 3, 100};
      Buffer<T> x(ops, xs), mx(ops, rows), sum(ops, rows);
      const Buffer<std::int64_t> de(ops, end);
      ops.softmax_rows(rows, cols, x.get(), ld, de.get(), 2, mx.get(), sum.get());
      const auto got = get(ops, x), gmx = get(ops, mx), gsum = get(ops, sum);
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t e = std::min(end[r / 2], cols);
        double m = -kInf, z = 0.0;
        for (std::int64_t j = 0; j < e; ++j) m = std::max(m, double(xs[r * ld + j]));
        for (std::int64_t j = 0; j < e && m != -kInf; ++j) z += std::exp(double(xs[r * ld + j]) - m);
        EXPECT_EQ(m, double(gmx[r])) << "row max " << r;
        close(z, gsum[r], "row sum", r);
        for (std::int64_t j = 0; j < ld; ++j) {
          const double p = j >= cols ? double(xs[r * ld + j])
                                     : (j < e && m != -kInf ? std::exp(double(xs[r * ld + j]) - m) / z : 0.0);
          close(p, got[r * ld + j], "softmax", r * ld + j);
        }
      }
    }
    {  // GDN chunk scales and masks: 3 chunks of C = 5
      const std::int64_t chunks = 3, C = 5;
      auto g64 = rand_vec(chunks * C, 16, -0.5, 0.0), b64 = rand_vec(chunks * C, 17, 0.0, 1.0);
      for (std::int64_t c = 0; c < chunks; ++c)  // gamma: cumulative
        for (std::int64_t i = 1; i < C; ++i) g64[c * C + i] = double(T(g64[c * C + i])) + double(T(g64[c * C + i - 1]));
      const Buffer<T> gamma(ops, cast<T>(g64)), beta(ops, cast<T>(b64));
      Buffer<T> ks(ops, chunks * C), vs(ops, chunks * C), qs(ops, chunks * C), ke(ops, chunks * C), ed(ops, chunks);
      ops.gdn_chunk_scales(chunks, C, gamma.get(), beta.get(), ks.get(), vs.get(), qs.get(), ke.get(), ed.get());
      const auto a64 = rand_vec(chunks * C * C, 18), q64 = rand_vec(chunks * C * C, 19);
      Buffer<T> a(ops, cast<T>(a64)), qk(ops, cast<T>(q64));
      ops.gdn_chunk_masks(chunks, C, gamma.get(), beta.get(), a.get(), qk.get());
      const auto gks = get(ops, ks), gvs = get(ops, vs), gqs = get(ops, qs), gke = get(ops, ke), ged = get(ops, ed);
      const auto ga = get(ops, a), gq = get(ops, qk);
      for (std::int64_t c = 0; c < chunks; ++c) {
        const double* gm = g64.data() + c * C;
        const auto G = [&](std::int64_t i) { return double(T(gm[i])); };
        close(std::exp(G(C - 1)), ged[c], "end_decay", c);
        for (std::int64_t i = 0; i < C; ++i) {
          const std::int64_t e = c * C + i;
          const double bi = double(T(b64[e]));
          close(bi * std::exp(G(i)), gks[e], "kscale", e);
          close(bi, gvs[e], "vscale", e);
          close(std::exp(G(i)), gqs[e], "qscale", e);
          close(std::exp(G(C - 1) - G(i)), gke[e], "kend", e);
          for (std::int64_t j = 0; j < C; ++j) {
            const std::int64_t m = e * C + j;
            const double d = std::exp(G(i) - G(j));
            close(j < i ? bi * d * double(T(a64[m])) : 0.0, ga[m], "wy mask", m);
            close(j <= i ? d * double(T(q64[m])) : 0.0, gq[m], "qk mask", m);
          }
        }
      }
    }
  };
  run(0.0f);
  run(0.0);
}

// The affine scan composed from the table's GEMMs and copies (ops::scan_affine) against the sequential composition
// in fp64: segments of 1, 2, 5 and 8 elements.
TEST_P(OpsTable, ScanAffineMatchesSequentialComposition) {
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    Ops<T>& ops = table<T>();
    const std::int64_t K = 3, V = 2, segs = 2;
    for (const std::int64_t n : {1, 2, 5, 8}) {
      const auto m64 = rand_vec(segs * n * K * K, 20 + n, -0.6, 0.6), u64 = rand_vec(segs * n * K * V, 30 + n);
      Buffer<T> m(ops, cast<T>(m64)), u(ops, cast<T>(u64));
      scan_affine(ops, segs, n, K, V, Mat<T>{m.get(), K, n * K * K, K * K}, Mat<T>{u.get(), V, n * K * V, K * V});
      const auto gm = get(ops, m), gu = get(ops, u);
      double err = 0.0;
      for (std::int64_t s = 0; s < segs; ++s) {
        std::vector<double> pm(K * K, 0.0), pu(K * V, 0.0);
        for (std::int64_t i = 0; i < K; ++i) pm[i * K + i] = 1.0;
        for (std::int64_t i = 0; i < n; ++i) {
          const double* Mi = m64.data() + (s * n + i) * K * K;
          const double* Ui = u64.data() + (s * n + i) * K * V;
          std::vector<double> nm(K * K, 0.0), nu(K * V, 0.0);
          for (std::int64_t r = 0; r < K; ++r)
            for (std::int64_t p = 0; p < K; ++p) {
              const double mrp = double(T(Mi[r * K + p]));
              for (std::int64_t c = 0; c < K; ++c) nm[r * K + c] += mrp * pm[p * K + c];
              for (std::int64_t c = 0; c < V; ++c) nu[r * V + c] += mrp * pu[p * V + c];
            }
          for (std::int64_t e = 0; e < K * V; ++e) nu[e] += double(T(Ui[e]));
          pm = nm;
          pu = nu;
          for (std::int64_t e = 0; e < K * K; ++e)
            err = std::max(err, std::abs(pm[e] - double(gm[(s * n + i) * K * K + e])));
          for (std::int64_t e = 0; e < K * V; ++e)
            err = std::max(err, std::abs(pu[e] - double(gu[(s * n + i) * K * V + e])));
        }
      }
      EXPECT_LT(err, 20 * tol<T>()) << "n " << n << " fp" << 8 * sizeof(T);
    }
  };
  run(0.0f);
  run(0.0);
}

// The GDN backward and short-conv row ops: each table's launch against its body (attention/kernels/gdn_rows.h) run
// here in fp64 over the same rows (the bodies themselves are checked against loops and finite differences in
// test_ops): a wrong row, stride, chunk or channel mapping of a launch shows up as a mismatch.
TEST_P(OpsTable, GdnBackwardAndConvRowsMatchTheirBodies) {
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    Ops<T>& ops = table<T>();
    {  // row_dots, l2norm_scale_backward_rows (eps >= 0 and eps < 0)
      const std::int64_t rows = 5, cols = 7, lda = 9, ldb = 8;
      const auto a = rand_as<T>(rows * lda, 40), b = rand_as<T>(rows * ldb, 41);
      const Buffer<T> da(ops, cast<T>(a)), db(ops, cast<T>(b));
      Buffer<T> out(ops, rows);
      ops.row_dots(rows, cols, da.get(), lda, db.get(), ldb, out.get());
      std::vector<double> want(rows);
      for (std::int64_t r = 0; r < rows; ++r) want[r] = rowops::dot_row(a.data() + r * lda, b.data() + r * ldb, cols);
      expect_close(want, get(ops, out), "row_dots");
      for (const double eps : {1e-6, -1.0}) {
        Buffer<T> dy(ops, cast<T>(b));
        ops.l2norm_scale_backward_rows(rows, cols, da.get(), lda, dy.get(), ldb, T(eps), T(0.7));
        std::vector<double> w = b;
        for (std::int64_t r = 0; r < rows; ++r)
          rowops::l2norm_scale_backward_row(a.data() + r * lda, w.data() + r * ldb, cols, double(T(eps)),
                                            double(T(0.7)));
        expect_close(w, get(ops, dy), "l2norm_scale_backward_rows");
      }
    }
    {  // gdn_chunk_masks_backward, gdn_chunk_scales_backward: 3 chunks of C = 5
      const std::int64_t chunks = 3, C = 5, CC = chunks * C * C;
      auto gamma = rand_as<T>(chunks * C, 42, -0.5, 0.0);
      for (std::int64_t c = 0; c < chunks; ++c)
        for (std::int64_t i = 1; i < C; ++i) gamma[c * C + i] = double(T(gamma[c * C + i] + gamma[c * C + i - 1]));
      const auto beta = rand_as<T>(chunks * C, 43, 0.0, 1.0), kk = rand_as<T>(CC, 44), qk = rand_as<T>(CC, 45),
                 dp = rand_as<T>(CC, 46), da = rand_as<T>(CC, 47);
      const Buffer<T> dg(ops, cast<T>(gamma)), dbt(ops, cast<T>(beta)), dkk_in(ops, cast<T>(kk)),
          dqk_in(ops, cast<T>(qk)), ddp(ops, cast<T>(dp)), dda(ops, cast<T>(da));
      Buffer<T> dqk(ops, CC), dkk(ops, CC), dgam(ops, chunks * C), dbet(ops, chunks * C);
      ops.gdn_chunk_masks_backward(chunks, C, dg.get(), dbt.get(), dkk_in.get(), dqk_in.get(), ddp.get(), dda.get(),
                                   dqk.get(), dkk.get(), dgam.get(), dbet.get());
      std::vector<double> wqk(CC), wkk(CC), wg(chunks * C), wb(chunks * C);
      for (std::int64_t c = 0; c < chunks; ++c)
        for (std::int64_t i = 0; i < C; ++i) {
          const std::int64_t m = c * C * C;
          rowops::gdn_masks_backward_row(i, C, gamma.data() + c * C, beta.data() + c * C, kk.data() + m, qk.data() + m,
                                         dp.data() + m, da.data() + m, wqk.data() + m + i * C, wkk.data() + m + i * C,
                                         wg.data() + c * C + i, wb.data() + c * C + i);
        }
      expect_close(wqk, get(ops, dqk), "masks_backward dqk");
      expect_close(wkk, get(ops, dkk), "masks_backward dkk");
      expect_close(wg, get(ops, dgam), "masks_backward dgamma");
      expect_close(wb, get(ops, dbet), "masks_backward dbeta");
      const auto dqq = rand_as<T>(chunks * C, 48), dkbk = rand_as<T>(chunks * C, 49), dvbv = rand_as<T>(chunks * C, 50),
                 dktk = rand_as<T>(chunks * C, 51), sds = rand_as<T>(chunks, 52);
      const Buffer<T> b1(ops, cast<T>(dqq)), b2(ops, cast<T>(dkbk)), b3(ops, cast<T>(dvbv)), b4(ops, cast<T>(dktk)),
          b5(ops, cast<T>(sds));
      for (std::size_t e = 0; e < wg.size(); ++e) wg[e] = double(T(wg[e])), wb[e] = double(T(wb[e]));
      Buffer<T> g2(ops, cast<T>(wg)), bb2(ops, cast<T>(wb));
      ops.gdn_chunk_scales_backward(chunks, C, dg.get(), dbt.get(), b1.get(), b2.get(), b3.get(), b4.get(), b5.get(),
                                    g2.get(), bb2.get());
      for (std::int64_t c = 0; c < chunks; ++c) {
        const std::int64_t o = c * C;
        rowops::gdn_scales_backward(gamma.data() + o, beta.data() + o, C, dqq.data() + o, dkbk.data() + o,
                                    dvbv.data() + o, dktk.data() + o, sds[c], wg.data() + o, wb.data() + o);
      }
      expect_close(wg, get(ops, g2), "scales_backward dg");
      expect_close(wb, get(ops, bb2), "scales_backward dbeta");
    }
    {  // the short conv: 6 output rows reading 3 consecutive rows each (out of order), 4 channels
      const std::int64_t rows = 6, C = 4, W = 3, xrows = 9;
      const std::vector<std::int64_t> first = {4, 0, 6, 2, 1, 5};
      std::vector<std::int64_t> src(xrows * W, -1);  // the output row reading input row j as its w-th
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t w = 0; w < W; ++w)
          if (src[(first[r] + w) * W + w] < 0) src[(first[r] + w) * W + w] = r;
      const auto xin = rand_as<T>(xrows * C, 53), weight = rand_as<T>(C * W, 54), dy = rand_as<T>(rows * C, 55);
      const Buffer<T> dx(ops, cast<T>(xin)), dwt(ops, cast<T>(weight));
      const Buffer<std::int64_t> dfirst(ops, first), dsrc(ops, src);
      for (const bool silu : {false, true}) {
        Buffer<T> y(ops, rows * C), dpre(ops, cast<T>(dy)), dxin(ops, xrows * C), dw(ops, C * W);
        ops.short_conv_rows(rows, C, W, dx.get(), dfirst.get(), dwt.get(), silu, y.get());
        ops.short_conv_dpre_rows(rows, C, W, dx.get(), dfirst.get(), dwt.get(), silu, dpre.get());
        ops.short_conv_dx_rows(xrows, C, W, dpre.get(), dsrc.get(), dwt.get(), dxin.get());
        ops.short_conv_dweight(rows, C, W, dpre.get(), dx.get(), dfirst.get(), dw.get());
        std::vector<double> wy(rows * C), wpre = dy, wdx(xrows * C), wdw(C * W);
        for (std::int64_t r = 0; r < rows; ++r) {
          rowops::short_conv_row(xin.data() + first[r] * C, C, W, weight.data(), silu, wy.data() + r * C);
          rowops::short_conv_dpre_row(xin.data() + first[r] * C, C, W, weight.data(), silu, wpre.data() + r * C);
        }
        const auto got_pre = get(ops, dpre);
        std::vector<double> pre_t(got_pre.begin(), got_pre.end());  // the next ops read the table's dpre
        for (std::int64_t j = 0; j < xrows; ++j)
          rowops::short_conv_dx_row(pre_t.data(), src.data() + j * W, C, W, weight.data(), wdx.data() + j * C);
        for (std::int64_t c = 0; c < C; ++c)
          rowops::short_conv_dweight_channel(c, rows, C, W, pre_t.data(), xin.data(), first.data(), wdw.data());
        expect_close(wy, get(ops, y), silu ? "short_conv silu" : "short_conv");
        expect_close(wpre, got_pre, "short_conv_dpre");
        expect_close(wdx, get(ops, dxin), "short_conv_dx");
        expect_close(wdw, get(ops, dw), "short_conv_dweight");
      }
    }
  };
  run(0.0f);
  run(0.0);
}

// The DSA ops: gemm_fixed_order against fp64 and its promise (an element's bits do not depend on the product's
// shape); the inverted index and the indexed row sums exactly against loops in ascending order; the top-k merge
// against the CPU table's; the row ops against their bodies (attention/kernels/dsa_rows.h) run here in fp64.
TEST_P(OpsTable, DsaOpsMatchLoopsAndBodies) {
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    Ops<T>& ops = table<T>();
    {  // gemm_fixed_order: [6, 9] x [9, 7]^T; then rows 2..4 and columns 3..6 alone must give the same bits
      const std::int64_t m = 6, n = 7, k = 9;
      const auto a = rand_as<T>(m * k, 60), b = rand_as<T>(n * k, 61);
      const Buffer<T> da(ops, cast<T>(a)), db(ops, cast<T>(b));
      Buffer<T> c(ops, m * n), c2(ops, 3 * 4);
      ops.gemm_fixed_order(Trans::kN, Trans::kT, m, n, k, T(1), Mat<const T>{da.get(), k}, Mat<const T>{db.get(), k},
                           T(0), Mat<T>{c.get(), n}, Batch{});
      ops.gemm_fixed_order(Trans::kN, Trans::kT, 3, 4, k, T(1), Mat<const T>{da.get() + 2 * k, k},
                           Mat<const T>{db.get() + 3 * k, k}, T(0), Mat<T>{c2.get(), 4}, Batch{});
      const auto got = get(ops, c), sub = get(ops, c2);
      std::vector<double> want(m * n);
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j)
          for (std::int64_t p = 0; p < k; ++p) want[i * n + j] += a[i * k + p] * b[j * k + p];
      expect_close(want, got, "gemm_fixed_order");
      for (std::int64_t i = 0; i < 3; ++i)
        for (std::int64_t j = 0; j < 4; ++j)
          EXPECT_EQ(got[(i + 2) * n + j + 3], sub[i * 4 + j]) << "gemm_fixed_order (" << i << ", " << j << ")";
    }
    {  // gemm_relu_fixed_order (the indexer logits): relu(alpha A B^T) against fp64, C's old contents ignored (NaN
       // there); the same bits for rows 2..4 x columns 3..6 alone, and for a strided batch of two products (the
       // selected-slot pass's form) whose second matrix is the first product's rows 3..5
      const std::int64_t m = 6, n = 7, k = 9;
      const T alpha = T(0.75);
      const auto a = rand_as<T>(m * k, 63), b = rand_as<T>(n * k, 64);
      const Buffer<T> da(ops, cast<T>(a)), db(ops, cast<T>(b));
      Buffer<T> c(ops, std::vector<T>(m * n, std::numeric_limits<T>::quiet_NaN())), c2(ops, 3 * 4), c3(ops, 2 * 3 * n);
      ops.gemm_relu_fixed_order(Trans::kN, Trans::kT, m, n, k, alpha, Mat<const T>{da.get(), k},
                                Mat<const T>{db.get(), k}, Mat<T>{c.get(), n}, Batch{});
      ops.gemm_relu_fixed_order(Trans::kN, Trans::kT, 3, 4, k, alpha, Mat<const T>{da.get() + 2 * k, k},
                                Mat<const T>{db.get() + 3 * k, k}, Mat<T>{c2.get(), 4}, Batch{});
      ops.gemm_relu_fixed_order(Trans::kN, Trans::kT, 3, n, k, alpha, Mat<const T>{da.get(), k, 0, 3 * k},
                                Mat<const T>{db.get(), k, 0, 0}, Mat<T>{c3.get(), n, 0, 3 * n}, Batch{1, 2});
      const auto got = get(ops, c), sub = get(ops, c2), bat = get(ops, c3);
      std::vector<double> want(m * n);
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          double s = 0.0;
          for (std::int64_t p = 0; p < k; ++p) s += a[i * k + p] * b[j * k + p];
          want[i * n + j] = std::max(0.0, double(alpha) * s);
        }
      expect_close(want, got, "gemm_relu_fixed_order");
      std::int64_t zeros = 0;
      for (const T v : got) zeros += v == T(0);
      EXPECT_GT(zeros, 0) << "gemm_relu_fixed_order: the case has no negative product to clamp";
      for (std::int64_t i = 0; i < 3; ++i)
        for (std::int64_t j = 0; j < 4; ++j)
          EXPECT_EQ(got[(i + 2) * n + j + 3], sub[i * 4 + j]) << "gemm_relu_fixed_order (" << i << ", " << j << ")";
      for (std::int64_t e = 0; e < m * n; ++e)
        EXPECT_EQ(got[e], bat[e]) << "gemm_relu_fixed_order, batched: element " << e;
    }
    {  // inverted_index and sum_rows_indexed: 23 rows onto 6 (some -1, one target empty)
      const std::int64_t n_src = 23, n_dst = 6, cols = 5;
      std::vector<std::int64_t> idx(n_src);
      for (std::int64_t r = 0; r < n_src; ++r) idx[r] = (r * 7) % 8 - 2 == 3 ? 5 : (r * 7) % 8 - 2;  // -2 .. 5, 3 never
      const Buffer<std::int64_t> di(ops, idx);
      Buffer<std::int64_t> off(ops, n_dst + 1), list(ops, n_src);
      ops.inverted_index(n_src, di.get(), n_dst, off.get(), list.get());
      const auto goff = get(ops, off), glist = get(ops, list);
      std::vector<std::int64_t> woff(n_dst + 1, 0), wlist;
      for (std::int64_t d = 0; d < n_dst; ++d) {
        for (std::int64_t r = 0; r < n_src; ++r)
          if (idx[r] == d) wlist.push_back(r);
        woff[d + 1] = static_cast<std::int64_t>(wlist.size());
      }
      EXPECT_EQ(woff, goff) << "inverted_index offsets";
      EXPECT_EQ(wlist, std::vector<std::int64_t>(glist.begin(), glist.begin() + woff[n_dst])) << "inverted_index list";
      const auto src = cast<T>(rand_as<T>(n_src * 8, 62));
      const Buffer<T> ds(ops, src);
      Buffer<T> dst(ops, std::vector<T>(n_dst * cols, T(1)));
      ops.sum_rows_indexed(n_dst, cols, ds.get(), 8, off.get(), list.get(), dst.get(), cols);
      std::vector<T> want(n_dst * cols, T(1));
      for (std::int64_t d = 0; d < n_dst; ++d)
        for (std::int64_t j = 0; j < cols; ++j) {
          if (woff[d] == woff[d + 1]) continue;
          T acc = src[wlist[woff[d]] * 8 + j];
          for (std::int64_t i = woff[d] + 1; i < woff[d + 1]; ++i) acc += src[wlist[i] * 8 + j];
          want[d * cols + j] += acc;
        }
      EXPECT_EQ(want, get(ops, dst)) << "sum_rows_indexed, bitwise in list order";
    }
    {  // topk_merge_rows against the CPU table's on rows with ties and -inf
      const std::int64_t rows = 9, k = 4;
      std::mt19937_64 rng(63);
      std::vector<T> sa(rows * k), sb(rows * k);
      std::vector<std::int64_t> pa(rows * k), pb(rows * k);
      for (std::int64_t r = 0; r < rows; ++r) {
        std::int64_t na = static_cast<std::int64_t>(rng() % (k + 1)), nb = static_cast<std::int64_t>(rng() % (k + 1));
        std::int64_t pos = 0;
        for (std::int64_t t = 0; t < k; ++t) {
          const bool live_a = t < na, live_b = t < nb;
          pa[r * k + t] = live_a ? (pos += 1 + static_cast<std::int64_t>(rng() % 3)) * 2 : -1;
          sa[r * k + t] = live_a ? T(double(rng() % 4) - 1.0) : T(-kInf);
          pb[r * k + t] = live_b ? pa[r * k + t] < 0 ? 2 * t + 1 : pa[r * k + t] + 1 : -1;  // odd: distinct
          sb[r * k + t] = live_b ? (t == 1 ? T(-kInf) : T(double(rng() % 4) - 1.0)) : T(-kInf);
        }
        for (std::int64_t t = 1; t < k; ++t)  // b ascending
          if (pb[r * k + t] >= 0 && pb[r * k + t] <= pb[r * k + t - 1]) pb[r * k + t] = pb[r * k + t - 1] + 2;
      }
      std::vector<T> want_s = sa;
      std::vector<std::int64_t> want_p = pa;
      cpu_ops<T>().topk_merge_rows(rows, k, want_s.data(), want_p.data(), sb.data(), pb.data());
      Buffer<T> dsa(ops, sa);
      Buffer<std::int64_t> dpa(ops, pa);
      const Buffer<T> dsb(ops, sb);
      const Buffer<std::int64_t> dpb(ops, pb);
      ops.topk_merge_rows(rows, k, dsa.get(), dpa.get(), dsb.get(), dpb.get());
      EXPECT_EQ(want_p, get(ops, dpa)) << "topk_merge_rows positions";
      EXPECT_EQ(want_s, get(ops, dsa)) << "topk_merge_rows scores";
    }
    {  // row ops against their bodies
      const std::int64_t rows = 4, n = 6, ld = 8, queries = 3, Hi = 2;
      const auto s = rand_as<T>(rows * ld, 64, -3.0, 0.0), dp = rand_as<T>(rows * ld, 65), delta = rand_as<T>(rows, 66);
      std::vector<std::int64_t> mask(2 * n);
      for (std::int64_t j = 0; j < 2 * n; ++j) mask[j] = j % 3 == 1 ? -1 : j;
      std::vector<double> hi = rand_as<T>(rows, 67, 0.0, 1.0), lo = rand_as<T>(rows, 68, -1e-6, 1e-6);
      hi[3] = -kInf;  // an empty row
      const Buffer<std::int64_t> dmask(ops, mask);
      const Buffer<T> dhi(ops, cast<T>(hi)), dlo(ops, cast<T>(lo)), ddelta(ops, cast<T>(delta));
      Buffer<T> ps(ops, cast<T>(s)), pdp(ops, cast<T>(dp));
      ops.dsa_probs_rows(rows, n, ps.get(), ld, dmask.get(), 2, dhi.get(), dlo.get());
      std::vector<double> wp = s;
      for (std::int64_t r = 0; r < rows; ++r)
        rowops::dsa_probs_row(wp.data() + r * ld, n, mask.data() + (r / 2) * n, hi[r], lo[r]);
      const auto gp = get(ops, ps);
      expect_close(wp, gp, "dsa_probs_rows");
      ops.dsa_dscore_rows(rows, n, ps.get(), pdp.get(), ld, ddelta.get());
      std::vector<double> wd = dp, gpd(gp.begin(), gp.end());
      for (std::int64_t r = 0; r < rows; ++r)
        rowops::dsa_dscore_row(gpd.data() + r * ld, wd.data() + r * ld, n, delta[r]);
      expect_close(wd, get(ops, pdp), "dsa_dscore_rows");
      const auto ls = rand_as<T>(queries * Hi * n, 69), w = rand_as<T>(queries * Hi, 70),
                 g = rand_as<T>(queries * n, 71);
      const Buffer<T> dls(ops, cast<T>(ls)), dw(ops, cast<T>(w)), dg(ops, cast<T>(g));
      Buffer<T> out(ops, queries * n), lsg(ops, cast<T>(ls)), dwo(ops, queries * Hi);
      ops.relu_head_sum_rows(queries, Hi, n, dls.get(), dw.get(), out.get());
      ops.indexer_grad_rows(queries, Hi, n, lsg.get(), dw.get(), dg.get(), dwo.get());
      std::vector<double> wout(queries * n), wls = ls, wdw(queries * Hi);
      for (std::int64_t q = 0; q < queries; ++q) {
        rowops::relu_head_sum_row(ls.data() + q * Hi * n, n, Hi, n, w.data() + q * Hi, wout.data() + q * n);
        for (std::int64_t i = 0; i < Hi; ++i)
          wdw[q * Hi + i] = rowops::indexer_grad_row(wls.data() + (q * Hi + i) * n, n, w[q * Hi + i], g.data() + q * n);
      }
      expect_close(wout, get(ops, out), "relu_head_sum_rows");
      expect_close(wls, get(ops, lsg), "indexer_grad_rows logits");
      expect_close(wdw, get(ops, dwo), "indexer_grad_rows dw");
      // kl_rows: probs >= 0, one -1 slot per row, a row of zero probs
      auto probs = rand_as<T>(rows * n, 72, 0.0, 1.0);
      for (std::int64_t j = 0; j < n; ++j) probs[2 * n + j] = 0.0;
      const auto scores = rand_as<T>(rows * n, 73);
      std::vector<std::int64_t> kidx(rows * n);
      for (std::int64_t e = 0; e < rows * n; ++e) kidx[e] = e % n == 2 ? -1 : e;
      const Buffer<T> dpr(ops, cast<T>(probs)), dsc(ops, cast<T>(scores));
      const Buffer<std::int64_t> dki(ops, kidx);
      Buffer<T> dscores(ops, rows * n);
      Buffer<double> loss(ops, rows);
      ops.kl_rows(rows, n, dpr.get(), dsc.get(), dki.get(), 0.5, dscores.get(), loss.get());
      std::vector<double> wds(rows * n), wl(rows);
      for (std::int64_t r = 0; r < rows; ++r)
        wl[r] = rowops::kl_row(probs.data() + r * n, scores.data() + r * n, kidx.data() + r * n, n, 0.5,
                               wds.data() + r * n);
      expect_close(wds, get(ops, dscores), "kl_rows dscores");
      const auto gl = get(ops, loss);
      for (std::int64_t r = 0; r < rows; ++r) EXPECT_NEAR(wl[r], gl[r], 1e-6 * std::max(1.0, std::abs(wl[r]))) << r;
    }
  };
  run(0.0f);
  run(0.0);
}

TEST(OpsTableFactory, RefusesWhatItCannotServe) {
  EXPECT_THROW((void)cuda_ops<float>(Device::cpu(), Stream::cpu()), Error);
  if (!cuda_ops_built()) {
    try {
      (void)cuda_ops<double>(Device::cuda(0), Stream{Device::cuda(0), nullptr});
      FAIL() << "a build without CUDA made a CUDA table";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("built without CUDA"), std::string::npos) << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Tables, OpsTable, ::testing::Values("cpu", "cuda"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace seqpar::attn::ops
