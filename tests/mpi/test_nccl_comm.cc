// NCCL communicator tests, registered at 2 ranks: point to point, grouped ring exchanges, every
// collective on every dtype against closed forms (the "unit" scheme of test_comm.cc: exact comparisons), byte
// counters, split, ordering against a compute stream, argument checks, and a stuck receive that turns into an
// error (ncclCommAbort) instead of a hang.
//
// Every NCCL test needs an NCCL build and one CUDA device per rank; otherwise it calls GTEST_SKIP with the reason
// (all ranks agree on it first, so that no rank enters NCCL alone). The tests of the launcher helpers and of the
// failure without a device run everywhere.
//
// No test returns early between collectives (EXPECT, not ASSERT), so that a failure on one rank never leaves the
// others waiting.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "runtime/comm_factory.h"
#include "runtime/nccl_comm.h"
#include "runtime/tensor.h"
#include "runtime/tensor_ops.h"
#include "tests/util/device_collectives.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"
#include "tests/util/units.h"

#if defined(SEQPAR_WITH_NCCL)
#include <cuda_runtime.h>  // the typed cudaMallocHost overload
#endif

namespace seqpar {
namespace {

using namespace test;  // NOLINT: the shared communicator test helpers (tests/util/device_collectives.h)

// Why this job cannot run the NCCL tests (empty when it can); the same answer on every rank.
const std::string& skip_reason() {
  static const std::string reason = [] {
    std::string r;
    if (!nccl_backend_built()) {
      r = "the NCCL backend is not built (SEQPAR_WITH_NCCL=OFF, no CUDA toolkit, or nccl.h not found)";
    } else if (const int n = cuda_device_count(); n < world().size()) {
      r = str_cat("NCCL needs one CUDA device per rank: ", world().size(), " ranks, ", n, " device(s) visible",
                  n == 0 ? str_cat(" (", cuda_unavailable_reason(), ")") : std::string());
    }
    return agreed_skip_reason(world(), r, "cannot run the NCCL tests");
  }();
  return reason;
}
#define SEQPAR_SKIP_WITHOUT_NCCL() SEQPAR_SKIP_IF(skip_reason())

// This rank's device (the launcher's local rank modulo the device count).
int device() { return device_ordinal_from_local_rank(); }

std::unique_ptr<NcclCommunicator> make_nccl() { return std::make_unique<NcclCommunicator>(world(), device()); }

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// ---- everywhere: launcher helpers, construction without NCCL or a device ---------------------------------------

TEST(NcclHelpers, LauncherLocalRankFollowsTheLauncher) {
  const char* ompi = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  if (ompi != nullptr) {
    EXPECT_EQ(launcher_local_rank(), std::atoi(ompi));
  } else if (std::getenv("SLURM_LOCALID") == nullptr && std::getenv("MPI_LOCALRANKID") == nullptr) {
    EXPECT_EQ(launcher_local_rank(), -1);
  }
  const int count = cuda_device_count();
  if (count == 0) {
    const std::string m = error_of([] { device_ordinal_from_local_rank(); });
    EXPECT_TRUE(contains(m, "cannot pick a CUDA device for this rank: ")) << m;
  } else {
    const int local = launcher_local_rank();
    EXPECT_EQ(device_ordinal_from_local_rank(), local < 0 ? 0 : local % count);
  }
}

// Without NCCL the constructor and the factory say so (the factory before any message); without a device every
// rank fails together, after agreeing through the bootstrap communicator (a failing rank never leaves the others
// inside NCCL).
TEST(NcclHelpers, ConstructionAndFactoryFailOnEveryRankWithoutNcclOrDevice) {
  if (nccl_backend_built() && cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  const std::vector<std::pair<std::string, std::function<void()>>> makers = {
      {"backend nccl does not support construction: seqpar was built without NCCL",
       [] { NcclCommunicator c(world(), 0); }},
      {"backend nccl is not compiled into this build of seqpar", [] { make_world_communicator("nccl"); }}};
  for (const auto& [without_nccl, make] : makers) {
    const std::string m = error_of(make);
    EXPECT_TRUE(contains(m, nccl_backend_built() ? "NcclCommunicator: the NCCL backend needs one CUDA device per "
                                                   "rank, and this rank has none"
                                                 : without_nccl))
        << m;
  }
  world().barrier()->wait();
}

// NCCL refuses two ranks on one device; the constructor says so on every rank, before NCCL starts.
TEST(NcclHelpers, RanksSharingOneDeviceAreRefused) {
  if (!nccl_backend_built()) GTEST_SKIP() << "the NCCL backend is not built";
  const int count = cuda_device_count();
  if (count == 0) GTEST_SKIP() << "no CUDA device: " << cuda_unavailable_reason();
  if (count >= world().size() || world().size() < 2) GTEST_SKIP() << "every rank has its own device";
  const std::string m = error_of([] { NcclCommunicator c(world(), 0); });
  EXPECT_TRUE(contains(m, "chose the same CUDA device; NCCL needs one device per rank")) << m;
  world().barrier()->wait();
}

// ---- point to point ------------------------------------------------------------------------------------------

// Lone isend / irecv: even ranks send first, odd ranks receive first, so that the stream-ordered operations of a
// pair always meet (a lone operation holds the communicator's stream until its match is posted).
TEST(Nccl, PairExchangeIsendIrecvEveryDType) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  const int p = nc->size(), r = nc->rank();
  if (p % 2 != 0) GTEST_SKIP() << "needs an even number of ranks, got " << p;
  const int partner = r % 2 == 0 ? r + 1 : r - 1, n = 7;
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> mine(n), want(n);
    for (int i = 0; i < n; ++i) {
      mine[i] = right_units(r, i);
      want[i] = right_units(partner, i);
    }
    Tensor out = on_device(dtype, mine), in = filled_on_device(dtype, n, -1);
    WorkHandle first, second;
    if (r % 2 == 0) {
      first = nc->isend(out, partner, 1);
      second = nc->irecv(in, partner, 1);
    } else {
      first = nc->irecv(in, partner, 1);
      second = nc->isend(out, partner, 1);
    }
    first->wait();
    second->wait();
    EXPECT_TRUE(units_equal(in, want, str_cat("received from rank ", partner)));
  }
}

TEST(Nccl, BatchRingExchangeBothDirectionsEveryDType) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  check_batch_ring_both_directions(*nc);
}

TEST(Nccl, RingForwardingForPMinusOneSteps) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  check_ring_forwarding(*nc);
}

// 64 MiB per message: many NCCL chunks, several protocol switches.
TEST(Nccl, LargeBatchRingExchange) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  const int p = nc->size(), r = nc->rank(), right = mod(r + 1, p), left = mod(r - 1, p);
  const std::int64_t n = std::int64_t{1} << 24;
  Tensor host = Tensor::empty({n}, DType::kFloat32, MemCategory::kCommBuffer);
  for (std::int64_t i = 0; i < n; ++i) host.data_as<float>()[i] = static_cast<float>((r * 1000003 + i) % 8388593);
  Tensor send = Tensor::empty({n}, DType::kFloat32, MemCategory::kCommBuffer, Device::cuda(device()));
  Tensor recv = Tensor::zeros({n}, DType::kFloat32, MemCategory::kCommBuffer, Device::cuda(device()));
  copy_convert(host, send);
  nc->batch_isend_irecv({P2POp::recv(recv, left, 9), P2POp::send(send, right, 9)})->wait();
  copy_convert(recv, host);
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i)
    bad += host.data_as<float>()[i] != static_cast<float>((left * 1000003 + i) % 8388593);
  EXPECT_EQ(bad, 0) << "rank " << r << ": elements received wrong from rank " << left;
}

// ---- collectives ---------------------------------------------------------------------------------------------

TEST(Nccl, AllToAllEveryDType) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  check_all_to_all(*nc);
}

TEST(Nccl, AllToAllVariableSplitsWithZeroCountsEveryDType) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  check_all_to_all_v(*nc);
}

TEST(Nccl, AllGatherEveryDType) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  check_all_gather(*nc);
}

TEST(Nccl, ReduceScatterSumAndMaxEveryDType) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  check_reduce_scatter(*nc);
}

TEST(Nccl, AllReduceSumAndMaxEveryDTypeClosedForm) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  check_all_reduce(*nc);
}

TEST(Nccl, BroadcastFromEveryRootEveryDTypeAndBarrier) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  check_broadcast(*nc);
  for (int i = 0; i < 3; ++i) nc->barrier()->wait();
}

TEST(Nccl, ByteCountersFollowTheirDefinitions) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  check_byte_counters(*nc, filled_on_device, /*lone_p2p=*/false);
}

// ---- split ---------------------------------------------------------------------------------------------------

// World ranks of the members of `comm` in its rank order, gathered inside it (on the device).
std::vector<std::int64_t> members(Communicator& comm) {
  Tensor me = on_device(DType::kInt64, {world().rank()});
  Tensor all = filled_on_device(DType::kInt64, comm.size(), -1);
  comm.all_gather(me, all)->wait();
  Tensor host = Tensor::empty({comm.size()}, DType::kInt64, MemCategory::kCommBuffer);
  copy_convert(all, host);
  std::vector<std::int64_t> out(comm.size());
  for (int i = 0; i < comm.size(); ++i) out[i] = *take(host, i);
  return out;
}

TEST(Nccl, SplitGroupsByColourAndOrdersByKey) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  const int p = nc->size(), r = nc->rank();
  {
    auto sub = nc->split(r % 2, -r);  // parity classes, by descending rank
    EXPECT_NE(sub, nullptr);
    std::vector<std::int64_t> want;
    for (int q = p - 1; q >= 0; --q)
      if (q % 2 == r % 2) want.push_back(q);
    if (sub) {
      EXPECT_STREQ(sub->backend_name(), "nccl");
      EXPECT_EQ(sub->size(), static_cast<int>(want.size()));
      EXPECT_EQ(sub->rank(), static_cast<int>(std::find(want.begin(), want.end(), r) - want.begin()));
      EXPECT_EQ(members(*sub), want) << "rank " << r;
    }
  }
  {
    auto sub = nc->split(r == 0 ? -1 : 7, r);  // a negative colour leaves rank 0 out
    if (r == 0) {
      EXPECT_EQ(sub, nullptr);
    } else if (sub) {
      EXPECT_EQ(sub->size(), p - 1);
      EXPECT_EQ(sub->rank(), r - 1);
    } else {
      ADD_FAILURE() << "rank " << r << ": split with colour 7 gave no communicator";
    }
  }
  nc->barrier()->wait();  // the parent stays usable after splits
}

// ---- streams -------------------------------------------------------------------------------------------------

#if defined(SEQPAR_WITH_NCCL)
// The input is written by an asynchronous copy on the caller's stream and the all-reduce is posted at once (no
// host synchronisation in between): the communicator's stream must wait for it through the event.
TEST(Nccl, OperationsWaitForTheComputeStream) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  const int p = nc->size(), r = nc->rank();
  const std::int64_t n = std::int64_t{1} << 22;  // 16 MiB: the copy takes long enough to lose a race
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaSetDevice(device()), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::int32_t* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, n * sizeof(std::int32_t)), cudaSuccess);
  for (std::int64_t i = 0; i < n; ++i) pinned[i] = static_cast<std::int32_t>((r + 1) * (i % 5 + 1));
  // Tensor::empty, not zeros: a memset on the legacy stream would race with the copy on the non-blocking stream.
  Tensor buf = Tensor::empty({n}, DType::kInt32, MemCategory::kCommBuffer, Device::cuda(device()));
  nc->set_stream({Device::cuda(device()), stream});
  EXPECT_EQ(cudaMemcpyAsync(buf.data(), pinned, n * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream), cudaSuccess);
  nc->all_reduce(buf, ReduceOp::kSum)->wait();
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<std::int32_t> got(n);
  EXPECT_EQ(cudaMemcpy(got.data(), buf.data(), n * sizeof(std::int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) bad += got[i] != p * (p + 1) / 2 * (i % 5 + 1);
  EXPECT_EQ(bad, 0) << "rank " << r << ": the all-reduce read its input before the compute stream wrote it";
  const std::string m = error_of([&] { nc->set_stream({Device::cuda(device() + 1), nullptr}); });
  EXPECT_TRUE(contains(m, "set_stream: the stream is on cuda:")) << m;
  nc->set_stream(Stream::cpu());
  nc->barrier()->wait();
  cudaFreeHost(pinned);
  cudaStreamDestroy(stream);
}
#endif

// ---- argument checks -----------------------------------------------------------------------------------------

TEST(Nccl, InvalidArgumentsThrowBeforeCommunicating) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  auto nc = make_nccl();
  const int p = nc->size();
  Tensor host = Tensor::empty({4}, DType::kFloat32, MemCategory::kCommBuffer);
  Tensor x = filled_on_device(DType::kFloat32, 4, 1), y = filled_on_device(DType::kFloat64, 4 * p, 0);
  std::string m = error_of([&] { nc->all_reduce(host, ReduceOp::kSum); });
  EXPECT_TRUE(contains(m, str_cat("all_reduce: the NCCL backend takes buffers on cuda:", device()))) << m;
  m = error_of([&] { nc->isend(x, p, 0); });
  EXPECT_TRUE(contains(m, str_cat("isend: peer ", p, " is outside the communicator of size ", p))) << m;
  m = error_of([&] { nc->batch_isend_irecv({P2POp::recv(x, -1)}); });
  EXPECT_TRUE(contains(m, "batch_isend_irecv: peer -1")) << m;
  m = error_of([&] { nc->all_gather(x, y); });
  EXPECT_TRUE(contains(m, "all_gather: recv")) << m;
  m = error_of([&] { nc->all_to_all(x, y); });
  EXPECT_TRUE(contains(m, "must have the same dtype and element count")) << m;
  m = error_of([&] { nc->all_to_all_v(x, {1}, x, {1, 2, 3, 4, 5, 6, 7, 8, 9}); });
  EXPECT_TRUE(contains(m, "one entry per rank")) << m;
  m = error_of([&] { nc->broadcast(x, p); });
  EXPECT_TRUE(contains(m, "broadcast: peer")) << m;
  nc->barrier()->wait();
}

// ---- timeout -------------------------------------------------------------------------------------------------

// Every rank waits for a message that no one sends: the wait turns into an error naming the operation, the peer
// and the time, the communicator is aborted (so its stuck kernel ends) and refuses further work.
TEST(Nccl, StuckReceiveTimesOutAbortsAndThrows) {
  SEQPAR_SKIP_WITHOUT_NCCL();
  {
    auto nc = make_nccl();
    const int p = nc->size(), r = nc->rank(), left = mod(r - 1, p), right = mod(r + 1, p);
    Tensor buf = filled_on_device(DType::kInt32, 4, -1), out = filled_on_device(DType::kInt32, 4, 1);
    // Connect the ring first: an unconnected receive would already time out while NCCL connects (in irecv()).
    nc->batch_isend_irecv({P2POp::send(out, right, 77), P2POp::recv(buf, left, 77)})->wait();
    WorkHandle work = nc->irecv(buf, left, 77);
    EXPECT_FALSE(work->test());
    const auto start = std::chrono::steady_clock::now();
    const std::string m = error_of([&] { work->wait(0.5); });
    const double waited = seconds_since(start);
    EXPECT_TRUE(contains(
        m, str_cat("world: irecv of 16 bytes from world rank ", left, " with tag 77 did not complete within 0.5 s")))
        << m;
    EXPECT_TRUE(contains(m, "ncclCommAbort")) << m;
    EXPECT_GE(waited, 0.5);
    EXPECT_LT(waited, 10.0) << "the timeout (and the abort) took far longer than asked";
    EXPECT_EQ(error_of([&] { work->wait(0.5); }), m) << "a second wait reports the same failure";
    const std::string later = error_of([&] { nc->all_reduce(buf, ReduceOp::kSum); });
    EXPECT_TRUE(contains(later, "world: all_reduce(sum) of 16 bytes")) << later;
    EXPECT_TRUE(contains(later, "the NCCL communicator was aborted after an earlier failure")) << later;
  }
  world().barrier()->wait();
  // A fresh communicator works again.
  auto nc = make_nccl();
  Tensor one = filled_on_device(DType::kInt64, 1, 1);
  nc->all_reduce(one, ReduceOp::kSum)->wait();
  EXPECT_TRUE(units_equal(one, {nc->size()}, "all_reduce on a new communicator after an abort"));
}

}  // namespace
}  // namespace seqpar
