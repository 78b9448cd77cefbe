// The MPI backend with CUDA device buffers, registered at 2 ranks: device buffers are staged through
// pinned host memory, so that several ranks may share one GPU. Every collective on every dtype against closed forms
// (the exact "unit" scheme of test_comm.cc), point to point in both directions, host and device buffers mixed in one
// batch, ordering against a compute stream, and a timed-out device receive that leaves its buffer untouched.
//
// The tests that move data need a CUDA device (shared by all ranks) and skip with the reason otherwise; the check
// that a device buffer is refused with a reason when no device is usable runs everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "runtime/nccl_comm.h"
#include "runtime/tensor.h"
#include "runtime/tensor_ops.h"
#include "tests/util/device_collectives.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"
#include "tests/util/units.h"

#if defined(SEQPAR_WITH_CUDA)
#include <cuda_runtime.h>  // the typed cudaMallocHost overload
#endif

namespace seqpar {
namespace {

using namespace test;  // NOLINT: the shared communicator test helpers (tests/util/device_collectives.h)

// Why this job cannot move device buffers (empty when it can); the same answer on every rank.
const std::string& skip_reason() {
  static const std::string reason = agreed_skip_reason(
      world(), cuda_device_count() > 0 ? std::string() : cuda_unavailable_reason(), "has no usable CUDA device");
  return reason;
}
#define SEQPAR_SKIP_WITHOUT_DEVICE() SEQPAR_SKIP_IF(skip_reason())

// This rank's device: ranks share the visible devices round-robin (all share one GPU on a one-GPU machine).
[[maybe_unused]] int device() { return device_ordinal_from_local_rank(); }

// ---- everywhere ------------------------------------------------------------------------------------------------

// Without a usable device (or without CUDA) a device buffer is refused before anything is posted, with the reason.
TEST(MpiDevice, DeviceBufferWithoutDeviceIsRefusedWithReason) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  float dummy[4] = {};
  const std::string m =
      error_of([&] { world().all_reduce(TensorView(dummy, DType::kFloat32, {4}, Device::cuda(0)), ReduceOp::kSum); });
  EXPECT_TRUE(contains(m, "all_reduce: the MPI backend takes host buffers")) << m;
  world().barrier()->wait();
}

// ---- with a device ---------------------------------------------------------------------------------------------

TEST(MpiDevice, RingExchangeBothDirectionsIsendIrecv) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  Communicator& w = world();
  const int p = w.size(), r = w.rank(), right = mod(r + 1, p), left = mod(r - 1, p), n = 7;
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> to_right(n), to_left(n), want_left(n), want_right(n);
    for (int i = 0; i < n; ++i) {
      to_right[i] = right_units(r, i);
      to_left[i] = left_units(r, i);
      want_left[i] = right_units(left, i);
      want_right[i] = left_units(right, i);
    }
    Tensor a = on_device(dtype, to_right), b = on_device(dtype, to_left);
    Tensor from_left = filled_on_device(dtype, n, -1), from_right = filled_on_device(dtype, n, -1);
    std::vector<WorkHandle> works;
    works.push_back(w.isend(a, right, 1));
    works.push_back(w.isend(b, left, 2));
    works.push_back(w.irecv(from_left, left, 1));
    works.push_back(w.irecv(from_right, right, 2));
    wait_all(works);
    EXPECT_TRUE(units_equal(from_left, want_left, "received from the left neighbour"));
    EXPECT_TRUE(units_equal(from_right, want_right, "received from the right neighbour"));
  }
}

TEST(MpiDevice, BatchRingExchangeBothDirectionsEveryDType) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  check_batch_ring_both_directions(world());
}

TEST(MpiDevice, RingForwardingForPMinusOneSteps) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  check_ring_forwarding(world());
}

// A host send and a device receive (and the reverse) in one batch: host buffers keep the zero-copy path.
TEST(MpiDevice, HostAndDeviceBuffersMixInOneBatch) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  Communicator& w = world();
  const int p = w.size(), r = w.rank(), right = mod(r + 1, p), left = mod(r - 1, p), n = 5;
  Tensor host_out = Tensor::empty({n}, DType::kFloat32, MemCategory::kCommBuffer);
  Tensor host_in = Tensor::empty({n}, DType::kFloat32, MemCategory::kCommBuffer);
  std::vector<std::int64_t> mine(n), want(n), want_host(n);
  for (int i = 0; i < n; ++i) {
    put(host_out, i, right_units(r, i));
    put(host_in, i, -1);
    mine[i] = left_units(r, i);
    want[i] = right_units(left, i);
    want_host[i] = left_units(right, i);
  }
  Tensor dev_out = on_device(DType::kFloat32, mine), dev_in = filled_on_device(DType::kFloat32, n, -1);
  w.batch_isend_irecv({P2POp::send(host_out, right, 3), P2POp::recv(dev_in, left, 3), P2POp::send(dev_out, left, 4),
                       P2POp::recv(host_in, right, 4)})
      ->wait();
  EXPECT_TRUE(units_equal(dev_in, want, "device buffer received from a host send"));
  EXPECT_TRUE(units_equal(host_in, want_host, "host buffer received from a device send"));
}

TEST(MpiDevice, AllToAllEveryDType) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  check_all_to_all(world());
}

TEST(MpiDevice, AllToAllVariableSplitsWithZeroCountsEveryDType) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  check_all_to_all_v(world());
}

TEST(MpiDevice, AllGatherEveryDType) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  check_all_gather(world());
}

TEST(MpiDevice, ReduceScatterSumAndMaxEveryDType) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  check_reduce_scatter(world());
}

TEST(MpiDevice, AllReduceSumAndMaxEveryDTypeClosedForm) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  check_all_reduce(world());
}

TEST(MpiDevice, BroadcastFromEveryRootEveryDType) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  check_broadcast(world());
  world().barrier()->wait();
}

#if defined(SEQPAR_WITH_CUDA)
// The input is written by an asynchronous copy on the caller's stream and the all-reduce is posted at once: the
// staging copy must wait for that stream.
TEST(MpiDevice, StagingWaitsForTheComputeStream) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  Communicator& w = world();
  const int p = w.size(), r = w.rank();
  const std::int64_t n = std::int64_t{1} << 22;
  ASSERT_EQ(cudaSetDevice(device()), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::int32_t* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, n * sizeof(std::int32_t)), cudaSuccess);
  for (std::int64_t i = 0; i < n; ++i) pinned[i] = static_cast<std::int32_t>((r + 1) * (i % 5 + 1));
  // Tensor::empty, not zeros: a memset on the legacy stream would race with the copy on the non-blocking stream.
  Tensor buf = Tensor::empty({n}, DType::kInt32, MemCategory::kCommBuffer, Device::cuda(device()));
  w.set_stream({Device::cuda(device()), stream});
  EXPECT_EQ(cudaMemcpyAsync(buf.data(), pinned, n * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream), cudaSuccess);
  w.all_reduce(buf, ReduceOp::kSum)->wait();
  w.set_stream(Stream::cpu());
  std::vector<std::int32_t> got(n);
  EXPECT_EQ(cudaMemcpy(got.data(), buf.data(), n * sizeof(std::int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) bad += got[i] != p * (p + 1) / 2 * (i % 5 + 1);
  EXPECT_EQ(bad, 0) << "rank " << r << ": the staged all-reduce read its input before the compute stream wrote it";
  cudaFreeHost(pinned);
  cudaStreamDestroy(stream);
}

// A host pointer labelled as device memory is refused before anything is posted.
TEST(MpiDevice, HostPointerLabelledAsDeviceIsRefused) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  float dummy[4] = {};
  const std::string m = error_of(
      [&] { world().all_reduce(TensorView(dummy, DType::kFloat32, {4}, Device::cuda(device())), ReduceOp::kSum); });
  EXPECT_TRUE(contains(m,
                       "the MPI backend takes host buffers, or CUDA device buffers staged through pinned host "
                       "memory; got fp32[4]@cuda:"))
      << m;
  EXPECT_TRUE(contains(m, "not device memory")) << m;
  world().barrier()->wait();
}
#endif

// A receive into a device buffer that no one matches times out; the buffer is not overwritten (no copy-back), and
// the communicator carries the next message on the same tag into a new receive.
TEST(MpiDevice, TimedOutDeviceReceiveLeavesItsBufferAndTheCommunicatorUsable) {
  SEQPAR_SKIP_WITHOUT_DEVICE();
  Communicator& w = world();
  const int p = w.size(), r = w.rank(), right = mod(r + 1, p), left = mod(r - 1, p);
  Tensor stale = filled_on_device(DType::kInt32, 4, -1);
  {
    WorkHandle work = w.irecv(stale, left, 877);
    const std::string m = error_of([&] { work->wait(0.3); });
    EXPECT_TRUE(contains(
        m, str_cat("world: irecv of 16 bytes from world rank ", left, " with tag 877 did not complete within 0.3 s")))
        << m;
  }
  w.barrier()->wait();
  std::vector<std::int64_t> mine(4), want(4);
  for (int i = 0; i < 4; ++i) {
    mine[i] = right_units(r, i);
    want[i] = right_units(left, i);
  }
  Tensor send = on_device(DType::kInt32, mine), recv = filled_on_device(DType::kInt32, 4, -1);
  w.batch_isend_irecv({P2POp::send(send, right, 877), P2POp::recv(recv, left, 877)})->wait();
  EXPECT_TRUE(units_equal(recv, want, "exchange after a timed-out device receive on the same tag"));
  EXPECT_TRUE(units_equal(stale, {-1, -1, -1, -1}, "device buffer of the cancelled receive"));
}

}  // namespace
}  // namespace seqpar
