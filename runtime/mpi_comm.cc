#include "runtime/mpi_comm.h"

#include <chrono>
#include <climits>
#include <cstdio>
#include <thread>

#include "runtime/logging.h"

namespace seqpar {
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

void check_host(const TensorView& t, const char* op) {
  SEQPAR_CHECK(t.device().is_cpu(), op, ": the MPI backend takes host buffers; got ", t.str());
}

// ---- work handle --------------------------------------------------------------------------------------

class MpiWork final : public Work {
 public:
  MpiWork(std::string description, std::vector<MPI_Request> requests, std::vector<bool> is_recv)
      : description_(std::move(description)), requests_(std::move(requests)), is_recv_(std::move(is_recv)) {}
  ~MpiWork() override {
    if (!done_) abandon();
  }

  // Keeps count / displacement arrays alive for v-collectives until completion.
  std::vector<int> arrays;

  bool test() override {
    if (done_) return true;
    int flag = 0;
    SEQPAR_CHECK_MPI(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE));
    done_ = flag != 0;
    return done_;
  }

  void wait(double timeout_s) override {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    for (long polls = 0; !test(); ++polls) {
      const double elapsed = std::chrono::duration<double>(clock::now() - start).count();
      if (elapsed > timeout_s) {
        abandon();
        SEQPAR_THROW(description_, " did not complete within ", timeout_s, " s (waited ", elapsed,
                     " s): a peer has failed, is stuck, or posted a mismatched operation");
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
  // Cancels pending receives and releases every request; their buffers may be reused afterwards only for receives.
  void abandon() {
    for (std::size_t i = 0; i < requests_.size(); ++i) {
      if (requests_[i] == MPI_REQUEST_NULL) continue;
      if (i < is_recv_.size() && is_recv_[i]) {
        MPI_Cancel(&requests_[i]);
        MPI_Wait(&requests_[i], MPI_STATUS_IGNORE);
      } else {
        MPI_Request_free(&requests_[i]);
      }
    }
    done_ = true;
  }

  std::string description_;
  std::vector<MPI_Request> requests_;
  std::vector<bool> is_recv_;
  bool done_ = false;
};

WorkHandle make_work(std::string description, MPI_Request request, bool is_recv = false) {
  return std::make_unique<MpiWork>(std::move(description), std::vector<MPI_Request>{request},
                                   std::vector<bool>{is_recv});
}

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
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  set_process_rank(rank);
  init_types();
}

MpiSession::~MpiSession() {
  free_types();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// ---- communicator -----------------------------------------------------------------------------------------

MpiCommunicator::MpiCommunicator(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
  SEQPAR_CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  SEQPAR_CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
  SEQPAR_CHECK_MPI(MPI_Comm_size(comm_, &size_));
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
  check_host(buffer, "isend");
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Isend(buffer.data(), to_int_count(buffer.numel(), "isend"), mpi_type(buffer.dtype()), peer,
                             tag, comm_, &req));
  counters_.bytes_sent += buffer.nbytes();
  ++counters_.num_ops;
  return make_work(str_cat("MPI isend to peer ", peer, " (tag ", tag, ", ", buffer.nbytes(), " bytes)"), req);
}

WorkHandle MpiCommunicator::irecv(const TensorView& buffer, int peer, int tag) {
  check_peer(*this, peer, "irecv");
  check_host(buffer, "irecv");
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Irecv(buffer.data(), to_int_count(buffer.numel(), "irecv"), mpi_type(buffer.dtype()), peer,
                             tag, comm_, &req));
  counters_.bytes_received += buffer.nbytes();
  ++counters_.num_ops;
  return make_work(str_cat("MPI irecv from peer ", peer, " (tag ", tag, ", ", buffer.nbytes(), " bytes)"), req,
                   true);
}

WorkHandle MpiCommunicator::batch_isend_irecv(const std::vector<P2POp>& ops) {
  for (const P2POp& op : ops) {
    check_peer(*this, op.peer, "batch_isend_irecv");
    check_host(op.buffer, "batch_isend_irecv");
  }
  std::vector<MPI_Request> reqs(ops.size(), MPI_REQUEST_NULL);
  std::vector<bool> is_recv(ops.size());
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
            MPI_Irecv(op.buffer.data(), count, mpi_type(op.buffer.dtype()), op.peer, op.tag, comm_, &reqs[i]));
        counters_.bytes_received += op.buffer.nbytes();
      } else {
        SEQPAR_CHECK_MPI(
            MPI_Isend(op.buffer.data(), count, mpi_type(op.buffer.dtype()), op.peer, op.tag, comm_, &reqs[i]));
        counters_.bytes_sent += op.buffer.nbytes();
      }
      is_recv[i] = recv;
      peers += str_cat(peers.empty() ? "" : ", ", recv ? "recv from " : "send to ", op.peer);
    }
  }
  ++counters_.num_ops;
  return std::make_unique<MpiWork>(str_cat("MPI batch_isend_irecv (", peers, ")"), std::move(reqs),
                                   std::move(is_recv));
}

WorkHandle MpiCommunicator::all_to_all(const TensorView& send, const TensorView& recv) {
  check_host(send, "all_to_all");
  check_host(recv, "all_to_all");
  SEQPAR_CHECK(send.dtype() == recv.dtype() && send.numel() == recv.numel(), "all_to_all: send ", send.str(),
               " and recv ", recv.str(), " must have the same dtype and element count");
  SEQPAR_CHECK(send.numel() % size_ == 0, "all_to_all: element count ", send.numel(),
               " must be divisible by the communicator size ", size_);
  const int block = to_int_count(send.numel() / size_, "all_to_all");
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Ialltoall(send.data(), block, mpi_type(send.dtype()), recv.data(), block,
                                 mpi_type(recv.dtype()), comm_, &req));
  const std::int64_t moved = static_cast<std::int64_t>(block) * (size_ - 1) * dtype_size(send.dtype());
  counters_.bytes_sent += moved;
  counters_.bytes_received += moved;
  ++counters_.num_ops;
  return make_work(str_cat("MPI all_to_all over ", size_, " ranks (", send.nbytes(), " bytes)"), req);
}

WorkHandle MpiCommunicator::all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts,
                                         const TensorView& recv, const std::vector<std::int64_t>& recv_counts) {
  check_host(send, "all_to_all_v");
  check_host(recv, "all_to_all_v");
  SEQPAR_CHECK(send.dtype() == recv.dtype(), "all_to_all_v: send and recv dtypes differ (",
               dtype_name(send.dtype()), " vs ", dtype_name(recv.dtype()), ")");
  SEQPAR_CHECK(static_cast<int>(send_counts.size()) == size_ && static_cast<int>(recv_counts.size()) == size_,
               "all_to_all_v: send_counts and recv_counts need one entry per rank (", size_, "), got ",
               send_counts.size(), " and ", recv_counts.size());
  auto work = std::make_unique<MpiWork>("", std::vector<MPI_Request>{}, std::vector<bool>{});
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
  SEQPAR_CHECK(send_total <= send.numel() && recv_total <= recv.numel(), "all_to_all_v: counts sum to ",
               send_total, " sent / ", recv_total, " received, more than the buffers hold (", send.numel(), " / ",
               recv.numel(), ")");
  MPI_Request req;
  int* a = arrays.data();
  SEQPAR_CHECK_MPI(MPI_Ialltoallv(send.data(), a, a + size_, mpi_type(send.dtype()), recv.data(), a + 2 * size_,
                                  a + 3 * size_, mpi_type(recv.dtype()), comm_, &req));
  const std::size_t esize = dtype_size(send.dtype());
  counters_.bytes_sent += (send_total - send_counts[rank_]) * esize;
  counters_.bytes_received += (recv_total - recv_counts[rank_]) * esize;
  ++counters_.num_ops;
  auto w = std::make_unique<MpiWork>(str_cat("MPI all_to_all_v over ", size_, " ranks"),
                                     std::vector<MPI_Request>{req}, std::vector<bool>{false});
  w->arrays = std::move(arrays);
  return w;
}

WorkHandle MpiCommunicator::all_gather(const TensorView& send, const TensorView& recv) {
  check_host(send, "all_gather");
  check_host(recv, "all_gather");
  SEQPAR_CHECK(send.dtype() == recv.dtype() && recv.numel() == send.numel() * size_, "all_gather: recv ",
               recv.str(), " must hold size (", size_, ") x send ", send.str());
  const int count = to_int_count(send.numel(), "all_gather");
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Iallgather(send.data(), count, mpi_type(send.dtype()), recv.data(), count,
                                  mpi_type(recv.dtype()), comm_, &req));
  counters_.bytes_sent += static_cast<std::int64_t>(send.nbytes()) * (size_ - 1);
  counters_.bytes_received += static_cast<std::int64_t>(send.nbytes()) * (size_ - 1);
  ++counters_.num_ops;
  return make_work(str_cat("MPI all_gather over ", size_, " ranks (", send.nbytes(), " bytes each)"), req);
}

WorkHandle MpiCommunicator::reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) {
  check_host(send, "reduce_scatter");
  check_host(recv, "reduce_scatter");
  SEQPAR_CHECK(send.dtype() == recv.dtype() && send.numel() == recv.numel() * size_, "reduce_scatter: send ",
               send.str(), " must hold size (", size_, ") x recv ", recv.str());
  const int count = to_int_count(recv.numel(), "reduce_scatter");
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Ireduce_scatter_block(send.data(), recv.data(), count, mpi_type(send.dtype()),
                                             mpi_op(op, send.dtype()), comm_, &req));
  counters_.bytes_sent += static_cast<std::int64_t>(recv.nbytes()) * (size_ - 1);
  counters_.bytes_received += static_cast<std::int64_t>(recv.nbytes()) * (size_ - 1);
  ++counters_.num_ops;
  return make_work(str_cat("MPI reduce_scatter(", reduce_op_name(op), ") over ", size_, " ranks"), req);
}

WorkHandle MpiCommunicator::all_reduce(const TensorView& buffer, ReduceOp op) {
  check_host(buffer, "all_reduce");
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, buffer.data(), to_int_count(buffer.numel(), "all_reduce"),
                                  mpi_type(buffer.dtype()), mpi_op(op, buffer.dtype()), comm_, &req));
  // Counted as a ring all-reduce would move it: 2 (P-1)/P of the buffer each way.
  const std::int64_t moved = size_ > 1 ? 2 * static_cast<std::int64_t>(buffer.nbytes()) * (size_ - 1) / size_ : 0;
  counters_.bytes_sent += moved;
  counters_.bytes_received += moved;
  ++counters_.num_ops;
  return make_work(str_cat("MPI all_reduce(", reduce_op_name(op), ") over ", size_, " ranks"), req);
}

WorkHandle MpiCommunicator::broadcast(const TensorView& buffer, int root) {
  check_peer(*this, root, "broadcast");
  check_host(buffer, "broadcast");
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Ibcast(buffer.data(), to_int_count(buffer.numel(), "broadcast"), mpi_type(buffer.dtype()),
                              root, comm_, &req));
  if (rank_ == root) {
    counters_.bytes_sent += static_cast<std::int64_t>(buffer.nbytes()) * (size_ - 1);
  } else {
    counters_.bytes_received += buffer.nbytes();
  }
  ++counters_.num_ops;
  return make_work(str_cat("MPI broadcast from root ", root, " over ", size_, " ranks"), req);
}

WorkHandle MpiCommunicator::barrier() {
  MPI_Request req;
  SEQPAR_CHECK_MPI(MPI_Ibarrier(comm_, &req));
  return make_work(str_cat("MPI barrier over ", size_, " ranks"), req);
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  MPI_Comm out = MPI_COMM_NULL;
  SEQPAR_CHECK_MPI(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &out));
  if (out == MPI_COMM_NULL) return nullptr;
  return std::make_unique<MpiCommunicator>(out, true);
}

// ---- main wrapper -----------------------------------------------------------------------------------------

int run_mpi_main(int argc, char** argv, const std::function<int(int, char**)>& body) {
  std::unique_ptr<MpiSession> session;
  try {
    session = std::make_unique<MpiSession>(&argc, &argv);
    const int rc = body(argc, argv);
    return rc;
  } catch (const std::exception& e) {
    const Error* error = dynamic_cast<const Error*>(&e);
    const std::string text =
        str_cat("rank ", process_rank(), ": error: ", error ? error->message() : std::string(e.what()), "\n");
    std::fwrite(text.data(), 1, text.size(), stderr);
    std::fflush(stderr);
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) {
      // Let the other ranks, which usually fail the same way at the same point, print their message too.
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return 1;
  }
}

}  // namespace seqpar
