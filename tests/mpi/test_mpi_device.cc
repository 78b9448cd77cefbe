// The MPI backend with CUDA device buffers (issue 9), registered at 2 ranks: device buffers are staged through
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
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"
#include "tests/util/units.h"

#if defined(SEQPAR_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace seqpar {
namespace {

using test::put;
using test::take;
using test::unit_exponent;
using test::units_equal;
using test::world;

// Why this job cannot move device buffers (empty when it can); the same answer on every rank.
const std::string& skip_reason() {
  static const std::string reason = [] {
    std::string r;
#if defined(SEQPAR_WITH_CUDA)
    if (cuda_device_count() == 0) r = cuda_unavailable_reason();
#else
    r = cuda_unavailable_reason();
#endif
    if (!test::all_ranks(world(), r.empty()) && r.empty()) r = "another rank has no usable CUDA device";
    return r;
  }();
  return reason;
}

#define SEQPAR_SKIP_WITHOUT_DEVICE()                           \
  do {                                                         \
    if (!skip_reason().empty()) GTEST_SKIP() << skip_reason(); \
  } while (0)

// This rank's device: ranks share the visible devices round-robin (all share one GPU on a one-GPU machine).
int device() { return device_ordinal_from_local_rank(); }

// ---- exact "unit" data (the scheme of tests/mpi/test_comm.cc) -------------------------------------------------
// Small integers stored as units x 2^k with a dtype-dependent power of two; every sum here stays within 256 units,
// so bf16 / fp16 reductions are exact in any order and every comparison is exact.

constexpr DType kAllDTypes[] = {DType::kFloat64, DType::kFloat32, DType::kBFloat16,
                                DType::kFloat16, DType::kInt32,   DType::kInt64};

// A device buffer holding `units` (one entry per element), copied from the host.
Tensor on_device(DType dtype, const std::vector<std::int64_t>& units) {
  const auto n = static_cast<std::int64_t>(units.size());
  Tensor host = Tensor::empty({n}, dtype, MemCategory::kCommBuffer);
  for (std::int64_t i = 0; i < n; ++i) put(host, i, units[i]);
  Tensor dev = Tensor::empty({n}, dtype, MemCategory::kCommBuffer, Device::cuda(device()));
  copy_convert(host, dev);
  return dev;
}
Tensor filled_on_device(DType dtype, std::int64_t n, std::int64_t units) {
  return on_device(dtype, std::vector<std::int64_t>(static_cast<std::size_t>(n), units));
}

int mod(int a, int p) { return ((a % p) + p) % p; }

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.message();
  }
  return "<no error>";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::int64_t right_units(int src, int i) { return 1 + src * 16 + i; }
std::int64_t left_units(int src, int i) { return 130 + src * 15 + i; }

// ---- collective cases shared by both backends ------------------------------------------------------------------

void check_all_to_all(Communicator& w) {
  const int p = w.size(), r = w.rank(), block = 3;
  auto units = [&](int s, int d, int j) { return std::int64_t{1} + (s * p + d) * block + j; };
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> mine(p * block), want(p * block);
    for (int d = 0; d < p; ++d)
      for (int j = 0; j < block; ++j) {
        mine[d * block + j] = units(r, d, j);
        want[d * block + j] = units(d, r, j);
      }
    Tensor send = on_device(dtype, mine), recv = filled_on_device(dtype, p * block, -1);
    w.all_to_all(send, recv)->wait();
    EXPECT_TRUE(units_equal(recv, want, "all_to_all"));
  }
}

void check_all_to_all_v(Communicator& w) {
  const int p = w.size(), r = w.rank();
  auto count = [](int s, int d) { return static_cast<std::int64_t>((s + 2 * d + 1) % 3); };
  auto units = [&](int s, int d, int j) { return std::int64_t{1} + (s * p + d) * 2 + j; };
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> send_counts(p), recv_counts(p), mine, want;
    for (int q = 0; q < p; ++q) {
      send_counts[q] = count(r, q);
      recv_counts[q] = count(q, r);
      for (int j = 0; j < count(r, q); ++j) mine.push_back(units(r, q, j));
      for (int j = 0; j < count(q, r); ++j) want.push_back(units(q, r, j));
    }
    const auto recv_total = static_cast<std::int64_t>(want.size());
    mine.insert(mine.end(), {-3, -3});
    Tensor send = on_device(dtype, mine), recv = filled_on_device(dtype, recv_total + 3, -7);
    w.all_to_all_v(send, send_counts, recv, recv_counts)->wait();
    want.insert(want.end(), {-7, -7, -7});
    EXPECT_TRUE(units_equal(recv, want, "all_to_all_v (with a 3-element untouched tail)"));
    const std::vector<std::int64_t> zeros(p, 0);
    Tensor empty_send = filled_on_device(dtype, 0, 0), sentinel = filled_on_device(dtype, 1, -9);
    w.all_to_all_v(empty_send, zeros, sentinel, zeros)->wait();
    EXPECT_TRUE(units_equal(sentinel, {-9}, "all_to_all_v with all counts zero"));
  }
}

void check_all_gather(Communicator& w) {
  const int p = w.size(), r = w.rank(), n = 3;
  auto units = [](int s, int j) { return std::int64_t{1} + s * 3 + j; };
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> mine(n), want(p * n);
    for (int j = 0; j < n; ++j) mine[j] = units(r, j);
    for (int s = 0; s < p; ++s)
      for (int j = 0; j < n; ++j) want[s * n + j] = units(s, j);
    Tensor send = on_device(dtype, mine), recv = filled_on_device(dtype, p * n, -1);
    w.all_gather(send, recv)->wait();
    EXPECT_TRUE(units_equal(recv, want, "all_gather"));
  }
}

void check_reduce_scatter(Communicator& w) {
  const int p = w.size(), r = w.rank(), n = 2;
  auto sum_units = [](int s, int d, int j) { return (s % 2 ? -1 : 1) * std::int64_t{1 + s + 2 * d + j}; };
  auto max_units = [](int s, int d, int j) { return std::int64_t{(s * 5 + d * 3 + j) % 7 - 3}; };
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      auto x = [&](int s, int d, int j) { return op == ReduceOp::kSum ? sum_units(s, d, j) : max_units(s, d, j); };
      std::vector<std::int64_t> mine(p * n), want(n);
      for (int d = 0; d < p; ++d)
        for (int j = 0; j < n; ++j) mine[d * n + j] = x(r, d, j);
      for (int j = 0; j < n; ++j) {
        std::int64_t acc = op == ReduceOp::kSum ? 0 : INT64_MIN;
        for (int s = 0; s < p; ++s) acc = op == ReduceOp::kSum ? acc + x(s, r, j) : std::max(acc, x(s, r, j));
        want[j] = acc;
      }
      Tensor send = on_device(dtype, mine), recv = filled_on_device(dtype, n, -100);
      w.reduce_scatter(send, recv, op)->wait();
      EXPECT_TRUE(units_equal(recv, want, str_cat("reduce_scatter(", reduce_op_name(op), ")")));
    }
  }
}

void check_all_reduce(Communicator& w) {
  const int p = w.size(), r = w.rank();
  for (DType dtype : kAllDTypes) {
    for (std::int64_t n : {std::int64_t{7}, std::int64_t{4099}}) {
      std::vector<std::int64_t> mine(n), want(n);
      // Sum: x(s, j) = +-(s + 1)(j % 3 + 1), total +-p(p+1)/2 (j % 3 + 1).
      for (std::int64_t j = 0; j < n; ++j) {
        mine[j] = (j % 2 ? -1 : 1) * (r + 1) * (j % 3 + 1);
        want[j] = (j % 2 ? -1 : 1) * std::int64_t{p} * (p + 1) / 2 * (j % 3 + 1);
      }
      Tensor sum = on_device(dtype, mine);
      w.all_reduce(sum, ReduceOp::kSum)->wait();
      EXPECT_TRUE(units_equal(sum, want, str_cat("all_reduce(sum) of ", n)));
      // Max: x(s, j) = 2 ((s + j) mod p) - 5 + j % 2, whose max over s is 2 (p - 1) - 5 + j % 2.
      for (std::int64_t j = 0; j < n; ++j) {
        mine[j] = 2 * ((r + j) % p) - 5 + j % 2;
        want[j] = 2 * (p - 1) - 5 + j % 2;
      }
      Tensor mx = on_device(dtype, mine);
      w.all_reduce(mx, ReduceOp::kMax)->wait();
      EXPECT_TRUE(units_equal(mx, want, str_cat("all_reduce(max) of ", n)));
    }
  }
}

void check_broadcast(Communicator& w) {
  const int p = w.size(), r = w.rank(), n = 4;
  for (DType dtype : kAllDTypes) {
    for (int root = 0; root < p; ++root) {
      std::vector<std::int64_t> want(n), mine(n, -1);
      for (int j = 0; j < n; ++j) want[j] = 1 + root * 4 + j;
      Tensor buf = on_device(dtype, r == root ? want : mine);
      w.broadcast(buf, root)->wait();
      EXPECT_TRUE(units_equal(buf, want, str_cat("broadcast from root ", root)));
    }
  }
}

// Both directions around the ring in one batch, plus a second message to the right with the same tag (matched in
// posting order).
void check_batch_ring_both_directions(Communicator& w) {
  const int p = w.size(), r = w.rank(), right = mod(r + 1, p), left = mod(r - 1, p), n = 6;
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> to_right(n), to_left(n), second(n), want_left(n), want_right(n), want_second(n);
    for (int i = 0; i < n; ++i) {
      to_right[i] = right_units(r, i);
      second[i] = right_units(r, i) + 100;
      to_left[i] = left_units(r, i);
      want_left[i] = right_units(left, i);
      want_second[i] = right_units(left, i) + 100;
      want_right[i] = left_units(right, i);
    }
    Tensor a = on_device(dtype, to_right), b = on_device(dtype, to_left), c = on_device(dtype, second);
    Tensor from_left = filled_on_device(dtype, n, -1), from_right = filled_on_device(dtype, n, -1),
           second_from_left = filled_on_device(dtype, n, -1);
    w.batch_isend_irecv({P2POp::send(a, right, 5), P2POp::recv(from_right, right, 6), P2POp::send(b, left, 6),
                         P2POp::recv(from_left, left, 5), P2POp::send(c, right, 5),
                         P2POp::recv(second_from_left, left, 5)})
        ->wait();
    EXPECT_TRUE(units_equal(from_left, want_left, "batch: first message from the left"));
    EXPECT_TRUE(units_equal(second_from_left, want_second, "batch: second message from the left"));
    EXPECT_TRUE(units_equal(from_right, want_right, "batch: message from the right"));
  }
}

// P - 1 steps of forwarding around the ring (as ring attention moves K/V), one batch per step.
void check_ring_forwarding(Communicator& w) {
  const int p = w.size(), r = w.rank(), right = mod(r + 1, p), left = mod(r - 1, p), n = 5;
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> mine(n);
    for (int i = 0; i < n; ++i) mine[i] = right_units(r, i);
    Tensor cur = on_device(dtype, mine), next = filled_on_device(dtype, n, -1);
    for (int step = 1; step < p; ++step) {
      w.batch_isend_irecv({P2POp::send(cur, right, step), P2POp::recv(next, left, step)})->wait();
      std::swap(cur, next);
      std::vector<std::int64_t> want(n);
      for (int i = 0; i < n; ++i) want[i] = right_units(mod(r - step, p), i);
      EXPECT_TRUE(units_equal(cur, want, str_cat("block after step ", step)));
    }
  }
}

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
    EXPECT_TRUE(
        contains(m, str_cat("MPI irecv from peer ", left, " (tag 877, 16 bytes) did not complete within 0.3 s")))
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
