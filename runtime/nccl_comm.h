// NCCL backend of the Communicator interface (one CUDA device per rank). The class and its helpers exist in every
// build so that callers can name them; in a build without NCCL, constructing it throws saying so.
//
// Bootstrap: collective over a bootstrap communicator (MPI): rank 0 makes the ncclUniqueId and the bootstrap
// broadcasts it; ranks first agree that every one of them has a distinct, usable device, so that a bad
// configuration fails on every rank before NCCL starts. The communicator is non-blocking (NCCL's `blocking = 0`
// config): initialisation, split and every launch are polled with SEQPAR_COMM_TIMEOUT_S, so that a missing peer
// becomes an error instead of a hang.
//
// Streams: communication runs on the communicator's own stream. Each operation first waits (an event, not the
// host) for the work queued so far on the compute stream given to set_stream() (default: the legacy default
// stream), and records an event when it is done; Work::test() queries that event and NCCL's asynchronous error
// state, Work::wait() polls them and, once complete, makes the compute stream wait for the event too. On timeout
// or an NCCL error, wait() aborts the communicator (ncclCommAbort) and throws an Error naming the operation, its
// peers and the time waited; every later operation on it throws (create a new communicator).
//
// Buffers are device buffers on this rank's device. Tags are accepted but not transmitted: NCCL matches the
// messages between a pair of ranks in posting order (the interface's rule for equal tags). NCCL serialises the
// operations of one communicator on its stream, so a lone irecv (or isend) holds back every later operation until
// its peer posts the match: post a send and a receive that depend on each other through batch_isend_irecv. The
// first operation between two ranks also connects them: that call returns once the peer has posted its side
// (bounded by SEQPAR_COMM_TIMEOUT_S, after which the communicator is aborted).
#pragma once

#include <memory>

#include "comm.h"

namespace seqpar {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `bootstrap`; binds this rank to CUDA device `device_ordinal` (see
  // device_ordinal_from_local_rank()). Throws on every rank when any rank's device is missing or shared. Takes the
  // bootstrap's world ranks (and is named "world").
  NcclCommunicator(Communicator& bootstrap, int device_ordinal);
  ~NcclCommunicator() override;

  const char* backend_name() const override { return "nccl"; }
  int device_ordinal() const { return device().index; }
  // The stream NCCL kernels run on (owned by the communicator).
  Stream comm_stream() const;

  struct State;  // NCCL handles (defined in nccl_comm.cc); shared with the Work handles

 protected:
  // Buffers on this rank's device only.
  void check_buffer(const TensorView& t, const std::string& op) const override;
  // `stream` must be on this communicator's device (Stream::cpu() selects the legacy default stream).
  void do_set_stream(const Stream& stream) override;

#if defined(SEQPAR_WITH_NCCL)
  // (Without NCCL the constructor throws, so the transfer hooks are the base class's "does not support" defaults.)
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
  // A one-element all_reduce on the device.
  WorkHandle do_barrier(std::string what) override;
  WorkHandle do_broadcast(const TensorView& buffer, int root, std::string what) override;
  // ncclCommSplit, after a device all-gather of every rank's (color, key) that gives the child's world ranks; the
  // child shares this communicator's device.
  std::unique_ptr<Communicator> do_split(int color, int key, std::string what) override;
#endif

 private:
  explicit NcclCommunicator(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

// True when this build contains the NCCL backend's implementation.
bool nccl_backend_built();

// This process's rank on its node as the launcher reports it (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID,
// MPI_LOCALRANKID, first set wins); -1 when none is set. Throws when the value is not a non-negative integer.
int launcher_local_rank();
// The CUDA device for this rank: launcher_local_rank() modulo the number of visible devices (0 when the launcher
// sets no local rank). Throws naming cuda_unavailable_reason() when no device is usable.
int device_ordinal_from_local_rank();

}  // namespace seqpar
