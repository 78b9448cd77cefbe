#include "runtime/nccl_comm.h"

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>

#include "runtime/error.h"

#if defined(SEQPAR_WITH_NCCL)
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include "runtime/cuda_staging.h"
#include "runtime/env.h"
#include "runtime/logging.h"
#endif

namespace seqpar {

// ---- launcher helpers (every build) -------------------------------------------------------------------------

int launcher_local_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    char* end = nullptr;
    errno = 0;
    const long x = std::strtol(value, &end, 10);
    SEQPAR_CHECK(errno == 0 && end != value && *end == '\0' && x >= 0 && x <= INT_MAX, name, "=\"", value,
                 "\" is not a non-negative integer local rank");
    return static_cast<int>(x);
  }
  return -1;
}

int device_ordinal_from_local_rank() {
  const int count = cuda_device_count();
  SEQPAR_CHECK(count > 0, "cannot pick a CUDA device for this rank: ", cuda_unavailable_reason());
  const int local = launcher_local_rank();
  return local < 0 ? 0 : local % count;
}

#if !defined(SEQPAR_WITH_NCCL)

// ---- builds without NCCL: every entry point says so -----------------------------------------------------------

namespace {
[[noreturn]] void not_built(const char* op) {
  SEQPAR_THROW("backend nccl does not support ", op,
               ": seqpar was built without NCCL (SEQPAR_WITH_NCCL=OFF, no "
               "CUDA toolkit, or nccl.h not found)");
}
}  // namespace

bool nccl_backend_built() { return false; }

NcclCommunicator::NcclCommunicator(Communicator&, int) { not_built("construction"); }
NcclCommunicator::~NcclCommunicator() = default;
Stream NcclCommunicator::comm_stream() const { not_built("comm_stream"); }
void NcclCommunicator::set_stream(const Stream&) { not_built("set_stream"); }
WorkHandle NcclCommunicator::isend(const TensorView&, int, int) { not_built("isend"); }
WorkHandle NcclCommunicator::irecv(const TensorView&, int, int) { not_built("irecv"); }
WorkHandle NcclCommunicator::batch_isend_irecv(const std::vector<P2POp>&) { not_built("batch_isend_irecv"); }
WorkHandle NcclCommunicator::all_to_all(const TensorView&, const TensorView&) { not_built("all_to_all"); }
WorkHandle NcclCommunicator::all_to_all_v(const TensorView&, const std::vector<std::int64_t>&, const TensorView&,
                                          const std::vector<std::int64_t>&) {
  not_built("all_to_all_v");
}
WorkHandle NcclCommunicator::all_gather(const TensorView&, const TensorView&) { not_built("all_gather"); }
WorkHandle NcclCommunicator::reduce_scatter(const TensorView&, const TensorView&, ReduceOp) {
  not_built("reduce_scatter");
}
WorkHandle NcclCommunicator::all_reduce(const TensorView&, ReduceOp) { not_built("all_reduce"); }
WorkHandle NcclCommunicator::broadcast(const TensorView&, int) { not_built("broadcast"); }
WorkHandle NcclCommunicator::barrier() { not_built("barrier"); }
std::unique_ptr<Communicator> NcclCommunicator::split(int, int) { not_built("split"); }

#else  // SEQPAR_WITH_NCCL

// ---- NCCL builds --------------------------------------------------------------------------------------------

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Spin briefly for latency, then back off so that a rank waiting on a slow peer leaves the CPU to others.
void backoff(long polls) {
  if (polls > 2000) {
    std::this_thread::sleep_for(std::chrono::microseconds(polls > 20000 ? 200 : 20));
  } else if (polls > 200) {
    std::this_thread::yield();
  }
}

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return ncclFloat64;
    case DType::kFloat32: return ncclFloat32;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
  }
  SEQPAR_THROW("no NCCL datatype for dtype ", static_cast<int>(dtype));
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

// An event destroyed with its scope unless released.
struct ScopedEvent {
  cudaEvent_t event = nullptr;
  ScopedEvent() { SEQPAR_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)); }
  ~ScopedEvent() {
    if (event != nullptr) cudaEventDestroy(event);
  }
  ScopedEvent(const ScopedEvent&) = delete;
  ScopedEvent& operator=(const ScopedEvent&) = delete;
  cudaEvent_t release() {
    cudaEvent_t e = event;
    event = nullptr;
    return e;
  }
};

// Polls a non-blocking communicator until no operation is in progress. Returns an empty string when it is ready,
// otherwise why not (an NCCL error, or `timeout_s` passed); the caller aborts the communicator.
std::string poll_ready(ncclComm_t comm, const std::string& what, double timeout_s) {
  const auto start = Clock::now();
  for (long polls = 0;; ++polls) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
    if (rc != ncclSuccess) state = rc;
    if (state == ncclSuccess) return {};
    const double elapsed = seconds_since(start);
    if (state != ncclInProgress) {
      return str_cat(what, " failed: NCCL reported \"", ncclGetErrorString(state), "\" (", ncclGetLastError(comm),
                     ") after ", elapsed, " s");
    }
    if (elapsed > timeout_s) {
      return str_cat(what, " did not complete within ", timeout_s, " s (waited ", elapsed,
                     " s): a peer has failed, is stuck, or has not joined");
    }
    backoff(polls);
  }
}

// Runs `body` (NCCL calls) between ncclGroupStart and ncclGroupEnd; the group is closed also when `body` throws.
void run_group(const std::function<void()>& body) {
  SEQPAR_CHECK_NCCL(ncclGroupStart());
  try {
    body();
  } catch (...) {
    ncclGroupEnd();
    throw;
  }
  SEQPAR_CHECK_NCCL(ncclGroupEnd());
}

char* byte_ptr(const TensorView& t, std::int64_t elements) {
  return static_cast<char*>(t.data()) + elements * static_cast<std::int64_t>(dtype_size(t.dtype()));
}

// NCCL forbids overlapping send and receive buffers in these collectives (outside the in-place layouts).
void check_disjoint(const TensorView& send, const TensorView& recv, const char* op) {
  if (send.nbytes() == 0 || recv.nbytes() == 0) return;
  const char* s = static_cast<const char*>(send.data());
  const char* r = static_cast<const char*>(recv.data());
  SEQPAR_CHECK(s + send.nbytes() <= r || r + recv.nbytes() <= s, op, ": send ", send.str(), " and recv ", recv.str(),
               " overlap; they must be distinct buffers");
}

}  // namespace

// ---- shared state ---------------------------------------------------------------------------------------------

struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  int device = 0;
  int rank = 0;
  int size = 1;
  cudaStream_t comm_stream = nullptr;      // owned; NCCL kernels run here
  cudaStream_t compute_stream = nullptr;   // the caller's (nullptr = legacy default stream)
  std::int32_t* barrier_buffer = nullptr;  // one int32 on the device
  std::string abort_reason;                // non-empty once aborted

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // Creates the stream and the barrier buffer on `device` (current device must be `device`).
  void create_resources() {
    SEQPAR_CHECK_CUDA(cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking));
    void* p = nullptr;
    SEQPAR_CHECK_CUDA(cudaMalloc(&p, sizeof(std::int32_t)));
    barrier_buffer = static_cast<std::int32_t*>(p);
    SEQPAR_CHECK_CUDA(cudaMemset(barrier_buffer, 0, sizeof(std::int32_t)));
  }

  // Reads rank and size from a ready communicator.
  void read_shape() {
    SEQPAR_CHECK_NCCL(ncclCommUserRank(comm, &rank));
    SEQPAR_CHECK_NCCL(ncclCommCount(comm, &size));
  }

  void check_usable(const char* op) const {
    SEQPAR_CHECK(abort_reason.empty(), op, ": the NCCL communicator was aborted after an earlier failure (",
                 abort_reason, "); create a new communicator");
  }

  // ncclCommAbort: frees the communicator without waiting for its peers and stops its kernels. Idempotent.
  void abort(const std::string& reason) {
    if (!abort_reason.empty()) return;
    abort_reason = reason;
    if (comm != nullptr) {
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(device);
      const ncclResult_t rc = ncclCommAbort(comm);  // the last resort: nothing further to do when it fails
      comm = nullptr;
      cudaSetDevice(previous);
      if (rc != ncclSuccess) {
        try {
          SEQPAR_LOG(kWarn) << "ncclCommAbort failed: " << ncclGetErrorString(rc);
        } catch (...) {
        }
      }
    }
  }

  // After a call that may leave the communicator in progress: polls it ready, or aborts and throws.
  void wait_ready(const std::string& what) {
    const std::string failure = poll_ready(comm, what, env::comm_timeout_s());
    if (failure.empty()) return;
    abort(failure);
    SEQPAR_THROW(failure, "; the NCCL communicator has been aborted");
  }

  ~State() {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    if (comm != nullptr) {
      // Flush and release, bounded: a peer that is gone must not hang a destructor.
      double timeout_s = 30;
      try {
        timeout_s = env::comm_timeout_s();
      } catch (...) {
      }
      const ncclResult_t rc = ncclCommFinalize(comm);
      std::string failure = rc == ncclSuccess || rc == ncclInProgress
                                ? poll_ready(comm, "ncclCommFinalize", timeout_s)
                                : std::string("ncclCommFinalize failed: ") + ncclGetErrorString(rc);
      if (failure.empty()) {
        if (ncclCommDestroy(comm) != ncclSuccess) failure = "ncclCommDestroy failed";
      } else {
        ncclCommAbort(comm);
      }
      if (!failure.empty()) {
        try {
          SEQPAR_LOG(kWarn) << "NCCL communicator over " << size << " ranks not destroyed cleanly (" << failure
                            << "); aborted";
        } catch (...) {
        }
      }
    }
    if (barrier_buffer != nullptr) cudaFree(barrier_buffer);
    if (comm_stream != nullptr) cudaStreamDestroy(comm_stream);
    cudaSetDevice(previous);
  }
};

// ---- work handle ----------------------------------------------------------------------------------------------

namespace {

using State = NcclCommunicator::State;

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<State> state, std::string description, cudaEvent_t done, cudaStream_t compute)
      : state_(std::move(state)),
        description_(std::move(description)),
        done_event_(done),
        compute_(compute),
        posted_(Clock::now()) {}

  ~NcclWork() override {
    if (!done_ && failure_.empty() && state_->abort_reason.empty() &&
        cudaEventQuery(done_event_) == cudaErrorNotReady) {
      try {
        SEQPAR_LOG(kWarn) << description_ << " was destroyed before it completed: NCCL operations cannot be "
                          << "cancelled, so its buffers must stay untouched until the communicator's stream passes it";
      } catch (...) {
      }
    }
    cudaEventDestroy(done_event_);  // legal while pending: released once the event completes
  }

  bool test() override {
    if (!failure_.empty()) SEQPAR_THROW(failure_);
    if (done_) return true;
    if (!state_->abort_reason.empty()) {
      failure_ =
          str_cat(description_, " cannot complete: the NCCL communicator was aborted (", state_->abort_reason, ")");
      SEQPAR_THROW(failure_);
    }
    const cudaError_t q = cudaEventQuery(done_event_);
    if (q == cudaSuccess) {
      done_ = true;
      // Later work on the caller's compute stream is ordered after the communication without a host round trip.
      DeviceScope scope(state_->device);
      SEQPAR_CHECK_CUDA(cudaStreamWaitEvent(compute_, done_event_, 0));
      return true;
    }
    if (q != cudaErrorNotReady) SEQPAR_CHECK_CUDA(q);
    ncclResult_t async = ncclSuccess;
    SEQPAR_CHECK_NCCL(ncclCommGetAsyncError(state_->comm, &async));
    if (async != ncclSuccess && async != ncclInProgress) {
      fail(str_cat(description_, " failed: NCCL reported \"", ncclGetErrorString(async), "\" (",
                   ncclGetLastError(state_->comm), ") ", seconds_since(posted_), " s after it was posted"));
    }
    return false;
  }

  void wait(double timeout_s) override {
    SEQPAR_CHECK(std::isfinite(timeout_s) && timeout_s >= 0, description_, ": wait timeout ", timeout_s,
                 " s must be finite and >= 0");
    const auto start = Clock::now();
    for (long polls = 0; !test(); ++polls) {
      const double elapsed = seconds_since(start);
      if (elapsed > timeout_s) {
        fail(str_cat(description_, " did not complete within ", timeout_s, " s (waited ", elapsed,
                     " s): a peer has failed, is stuck, or posted a mismatched operation"));
      }
      backoff(polls);
    }
  }

 private:
  [[noreturn]] void fail(const std::string& reason) {
    failure_ = str_cat(reason, "; the NCCL communicator has been aborted (ncclCommAbort) and cannot be used again");
    state_->abort(reason);
    SEQPAR_THROW(failure_);
  }

  std::shared_ptr<State> state_;
  std::string description_;
  cudaEvent_t done_event_;
  cudaStream_t compute_;
  Clock::time_point posted_;
  bool done_ = false;
  std::string failure_;  // once set, every later wait() / test() throws it again
};

// Orders the communicator's stream after the caller's compute stream, runs `enqueue` (NCCL calls on the
// communicator's stream), waits until NCCL has accepted them, and records the completion event.
WorkHandle launch(const std::shared_ptr<State>& state, const char* op, std::string description,
                  const std::function<void(ncclComm_t, cudaStream_t)>& enqueue) {
  state->check_usable(op);
  DeviceScope scope(state->device);
  {
    ScopedEvent ready;
    SEQPAR_CHECK_CUDA(cudaEventRecord(ready.event, state->compute_stream));
    SEQPAR_CHECK_CUDA(cudaStreamWaitEvent(state->comm_stream, ready.event, 0));
  }
  enqueue(state->comm, state->comm_stream);
  state->wait_ready(description);
  ScopedEvent done;
  SEQPAR_CHECK_CUDA(cudaEventRecord(done.event, state->comm_stream));
  return std::make_unique<NcclWork>(state, std::move(description), done.release(), state->compute_stream);
}

void check_on_device(const State& state, const TensorView& t, const char* op) {
  SEQPAR_CHECK(t.device() == Device::cuda(state.device), op, ": the NCCL backend takes buffers on cuda:", state.device,
               " (this rank's device); got ", t.str());
}

}  // namespace

bool nccl_backend_built() { return true; }

// ---- construction -------------------------------------------------------------------------------------------

NcclCommunicator::NcclCommunicator(Communicator& bootstrap, int device_ordinal)
    : rank_(bootstrap.rank()), size_(bootstrap.size()), device_ordinal_(device_ordinal) {
  // Every rank checks its device and makes its part of the bootstrap data; the ranks then agree, so that a bad
  // configuration fails everywhere before NCCL starts (one rank failing alone would leave the others waiting).
  static_assert(sizeof(ncclUniqueId) % sizeof(std::int64_t) == 0, "ncclUniqueId is not a whole number of int64");
  constexpr int kIdWords = sizeof(ncclUniqueId) / sizeof(std::int64_t);
  std::string problem;
  std::int64_t mine[3] = {0, 0, 0};  // {has a problem, device UUID bytes 0-7, 8-15}
  ncclUniqueId id{};
  try {
    const int count = cuda_device_count();
    if (count == 0) {
      problem = cuda_unavailable_reason();
    } else if (device_ordinal < 0 || device_ordinal >= count) {
      problem = str_cat("device ordinal ", device_ordinal, " is outside the ", count, " visible CUDA device(s)");
    } else {
      cudaDeviceProp prop{};
      SEQPAR_CHECK_CUDA(cudaGetDeviceProperties(&prop, device_ordinal));
      std::memcpy(&mine[1], prop.uuid.bytes, 16);
      if (rank_ == 0) SEQPAR_CHECK_NCCL(ncclGetUniqueId(&id));
    }
  } catch (const Error& e) {
    problem = e.message();
  }
  mine[0] = problem.empty() ? 0 : 1;
  std::vector<std::int64_t> all(3 * static_cast<std::size_t>(size_));
  bootstrap.all_gather(TensorView(mine, DType::kInt64, {3}), TensorView(all.data(), DType::kInt64, {3 * size_}))
      ->wait();
  SEQPAR_CHECK(problem.empty(), "NcclCommunicator on cuda:", device_ordinal, ": ", problem);
  std::string failed;
  for (int r = 0; r < size_; ++r) {
    if (all[3 * r] != 0) failed += str_cat(failed.empty() ? "" : ", ", r);
  }
  SEQPAR_CHECK(failed.empty(), "NcclCommunicator: rank(s) ", failed, " of the bootstrap communicator have no usable ",
               "CUDA device (each prints why)");
  for (int a = 0; a < size_; ++a) {
    for (int b = a + 1; b < size_; ++b) {
      SEQPAR_CHECK(all[3 * a + 1] != all[3 * b + 1] || all[3 * a + 2] != all[3 * b + 2], "NcclCommunicator: ranks ", a,
                   " and ", b, " chose the same CUDA device; NCCL needs one device per rank (with several ranks ",
                   "per GPU, use the MPI backend, which stages device buffers through pinned host memory)");
    }
  }
  bootstrap.broadcast(TensorView(&id, DType::kInt64, {kIdWords}), 0)->wait();

  auto state = std::make_shared<State>();
  state->device = device_ordinal;
  DeviceScope scope(device_ordinal);
  state->create_resources();
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every NCCL call returns at once; readiness is polled with a timeout
  SEQPAR_CHECK_NCCL(ncclCommInitRankConfig(&state->comm, size_, id, rank_, &config));
  state->wait_ready(str_cat("NCCL communicator initialisation over ", size_, " ranks on cuda:", device_ordinal));
  state->read_shape();
  SEQPAR_ASSERT(state->rank == rank_ && state->size == size_, "NCCL rank ", state->rank, "/", state->size,
                " differs from the bootstrap's ", rank_, "/", size_);
  state_ = std::move(state);
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<State> state)
    : state_(std::move(state)), rank_(state_->rank), size_(state_->size), device_ordinal_(state_->device) {}

NcclCommunicator::~NcclCommunicator() = default;

Stream NcclCommunicator::comm_stream() const { return {Device::cuda(device_ordinal_), state_->comm_stream}; }

void NcclCommunicator::set_stream(const Stream& stream) {
  SEQPAR_CHECK(stream.device.is_cpu() || stream.device == Device::cuda(device_ordinal_),
               "NcclCommunicator::set_stream: the stream is on ", stream.device.str(),
               ", but this communicator runs on cuda:", device_ordinal_);
  stream_ = stream;
  state_->compute_stream = stream.device.is_cpu() ? nullptr : static_cast<cudaStream_t>(stream.handle);
}

// ---- point to point -------------------------------------------------------------------------------------------

WorkHandle NcclCommunicator::isend(const TensorView& buffer, int peer, int tag) {
  check_peer(*this, peer, "isend");
  check_on_device(*state_, buffer, "isend");
  WorkHandle w =
      launch(state_, "isend", str_cat("NCCL isend to peer ", peer, " (tag ", tag, ", ", buffer.nbytes(), " bytes)"),
             [&](ncclComm_t comm, cudaStream_t stream) {
               SEQPAR_CHECK_NCCL(ncclSend(buffer.data(), static_cast<std::size_t>(buffer.numel()),
                                          nccl_type(buffer.dtype()), peer, comm, stream));
             });
  counters_.bytes_sent += buffer.nbytes();
  ++counters_.num_ops;
  return w;
}

WorkHandle NcclCommunicator::irecv(const TensorView& buffer, int peer, int tag) {
  check_peer(*this, peer, "irecv");
  check_on_device(*state_, buffer, "irecv");
  WorkHandle w =
      launch(state_, "irecv", str_cat("NCCL irecv from peer ", peer, " (tag ", tag, ", ", buffer.nbytes(), " bytes)"),
             [&](ncclComm_t comm, cudaStream_t stream) {
               SEQPAR_CHECK_NCCL(ncclRecv(buffer.data(), static_cast<std::size_t>(buffer.numel()),
                                          nccl_type(buffer.dtype()), peer, comm, stream));
             });
  counters_.bytes_received += buffer.nbytes();
  ++counters_.num_ops;
  return w;
}

WorkHandle NcclCommunicator::batch_isend_irecv(const std::vector<P2POp>& ops) {
  std::string peers;
  std::int64_t sent = 0, received = 0;
  for (const P2POp& op : ops) {
    check_peer(*this, op.peer, "batch_isend_irecv");
    check_on_device(*state_, op.buffer, "batch_isend_irecv");
    const bool recv = op.kind == P2POp::Kind::kRecv;
    peers += str_cat(peers.empty() ? "" : ", ", recv ? "recv from " : "send to ", op.peer);
    (recv ? received : sent) += static_cast<std::int64_t>(op.buffer.nbytes());
  }
  // One group, in posting order: NCCL matches the messages of a pair of ranks in that order.
  WorkHandle w = launch(
      state_, "batch_isend_irecv", str_cat("NCCL batch_isend_irecv (", peers, ")"),
      [&](ncclComm_t comm, cudaStream_t stream) {
        run_group([&] {
          for (const P2POp& op : ops) {
            const auto count = static_cast<std::size_t>(op.buffer.numel());
            if (op.kind == P2POp::Kind::kRecv) {
              SEQPAR_CHECK_NCCL(ncclRecv(op.buffer.data(), count, nccl_type(op.buffer.dtype()), op.peer, comm, stream));
            } else {
              SEQPAR_CHECK_NCCL(ncclSend(op.buffer.data(), count, nccl_type(op.buffer.dtype()), op.peer, comm, stream));
            }
          }
        });
      });
  counters_.bytes_sent += sent;
  counters_.bytes_received += received;
  ++counters_.num_ops;
  return w;
}

// ---- collectives ------------------------------------------------------------------------------------------------

WorkHandle NcclCommunicator::all_to_all(const TensorView& send, const TensorView& recv) {
  check_on_device(*state_, send, "all_to_all");
  check_on_device(*state_, recv, "all_to_all");
  SEQPAR_CHECK(send.dtype() == recv.dtype() && send.numel() == recv.numel(), "all_to_all: send ", send.str(),
               " and recv ", recv.str(), " must have the same dtype and element count");
  SEQPAR_CHECK(send.numel() % size_ == 0, "all_to_all: element count ", send.numel(),
               " must be divisible by the communicator size ", size_);
  check_disjoint(send, recv, "all_to_all");
  const std::int64_t block = send.numel() / size_;
  const std::size_t block_bytes = static_cast<std::size_t>(block) * dtype_size(send.dtype());
  WorkHandle w =
      launch(state_, "all_to_all", str_cat("NCCL all_to_all over ", size_, " ranks (", send.nbytes(), " bytes)"),
             [&](ncclComm_t comm, cudaStream_t stream) {
               if (block_bytes > 0) {
                 SEQPAR_CHECK_CUDA(cudaMemcpyAsync(byte_ptr(recv, rank_ * block), byte_ptr(send, rank_ * block),
                                                   block_bytes, cudaMemcpyDeviceToDevice, stream));
               }
               if (block == 0) return;
               run_group([&] {
                 for (int r = 0; r < size_; ++r) {
                   if (r == rank_) continue;
                   SEQPAR_CHECK_NCCL(ncclSend(byte_ptr(send, r * block), static_cast<std::size_t>(block),
                                              nccl_type(send.dtype()), r, comm, stream));
                   SEQPAR_CHECK_NCCL(ncclRecv(byte_ptr(recv, r * block), static_cast<std::size_t>(block),
                                              nccl_type(recv.dtype()), r, comm, stream));
                 }
               });
             });
  const std::int64_t moved = static_cast<std::int64_t>(block_bytes) * (size_ - 1);
  counters_.bytes_sent += moved;
  counters_.bytes_received += moved;
  ++counters_.num_ops;
  return w;
}

WorkHandle NcclCommunicator::all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts,
                                          const TensorView& recv, const std::vector<std::int64_t>& recv_counts) {
  check_on_device(*state_, send, "all_to_all_v");
  check_on_device(*state_, recv, "all_to_all_v");
  SEQPAR_CHECK(send.dtype() == recv.dtype(), "all_to_all_v: send and recv dtypes differ (", dtype_name(send.dtype()),
               " vs ", dtype_name(recv.dtype()), ")");
  SEQPAR_CHECK(static_cast<int>(send_counts.size()) == size_ && static_cast<int>(recv_counts.size()) == size_,
               "all_to_all_v: send_counts and recv_counts need one entry per rank (", size_, "), got ",
               send_counts.size(), " and ", recv_counts.size());
  std::vector<std::int64_t> send_offsets(size_), recv_offsets(size_);
  std::int64_t send_total = 0, recv_total = 0;
  for (int r = 0; r < size_; ++r) {
    SEQPAR_CHECK(send_counts[r] >= 0 && recv_counts[r] >= 0, "all_to_all_v: negative count for rank ", r);
    send_offsets[r] = send_total;
    recv_offsets[r] = recv_total;
    send_total += send_counts[r];
    recv_total += recv_counts[r];
  }
  SEQPAR_CHECK(send_total <= send.numel() && recv_total <= recv.numel(), "all_to_all_v: counts sum to ", send_total,
               " sent / ", recv_total, " received, more than the buffers hold (", send.numel(), " / ", recv.numel(),
               ")");
  SEQPAR_CHECK(send_counts[rank_] == recv_counts[rank_], "all_to_all_v: rank ", rank_, " sends ", send_counts[rank_],
               " elements to itself but expects to receive ", recv_counts[rank_]);
  check_disjoint(send, recv, "all_to_all_v");
  const std::size_t esize = dtype_size(send.dtype());
  WorkHandle w = launch(
      state_, "all_to_all_v", str_cat("NCCL all_to_all_v over ", size_, " ranks"),
      [&](ncclComm_t comm, cudaStream_t stream) {
        if (send_counts[rank_] > 0) {
          SEQPAR_CHECK_CUDA(cudaMemcpyAsync(byte_ptr(recv, recv_offsets[rank_]), byte_ptr(send, send_offsets[rank_]),
                                            static_cast<std::size_t>(send_counts[rank_]) * esize,
                                            cudaMemcpyDeviceToDevice, stream));
        }
        run_group([&] {
          // Zero counts are skipped on both sides (the counts of a pair agree).
          for (int r = 0; r < size_; ++r) {
            if (r == rank_) continue;
            if (send_counts[r] > 0) {
              SEQPAR_CHECK_NCCL(ncclSend(byte_ptr(send, send_offsets[r]), static_cast<std::size_t>(send_counts[r]),
                                         nccl_type(send.dtype()), r, comm, stream));
            }
            if (recv_counts[r] > 0) {
              SEQPAR_CHECK_NCCL(ncclRecv(byte_ptr(recv, recv_offsets[r]), static_cast<std::size_t>(recv_counts[r]),
                                         nccl_type(recv.dtype()), r, comm, stream));
            }
          }
        });
      });
  counters_.bytes_sent += (send_total - send_counts[rank_]) * static_cast<std::int64_t>(esize);
  counters_.bytes_received += (recv_total - recv_counts[rank_]) * static_cast<std::int64_t>(esize);
  ++counters_.num_ops;
  return w;
}

WorkHandle NcclCommunicator::all_gather(const TensorView& send, const TensorView& recv) {
  check_on_device(*state_, send, "all_gather");
  check_on_device(*state_, recv, "all_gather");
  SEQPAR_CHECK(send.dtype() == recv.dtype() && recv.numel() == send.numel() * size_, "all_gather: recv ", recv.str(),
               " must hold size (", size_, ") x send ", send.str());
  check_disjoint(send, recv, "all_gather");
  WorkHandle w =
      launch(state_, "all_gather", str_cat("NCCL all_gather over ", size_, " ranks (", send.nbytes(), " bytes each)"),
             [&](ncclComm_t comm, cudaStream_t stream) {
               SEQPAR_CHECK_NCCL(ncclAllGather(send.data(), recv.data(), static_cast<std::size_t>(send.numel()),
                                               nccl_type(send.dtype()), comm, stream));
             });
  counters_.bytes_sent += static_cast<std::int64_t>(send.nbytes()) * (size_ - 1);
  counters_.bytes_received += static_cast<std::int64_t>(send.nbytes()) * (size_ - 1);
  ++counters_.num_ops;
  return w;
}

WorkHandle NcclCommunicator::reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) {
  check_on_device(*state_, send, "reduce_scatter");
  check_on_device(*state_, recv, "reduce_scatter");
  SEQPAR_CHECK(send.dtype() == recv.dtype() && send.numel() == recv.numel() * size_, "reduce_scatter: send ",
               send.str(), " must hold size (", size_, ") x recv ", recv.str());
  check_disjoint(send, recv, "reduce_scatter");
  WorkHandle w =
      launch(state_, "reduce_scatter", str_cat("NCCL reduce_scatter(", reduce_op_name(op), ") over ", size_, " ranks"),
             [&](ncclComm_t comm, cudaStream_t stream) {
               SEQPAR_CHECK_NCCL(ncclReduceScatter(send.data(), recv.data(), static_cast<std::size_t>(recv.numel()),
                                                   nccl_type(send.dtype()), nccl_op(op), comm, stream));
             });
  counters_.bytes_sent += static_cast<std::int64_t>(recv.nbytes()) * (size_ - 1);
  counters_.bytes_received += static_cast<std::int64_t>(recv.nbytes()) * (size_ - 1);
  ++counters_.num_ops;
  return w;
}

WorkHandle NcclCommunicator::all_reduce(const TensorView& buffer, ReduceOp op) {
  check_on_device(*state_, buffer, "all_reduce");
  WorkHandle w =
      launch(state_, "all_reduce", str_cat("NCCL all_reduce(", reduce_op_name(op), ") over ", size_, " ranks"),
             [&](ncclComm_t comm, cudaStream_t stream) {
               SEQPAR_CHECK_NCCL(ncclAllReduce(buffer.data(), buffer.data(), static_cast<std::size_t>(buffer.numel()),
                                               nccl_type(buffer.dtype()), nccl_op(op), comm, stream));
             });
  // Counted as a ring all-reduce would move it: 2 (P-1)/P of the buffer each way.
  const std::int64_t moved = size_ > 1 ? 2 * static_cast<std::int64_t>(buffer.nbytes()) * (size_ - 1) / size_ : 0;
  counters_.bytes_sent += moved;
  counters_.bytes_received += moved;
  ++counters_.num_ops;
  return w;
}

WorkHandle NcclCommunicator::broadcast(const TensorView& buffer, int root) {
  check_peer(*this, root, "broadcast");
  check_on_device(*state_, buffer, "broadcast");
  WorkHandle w =
      launch(state_, "broadcast", str_cat("NCCL broadcast from root ", root, " over ", size_, " ranks"),
             [&](ncclComm_t comm, cudaStream_t stream) {
               SEQPAR_CHECK_NCCL(ncclBroadcast(buffer.data(), buffer.data(), static_cast<std::size_t>(buffer.numel()),
                                               nccl_type(buffer.dtype()), root, comm, stream));
             });
  if (rank_ == root) {
    counters_.bytes_sent += static_cast<std::int64_t>(buffer.nbytes()) * (size_ - 1);
  } else {
    counters_.bytes_received += buffer.nbytes();
  }
  ++counters_.num_ops;
  return w;
}

WorkHandle NcclCommunicator::barrier() {
  std::int32_t* flag = state_->barrier_buffer;
  WorkHandle w = launch(state_, "barrier", str_cat("NCCL barrier over ", size_, " ranks"),
                        [&](ncclComm_t comm, cudaStream_t stream) {
                          SEQPAR_CHECK_NCCL(ncclAllReduce(flag, flag, 1, ncclInt32, ncclSum, comm, stream));
                        });
  ++counters_.num_ops;
  return w;
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
  state_->check_usable("split");
  DeviceScope scope(device_ordinal_);
  const std::string what = str_cat("NCCL split (color ", color, ", key ", key, ") over ", size_, " ranks");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t child = nullptr;
  SEQPAR_CHECK_NCCL(ncclCommSplit(state_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config));
  try {
    state_->wait_ready(what);
  } catch (...) {
    if (child != nullptr) ncclCommAbort(child);  // the parent failed: the half-made child goes too
    throw;
  }
  if (child == nullptr) return nullptr;
  auto state = std::make_shared<State>();
  state->device = device_ordinal_;
  state->comm = child;  // owned from here: the State's destructor releases it if anything below fails
  state->wait_ready(str_cat(what, ": the new communicator"));
  state->create_resources();
  state->read_shape();
  auto out = std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(state)));
  out->set_stream(stream_);
  return out;
}

#endif  // SEQPAR_WITH_NCCL

}  // namespace seqpar
