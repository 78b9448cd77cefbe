// The data-movement operations of runtime/tensor_ops.h on host tensors against plain index loops written here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/elementwise.h"
#include "runtime/tensor_ops.h"
#include "tests/util/device_collectives.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::random_tensor;
using test::to_double;

TEST(TensorOps, GatherAndScatterRowsMatchLoops) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat64, DType::kInt64}) {
    const std::int64_t A = 2, S = 7, C = 3, D = 5;
    Tensor full = dtype == DType::kInt64 ? Tensor::zeros({A, S, C, D}, dtype, MemCategory::kWorkspace)
                                         : random_tensor({A, S, C, D}, dtype, 1);
    if (dtype == DType::kInt64)
      for (std::int64_t i = 0; i < full.numel(); ++i) full.data_as<std::int64_t>()[i] = 3 * i - 7;
    const std::vector<std::int64_t> index = {6, 0, 3, 3};  // any order, repeats allowed for a gather
    Tensor local = Tensor::empty({A, 4, C, D}, dtype, MemCategory::kWorkspace);
    gather_rows(full.view(), 1, index, local.view());
    const std::vector<double> f = to_double(full), l = to_double(local);
    for (std::int64_t a = 0; a < A; ++a)
      for (std::int64_t i = 0; i < 4; ++i)
        for (std::int64_t e = 0; e < C * D; ++e)
          ASSERT_EQ(l[(a * 4 + i) * C * D + e], f[(a * S + index[i]) * C * D + e]) << dtype_name(dtype);

    // scatter into zeros: the named rows get the local rows, the others stay zero.
    const std::vector<std::int64_t> rows = {5, 1, 2, 0};
    Tensor back = Tensor::zeros(full.shape(), dtype, MemCategory::kWorkspace);
    scatter_rows(local.view(), 1, rows, back.view());
    const std::vector<double> b = to_double(back);
    for (std::int64_t a = 0; a < A; ++a)
      for (std::int64_t s = 0; s < S; ++s)
        for (std::int64_t e = 0; e < C * D; ++e) {
          double want = 0;
          for (std::int64_t i = 0; i < 4; ++i)
            if (rows[i] == s) want = l[(a * 4 + i) * C * D + e];
          ASSERT_EQ(b[(a * S + s) * C * D + e], want) << dtype_name(dtype);
        }
  }
}

TEST(TensorOps, RowsAlongAnyDimension) {
  Tensor x = random_tensor({3, 4, 6}, DType::kFloat32, 2);
  const std::vector<std::int64_t> index = {5, 2};
  Tensor y = Tensor::empty({3, 4, 2}, DType::kFloat32, MemCategory::kWorkspace);
  gather_rows(x.view(), 2, index, y.view());
  for (std::int64_t o = 0; o < 12; ++o)
    for (std::int64_t i = 0; i < 2; ++i) ASSERT_EQ(y.data_as<float>()[o * 2 + i], x.data_as<float>()[o * 6 + index[i]]);
  Tensor z = Tensor::empty({2, 4, 6}, DType::kFloat32, MemCategory::kWorkspace);
  gather_rows(x.view(), 0, std::vector<std::int64_t>{2, 0}, z.view());
  for (std::int64_t e = 0; e < 24; ++e) {
    ASSERT_EQ(z.data_as<float>()[e], x.data_as<float>()[48 + e]);
    ASSERT_EQ(z.data_as<float>()[24 + e], x.data_as<float>()[e]);
  }
}

TEST(TensorOps, IndexAddRowsSumsRepeatsInOrder) {
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    Tensor src = random_tensor({2, 5, 3}, dtype, 3);
    Tensor dst = random_tensor({2, 4, 3}, dtype, 4);
    const std::vector<double> d0 = to_double(dst), s = to_double(src);
    const std::vector<std::int64_t> index = {1, 3, 1, 0, 1};
    index_add_rows(src.view(), 1, index, dst.view());
    std::vector<double> want = d0;
    for (std::int64_t o = 0; o < 2; ++o)
      for (std::int64_t i = 0; i < 5; ++i)
        for (std::int64_t e = 0; e < 3; ++e) {
          double& w = want[(o * 4 + index[i]) * 3 + e];
          w = dtype == DType::kFloat32
                  ? static_cast<double>(static_cast<float>(w) + static_cast<float>(s[(o * 5 + i) * 3 + e]))
                  : w + s[(o * 5 + i) * 3 + e];
        }
    EXPECT_EQ(to_double(dst), want) << dtype_name(dtype);
  }
  Tensor b16 = Tensor::zeros({1, 2, 2}, DType::kBFloat16, MemCategory::kWorkspace);
  EXPECT_THROW(index_add_rows(b16.view(), 1, std::vector<std::int64_t>{0, 1}, b16.view()), Error);
}

TEST(TensorOps, SwapOuterDimsMatchesLoop) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    const std::int64_t a = 3, b = 4, rest = 5;
    Tensor src = random_tensor({a, b, rest}, dtype, 5);
    Tensor dst = Tensor::empty({b, a, rest}, dtype, MemCategory::kWorkspace);
    swap_outer_dims(src.view(), a, b, dst.view());
    const std::vector<double> s = to_double(src), d = to_double(dst);
    for (std::int64_t i = 0; i < a; ++i)
      for (std::int64_t j = 0; j < b; ++j)
        for (std::int64_t r = 0; r < rest; ++r) ASSERT_EQ(d[(j * a + i) * rest + r], s[(i * b + j) * rest + r]);
    Tensor again = Tensor::empty(src.shape(), dtype, MemCategory::kWorkspace);
    swap_outer_dims(dst.view(), b, a, again.view());
    EXPECT_EQ(to_double(again), s);
  }
}

TEST(TensorOps, CountNonnegativeMatchesLoop) {
  Tensor t = Tensor::empty({3, 5, 7}, DType::kInt64, MemCategory::kWorkspace);
  std::int64_t want = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const std::int64_t v = (i * 37) % 11 - 4;  // -4 .. 6, -1 included
    t.data_as<std::int64_t>()[i] = v;
    want += v >= 0;
  }
  EXPECT_EQ(count_nonnegative(t.view()), want);
  EXPECT_EQ(count_nonnegative(Tensor::empty({0}, DType::kInt64, MemCategory::kWorkspace).view()), 0);
  Tensor f = Tensor::zeros({2}, DType::kFloat32, MemCategory::kWorkspace);
  EXPECT_NE(test::error_of([&] { count_nonnegative(f.view()); }).find("count_nonnegative input has dtype fp32"),
            std::string::npos);
}

// add_scaled_inplace (and its element body, shared with the CUDA kernel) against an fp64 / long double reference:
// alpha = -1 and 1 are exact differences and sums, any other alpha one rounding of the product and one of the sum.
TEST(TensorOps, AddScaledMatchesReference) {
  EXPECT_EQ(elementwise::add_scaled(1.5f, 0.25f, -1.0f), 1.25f);
  EXPECT_EQ(elementwise::add_scaled(2.0, 3.0, 0.5), 3.5);
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    for (double alpha : {-1.0, 1.0, 0.3, -2.75}) {
      Tensor d = random_tensor({3, 5, 7}, dtype, 7, -4, 4), s = random_tensor({3, 5, 7}, dtype, 8, -4, 4);
      const std::vector<double> d0 = to_double(d), s0 = to_double(s);
      add_scaled_inplace(d.view(), s.view(), alpha);
      const std::vector<double> got = to_double(d);
      const bool f32 = dtype == DType::kFloat32;
      const double a = f32 ? static_cast<double>(static_cast<float>(alpha)) : alpha;
      for (std::size_t i = 0; i < got.size(); ++i) {
        const long double want = static_cast<long double>(d0[i]) + static_cast<long double>(a) * s0[i];
        if (alpha == 1.0 || alpha == -1.0) {
          const double exact =
              f32 ? static_cast<double>(static_cast<float>(d0[i]) + static_cast<float>(a * s0[i])) : d0[i] + a * s0[i];
          ASSERT_EQ(got[i], exact) << dtype_name(dtype) << " alpha " << alpha << " at " << i;
        }
        // two roundings of the dtype, relative to the operands' size
        const double eps = f32 ? 0x1p-23 : 0x1p-52;
        ASSERT_LE(std::abs(static_cast<double>(got[i] - want)), 2 * eps * (std::abs(d0[i]) + std::abs(a * s0[i])))
            << dtype_name(dtype) << " alpha " << alpha << " at " << i;
      }
    }
  }
  Tensor x = Tensor::zeros({4}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor y = Tensor::zeros({4}, DType::kFloat64, MemCategory::kWorkspace);
  EXPECT_NE(test::error_of([&] {
              add_scaled_inplace(x.view(), y.view(), -1.0);
            }).find("needs equal counts and one fp32/fp64 dtype"),
            std::string::npos);
}

// Tensor::copy_of and Tensor::zeros allocate on the source's / given device; copy_convert on the host with a stream
// converts like convert(). Mixed devices name both tensors.
TEST(TensorOps, CopiesKeepTheDeviceAndConvert) {
  Tensor src = random_tensor({4, 6}, DType::kFloat32, 5);
  Tensor half = Tensor::copy_of(src.view(), DType::kBFloat16, MemCategory::kWorkspace, Stream::cpu());
  EXPECT_TRUE(half.view().device().is_cpu());
  Tensor back = Tensor::zeros({4, 6}, DType::kFloat32, MemCategory::kWorkspace, Device::cpu(), Stream::cpu());
  copy_convert(half.view(), back.view(), Stream::cpu());
  const std::vector<double> a = to_double(src), b = to_double(back);
  for (std::size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(b[i], a[i], 1.0 / 128 * (1 + std::abs(a[i]))) << i;
  const TensorView on_cuda(reinterpret_cast<void*>(std::uintptr_t{0x1000}), DType::kFloat32, {4, 6}, Device::cuda(0));
  const std::string m = test::error_of([&] { (void)common_device({src.view(), on_cuda}, "layer forward"); });
  EXPECT_NE(m.find("layer forward: every input must be on one device; fp32[4, 6]@cpu and fp32[4, 6]@cuda:0 differ"),
            std::string::npos)
      << m;
  EXPECT_TRUE(common_device({TensorView(), src.view()}, "x").is_cpu());
}

TEST(TensorOps, ErrorsNameTheRule) {
  Tensor x = Tensor::zeros({2, 4, 3}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor y = Tensor::zeros({2, 2, 3}, DType::kFloat32, MemCategory::kWorkspace);
  std::string m;
  try {
    gather_rows(x.view(), 1, std::vector<std::int64_t>{0, 4}, y.view());
  } catch (const Error& e) {
    m = e.message();
  }
  EXPECT_EQ(m, "gather_rows: index 4 outside [0, 4)");
  EXPECT_THROW(gather_rows(x.view(), 1, std::vector<std::int64_t>{0}, y.view()), Error);  // 1 index, 2 rows
  Tensor yb = Tensor::zeros({2, 2, 3}, DType::kBFloat16, MemCategory::kWorkspace);
  EXPECT_THROW(scatter_rows(yb.view(), 1, std::vector<std::int64_t>{0, 1}, x.view()), Error);  // dtype
  Tensor y4 = Tensor::zeros({2, 2, 4}, DType::kFloat32, MemCategory::kWorkspace);
  EXPECT_THROW(scatter_rows(y4.view(), 1, std::vector<std::int64_t>{0, 1}, x.view()), Error);  // dim 2 differs
  EXPECT_THROW(swap_outer_dims(x.view(), 5, 1, x.view()), Error);                              // 24 % 5 != 0
}

}  // namespace
}  // namespace seqpar
