// The ring schedules every context-parallel algorithm here is built from (Liu et al. 2023, "Ring Attention"):
// ring_circulate (a block visits every rank, double-buffered), ring_circulate_with_grad (plus an accumulator one step
// behind that arrives home after P hops), and window_exchange (only the rows a causal sliding window needs travel,
// directly from owner to user, in rounds by ring distance).
// Math and schedules: docs/design.md, "Ring attention" and "Sliding-window ring" (WindowPlan's rows(dst, src), the
// round order and the deadlock-freedom argument).
//
// Deadlock freedom: every exchange posts its receive and send together (batch_isend_irecv), blocks on tag and
// accumulators on tag + 1, in the same order on every rank, for any P >= 1.
// Synchronisation: collective over `comm`, host-synchronous. `exposed_s` (may be null) accumulates the seconds
// blocked in waits. Device buffers (one schedule for host and device): every copy, fill and sum here is a
// runtime/tensor_ops.h call on `stream` that returns after the stream has finished it, and the visits' kernels
// (attn::mha_forward / mha_backward / lse_merge) return after their stream work too, so a buffer is complete before
// the send that reads it is posted and a received one is read only after its wait. The communicator orders its own
// side on the stream set on it (CommStreamScope sets the layer's): the MPI backend stages a device buffer through
// pinned host memory with copies ordered after the work queued on that stream (runtime/cuda_staging.h); NCCL makes
// its stream wait on an event of that stream and the stream wait on its completion (runtime/nccl_comm.h).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "layout.h"
#include "../runtime/comm.h"

namespace seqpar {

using RingVisit = std::function<void(int src, const TensorView& block)>;
using RingGradVisit = std::function<void(int src, const TensorView& block, const TensorView& grad)>;

// Buffers live on local_block's device; copies, fills and sums run on `stream`.
void ring_circulate(Communicator& comm, const TensorView& local_block, int tag, const RingVisit& visit,
                    double* exposed_s = nullptr, Stream stream = Stream::cpu());

// home_grad: fp32 or fp64 (the accumulators' dtype) with the element count of `grad_shape`; receives the full
// gradient of this rank's block.
void ring_circulate_with_grad(Communicator& comm, const TensorView& local_block, const Shape& grad_shape,
                              const TensorView& home_grad, int tag, const RingGradVisit& visit,
                              double* exposed_s = nullptr, Stream stream = Stream::cpu());

// The rows each rank of a ring needs of each other rank's block under a causal sliding window (docs/design.md,
// "Sliding-window ring"). Built identically on every rank from `positions` (every rank's increasing global
// positions, all of one length L), `window` (> 0) and, for a packed or padded row, `doc_bounds`: every rank's
// per-position document bounds
// (SequenceLayout::doc_bounds_of_slots of its positions; a padding position has lo = hi). With them a key row is
// needed only when a query of its own document sees it, rows(dst, src) = { j : 0 <= q - pos_src[j] < W and
// lo(q) <= pos_src[j] < hi(q) for some q in pos_dst }, so rows of other documents and padding rows never travel;
// empty: one document, no padding. Cost: O(P^2 L log L) on construction; no communication.
class WindowPlan {
 public:
  WindowPlan(const std::vector<std::vector<std::int64_t>>& positions, int rank, std::int64_t window,
             const std::vector<DocBounds>& doc_bounds = {});

  int size() const { return size_; }
  int rank() const { return rank_; }
  std::int64_t block_rows() const { return block_rows_; }  // L
  // Rows of this rank's block that rank (rank + d) mod P needs / rows of rank (rank - d) mod P's block this rank
  // needs; d in [1, P). Empty: no message.
  std::span<const std::int64_t> send_rows(int d) const { return send_rows_[d]; }
  std::span<const std::int64_t> recv_rows(int d) const { return recv_rows_[d]; }
  std::span<const std::int64_t> all_rows() const { return all_rows_; }  // 0..L-1 (this rank's own block)
  // The distances with a message anywhere in the group, increasing (identical on every rank).
  const std::vector<int>& rounds() const { return rounds_; }
  std::int64_t rows_sent() const;      // sum over d of |send_rows(d)|
  std::int64_t rows_received() const;  // sum over d of |recv_rows(d)|

 private:
  int size_, rank_;
  std::int64_t block_rows_;
  std::vector<std::vector<std::int64_t>> send_rows_, recv_rows_;
  std::vector<std::int64_t> all_rows_;
  std::vector<int> rounds_;
};

// WindowPlan's doc_bounds for ranks holding `positions` of `layout`: each rank's bounds when the layout is packed or
// padded, else none (one document).
std::vector<DocBounds> window_doc_bounds(const SequenceLayout& layout,
                                         const std::vector<std::vector<std::int64_t>>& positions);

// The global positions of `rows` of a block whose rows sit at `positions` (positions[rows[i]]).
std::vector<std::int64_t> positions_of_rows(const std::vector<std::int64_t>& positions,
                                            std::span<const std::int64_t> rows);

// rows: indices into the sender's block of the rows in `block` (block row i is the sender's row rows[i]).
using WindowVisit = std::function<void(int src, const TensorView& block, std::span<const std::int64_t> rows)>;
using WindowGradVisit =
    std::function<void(int src, const TensorView& block, std::span<const std::int64_t> rows, const TensorView& grad)>;

// local_block [N, L, ...] (rows along dim 1). visit runs on this rank's own block first (rows = all_rows()), then
// on every received block in round order. Collective over `comm` (size plan.size(), rank plan.rank()).
void window_exchange(Communicator& comm, const WindowPlan& plan, const TensorView& local_block, int tag,
                     const WindowVisit& visit, double* exposed_s = nullptr, Stream stream = Stream::cpu());

// grad_shape [N', L, ...] (rows along dim 1); home_grad fp32 or fp64 with its elements: receives this rank's own
// contribution plus every contribution sent back, added in round order. visit adds into a zeroed grad of
// [N', rows.size(), ...] for the rows it was given.
void window_exchange_with_grad(Communicator& comm, const WindowPlan& plan, const TensorView& local_block,
                               const Shape& grad_shape, const TensorView& home_grad, int tag,
                               const WindowGradVisit& visit, double* exposed_s = nullptr,
                               Stream stream = Stream::cpu());

}  // namespace seqpar
