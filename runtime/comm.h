// The communicator interface (after PyTorch c10d's Backend / Work): every operation is asynchronous and returns a
// Work handle whose wait(timeout) either completes or throws an Error naming the group, the operation, the bytes,
// the peers (by world rank and group rank) and the time waited; it never blocks forever. Buffers are host or device
// TensorViews, contiguous; counts are in elements.
//
// Synchronisation: an operation may read/write its buffers until its Work has completed; the caller keeps them
// alive and untouched until then. Operations on one communicator are issued in the same order on every rank (MPI's
// rule); point-to-point messages between a pair of ranks with the same tag are matched in posting order.
//
// Buffers of an unfinished operation (the rule on failure paths): when a Work is abandoned - wait() timed out or
// failed, or the Work was destroyed before it completed, for example while an exception unwinds the caller - the
// runtime never lets MPI touch freed memory. Receives are cancelled. A send or collective that MPI has not completed
// by then keeps its host buffers: the runtime records their address ranges, and when the caller's Tensor is freed
// afterwards that memory is deliberately kept (leaked, with a warning) instead of being returned to the system
// (runtime/comm_keepalive.h); pinned mirrors of staged device buffers are kept the same way, and a communicator with
// an abandoned collective is never freed. An NCCL communicator whose wait failed is aborted (ncclCommAbort), which
// stops its kernels; an NCCL Work destroyed unfinished leaves its kernels queued (they cannot be cancelled), and its
// device buffers must outlive them.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "env.h"
#include "tensor.h"

namespace seqpar {

// The handle of one posted operation. Destroying an unfinished Work cancels its receives (with a warning) and
// keeps the buffers MPI may still read (the rule above).
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation completes.
  // Args: timeout_s: seconds, default SEQPAR_COMM_TIMEOUT_S.
  // Errors: "<group>: <op> ... did not complete within T s" after timeout_s; later wait() / test() calls throw the
  //   same error again. A timed-out receive is cancelled and the communicator stays usable for point-to-point
  //   traffic; after a timed-out collective it is not (the collective cannot be cancelled).
  // Sync: host-blocking on this rank.
  virtual void wait(double timeout_s) = 0;
  void wait() { wait(env::comm_timeout_s()); }

  // Non-blocking completion check (also drives progress).
  // Returns: true once the operation has completed.
  // Errors: the error of a failed or timed-out operation.
  // Sync: host, non-blocking.
  virtual bool test() = 0;
};
using WorkHandle = std::unique_ptr<Work>;

// Waits for every non-null handle in order.
// Errors: the first wait() that throws.
// Sync: host-blocking, as Work::wait().
void wait_all(std::vector<WorkHandle>& works);

// The reductions of all_reduce and reduce_scatter.
enum class ReduceOp : std::uint8_t { kSum, kMax };

// The name of a reduction, for messages.
// Sync: host-only.
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

// The front-end of every backend. The public operations are not virtual: each one checks its arguments (peers,
// tags, dtypes, element counts, disjoint buffers, and the backend's buffer rules through check_buffer) on this rank
// before anything is posted, so that a bad call fails on every rank alike; then it calls the backend's protected
// do_* implementation and counts the bytes (CommCounters). Error messages start with the communicator's name and
// name peers by world rank and group rank ("ring: irecv of 65536 bytes from world rank 3 (ring rank 1) with tag 7
// did not complete within 5 s"). An operation a backend does not implement throws
// "backend <name> does not support <operation>".
//
// Adding a backend: derive from Communicator, call set_group() in the constructor, override backend_name(),
// check_buffer() and the do_* operations it supports, and add its name to make_world_communicator
// (runtime/comm_factory.h).
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Accessors: this rank in the group, the group size, the backend's name.
  // Sync: host-only.
  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual const char* backend_name() const = 0;

  // Where this backend wants its buffers.
  // Returns: the CPU (MPI; CUDA builds also stage device buffers) or its CUDA device (NCCL).
  // Sync: host-only.
  Device device() const { return device_; }

  // The group's name in error and log messages: "world" for a world communicator, "split" for one made by split()
  // until renamed (CpGrid names its groups "ulysses", "ring", "cp" and "dp").
  // Sync: host-only.
  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }

  // The world rank (rank in MPI_COMM_WORLD) of group rank `group_rank`; world_ranks()[r] for every r.
  // Errors: group_rank outside [0, size()).
  // Sync: host-only.
  int world_rank_of(int group_rank) const;
  const std::vector<int>& world_ranks() const { return world_ranks_; }

  // A peer for messages.
  // Returns: "world rank 3 (ring rank 1)" ("world rank 3" for the world communicator itself).
  // Sync: host-only.
  std::string peer_str(int group_rank) const;

  // The group's members for messages.
  // Returns: "world rank 2", "world ranks 0-3", or "world ranks 0, 2, 4, 6".
  // Sync: host-only.
  std::string members_str() const;

  // ---- point to point ------------------------------------------------------------------------------
  // Sends `buffer` to / receives it from group rank `peer`; messages of a pair with one tag match in posting order.
  // Returns: the Work; `buffer` stays alive and untouched until it completes.
  // Errors: a bad peer or tag, too many elements, a buffer the backend cannot move (check_buffer); the backend
  //   does not support the operation.
  // Sync: asynchronous point-to-point with `peer`; ordered after this communicator's stream (set_stream).
  WorkHandle isend(const TensorView& buffer, int peer, int tag = 0);
  WorkHandle irecv(const TensorView& buffer, int peer, int tag = 0);

  // Posts all operations together (no ordering among them can deadlock).
  // Returns: one handle for the group.
  // Errors: as isend / irecv for each operation; overlapping buffers of two operations.
  // Sync: asynchronous point-to-point with the peers named; ordered after set_stream's stream.
  WorkHandle batch_isend_irecv(const std::vector<P2POp>& ops);

  // ---- collectives -----------------------------------------------------------------------------------
  // Each collective below:
  // Returns: the Work; the buffers stay alive and untouched until it completes.
  // Errors: element counts or dtypes that do not fit, overlapping send and recv, a buffer the backend cannot move
  //   (check_buffer), a bad root; the backend does not support the operation.
  // Sync: asynchronous collective over this communicator (same order on every rank); ordered after set_stream's
  //   stream.

  // Block r (numel/size elements) of send goes to rank r and block r of recv comes from rank r.
  // Args: send, recv: equal numel, divisible by size().
  WorkHandle all_to_all(const TensorView& send, const TensorView& recv);

  // All-to-all with variable splits.
  // Args: send_counts[r] elements (consecutive, in rank order) go to rank r; recv_counts[r] come from r. The block
  //   a rank sends itself has as many elements as it receives from itself.
  WorkHandle all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts, const TensorView& recv,
                          const std::vector<std::int64_t>& recv_counts);

  // Rank r's block lands at offset r * send.numel of recv.
  // Args: recv.numel == size() * send.numel.
  WorkHandle all_gather(const TensorView& send, const TensorView& recv);

  // Rank r receives the reduction of every rank's block r.
  // Args: send.numel == size() * recv.numel.
  WorkHandle reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op);

  // Reduction in place on every rank; broadcast of `buffer` from group rank `root`; barrier.
  WorkHandle all_reduce(const TensorView& buffer, ReduceOp op);
  WorkHandle broadcast(const TensorView& buffer, int root);
  WorkHandle barrier();

  // Ranks with equal `color` form a new communicator (named "split", on the same stream), ordered by (key, rank).
  // Returns: the new communicator; nullptr on a rank with a negative color.
  // Errors: the backend does not support split.
  // Sync: collective over this communicator, host-blocking.
  std::unique_ptr<Communicator> split(int color, int key);

  // The bytes and operations counted so far (CommCounters); reset_counters() zeroes them.
  // Sync: host-only.
  const CommCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  // The caller's compute stream (default: Stream::cpu(), i.e. the legacy default stream for device buffers).
  // Operations posted afterwards start only once the work queued on it so far has finished. Host buffers ignore it.
  // Errors: a backend may refuse a stream on another device than its own (NCCL does).
  // Sync: stream: an event, not a host wait, in the NCCL backend; a stream synchronisation before staging in the
  //   MPI backend.
  void set_stream(const Stream& stream);
  const Stream& stream() const { return stream_; }

 protected:
  Communicator() = default;
  // Called once by every backend constructor: this rank, the group size and the world rank of every group rank.
  void set_group(int rank, int size, std::vector<int> world_ranks, Device device = Device::cpu());

  // ---- backend hooks -----------------------------------------------------------------------------------
  // Throws when `t` is not a buffer this backend can move (device, pointer); `op` names the operation.
  virtual void check_buffer(const TensorView& t, const std::string& op) const = 0;
  // The largest tag (MPI_TAG_UB) and the most elements in one message (MPI: INT_MAX) this backend accepts.
  virtual int max_tag() const { return std::numeric_limits<int>::max(); }
  virtual std::int64_t max_message_elements() const { return std::numeric_limits<std::int64_t>::max(); }
  virtual void do_set_stream(const Stream& stream);

  // The operations, called with checked arguments; `what` describes the operation for error messages ("ring:
  // irecv of 64 bytes from world rank 3 (ring rank 1) with tag 7"). Each default throws "backend X does not support Y".
  virtual WorkHandle do_isend(const TensorView& buffer, int peer, int tag, std::string what);
  virtual WorkHandle do_irecv(const TensorView& buffer, int peer, int tag, std::string what);
  virtual WorkHandle do_batch_isend_irecv(const std::vector<P2POp>& ops, std::string what);
  virtual WorkHandle do_all_to_all(const TensorView& send, const TensorView& recv, std::string what);
  virtual WorkHandle do_all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts,
                                     const TensorView& recv, const std::vector<std::int64_t>& recv_counts,
                                     std::string what);
  virtual WorkHandle do_all_gather(const TensorView& send, const TensorView& recv, std::string what);
  virtual WorkHandle do_reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op, std::string what);
  virtual WorkHandle do_all_reduce(const TensorView& buffer, ReduceOp op, std::string what);
  virtual WorkHandle do_broadcast(const TensorView& buffer, int root, std::string what);
  virtual WorkHandle do_barrier(std::string what);
  // Returns the new communicator (nullptr for a negative color); the front-end names it and sets its stream.
  virtual std::unique_ptr<Communicator> do_split(int color, int key, std::string what);

  // The world ranks of the communicator split() makes on this rank, from every rank's (color, key) in rank order
  // (2 * size() entries): the ranks of equal color ordered by (key, rank), as MPI_Comm_split and ncclCommSplit
  // order them. Empty for a negative color.
  std::vector<int> split_world_ranks(const std::vector<std::int32_t>& color_key, int color) const;

 private:
  [[noreturn]] void unsupported(const char* op) const;
  // Counts one communication call for SEQPAR_FAULT and injects the configured fault there (runtime/fault.h).
  void fault_point(const char* op) const;
  void check_peer(int peer, const char* op) const;
  std::string check_p2p(const P2POp& op, const char* name) const;
  WorkHandle post_p2p(const P2POp& op);  // isend / irecv
  // Adds one posted operation and its bytes to counters_.
  void count(std::int64_t sent, std::int64_t received);
  void check_tag(int tag, const char* op) const;
  void check_elements(std::int64_t count, const char* op) const;
  // `names` replaces "send" / "recv" in the message ("operations 0 and 2").
  void check_disjoint(const TensorView& send, const TensorView& recv, const char* op,
                      const std::string& names = {}) const;
  // "<name>: <op>" for messages.
  std::string where(const char* op) const;

  int rank_ = 0;
  int size_ = 1;
  Device device_;
  std::vector<int> world_ranks_{0};
  std::string name_ = "world";
  CommCounters counters_;
  Stream stream_;
};

// The wait loop of every backend's Work::wait: polls `done` until it returns true or `timeout_s` seconds have
// passed. Spins briefly, then backs off, so that oversubscribed ranks leave their cores to their peers.
// Args: waited_s: out, the seconds waited.
// Returns: true when `done` returned true; false on timeout.
// Errors: "<what>: wait timeout T s must be finite and >= 0" for a bad timeout, before polling.
// Sync: host-blocking.
bool poll_until(const std::function<bool()>& done, double timeout_s, const std::string& what, double& waited_s);

}  // namespace seqpar
