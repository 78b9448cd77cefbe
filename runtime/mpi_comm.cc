#include "runtime/mpi_comm.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>

#include "runtime/comm_keepalive.h"
#include "runtime/cuda_staging.h"
#include "runtime/fault.h"
#include "runtime/logging.h"
#include "runtime/memory.h"

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

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// The requests of one operation and everything they use until MPI is done with them: the host buffers (kept alive
// through runtime/comm_keepalive.h if the operation is abandoned), the pinned mirrors of device buffers, and the
// count / displacement arrays of a v-collective.
class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<bool> collective_abandoned, std::string description, std::vector<MPI_Request> requests,
          std::vector<ReqKind> kinds, std::vector<TensorView> host_buffers,
          std::shared_ptr<DeviceStaging> staging = nullptr, std::vector<int> arrays = {})
      : collective_abandoned_(std::move(collective_abandoned)),
        description_(std::move(description)),
        requests_(std::move(requests)),
        kinds_(std::move(kinds)),
        host_buffers_(std::move(host_buffers)),
        staging_(std::move(staging)),
        arrays_(std::move(arrays)) {}
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
                        << "the buffers MPI may still use are kept instead of freed";
    } catch (...) {  // a malformed SEQPAR_LOG_LEVEL must not terminate the program from a destructor
    }
    abandon();
  }

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
    double waited = 0;
    if (poll_until([this] { return test(); }, timeout_s, description_, waited)) return;
    const bool collective = std::find(kinds_.begin(), kinds_.end(), ReqKind::kCollective) != kinds_.end();
    abandon();
    failure_ = str_cat(description_, " did not complete within ", timeout_s, " s (waited ", waited,
                       " s): a peer has failed, is stuck, or posted a mismatched operation",
                       collective ? "; this communicator cannot run further collectives" : "");
    SEQPAR_THROW(failure_);
  }

 private:
  // Releases every pending request without ever letting MPI touch freed memory. Receives are cancelled (so that a
  // later message is not swallowed by them). A send is released and completes in the background; a nonblocking
  // collective can be neither cancelled nor freed (MPI forbids both), so it is left pending. Whenever a request
  // may still be used by MPI afterwards, the operation's host buffers are kept alive (never freed), and so are
  // the pinned mirrors of device buffers.
  void abandon() {
    bool pending = false;
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
        if (!flag && req != MPI_REQUEST_NULL) {
          MPI_Request_free(&req);
          pending = true;
        }
      } else {
        int flag = 0;
        if (MPI_Test(&req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || !flag) {
          pending = true;
          if (kind == ReqKind::kSend && req != MPI_REQUEST_NULL) MPI_Request_free(&req);
          // A pending collective keeps using its communicator: it must never be freed (MpiCommunicator's
          // destructor leaks it instead).
          if (kind == ReqKind::kCollective && collective_abandoned_) *collective_abandoned_ = true;
        }
      }
    }
    if (pending) {
      for (const TensorView& t : host_buffers_) keep_alive_for_transport(t.data(), t.nbytes());
      // The count arrays of a pending v-collective are MPI's too: leak them with the request.
      if (!arrays_.empty()) new std::vector<int>(std::move(arrays_));  // NOLINT: deliberate leak
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

  std::shared_ptr<bool> collective_abandoned_;  // the communicator's flag
  std::string description_;
  std::vector<MPI_Request> requests_;
  std::vector<ReqKind> kinds_;
  std::vector<TensorView> host_buffers_;  // what MPI reads / writes (pinned mirrors for device buffers)
  bool done_ = false;
  std::vector<MPI_Status> statuses_;        // of the last MPI_Testall
  std::string failure_;                     // set once wait() timed out; later wait() / test() calls throw it again
  std::shared_ptr<DeviceStaging> staging_;  // pinned mirrors of device buffers, if any
  std::vector<int> arrays_;                 // count / displacement arrays of a v-collective
};

WorkHandle make_work(const std::shared_ptr<bool>& collective_abandoned, std::string description, MPI_Request request,
                     ReqKind kind, std::vector<TensorView> host_buffers,
                     std::shared_ptr<DeviceStaging> staging = nullptr) {
  return std::make_unique<MpiWork>(collective_abandoned, std::move(description), std::vector<MPI_Request>{request},
                                   std::vector<ReqKind>{kind}, std::move(host_buffers), std::move(staging));
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
  // Read the environment knobs now, so that a malformed value stops every rank here, before any message is sent.
  env::log_level();
  env::comm_timeout_s();
  env::lowered_attention();
  env::gdn_work_ahead();
  env::gdn_defer_copies();
  env::gdn_ahead_last_first();
  env::gdn_lean_backward();
  host_cache_limit();  // SEQPAR_HOST_CACHE_MB (it was read at the first large host allocation, after messages)
  int world_size = 1;
  SEQPAR_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  fault::check_rank_in_world(fault::plan(), world_size);
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
  int rank = 0, size = 1;
  SEQPAR_CHECK_MPI(MPI_Comm_rank(comm_, &rank));
  SEQPAR_CHECK_MPI(MPI_Comm_size(comm_, &size));
  // The world rank of every member, so that errors can name peers as the launcher numbers them.
  MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  SEQPAR_CHECK_MPI(MPI_Comm_group(comm_, &group));
  SEQPAR_CHECK_MPI(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  std::vector<int> ranks(static_cast<std::size_t>(size)), world_ranks(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) ranks[r] = r;
  const int rc = MPI_Group_translate_ranks(group, size, ranks.data(), world_group, world_ranks.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  SEQPAR_CHECK_MPI(rc);
  set_group(rank, size, std::move(world_ranks));
  int* tag_ub = nullptr;
  int has_tag_ub = 0;
  // MPI_TAG_UB is a predefined attribute of MPI_COMM_WORLD (the bound holds for every communicator).
  SEQPAR_CHECK_MPI(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &has_tag_ub));
  if (has_tag_ub && tag_ub) tag_ub_ = *tag_ub;
}

MpiCommunicator::~MpiCommunicator() {
  // A communicator with an abandoned collective still pending is deliberately kept (leaked): MPI progresses that
  // collective on it for as long as the process lives.
  if (owned_ && comm_ != MPI_COMM_NULL && !*collective_abandoned_ && !mpi_finalized()) MPI_Comm_free(&comm_);
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::world() {
  MPI_Comm dup = MPI_COMM_NULL;
  SEQPAR_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &dup));
  return std::make_unique<MpiCommunicator>(dup, true);
}

void MpiCommunicator::check_buffer(const TensorView& t, const std::string& op) const {
#if defined(SEQPAR_WITH_CUDA)
  check_device_buffer(t, op.c_str());
#else
  SEQPAR_CHECK(t.device().is_cpu(), op, ": the MPI backend takes host buffers; got ", t.str());
#endif
}

std::int64_t MpiCommunicator::max_message_elements() const { return INT_MAX; }

// Every count below was checked against max_message_elements() by the front-end.
WorkHandle MpiCommunicator::do_isend(const TensorView& buffer, int peer, int tag, std::string what) {
  std::shared_ptr<DeviceStaging> staging;
  const TensorView host = host_view(buffer, true, false, stream(), staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(
      MPI_Isend(host.data(), static_cast<int>(buffer.numel()), mpi_type(buffer.dtype()), peer, tag, comm_, &req));
  return make_work(collective_abandoned_, std::move(what), req, ReqKind::kSend, {host}, std::move(staging));
}

WorkHandle MpiCommunicator::do_irecv(const TensorView& buffer, int peer, int tag, std::string what) {
  std::shared_ptr<DeviceStaging> staging;
  const TensorView host = host_view(buffer, false, true, stream(), staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(
      MPI_Irecv(host.data(), static_cast<int>(buffer.numel()), mpi_type(buffer.dtype()), peer, tag, comm_, &req));
  return make_work(collective_abandoned_, std::move(what), req, ReqKind::kRecv, {host}, std::move(staging));
}

WorkHandle MpiCommunicator::do_batch_isend_irecv(const std::vector<P2POp>& ops, std::string what) {
  std::shared_ptr<DeviceStaging> staging;
  std::vector<TensorView> hosts;
  hosts.reserve(ops.size());
  for (const P2POp& op : ops) {
    const bool recv = op.kind == P2POp::Kind::kRecv;
    hosts.push_back(host_view(op.buffer, !recv, recv, stream(), staging));
  }
  std::vector<MPI_Request> reqs(ops.size(), MPI_REQUEST_NULL);
  std::vector<ReqKind> kinds(ops.size(), ReqKind::kSend);
  // Receives first, so that every matching send finds its receive already posted.
  for (int pass = 0; pass < 2; ++pass) {
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const P2POp& op = ops[i];
      const bool recv = op.kind == P2POp::Kind::kRecv;
      if (recv != (pass == 0)) continue;
      const int count = static_cast<int>(op.buffer.numel());
      if (recv) {
        SEQPAR_CHECK_MPI(
            MPI_Irecv(hosts[i].data(), count, mpi_type(op.buffer.dtype()), op.peer, op.tag, comm_, &reqs[i]));
      } else {
        SEQPAR_CHECK_MPI(
            MPI_Isend(hosts[i].data(), count, mpi_type(op.buffer.dtype()), op.peer, op.tag, comm_, &reqs[i]));
      }
      kinds[i] = recv ? ReqKind::kRecv : ReqKind::kSend;
    }
  }
  return std::make_unique<MpiWork>(collective_abandoned_, std::move(what), std::move(reqs), std::move(kinds),
                                   std::move(hosts), std::move(staging));
}

WorkHandle MpiCommunicator::do_all_to_all(const TensorView& send, const TensorView& recv, std::string what) {
  const int block = static_cast<int>(send.numel() / size());
  std::shared_ptr<DeviceStaging> staging;
  const TensorView hsend = host_view(send, true, false, stream(), staging);
  const TensorView hrecv = host_view(recv, false, true, stream(), staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Ialltoall(hsend.data(), block, mpi_type(send.dtype()), hrecv.data(), block,
                                 mpi_type(recv.dtype()), comm_, &req));
  return make_work(collective_abandoned_, std::move(what), req, ReqKind::kCollective, {hsend, hrecv},
                   std::move(staging));
}

WorkHandle MpiCommunicator::do_all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts,
                                            const TensorView& recv, const std::vector<std::int64_t>& recv_counts,
                                            std::string what) {
  const int p = size();
  std::vector<int> arrays(4 * static_cast<std::size_t>(p));  // send counts, send offsets, recv counts, recv offsets
  std::int64_t send_total = 0, recv_total = 0;
  for (int r = 0; r < p; ++r) {
    arrays[r] = static_cast<int>(send_counts[r]);
    arrays[p + r] = static_cast<int>(send_total);
    arrays[2 * p + r] = static_cast<int>(recv_counts[r]);
    arrays[3 * p + r] = static_cast<int>(recv_total);
    send_total += send_counts[r];
    recv_total += recv_counts[r];
  }
  std::shared_ptr<DeviceStaging> staging;
  const TensorView hsend = host_view(send, true, false, stream(), staging);
  const TensorView hrecv = host_view(recv, false, true, stream(), staging);
  MPI_Request req;
  int* a = arrays.data();
  SEQPAR_CHECK_MPI(MPI_Ialltoallv(hsend.data(), a, a + p, mpi_type(send.dtype()), hrecv.data(), a + 2 * p, a + 3 * p,
                                  mpi_type(recv.dtype()), comm_, &req));
  return std::make_unique<MpiWork>(collective_abandoned_, std::move(what), std::vector<MPI_Request>{req},
                                   std::vector<ReqKind>{ReqKind::kCollective}, std::vector<TensorView>{hsend, hrecv},
                                   std::move(staging), std::move(arrays));
}

WorkHandle MpiCommunicator::do_all_gather(const TensorView& send, const TensorView& recv, std::string what) {
  const int count = static_cast<int>(send.numel());
  std::shared_ptr<DeviceStaging> staging;
  const TensorView hsend = host_view(send, true, false, stream(), staging);
  const TensorView hrecv = host_view(recv, false, true, stream(), staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Iallgather(hsend.data(), count, mpi_type(send.dtype()), hrecv.data(), count,
                                  mpi_type(recv.dtype()), comm_, &req));
  return make_work(collective_abandoned_, std::move(what), req, ReqKind::kCollective, {hsend, hrecv},
                   std::move(staging));
}

WorkHandle MpiCommunicator::do_reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op,
                                              std::string what) {
  const int count = static_cast<int>(recv.numel());
  std::shared_ptr<DeviceStaging> staging;
  const TensorView hsend = host_view(send, true, false, stream(), staging);
  const TensorView hrecv = host_view(recv, false, true, stream(), staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Ireduce_scatter_block(hsend.data(), hrecv.data(), count, mpi_type(send.dtype()),
                                             mpi_op(op, send.dtype()), comm_, &req));
  return make_work(collective_abandoned_, std::move(what), req, ReqKind::kCollective, {hsend, hrecv},
                   std::move(staging));
}

WorkHandle MpiCommunicator::do_all_reduce(const TensorView& buffer, ReduceOp op, std::string what) {
  std::shared_ptr<DeviceStaging> staging;
  const TensorView host = host_view(buffer, true, true, stream(), staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, host.data(), static_cast<int>(buffer.numel()), mpi_type(buffer.dtype()),
                                  mpi_op(op, buffer.dtype()), comm_, &req));
  return make_work(collective_abandoned_, std::move(what), req, ReqKind::kCollective, {host}, std::move(staging));
}

WorkHandle MpiCommunicator::do_broadcast(const TensorView& buffer, int root, std::string what) {
  std::shared_ptr<DeviceStaging> staging;
  const TensorView host = host_view(buffer, rank() == root, rank() != root, stream(), staging);
  MPI_Request req;
  SEQPAR_CHECK_MPI(
      MPI_Ibcast(host.data(), static_cast<int>(buffer.numel()), mpi_type(buffer.dtype()), root, comm_, &req));
  return make_work(collective_abandoned_, std::move(what), req, ReqKind::kCollective, {host}, std::move(staging));
}

WorkHandle MpiCommunicator::do_barrier(std::string what) {
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Ibarrier(comm_, &req));
  return make_work(collective_abandoned_, std::move(what), req, ReqKind::kCollective, {});
}

std::unique_ptr<Communicator> MpiCommunicator::do_split(int color, int key, std::string what) {
  // MPI_Comm_split blocks without a timeout. A timed all-gather of (color, key) first makes a rank that never
  // arrives a timeout error here; once it has completed, every rank is known to be entering the split.
  const int p = size();
  auto table = std::make_unique<std::int32_t[]>(2 + 2 * static_cast<std::size_t>(p));  // mine, then everyone's
  table[0] = color;
  table[1] = key;
  MPI_Request gather_req;
  SEQPAR_CHECK_MPI(MPI_Iallgather(table.get(), 2, MPI_INT32_T, table.get() + 2, 2, MPI_INT32_T, comm_, &gather_req));
  try {
    make_work(collective_abandoned_, std::move(what), gather_req, ReqKind::kCollective, {})->wait();
  } catch (...) {
    table.release();  // NOLINT: deliberate leak, the abandoned gather may still write the table
    throw;
  }
  MPI_Comm out = MPI_COMM_NULL;
  SEQPAR_CHECK_MPI(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &out));
  if (out == MPI_COMM_NULL) return nullptr;
  return std::make_unique<MpiCommunicator>(out, true);
}

// ---- main wrapper -----------------------------------------------------------------------------------------

namespace {
constexpr int kAbortGraceMs = 2000;  // how long a failed rank waits for its peers to fail too
}  // namespace

namespace {

// A rank that is stopped by the job's abort (OpenMPI sends SIGTERM to every other rank when one calls MPI_Abort) says
// so in the same form as an error, and exits with status 1: the handler writes a message prepared beforehand (only
// async-signal-safe calls), unless this rank has already printed its own error.
char g_sigterm_text[256];
std::size_t g_sigterm_length = 0;
volatile std::sig_atomic_t g_error_printed = 0;

extern "C" void on_sigterm(int) {
  if (!g_error_printed && g_sigterm_length > 0) {
    [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, g_sigterm_text, g_sigterm_length);
  }
  ::_exit(1);
}

void install_sigterm_notice(int rank) {
  const std::string text = str_cat("rank ", rank,
                                   ": error: stopped by SIGTERM: the job is being aborted after another rank's error "
                                   "(printed by that rank), or it was interrupted\n");
  g_sigterm_length = std::min(text.size(), sizeof(g_sigterm_text));
  std::memcpy(g_sigterm_text, text.data(), g_sigterm_length);
  struct sigaction action {};
  action.sa_handler = on_sigterm;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
}

}  // namespace

int run_mpi_main(int argc, char** argv, const std::function<int(int, char**)>& body) {
  std::unique_ptr<MpiSession> session;
  try {
    session = std::make_unique<MpiSession>(&argc, &argv);
    install_sigterm_notice(process_rank());
    const int rc = body(argc, argv);
    return rc;
  } catch (const std::exception& e) {
    const Error* error = dynamic_cast<const Error*>(&e);
    // std::bad_alloc comes from a standard container (the ledger raises its own out-of-memory Error): say so.
    const std::string message = error ? error->message()
                                : dynamic_cast<const std::bad_alloc*>(&e)
                                    ? str_cat("out of host memory (", e.what(),
                                              " from a host allocation outside the memory ledger; are the "
                                              "sizes too large for this machine?)")
                                    : std::string(e.what());
    const int rank = process_rank();
    const std::string text =
        rank >= 0 ? str_cat("rank ", rank, ": error: ", message, "\n") : str_cat("error: ", message, "\n");
    std::fwrite(text.data(), 1, text.size(), stderr);
    std::fflush(stderr);
    g_error_printed = 1;
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
