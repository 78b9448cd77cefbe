#include "runtime/mpi_comm.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <thread>

#include "runtime/cuda_staging.h"
#include "runtime/fault.h"
#include "runtime/logging.h"

namespace seqpar {
#if !defined(SEQPAR_WITH_CUDA)
class DeviceStaging;  // CUDA builds only (runtime/cuda_staging.h); never instantiated here
#endif
namespace {

// ---- datatypes and reduction operators ------------------------------------------------------------------

MPI_Datatype g_bf16_type = MPI_DATATYPE_NULL;
MPI_Datatype g_fp16_type = MPI_DATATYPE_NULL;
MPI_Op g_half_sum = MPI_OP_NULL;
MPI_Op g_half_max = MPI_OP_NULL;

template <typename H, bool kMax>
void half_reduce(const void* in, void* inout, int count) {
  const H* a = static_cast<const H*>(in);
  H* b = static_cast<H*>(inout);
  for (int i = 0; i < count; ++i) {
    const float x = static_cast<float>(a[i]);
    const float y = static_cast<float>(b[i]);
    b[i] = H(kMax ? (x > y || x != x ? x : y) : x + y);
  }
}

template <bool kMax>
void half_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  if (*type == g_bf16_type) {
    half_reduce<bf16, kMax>(in, inout, *len);
  } else {
    half_reduce<fp16, kMax>(in, inout, *len);
  }
}

void init_types() {
  SEQPAR_CHECK_MPI(MPI_Type_contiguous(1, MPI_UINT16_T, &g_bf16_type));
  SEQPAR_CHECK_MPI(MPI_Type_commit(&g_bf16_type));
  SEQPAR_CHECK_MPI(MPI_Type_contiguous(1, MPI_UINT16_T, &g_fp16_type));
  SEQPAR_CHECK_MPI(MPI_Type_commit(&g_fp16_type));
  SEQPAR_CHECK_MPI(MPI_Op_create(&half_op<false>, 1, &g_half_sum));
  SEQPAR_CHECK_MPI(MPI_Op_create(&half_op<true>, 1, &g_half_max));
}

void free_types() {
  if (g_half_sum != MPI_OP_NULL) MPI_Op_free(&g_half_sum);
  if (g_half_max != MPI_OP_NULL) MPI_Op_free(&g_half_max);
  if (g_bf16_type != MPI_DATATYPE_NULL) MPI_Type_free(&g_bf16_type);
  if (g_fp16_type != MPI_DATATYPE_NULL) MPI_Type_free(&g_fp16_type);
}

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kBFloat16: return g_bf16_type;
    case DType::kFloat16: return g_fp16_type;
    case DType::kInt32: return MPI_INT32_T;
    case DType::kInt64: return MPI_INT64_T;
  }
  SEQPAR_THROW("no MPI datatype for dtype ", static_cast<int>(dtype));
}

MPI_Op mpi_op(ReduceOp op, DType dtype) {
  const bool half = dtype == DType::kBFloat16 || dtype == DType::kFloat16;
  if (op == ReduceOp::kSum) return half ? g_half_sum : MPI_SUM;
  return half ? g_half_max : MPI_MAX;
}

int to_int_count(std::int64_t count, const char* op) {
  SEQPAR_CHECK(count >= 0 && count <= INT_MAX, op, ": element count ", count,
               " exceeds the MPI backend's limit of INT_MAX per message");
  return static_cast<int>(count);
}

// Host buffers always; in CUDA builds also device buffers, which are staged through pinned host memory
// (runtime/cuda_staging.h).
void check_buffer(const TensorView& t, const char* op) {
#if defined(SEQPAR_WITH_CUDA)
  check_device_buffer(t, op);
#else
  SEQPAR_CHECK(t.device().is_cpu(), op, ": the MPI backend takes host buffers; got ", t.str());
#endif
}

// The host view an MPI call uses: `t` itself for a host buffer (zero copy); for a device buffer (CUDA builds), a
// pinned mirror, filled from the device when the operation reads it (`read`) and copied back when its work
// completes (`write`). Called after every argument check, right before the MPI call.
TensorView host_view(const TensorView& t, bool read, bool write, const Stream& stream,
                     std::shared_ptr<DeviceStaging>& staging) {
  if (t.device().is_cpu()) return t;
#if defined(SEQPAR_WITH_CUDA)
  if (!staging) staging = std::make_shared<DeviceStaging>();
  return staging->stage(t, read, write, stream);
#else
  SEQPAR_ASSERT(false, "device buffer ", t.str(), " passed check_buffer in a build without CUDA");
#endif
}

// ---- work handle --------------------------------------------------------------------------------------

enum class ReqKind : std::uint8_t { kSend, kRecv, kCollective };

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return str_cat("MPI error code ", code);
  return std::string(text, static_cast<std::size_t>(len));
}

// MPI tags must lie in [0, MPI_TAG_UB]; checked here so that the error names the value and the rule.
void check_tag(int tag, int tag_ub, const char* op) {
  SEQPAR_CHECK(0 <= tag && tag <= tag_ub, op, ": tag ", tag, " must be in [0, ", tag_ub, "] (MPI_TAG_UB of this MPI)");
}

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

class MpiWork final : public Work {
 public:
  MpiWork(std::string description, std::vector<MPI_Request> requests, std::vector<ReqKind> kinds,
          std::shared_ptr<DeviceStaging> staging = nullptr)
      : description_(std::move(description)),
        requests_(std::move(requests)),
        kinds_(std::move(kinds)),
        staging_(std::move(staging)) {}
  ~MpiWork() override {
    if (done_ || !failure_.empty() || mpi_finalized()) return;
    int flag = 0;
    MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE);
    if (flag) {
      try {
        finish_staging();  // completed but never waited for: device buffers still get their data
      } catch (...) {      // a destructor never throws
      }
      return;
    }
    try {
      SEQPAR_LOG(kWarn) << description_ << " was destroyed before it completed: its receives are cancelled, and "
                        << "its buffers must stay untouched until the peers have finished";
    } catch (...) {  // a malformed SEQPAR_LOG_LEVEL must not terminate the program from a destructor
    }
    abandon();
  }

  // Keeps count / displacement arrays alive for v-collectives until completion.
  std::vector<int> arrays;

  bool test() override {
    if (!failure_.empty()) SEQPAR_THROW(failure_);
    if (done_) return true;
    int flag = 0;
    statuses_.resize(requests_.size());
    const int rc = MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, statuses_.data());
    if (rc != MPI_SUCCESS) {
      // Name the operation and MPI's own error (a truncated receive is how a peer's mismatched count or dtype
      // shows up), not MPI_ERR_IN_STATUS; later wait() / test() calls throw the same error.
      int code = rc;
      if (rc == MPI_ERR_IN_STATUS) {
        for (const MPI_Status& st : statuses_) {
          if (st.MPI_ERROR != MPI_SUCCESS && st.MPI_ERROR != MPI_ERR_PENDING) {
            code = st.MPI_ERROR;
            break;
          }
        }
      }
      int error_class = code;
      MPI_Error_class(code, &error_class);
      abandon();
      failure_ = str_cat(description_, " failed: ", mpi_error_text(code),
                         error_class == MPI_ERR_TRUNCATE
                             ? " (a peer posted a mismatched operation: a different element count, dtype or "
                               "collective)"
                             : "");
      SEQPAR_THROW(failure_);
    }
    if (flag != 0) {
      try {
        finish_staging();
      } catch (const Error& e) {
        failure_ = str_cat(description_, " completed, but copying its data back to the device failed: ", e.message());
        done_ = true;
        SEQPAR_THROW(failure_);
      }
    }
    done_ = flag != 0;
    return done_;
  }

  void wait(double timeout_s) override {
    SEQPAR_CHECK(std::isfinite(timeout_s) && timeout_s >= 0, description_, ": wait timeout ", timeout_s,
                 " s must be finite and >= 0");
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    for (long polls = 0; !test(); ++polls) {
      const double elapsed = std::chrono::duration<double>(clock::now() - start).count();
      if (elapsed > timeout_s) {
        const bool collective = std::find(kinds_.begin(), kinds_.end(), ReqKind::kCollective) != kinds_.end();
        abandon();
        failure_ = str_cat(description_, " did not complete within ", timeout_s, " s (waited ", elapsed,
                           " s): a peer has failed, is stuck, or posted a mismatched operation",
                           collective ? "; this communicator cannot run further collectives" : "");
        SEQPAR_THROW(failure_);
      }
      // Spin briefly for latency, then back off so that oversubscribed ranks let their peers run.
      if (polls > 2000) {
        std::this_thread::sleep_for(std::chrono::microseconds(polls > 20000 ? 200 : 20));
      } else if (polls > 200) {
        std::this_thread::yield();
      }
    }
  }

 private:
  // Releases every pending request. Receives are cancelled (so that a later message is not swallowed by them);
  // sends are released and complete in the background; a nonblocking collective can be neither cancelled nor
  // freed (MPI forbids both), so it is left pending.
  void abandon() {
    for (std::size_t i = 0; i < requests_.size(); ++i) {
      MPI_Request& req = requests_[i];
      if (req == MPI_REQUEST_NULL) continue;
      const ReqKind kind = i < kinds_.size() ? kinds_[i] : ReqKind::kCollective;
      if (kind == ReqKind::kRecv) {
        MPI_Cancel(&req);
        // The cancel completes at once unless the message is already arriving; never wait for long.
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
        int flag = 0;
        while (!flag && std::chrono::steady_clock::now() < deadline) {
          if (MPI_Test(&req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
          if (!flag) std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        if (!flag && req != MPI_REQUEST_NULL) MPI_Request_free(&req);
      } else if (kind == ReqKind::kSend) {
        MPI_Request_free(&req);
      }
    }
#if defined(SEQPAR_WITH_CUDA)
    if (staging_) staging_->abandon();
#endif
    done_ = true;
  }

  // Copies staged receive buffers back to their devices (CUDA builds; nothing for host buffers).
  void finish_staging() {
#if defined(SEQPAR_WITH_CUDA)
    if (staging_) staging_->finish();
#endif
  }

  std::string description_;
  std::vector<MPI_Request> requests_;
  std::vector<ReqKind> kinds_;
  bool done_ = false;
  std::vector<MPI_Status> statuses_;        // of the last MPI_Testall
  std::string failure_;                     // set once wait() timed out; later wait() / test() calls throw it again
  std::shared_ptr<DeviceStaging> staging_;  // pinned mirrors of device buffers, if any
};

WorkHandle make_work(std::string description, MPI_Request request, ReqKind kind,
                     std::shared_ptr<DeviceStaging> staging = nullptr) {
  return std::make_unique<MpiWork>(std::move(description), std::vector<MPI_Request>{request},
                                   std::vector<ReqKind>{kind}, std::move(staging));
}

// MPI forbids overlapping send and receive buffers in a collective (outside MPI_IN_PLACE).
void check_disjoint(const TensorView& send, const TensorView& recv, const char* op) {
  if (send.nbytes() == 0 || recv.nbytes() == 0) return;
  const char* s = static_cast<const char*>(send.data());
  const char* r = static_cast<const char*>(recv.data());
  SEQPAR_CHECK(s + send.nbytes() <= r || r + recv.nbytes() <= s, op, ": send ", send.str(), " and recv ", recv.str(),
               " overlap; they must be distinct buffers");
}

// A duplicate of MPI_COMM_WORLD used only by run_mpi_main's error path.
MPI_Comm g_error_comm = MPI_COMM_NULL;
bool g_session_initialized_mpi = false;

}  // namespace

// ---- session ----------------------------------------------------------------------------------------------

MpiSession::MpiSession(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
      throw Error("MPI_Init_thread failed");
    }
    g_session_initialized_mpi = true;
    SEQPAR_CHECK(provided >= MPI_THREAD_FUNNELED, "MPI provides thread level ", provided,
                 ", seqpar needs MPI_THREAD_FUNNELED");
  }
  SEQPAR_CHECK_MPI(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  int rank = 0;
  SEQPAR_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  set_process_rank(rank);
  if (g_bf16_type == MPI_DATATYPE_NULL) init_types();
  if (g_error_comm == MPI_COMM_NULL) SEQPAR_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &g_error_comm));
  // Read the environment knobs now, so that a malformed value stops every rank here, before any message is sent
  // (they used to be read at the first wait or the first log line, with operations already posted).
  env::log_level();
  env::comm_timeout_s();
  fault::plan();
}

MpiSession::~MpiSession() {
  if (mpi_finalized()) return;
  if (g_error_comm != MPI_COMM_NULL) MPI_Comm_free(&g_error_comm);
  free_types();
  // Finalises only what this session initialised; a caller that initialised MPI itself also finalises it.
  if (g_session_initialized_mpi) MPI_Finalize();
}

// ---- communicator -----------------------------------------------------------------------------------------

MpiCommunicator::MpiCommunicator(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
  SEQPAR_CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  SEQPAR_CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
  SEQPAR_CHECK_MPI(MPI_Comm_size(comm_, &size_));
  int* tag_ub = nullptr;
  int has_tag_ub = 0;
  // MPI_TAG_UB is a predefined attribute of MPI_COMM_WORLD (the bound holds for every communicator).
  SEQPAR_CHECK_MPI(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &has_tag_ub));
  if (has_tag_ub && tag_ub) tag_ub_ = *tag_ub;
}

MpiCommunicator::~MpiCommunicator() {
  if (owned_ && comm_ != MPI_COMM_NULL) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::world() {
  MPI_Comm dup = MPI_COMM_NULL;
  SEQPAR_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &dup));
  return std::make_unique<MpiCommunicator>(dup, true);
}

WorkHandle MpiCommunicator::isend(const TensorView& buffer, int peer, int tag) {
  check_peer(*this, peer, "isend");
  check_tag(tag, tag_ub_, "isend");
  check_buffer(buffer, "isend");
  const int count = to_int_count(buffer.numel(), "isend");
  std::shared_ptr<DeviceStaging> staging;
  const TensorView host = host_view(buffer, true, false, stream_, staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Isend(host.data(), count, mpi_type(buffer.dtype()), peer, tag, comm_, &req));
  counters_.bytes_sent += buffer.nbytes();
  ++counters_.num_ops;
  return make_work(str_cat("MPI isend to peer ", peer, " (tag ", tag, ", ", buffer.nbytes(), " bytes)"), req,
                   ReqKind::kSend, std::move(staging));
}

WorkHandle MpiCommunicator::irecv(const TensorView& buffer, int peer, int tag) {
  check_peer(*this, peer, "irecv");
  check_tag(tag, tag_ub_, "irecv");
  check_buffer(buffer, "irecv");
  const int count = to_int_count(buffer.numel(), "irecv");
  std::shared_ptr<DeviceStaging> staging;
  const TensorView host = host_view(buffer, false, true, stream_, staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Irecv(host.data(), count, mpi_type(buffer.dtype()), peer, tag, comm_, &req));
  counters_.bytes_received += buffer.nbytes();
  ++counters_.num_ops;
  return make_work(str_cat("MPI irecv from peer ", peer, " (tag ", tag, ", ", buffer.nbytes(), " bytes)"), req,
                   ReqKind::kRecv, std::move(staging));
}

WorkHandle MpiCommunicator::batch_isend_irecv(const std::vector<P2POp>& ops) {
  for (const P2POp& op : ops) {
    check_peer(*this, op.peer, "batch_isend_irecv");
    check_tag(op.tag, tag_ub_, "batch_isend_irecv");
    check_buffer(op.buffer, "batch_isend_irecv");
    to_int_count(op.buffer.numel(), "batch_isend_irecv");
  }
  std::shared_ptr<DeviceStaging> staging;
  std::vector<TensorView> hosts;
  hosts.reserve(ops.size());
  for (const P2POp& op : ops) {
    const bool recv = op.kind == P2POp::Kind::kRecv;
    hosts.push_back(host_view(op.buffer, !recv, recv, stream_, staging));
  }
  std::vector<MPI_Request> reqs(ops.size(), MPI_REQUEST_NULL);
  std::vector<ReqKind> kinds(ops.size(), ReqKind::kSend);
  std::string peers;
  // Receives first, so that every matching send finds its receive already posted.
  for (int pass = 0; pass < 2; ++pass) {
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const P2POp& op = ops[i];
      const bool recv = op.kind == P2POp::Kind::kRecv;
      if (recv != (pass == 0)) continue;
      const int count = to_int_count(op.buffer.numel(), "batch_isend_irecv");
      if (recv) {
        SEQPAR_CHECK_MPI(
            MPI_Irecv(hosts[i].data(), count, mpi_type(op.buffer.dtype()), op.peer, op.tag, comm_, &reqs[i]));
        counters_.bytes_received += op.buffer.nbytes();
      } else {
        SEQPAR_CHECK_MPI(
            MPI_Isend(hosts[i].data(), count, mpi_type(op.buffer.dtype()), op.peer, op.tag, comm_, &reqs[i]));
        counters_.bytes_sent += op.buffer.nbytes();
      }
      kinds[i] = recv ? ReqKind::kRecv : ReqKind::kSend;
      peers += str_cat(peers.empty() ? "" : ", ", recv ? "recv from " : "send to ", op.peer);
    }
  }
  ++counters_.num_ops;
  return std::make_unique<MpiWork>(str_cat("MPI batch_isend_irecv (", peers, ")"), std::move(reqs), std::move(kinds),
                                   std::move(staging));
}

WorkHandle MpiCommunicator::all_to_all(const TensorView& send, const TensorView& recv) {
  check_buffer(send, "all_to_all");
  check_buffer(recv, "all_to_all");
  SEQPAR_CHECK(send.dtype() == recv.dtype() && send.numel() == recv.numel(), "all_to_all: send ", send.str(),
               " and recv ", recv.str(), " must have the same dtype and element count");
  SEQPAR_CHECK(send.numel() % size_ == 0, "all_to_all: element count ", send.numel(),
               " must be divisible by the communicator size ", size_);
  check_disjoint(send, recv, "all_to_all");
  const int block = to_int_count(send.numel() / size_, "all_to_all");
  std::shared_ptr<DeviceStaging> staging;
  const TensorView hsend = host_view(send, true, false, stream_, staging);
  const TensorView hrecv = host_view(recv, false, true, stream_, staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Ialltoall(hsend.data(), block, mpi_type(send.dtype()), hrecv.data(), block,
                                 mpi_type(recv.dtype()), comm_, &req));
  const std::int64_t moved = static_cast<std::int64_t>(block) * (size_ - 1) * dtype_size(send.dtype());
  counters_.bytes_sent += moved;
  counters_.bytes_received += moved;
  ++counters_.num_ops;
  return make_work(str_cat("MPI all_to_all over ", size_, " ranks (", send.nbytes(), " bytes)"), req,
                   ReqKind::kCollective, std::move(staging));
}

WorkHandle MpiCommunicator::all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts,
                                         const TensorView& recv, const std::vector<std::int64_t>& recv_counts) {
  check_buffer(send, "all_to_all_v");
  check_buffer(recv, "all_to_all_v");
  SEQPAR_CHECK(send.dtype() == recv.dtype(), "all_to_all_v: send and recv dtypes differ (", dtype_name(send.dtype()),
               " vs ", dtype_name(recv.dtype()), ")");
  SEQPAR_CHECK(static_cast<int>(send_counts.size()) == size_ && static_cast<int>(recv_counts.size()) == size_,
               "all_to_all_v: send_counts and recv_counts need one entry per rank (", size_, "), got ",
               send_counts.size(), " and ", recv_counts.size());
  std::vector<int> arrays(4 * size_);
  std::int64_t send_total = 0, recv_total = 0;
  for (int r = 0; r < size_; ++r) {
    SEQPAR_CHECK(send_counts[r] >= 0 && recv_counts[r] >= 0, "all_to_all_v: negative count for rank ", r);
    arrays[r] = to_int_count(send_counts[r], "all_to_all_v");
    arrays[size_ + r] = to_int_count(send_total, "all_to_all_v");
    arrays[2 * size_ + r] = to_int_count(recv_counts[r], "all_to_all_v");
    arrays[3 * size_ + r] = to_int_count(recv_total, "all_to_all_v");
    send_total += send_counts[r];
    recv_total += recv_counts[r];
  }
  SEQPAR_CHECK(send_total <= send.numel() && recv_total <= recv.numel(), "all_to_all_v: counts sum to ", send_total,
               " sent / ", recv_total, " received, more than the buffers hold (", send.numel(), " / ", recv.numel(),
               ")");
  check_disjoint(send, recv, "all_to_all_v");
  std::shared_ptr<DeviceStaging> staging;
  const TensorView hsend = host_view(send, true, false, stream_, staging);
  const TensorView hrecv = host_view(recv, false, true, stream_, staging);
  MPI_Request req;
  int* a = arrays.data();
  SEQPAR_CHECK_MPI(MPI_Ialltoallv(hsend.data(), a, a + size_, mpi_type(send.dtype()), hrecv.data(), a + 2 * size_,
                                  a + 3 * size_, mpi_type(recv.dtype()), comm_, &req));
  const std::size_t esize = dtype_size(send.dtype());
  counters_.bytes_sent += (send_total - send_counts[rank_]) * esize;
  counters_.bytes_received += (recv_total - recv_counts[rank_]) * esize;
  ++counters_.num_ops;
  auto w = std::make_unique<MpiWork>(str_cat("MPI all_to_all_v over ", size_, " ranks"), std::vector<MPI_Request>{req},
                                     std::vector<ReqKind>{ReqKind::kCollective}, std::move(staging));
  w->arrays = std::move(arrays);
  return w;
}

WorkHandle MpiCommunicator::all_gather(const TensorView& send, const TensorView& recv) {
  check_buffer(send, "all_gather");
  check_buffer(recv, "all_gather");
  SEQPAR_CHECK(send.dtype() == recv.dtype() && recv.numel() == send.numel() * size_, "all_gather: recv ", recv.str(),
               " must hold size (", size_, ") x send ", send.str());
  check_disjoint(send, recv, "all_gather");
  const int count = to_int_count(send.numel(), "all_gather");
  std::shared_ptr<DeviceStaging> staging;
  const TensorView hsend = host_view(send, true, false, stream_, staging);
  const TensorView hrecv = host_view(recv, false, true, stream_, staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Iallgather(hsend.data(), count, mpi_type(send.dtype()), hrecv.data(), count,
                                  mpi_type(recv.dtype()), comm_, &req));
  counters_.bytes_sent += static_cast<std::int64_t>(send.nbytes()) * (size_ - 1);
  counters_.bytes_received += static_cast<std::int64_t>(send.nbytes()) * (size_ - 1);
  ++counters_.num_ops;
  return make_work(str_cat("MPI all_gather over ", size_, " ranks (", send.nbytes(), " bytes each)"), req,
                   ReqKind::kCollective, std::move(staging));
}

WorkHandle MpiCommunicator::reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) {
  check_buffer(send, "reduce_scatter");
  check_buffer(recv, "reduce_scatter");
  SEQPAR_CHECK(send.dtype() == recv.dtype() && send.numel() == recv.numel() * size_, "reduce_scatter: send ",
               send.str(), " must hold size (", size_, ") x recv ", recv.str());
  check_disjoint(send, recv, "reduce_scatter");
  const int count = to_int_count(recv.numel(), "reduce_scatter");
  std::shared_ptr<DeviceStaging> staging;
  const TensorView hsend = host_view(send, true, false, stream_, staging);
  const TensorView hrecv = host_view(recv, false, true, stream_, staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Ireduce_scatter_block(hsend.data(), hrecv.data(), count, mpi_type(send.dtype()),
                                             mpi_op(op, send.dtype()), comm_, &req));
  counters_.bytes_sent += static_cast<std::int64_t>(recv.nbytes()) * (size_ - 1);
  counters_.bytes_received += static_cast<std::int64_t>(recv.nbytes()) * (size_ - 1);
  ++counters_.num_ops;
  return make_work(str_cat("MPI reduce_scatter(", reduce_op_name(op), ") over ", size_, " ranks"), req,
                   ReqKind::kCollective, std::move(staging));
}

WorkHandle MpiCommunicator::all_reduce(const TensorView& buffer, ReduceOp op) {
  check_buffer(buffer, "all_reduce");
  const int count = to_int_count(buffer.numel(), "all_reduce");
  std::shared_ptr<DeviceStaging> staging;
  const TensorView host = host_view(buffer, true, true, stream_, staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, host.data(), count, mpi_type(buffer.dtype()),
                                  mpi_op(op, buffer.dtype()), comm_, &req));
  // Counted as a ring all-reduce would move it: 2 (P-1)/P of the buffer each way.
  const std::int64_t moved = size_ > 1 ? 2 * static_cast<std::int64_t>(buffer.nbytes()) * (size_ - 1) / size_ : 0;
  counters_.bytes_sent += moved;
  counters_.bytes_received += moved;
  ++counters_.num_ops;
  return make_work(str_cat("MPI all_reduce(", reduce_op_name(op), ") over ", size_, " ranks"), req,
                   ReqKind::kCollective, std::move(staging));
}

WorkHandle MpiCommunicator::broadcast(const TensorView& buffer, int root) {
  check_peer(*this, root, "broadcast");
  check_buffer(buffer, "broadcast");
  const int count = to_int_count(buffer.numel(), "broadcast");
  std::shared_ptr<DeviceStaging> staging;
  const TensorView host = host_view(buffer, rank_ == root, rank_ != root, stream_, staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Ibcast(host.data(), count, mpi_type(buffer.dtype()), root, comm_, &req));
  if (rank_ == root) {
    counters_.bytes_sent += static_cast<std::int64_t>(buffer.nbytes()) * (size_ - 1);
  } else {
    counters_.bytes_received += buffer.nbytes();
  }
  ++counters_.num_ops;
  return make_work(str_cat("MPI broadcast from root ", root, " over ", size_, " ranks"), req, ReqKind::kCollective,
                   std::move(staging));
}

WorkHandle MpiCommunicator::barrier() {
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Ibarrier(comm_, &req));
  ++counters_.num_ops;
  return make_work(str_cat("MPI barrier over ", size_, " ranks"), req, ReqKind::kCollective);
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  // MPI_Comm_split blocks without a timeout. A timed all-gather of (color, key) first makes a rank that never
  // arrives a timeout error here; once it has completed, every rank is known to be entering the split.
  std::vector<std::int32_t> mine = {color, key};
  std::vector<std::int32_t> all(2 * static_cast<std::size_t>(size_));
  MPI_Request gather_req;
  SEQPAR_CHECK_MPI(MPI_Iallgather(mine.data(), 2, MPI_INT32_T, all.data(), 2, MPI_INT32_T, comm_, &gather_req));
  make_work(str_cat("MPI split (color ", color, ", key ", key, ") over ", size_, " ranks"), gather_req,
            ReqKind::kCollective)
      ->wait();
  MPI_Comm out = MPI_COMM_NULL;
  SEQPAR_CHECK_MPI(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &out));
  if (out == MPI_COMM_NULL) return nullptr;
  auto child = std::make_unique<MpiCommunicator>(out, true);
  child->set_stream(stream_);  // device buffers are staged on the same compute stream
  return child;
}

// ---- main wrapper -----------------------------------------------------------------------------------------

namespace {
constexpr int kAbortGraceMs = 2000;  // how long a failed rank waits for its peers to fail too
}  // namespace

int run_mpi_main(int argc, char** argv, const std::function<int(int, char**)>& body) {
  std::unique_ptr<MpiSession> session;
  try {
    session = std::make_unique<MpiSession>(&argc, &argv);
    const int rc = body(argc, argv);
    return rc;
  } catch (const std::exception& e) {
    const Error* error = dynamic_cast<const Error*>(&e);
    const std::string message = error ? error->message() : std::string(e.what());
    const int rank = process_rank();
    const std::string text =
        rank >= 0 ? str_cat("rank ", rank, ": error: ", message, "\n") : str_cat("error: ", message, "\n");
    std::fwrite(text.data(), 1, text.size(), stderr);
    std::fflush(stderr);
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) {
      // Ranks usually fail together (a configuration error is detected on every rank at the same point): a
      // bounded barrier lets every one of them print its message before the job is aborted, and a rank that
      // fails alone aborts the job after the grace period, so that no peer is left waiting.
      if (g_error_comm != MPI_COMM_NULL) {
        MPI_Request req = MPI_REQUEST_NULL;
        if (MPI_Ibarrier(g_error_comm, &req) == MPI_SUCCESS) {
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kAbortGraceMs);
          int flag = 0;
          while (!flag && std::chrono::steady_clock::now() < deadline) {
            if (MPI_Test(&req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
            if (!flag) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
        }
      }
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return 1;
  }
}

}  // namespace seqpar
