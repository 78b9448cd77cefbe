// The two ring schedules every context-parallel algorithm here is built from (Liu et al. 2023, "Ring Attention").
//
// ring_circulate: a block (K/V, a latent, index keys) visits every rank of `comm`, one hop per step, P steps;
// the next block's send / receive is posted before the current block is processed (double buffering), so that
// communication overlaps `visit`. Step s at rank r sees the block of rank (r - s) mod P.
//
// ring_circulate_with_grad: the same, plus a gradient accumulator per block (fp32, or fp64 for fp64 results: the
// dtype of home_grad) that follows it one step behind:
// at each step `visit` adds this rank's contribution into a zeroed buffer while the upstream partial sum is in
// flight; the partial is then added (fixed order: local contribution + upstream partial) and sent on, grouped with
// the receive of the next partial (so that backends running a communicator's operations in order, like NCCL, never
// wait on a lone receive). After P hops the sum of every rank's contribution arrives home in `home_grad`.
//
// Deadlock freedom: every exchange posts its receive and send together (batch_isend_irecv), blocks on tag, gradients
// on tag + 1, in the same order on every rank, for any P >= 1. Synchronisation: collective over `comm`,
// host-synchronous. `exposed_s` (may be null) accumulates the seconds blocked in waits.
//
// window_exchange / window_exchange_with_grad: the schedule of a causal sliding window of W tokens, where only the
// rows a rank can see travel. A WindowPlan lists, for every ordered pair (dst, src), the rows of src's block that some
// query of dst sees: rows(dst, src) = { j : 0 <= q - pos_src[j] < W for some q in pos_dst }, a pure function of
// (positions of every rank, W), so that every rank computes the same plan without communication, sender and
// receiver agree on every message and its size, and a block no local query can see is neither sent, received nor
// computed. Rows travel directly from src to dst (not relayed: for zigzag and stripe the ranks that need a block
// are not the next ones in ring order) in rounds by ring distance: in round d, rank r sends rows(r+d, r) to r+d and
// receives rows(r, r-d) from r-d (mod P; a side with no rows posts nothing). Rounds are the distances d in
// [1, P) at which any pair of the group exchanges rows (the same list on every rank). The backward sends each
// received block's accumulator (its rows only) straight back to the owner in the same round, which adds the
// contributions into its home accumulator in round order (deterministic).
// Bytes per rank (rows of `row_bytes` each, the plan's counts): sent rows_sent() row_bytes forward, plus
// rows_received() grad_row_bytes backward; received: the mirror. For per-layout closed forms see ring_attention.h.
// Deadlock freedom: every round's operations are posted as one group (batch_isend_irecv), blocks on tag and
// accumulators on tag + 1, and every rank posts its groups in the same global order (block groups of rounds d1, d2,
// then for i >= 1 the accumulator group of round d_i before the block group of round d_{i+2}); a rank with no
// message in a group skips it. Each message is matched by its partner in the same group, so by induction over that
// order the first unfinished group can always complete, also on backends that run a communicator's operations in
// order (NCCL): no rank ever waits on a group that its partner posts after a group the rank has not finished.
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

// The rows each rank of a ring needs of each other rank's block under a causal sliding window (see above). Built
// identically on every rank from `positions` (every rank's increasing global positions, all of one length L),
// `window` (> 0) and, for a packed or padded row, `doc_bounds`: every rank's per-position document bounds
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
