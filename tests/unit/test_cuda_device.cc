// The CUDA device path of the runtime: allocation through the ledger, zero fill and host <-> device copies,
// checked against the host values. Skips with the reason when no GPU (or no CUDA build) is present.
#include <gtest/gtest.h>

#include "runtime/tensor_ops.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

TEST(CudaDevice, LedgerAllocationZeroFillAndRoundTrip) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  const Device gpu = Device::cuda(0);
  const std::int64_t before = memory_ledger().snapshot().current[static_cast<int>(MemCategory::kWorkspace)];
  Tensor host = test::random_tensor({3, 5, 7}, DType::kBFloat16, 1);
  {
    Tensor dev = Tensor::zeros(host.shape(), DType::kBFloat16, MemCategory::kWorkspace, gpu);
    EXPECT_EQ(memory_ledger().snapshot().current[static_cast<int>(MemCategory::kWorkspace)] - before,
              static_cast<std::int64_t>(host.nbytes()));
    Tensor back = Tensor::empty(host.shape(), DType::kBFloat16, MemCategory::kWorkspace);
    copy_convert(dev.view(), back.view());
    for (double x : test::to_double(back)) ASSERT_EQ(x, 0.0);
    copy_convert(host.view(), dev.view());
    copy_convert(dev.view(), back.view());
    EXPECT_EQ(test::to_double(back), test::to_double(host));
    Stream{gpu, nullptr}.synchronize();
  }
  EXPECT_EQ(memory_ledger().snapshot().current[static_cast<int>(MemCategory::kWorkspace)], before);
}

TEST(CudaDevice, UnavailableReasonIsStated) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_FALSE(cuda_unavailable_reason().empty());
  EXPECT_THROW(Tensor::empty({4}, DType::kFloat32, MemCategory::kWorkspace, Device::cuda(0)), Error);
}

}  // namespace
}  // namespace seqpar
