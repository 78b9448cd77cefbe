#include "runtime/nccl_comm.h"

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>

#include "runtime/cuda_check.h"

#if defined(SEQPAR_WITH_NCCL)
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include "runtime/cuda_staging.h"
#include "runtime/env.h"
#include "runtime/logging.h"
#include "runtime/tensor_ops.h"
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
void NcclCommunicator::check_buffer(const TensorView&, const std::string&) const { not_built("check_buffer"); }
void NcclCommunicator::do_set_stream(const Stream&) { not_built("set_stream"); }

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

}  // namespace

// ---- shared state ---------------------------------------------------------------------------------------------

struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  int device = 0;
  int rank = 0;
  int size = 1;
  std::vector<int> world_ranks;            // world rank of every rank of this communicator
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

  void check_usable(const std::string& op) const {
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
    double waited = 0;
    if (poll_until([this] { return test(); }, timeout_s, description_, waited)) return;
    fail(str_cat(description_, " did not complete within ", timeout_s, " s (waited ", waited,
                 " s): a peer has failed, is stuck, or posted a mismatched operation"));
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
WorkHandle launch(const std::shared_ptr<State>& state, std::string description,
                  const std::function<void(ncclComm_t, cudaStream_t)>& enqueue) {
  state->check_usable(description);
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

}  // namespace

bool nccl_backend_built() { return true; }

// ---- construction -------------------------------------------------------------------------------------------

NcclCommunicator::NcclCommunicator(Communicator& bootstrap, int device_ordinal) {
  const int my_rank = bootstrap.rank(), num_ranks = bootstrap.size();
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
      problem = str_cat("the NCCL backend needs one CUDA device per rank, and this rank has none (",
                        cuda_unavailable_reason(), ")");
    } else if (device_ordinal < 0 || device_ordinal >= count) {
      problem = str_cat("device ordinal ", device_ordinal, " is outside the ", count, " visible CUDA device(s)");
    } else {
      cudaDeviceProp prop{};
      SEQPAR_CHECK_CUDA(cudaGetDeviceProperties(&prop, device_ordinal));
      std::memcpy(&mine[1], prop.uuid.bytes, 16);
      if (my_rank == 0) SEQPAR_CHECK_NCCL(ncclGetUniqueId(&id));
    }
  } catch (const Error& e) {
    problem = e.message();
  }
  mine[0] = problem.empty() ? 0 : 1;
  std::vector<std::int64_t> all(3 * static_cast<std::size_t>(num_ranks));
  bootstrap.all_gather(TensorView(mine, DType::kInt64, {3}), TensorView(all.data(), DType::kInt64, {3 * num_ranks}))
      ->wait();
  SEQPAR_CHECK(problem.empty(), "NcclCommunicator", cuda_device_count() > 0 ? str_cat(" on cuda:", device_ordinal) : "",
               ": ", problem);
  std::string failed;
  for (int r = 0; r < num_ranks; ++r) {
    if (all[3 * r] != 0) failed += str_cat(failed.empty() ? "" : ", ", r);
  }
  SEQPAR_CHECK(failed.empty(), "NcclCommunicator: rank(s) ", failed, " of the bootstrap communicator have no usable ",
               "CUDA device (each prints why)");
  for (int a = 0; a < num_ranks; ++a) {
    for (int b = a + 1; b < num_ranks; ++b) {
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
  SEQPAR_CHECK_NCCL(ncclCommInitRankConfig(&state->comm, num_ranks, id, my_rank, &config));
  state->wait_ready(str_cat("NCCL communicator initialisation over ", num_ranks, " ranks on cuda:", device_ordinal));
  state->read_shape();
  SEQPAR_ASSERT(state->rank == my_rank && state->size == num_ranks, "NCCL rank ", state->rank, "/", state->size,
                " differs from the bootstrap's ", my_rank, "/", num_ranks);
  state->world_ranks = bootstrap.world_ranks();
  state_ = std::move(state);
  set_group(my_rank, num_ranks, state_->world_ranks, Device::cuda(device_ordinal));
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<State> state) : state_(std::move(state)) {
  set_group(state_->rank, state_->size, state_->world_ranks, Device::cuda(state_->device));
}

NcclCommunicator::~NcclCommunicator() = default;

Stream NcclCommunicator::comm_stream() const { return {device(), state_->comm_stream}; }

void NcclCommunicator::check_buffer(const TensorView& t, const std::string& op) const {
  SEQPAR_CHECK(t.device() == device(), op, ": the NCCL backend takes buffers on ", device().str(),
               " (this rank's device); got ", t.str());
}

void NcclCommunicator::do_set_stream(const Stream& stream) {
  SEQPAR_CHECK(stream.device.is_cpu() || stream.device == device(), name(), ": set_stream: the stream is on ",
               stream.device.str(), ", but this communicator runs on ", device().str());
  state_->compute_stream = stream.device.is_cpu() ? nullptr : static_cast<cudaStream_t>(stream.handle);
}

// ---- point to point -------------------------------------------------------------------------------------------
// Arguments were checked by the front-end (runtime/comm.cc); `what` names the operation in errors.

WorkHandle NcclCommunicator::do_isend(const TensorView& buffer, int peer, int, std::string what) {
  return launch(state_, std::move(what), [&](ncclComm_t comm, cudaStream_t stream) {
    SEQPAR_CHECK_NCCL(ncclSend(buffer.data(), static_cast<std::size_t>(buffer.numel()), nccl_type(buffer.dtype()), peer,
                               comm, stream));
  });
}

WorkHandle NcclCommunicator::do_irecv(const TensorView& buffer, int peer, int, std::string what) {
  return launch(state_, std::move(what), [&](ncclComm_t comm, cudaStream_t stream) {
    SEQPAR_CHECK_NCCL(ncclRecv(buffer.data(), static_cast<std::size_t>(buffer.numel()), nccl_type(buffer.dtype()), peer,
                               comm, stream));
  });
}

WorkHandle NcclCommunicator::do_batch_isend_irecv(const std::vector<P2POp>& ops, std::string what) {
  // One group, in posting order: NCCL matches the messages of a pair of ranks in that order.
  return launch(state_, std::move(what), [&](ncclComm_t comm, cudaStream_t stream) {
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
}

// ---- collectives ------------------------------------------------------------------------------------------------

WorkHandle NcclCommunicator::do_all_to_all(const TensorView& send, const TensorView& recv, std::string what) {
  const int p = size(), me = rank();
  const std::int64_t block = send.numel() / p;
  const std::size_t block_bytes = static_cast<std::size_t>(block) * dtype_size(send.dtype());
  return launch(state_, std::move(what), [&](ncclComm_t comm, cudaStream_t stream) {
    if (block_bytes > 0) {
      SEQPAR_CHECK_CUDA(cudaMemcpyAsync(byte_ptr(recv, me * block), byte_ptr(send, me * block), block_bytes,
                                        cudaMemcpyDeviceToDevice, stream));
    }
    if (block == 0) return;
    run_group([&] {
      for (int r = 0; r < p; ++r) {
        if (r == me) continue;
        SEQPAR_CHECK_NCCL(ncclSend(byte_ptr(send, r * block), static_cast<std::size_t>(block), nccl_type(send.dtype()),
                                   r, comm, stream));
        SEQPAR_CHECK_NCCL(ncclRecv(byte_ptr(recv, r * block), static_cast<std::size_t>(block), nccl_type(recv.dtype()),
                                   r, comm, stream));
      }
    });
  });
}

WorkHandle NcclCommunicator::do_all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts,
                                             const TensorView& recv, const std::vector<std::int64_t>& recv_counts,
                                             std::string what) {
  const int p = size(), me = rank();
  std::vector<std::int64_t> send_offsets(p), recv_offsets(p);
  std::int64_t send_total = 0, recv_total = 0;
  for (int r = 0; r < p; ++r) {
    send_offsets[r] = send_total;
    recv_offsets[r] = recv_total;
    send_total += send_counts[r];
    recv_total += recv_counts[r];
  }
  const std::size_t esize = dtype_size(send.dtype());
  return launch(state_, std::move(what), [&](ncclComm_t comm, cudaStream_t stream) {
    if (send_counts[me] > 0) {
      SEQPAR_CHECK_CUDA(cudaMemcpyAsync(byte_ptr(recv, recv_offsets[me]), byte_ptr(send, send_offsets[me]),
                                        static_cast<std::size_t>(send_counts[me]) * esize, cudaMemcpyDeviceToDevice,
                                        stream));
    }
    run_group([&] {
      // Zero counts are skipped on both sides (the counts of a pair agree).
      for (int r = 0; r < p; ++r) {
        if (r == me) continue;
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
}

WorkHandle NcclCommunicator::do_all_gather(const TensorView& send, const TensorView& recv, std::string what) {
  return launch(state_, std::move(what), [&](ncclComm_t comm, cudaStream_t stream) {
    SEQPAR_CHECK_NCCL(ncclAllGather(send.data(), recv.data(), static_cast<std::size_t>(send.numel()),
                                    nccl_type(send.dtype()), comm, stream));
  });
}

WorkHandle NcclCommunicator::do_reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op,
                                               std::string what) {
  return launch(state_, std::move(what), [&](ncclComm_t comm, cudaStream_t stream) {
    SEQPAR_CHECK_NCCL(ncclReduceScatter(send.data(), recv.data(), static_cast<std::size_t>(recv.numel()),
                                        nccl_type(send.dtype()), nccl_op(op), comm, stream));
  });
}

WorkHandle NcclCommunicator::do_all_reduce(const TensorView& buffer, ReduceOp op, std::string what) {
  return launch(state_, std::move(what), [&](ncclComm_t comm, cudaStream_t stream) {
    SEQPAR_CHECK_NCCL(ncclAllReduce(buffer.data(), buffer.data(), static_cast<std::size_t>(buffer.numel()),
                                    nccl_type(buffer.dtype()), nccl_op(op), comm, stream));
  });
}

WorkHandle NcclCommunicator::do_broadcast(const TensorView& buffer, int root, std::string what) {
  return launch(state_, std::move(what), [&](ncclComm_t comm, cudaStream_t stream) {
    SEQPAR_CHECK_NCCL(ncclBroadcast(buffer.data(), buffer.data(), static_cast<std::size_t>(buffer.numel()),
                                    nccl_type(buffer.dtype()), root, comm, stream));
  });
}

WorkHandle NcclCommunicator::do_barrier(std::string what) {
  std::int32_t* flag = state_->barrier_buffer;
  return launch(state_, std::move(what), [&](ncclComm_t comm, cudaStream_t stream) {
    SEQPAR_CHECK_NCCL(ncclAllReduce(flag, flag, 1, ncclInt32, ncclSum, comm, stream));
  });
}

std::unique_ptr<Communicator> NcclCommunicator::do_split(int color, int key, std::string what) {
  state_->check_usable(what);
  // Every rank's (color, key), gathered on the device (not counted: split moves no payload), gives the child's
  // world ranks in the order ncclCommSplit uses: (key, parent rank).
  const int p = size();
  Tensor host = Tensor::empty({2 + 2 * static_cast<std::int64_t>(p)}, DType::kInt32, MemCategory::kCommBuffer);
  host.data_as<std::int32_t>()[0] = color;
  host.data_as<std::int32_t>()[1] = key;
  Tensor dev = Tensor::empty(host.shape(), DType::kInt32, MemCategory::kCommBuffer, device());
  copy_convert(host, dev);
  do_all_gather(dev.view().slice0(0, 2), dev.view().slice0(2, 2 + 2 * p), str_cat(what, ": gathering colors and keys"))
      ->wait();
  copy_convert(dev, host);
  const std::vector<std::int32_t> table(host.data_as<std::int32_t>() + 2, host.data_as<std::int32_t>() + 2 + 2 * p);

  DeviceScope scope(device_ordinal());
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
  state->device = device_ordinal();
  state->comm = child;  // owned from here: the State's destructor releases it if anything below fails
  state->wait_ready(str_cat(what, ": the new communicator"));
  state->create_resources();
  state->read_shape();
  state->world_ranks = split_world_ranks(table, color);
  SEQPAR_ASSERT(static_cast<int>(state->world_ranks.size()) == state->size, "NCCL split gave ", state->size,
                " ranks, the (color, key) table ", state->world_ranks.size());
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(state)));
}

#endif  // SEQPAR_WITH_NCCL

}  // namespace seqpar
