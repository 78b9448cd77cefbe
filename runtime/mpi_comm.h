// MPI backend of the Communicator interface, over host memory, for every dtype (bf16 / fp16 reductions use
// seqpar's own MPI reduction operators, which add in fp32 and round to nearest even).
//
// Every operation is posted non-blocking (MPI_Isend, MPI_Ialltoall, ...) and completed by polling MPI_Testall
// in Work::wait, which is how a stuck peer becomes a timeout error instead of a hang. Only the thread that
// initialised MPI calls into it (MPI_THREAD_FUNNELED); OpenMP threads in kernels never communicate.
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>

#include "comm.h"

namespace seqpar {

// Initialises MPI (MPI_THREAD_FUNNELED, errors returned rather than fatal) and finalises it on destruction
// (only when this session initialised it).
// Sets the rank used in error and log prefixes. Reads SEQPAR_LOG_LEVEL and SEQPAR_COMM_TIMEOUT_S and throws for a
// malformed value (before any communication).
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
};

class MpiCommunicator final : public Communicator {
 public:
  // Wraps `comm`; when `owned`, frees it on destruction. Sets MPI_ERRORS_RETURN on it. The world rank of every
  // member comes from MPI_Group_translate_ranks.
  MpiCommunicator(MPI_Comm comm, bool owned);
  ~MpiCommunicator() override;
  // A communicator over MPI_COMM_WORLD (duplicated, so that seqpar's traffic never mixes with the caller's), named
  // "world".
  static std::unique_ptr<MpiCommunicator> world();

  const char* backend_name() const override { return "mpi"; }
  MPI_Comm handle() const { return comm_; }

 protected:
  // Host buffers; in CUDA builds also device buffers (staged through pinned host memory).
  void check_buffer(const TensorView& t, const std::string& op) const override;
  int max_tag() const override { return tag_ub_; }
  std::int64_t max_message_elements() const override;  // INT_MAX (MPI counts are int)

  WorkHandle do_isend(const TensorView& buffer, int peer, int tag, std::string what) override;
  WorkHandle do_irecv(const TensorView& buffer, int peer, int tag, std::string what) override;
  WorkHandle do_batch_isend_irecv(const std::vector<P2POp>& ops, std::string what) override;
  WorkHandle do_all_to_all(const TensorView& send, const TensorView& recv, std::string what) override;
  WorkHandle do_all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts,
                             const TensorView& recv, const std::vector<std::int64_t>& recv_counts,
                             std::string what) override;
  WorkHandle do_all_gather(const TensorView& send, const TensorView& recv, std::string what) override;
  WorkHandle do_reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op, std::string what) override;
  WorkHandle do_all_reduce(const TensorView& buffer, ReduceOp op, std::string what) override;
  WorkHandle do_broadcast(const TensorView& buffer, int root, std::string what) override;
  WorkHandle do_barrier(std::string what) override;
  std::unique_ptr<Communicator> do_split(int color, int key, std::string what) override;

 private:
  MPI_Comm comm_;
  bool owned_;
  int tag_ub_ = 32767;  // MPI_TAG_UB (at least 32767 by the standard)
  // Set by a Work that abandoned a collective still pending on comm_; then comm_ is never freed.
  std::shared_ptr<bool> collective_abandoned_ = std::make_shared<bool>(false);
};

// Runs `body` as the main of an MPI program: initialises MPI, turns a seqpar::Error (or any std::exception) into
// "rank R: error: message" on stderr and a non-zero exit of the whole job (MPI_Abort, so no rank is left waiting).
// Before aborting, a failed rank waits up to 2 s in a barrier of failed ranks, so that when every rank fails
// (a configuration error) each prints its message first.
// A rank stopped by SIGTERM (OpenMPI sends it to the other ranks when one aborts) prints
// "rank R: error: stopped by SIGTERM: ..." and exits with status 1, so that the ranks of a failed job say why they
// ended (best effort: mpirun may follow with SIGKILL before a line is forwarded).
int run_mpi_main(int argc, char** argv, const std::function<int(int, char**)>& body);

}  // namespace seqpar
