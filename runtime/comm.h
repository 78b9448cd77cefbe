// The communicator interface (after PyTorch c10d's Backend / Work): every operation is asynchronous and returns a
// Work handle whose wait(timeout) either completes or throws an Error naming the operation, the peer and the time
// waited; it never blocks forever. Buffers are host or device TensorViews, contiguous; counts are in elements.
//
// Synchronisation: an operation may read/write its buffers until its Work has completed; the caller keeps them
// alive and untouched until then. Operations on one communicator are issued in the same order on every rank (MPI's
// rule); point-to-point messages between a pair of ranks with the same tag are matched in posting order.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/env.h"
#include "runtime/tensor.h"

namespace seqpar {

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation completes. Throws Error "<op> ... did not complete within T s" after `timeout_s`
  // seconds (default SEQPAR_COMM_TIMEOUT_S); later wait() / test() calls throw the same error again. A timed-out
  // receive is cancelled and the communicator stays usable for point-to-point traffic; after a timed-out
  // collective it is not (the collective cannot be cancelled). Destroying an unfinished Work cancels its
  // receives (with a warning).
  virtual void wait(double timeout_s) = 0;
  void wait() { wait(env::comm_timeout_s()); }
  // Non-blocking completion check (also drives progress).
  virtual bool test() = 0;
};
using WorkHandle = std::unique_ptr<Work>;

// Waits for every non-null handle in order.
void wait_all(std::vector<WorkHandle>& works);

enum class ReduceOp : std::uint8_t { kSum, kMax };
const char* reduce_op_name(ReduceOp op);

// One point-to-point operation of a batched group.
struct P2POp {
  enum class Kind : std::uint8_t { kSend, kRecv };
  Kind kind;
  TensorView buffer;
  int peer;
  int tag = 0;
  static P2POp send(const TensorView& buffer, int peer, int tag = 0) { return {Kind::kSend, buffer, peer, tag}; }
  static P2POp recv(const TensorView& buffer, int peer, int tag = 0) { return {Kind::kRecv, buffer, peer, tag}; }
};

// Bytes this rank has handed to / received from the network through one communicator, counted when an operation
// is posted (collectives count what this rank sends and receives, excluding its own block; all_reduce counts the
// volume of a ring all-reduce, 2 (P-1)/P of the buffer each way; barrier and split count no bytes). num_ops counts
// every posted operation except split, a batch_isend_irecv group once.
struct CommCounters {
  std::int64_t bytes_sent = 0;
  std::int64_t bytes_received = 0;
  std::int64_t num_ops = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend_name() const = 0;

  // ---- point to point ------------------------------------------------------------------------------
  virtual WorkHandle isend(const TensorView& buffer, int peer, int tag = 0) = 0;
  virtual WorkHandle irecv(const TensorView& buffer, int peer, int tag = 0) = 0;
  // Posts all operations together (no ordering among them can deadlock) and returns one handle for the group.
  virtual WorkHandle batch_isend_irecv(const std::vector<P2POp>& ops) = 0;

  // ---- collectives -----------------------------------------------------------------------------------
  // send and recv have equal numel, divisible by size(); block r (numel/size elements) of send goes to rank r and
  // block r of recv comes from rank r.
  virtual WorkHandle all_to_all(const TensorView& send, const TensorView& recv) = 0;
  // Variable splits: send_counts[r] elements (consecutive, in rank order) go to rank r; recv_counts[r] come from r.
  virtual WorkHandle all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts,
                                  const TensorView& recv, const std::vector<std::int64_t>& recv_counts) = 0;
  // recv.numel == size() * send.numel; rank r's block lands at offset r * send.numel.
  virtual WorkHandle all_gather(const TensorView& send, const TensorView& recv) = 0;
  // send.numel == size() * recv.numel; rank r receives the reduction of every rank's block r.
  virtual WorkHandle reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) = 0;
  // In place on every rank.
  virtual WorkHandle all_reduce(const TensorView& buffer, ReduceOp op) = 0;
  virtual WorkHandle broadcast(const TensorView& buffer, int root) = 0;
  virtual WorkHandle barrier() = 0;

  // Collective over this communicator: ranks with equal `color` form a new communicator, ordered by (key, rank).
  // A negative color gives nullptr on that rank.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  const CommCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  // The caller's compute stream (default: Stream::cpu(), i.e. the legacy default stream for device buffers).
  // Operations posted afterwards start only once the work queued on it so far has finished (an event, not a host
  // wait, in the NCCL backend; a stream synchronisation before staging in the MPI backend). Host buffers ignore it.
  // A backend may refuse a stream on another device than its own.
  virtual void set_stream(const Stream& stream) { stream_ = stream; }
  const Stream& stream() const { return stream_; }

 protected:
  CommCounters counters_;
  Stream stream_;
};

// Checks shared by backends; throw Error naming the operation and the offending value.
void check_peer(const Communicator& comm, int peer, const char* op);

}  // namespace seqpar
