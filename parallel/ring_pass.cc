#include "parallel/ring_pass.h"

#include <algorithm>
#include <numeric>

#include "parallel/cp_common.h"
#include "runtime/tensor_ops.h"

namespace seqpar {

void ring_circulate(Communicator& comm, const TensorView& local_block, int tag, const RingVisit& visit,
                    double* exposed_s, Stream stream) {
  const DeviceAlloc alloc{local_block.device(), stream};
  const int p = comm.size(), r = comm.rank();
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  Tensor buf[2] = {alloc.copy_of(local_block, local_block.dtype(), MemCategory::kCommBuffer),
                   alloc.empty(local_block.shape(), local_block.dtype(), MemCategory::kCommBuffer)};
  int cur = 0;
  for (int step = 0; step < p; ++step) {
    WorkHandle w;
    if (step + 1 < p) {
      w = comm.batch_isend_irecv(
          {P2POp::send(buf[cur].view(), next, tag), P2POp::recv(buf[1 - cur].view(), prev, tag)});
    }
    visit((r - step + p) % p, buf[cur].view());
    timed_wait(w, exposed_s);
    cur = 1 - cur;
  }
}

void ring_circulate_with_grad(Communicator& comm, const TensorView& local_block, const Shape& grad_shape,
                              const TensorView& home_grad, int tag, const RingGradVisit& visit, double* exposed_s,
                              Stream stream) {
  const DeviceAlloc alloc{common_device({local_block, home_grad}, "ring_circulate_with_grad"), stream};
  const DType acc = home_grad.dtype();
  SEQPAR_CHECK((acc == DType::kFloat32 || acc == DType::kFloat64) && home_grad.numel() == shape_numel(grad_shape),
               "ring_circulate_with_grad: home_grad ", home_grad.str(), " must be fp32 or fp64 with the elements of ",
               shape_str(grad_shape));
  const int p = comm.size(), r = comm.rank();
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  const int grad_tag = tag + 1;
  Tensor buf[2] = {alloc.copy_of(local_block, local_block.dtype(), MemCategory::kCommBuffer),
                   alloc.empty(local_block.shape(), local_block.dtype(), MemCategory::kCommBuffer)};
  // out[i]: this rank's running sum for the block of the step, sent downstream; in[i]: upstream partial sums.
  Tensor out[2] = {alloc.empty(grad_shape, acc, MemCategory::kCommBuffer),
                   alloc.empty(grad_shape, acc, MemCategory::kCommBuffer)};
  Tensor in[2];
  if (p > 1) {
    in[0] = alloc.empty(grad_shape, acc, MemCategory::kCommBuffer);
    in[1] = alloc.empty(grad_shape, acc, MemCategory::kCommBuffer);
  }
  // grads[i]: the step's exchange of accumulators (send ours downstream, receive the upstream partial), posted as
  // one group so that backends that run a communicator's operations in order (NCCL) never wait on a lone receive.
  WorkHandle grads[2];
  int cur = 0;
  for (int step = 0; step < p; ++step) {
    const int slot = step % 2;
    WorkHandle w;
    if (step + 1 < p) {
      w = comm.batch_isend_irecv(
          {P2POp::send(buf[cur].view(), next, tag), P2POp::recv(buf[1 - cur].view(), prev, tag)});
    }
    out[slot].fill_zero(alloc.stream);  // its send (two steps ago) completed when that exchange was waited for
    visit((r - step + p) % p, buf[cur].view(), out[slot].view());
    if (step > 0) {
      timed_wait(grads[1 - slot], exposed_s);  // contributions of the ranks that saw this block before us
      add_inplace(out[slot].view(), in[1 - slot].view(), stream);
    }
    if (p > 1) {
      grads[slot] = comm.batch_isend_irecv(
          {P2POp::send(out[slot].view(), next, grad_tag), P2POp::recv(in[slot].view(), prev, grad_tag)});
    }
    timed_wait(w, exposed_s);
    cur = 1 - cur;
  }
  if (p == 1) {
    alloc.copy_convert(out[0].view(), home_grad);
    return;
  }
  const int last = (p - 1) % 2;  // the last exchange brings this rank's own block home
  timed_wait(grads[last], exposed_s);
  alloc.copy_convert(in[last].view(), home_grad);
}

// ---- windowed schedule -----------------------------------------------------------------------------------

namespace {

// Rows j of k_pos with 0 <= q - k_pos[j] < window for some q of q_pos (both increasing) and, with q_docs (the
// queries' document bounds, or null), lo(q) <= k_pos[j] < hi(q). The nearest query at or after the key decides:
// documents are contiguous runs of slots with their padding at the end, so a later query lies in the same document
// only if the nearest one does, and is no closer.
std::vector<std::int64_t> visible_rows(const std::vector<std::int64_t>& q_pos, const std::vector<std::int64_t>& k_pos,
                                       std::int64_t window, const DocBounds* q_docs) {
  std::vector<std::int64_t> rows;
  for (std::size_t j = 0; j < k_pos.size(); ++j) {
    const auto q = std::lower_bound(q_pos.begin(), q_pos.end(), k_pos[j]);
    if (q == q_pos.end() || *q - k_pos[j] >= window) continue;
    const std::size_t i = static_cast<std::size_t>(q - q_pos.begin());
    if (q_docs != nullptr && (k_pos[j] < q_docs->lo[i] || k_pos[j] >= q_docs->hi[i])) continue;
    rows.push_back(static_cast<std::int64_t>(j));
  }
  return rows;
}

// [N, L, ...] with L replaced by n.
Shape with_rows(Shape shape, std::int64_t n) {
  shape[1] = n;
  return shape;
}

std::int64_t total_rows(const std::vector<std::vector<std::int64_t>>& lists) {
  std::int64_t n = 0;
  for (const auto& l : lists) n += static_cast<std::int64_t>(l.size());
  return n;
}

}  // namespace

WindowPlan::WindowPlan(const std::vector<std::vector<std::int64_t>>& positions, int rank, std::int64_t window,
                       const std::vector<DocBounds>& doc_bounds)
    : size_(static_cast<int>(positions.size())), rank_(rank) {
  SEQPAR_CHECK(size_ >= 1 && rank >= 0 && rank < size_, "WindowPlan: rank ", rank, " outside a group of ", size_);
  SEQPAR_CHECK(window > 0, "WindowPlan: window ", window, " must be > 0");
  block_rows_ = static_cast<std::int64_t>(positions[0].size());
  for (const auto& p : positions) {
    SEQPAR_CHECK(static_cast<std::int64_t>(p.size()) == block_rows_ && std::is_sorted(p.begin(), p.end()),
                 "WindowPlan: every rank needs ", block_rows_, " increasing positions; got ", p.size());
  }
  SEQPAR_CHECK(doc_bounds.empty() || doc_bounds.size() == positions.size(), "WindowPlan: ", doc_bounds.size(),
               " ranks' document bounds for ", positions.size(), " ranks' positions (none or one per rank)");
  for (const DocBounds& b : doc_bounds) {
    SEQPAR_CHECK(static_cast<std::int64_t>(b.lo.size()) == block_rows_ && b.hi.size() == b.lo.size(),
                 "WindowPlan: document bounds of ", b.lo.size(), " / ", b.hi.size(), " positions; expected ",
                 block_rows_);
  }
  // rows(dst, src)
  const auto rows = [&](int dst, int src) {
    return visible_rows(positions[dst], positions[src], window, doc_bounds.empty() ? nullptr : &doc_bounds[dst]);
  };
  all_rows_.resize(static_cast<std::size_t>(block_rows_));
  std::iota(all_rows_.begin(), all_rows_.end(), 0);
  send_rows_.resize(static_cast<std::size_t>(size_));
  recv_rows_.resize(static_cast<std::size_t>(size_));
  for (int d = 1; d < size_; ++d) {
    const int next = (rank + d) % size_, prev = (rank - d + size_) % size_;
    send_rows_[d] = rows(next, rank);
    recv_rows_[d] = rows(rank, prev);
    bool any = false;  // any pair (r + d, r) of the group
    for (int r = 0; r < size_ && !any; ++r) any = !rows((r + d) % size_, r).empty();
    if (any) rounds_.push_back(d);
  }
}

std::vector<DocBounds> window_doc_bounds(const SequenceLayout& layout,
                                         const std::vector<std::vector<std::int64_t>>& positions) {
  std::vector<DocBounds> docs;
  if (!layout.is_packed() && !layout.has_padding()) return docs;
  for (const auto& pos : positions) docs.push_back(layout.doc_bounds_of_slots(pos));
  return docs;
}

std::vector<std::int64_t> positions_of_rows(const std::vector<std::int64_t>& positions,
                                            std::span<const std::int64_t> rows) {
  std::vector<std::int64_t> out(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) out[i] = positions[static_cast<std::size_t>(rows[i])];
  return out;
}

std::int64_t WindowPlan::rows_sent() const { return total_rows(send_rows_); }
std::int64_t WindowPlan::rows_received() const { return total_rows(recv_rows_); }

namespace {

// One round's block messages: the packed rows for rank + d, the buffer for the rows of rank - d.
struct WindowRound {
  Tensor send, recv;
  WorkHandle work;
};

WindowRound post_window_round(Communicator& comm, const WindowPlan& plan, const DeviceAlloc& alloc,
                              const TensorView& local_block, int d, int tag) {
  const int p = plan.size(), r = plan.rank();
  WindowRound round;
  std::vector<P2POp> ops;
  const auto send_rows = plan.send_rows(d);
  const auto recv_rows = plan.recv_rows(d);
  if (!send_rows.empty()) {
    round.send = alloc.empty(with_rows(local_block.shape(), static_cast<std::int64_t>(send_rows.size())),
                             local_block.dtype(), MemCategory::kCommBuffer);
    gather_rows(local_block, 1, send_rows, round.send.view(), alloc.stream);
    ops.push_back(P2POp::send(round.send.view(), (r + d) % p, tag));
  }
  if (!recv_rows.empty()) {
    round.recv = alloc.empty(with_rows(local_block.shape(), static_cast<std::int64_t>(recv_rows.size())),
                             local_block.dtype(), MemCategory::kCommBuffer);
    ops.push_back(P2POp::recv(round.recv.view(), (r - d + p) % p, tag));
  }
  if (!ops.empty()) round.work = comm.batch_isend_irecv(ops);
  return round;
}

void check_window_plan(const Communicator& comm, const WindowPlan& plan, const TensorView& local_block) {
  SEQPAR_CHECK(comm.size() == plan.size() && comm.rank() == plan.rank(), "window exchange: plan for rank ", plan.rank(),
               " of ", plan.size(), " used on rank ", comm.rank(), " of ", comm.size());
  SEQPAR_CHECK(local_block.ndim() >= 2 && local_block.dim(1) == plan.block_rows(), "window exchange: block ",
               local_block.str(), " must be [N, ", plan.block_rows(), ", ...]");
}

}  // namespace

void window_exchange(Communicator& comm, const WindowPlan& plan, const TensorView& local_block, int tag,
                     const WindowVisit& visit, double* exposed_s, Stream stream) {
  check_window_plan(comm, plan, local_block);
  const DeviceAlloc alloc{local_block.device(), stream};
  const int p = plan.size(), r = plan.rank();
  const std::vector<int>& rounds = plan.rounds();
  const std::size_t n = rounds.size();
  WindowRound cur, next;
  if (n > 0) cur = post_window_round(comm, plan, alloc, local_block, rounds[0], tag);
  visit(r, local_block, plan.all_rows());
  for (std::size_t i = 0; i < n; ++i) {
    if (i + 1 < n) next = post_window_round(comm, plan, alloc, local_block, rounds[i + 1], tag);
    timed_wait(cur.work, exposed_s);
    const int d = rounds[i];
    if (cur.recv.defined()) visit((r - d + p) % p, cur.recv.view(), plan.recv_rows(d));
    cur = std::move(next);
    next = {};
  }
}

void window_exchange_with_grad(Communicator& comm, const WindowPlan& plan, const TensorView& local_block,
                               const Shape& grad_shape, const TensorView& home_grad, int tag,
                               const WindowGradVisit& visit, double* exposed_s, Stream stream) {
  check_window_plan(comm, plan, local_block);
  const DeviceAlloc alloc{common_device({local_block, home_grad}, "window_exchange_with_grad"), stream};
  const DType acc = home_grad.dtype();
  SEQPAR_CHECK((acc == DType::kFloat32 || acc == DType::kFloat64) && home_grad.numel() == shape_numel(grad_shape) &&
                   grad_shape.size() >= 2 && grad_shape[1] == plan.block_rows(),
               "window_exchange_with_grad: home_grad ", home_grad.str(), " must be fp32 or fp64 with the elements of ",
               shape_str(grad_shape), " (rows along dim 1: ", plan.block_rows(), ")");
  const int p = plan.size(), r = plan.rank();
  const std::vector<int>& rounds = plan.rounds();
  const std::size_t n = rounds.size();
  const TensorView home = home_grad.reshape(grad_shape);
  // One round's accumulators: ours for the rows of rank - d (sent back to it), theirs for our rows (from rank + d).
  struct GradRound {
    Tensor out, in;
    WorkHandle work;
    int d = 0;
  };
  // Adds the contributions of a finished accumulator round into home (round order: deterministic).
  auto land = [&](GradRound& g) {
    timed_wait(g.work, exposed_s);
    if (g.in.defined()) index_add_rows(g.in.view(), 1, plan.send_rows(g.d), home, stream);
    g = {};
  };
  WindowRound cur, next;
  GradRound pending;
  if (n > 0) cur = post_window_round(comm, plan, alloc, local_block, rounds[0], tag);
  fill(home, 0.0, stream);
  visit(r, local_block, plan.all_rows(), home);
  for (std::size_t i = 0; i < n; ++i) {
    if (i + 1 < n) next = post_window_round(comm, plan, alloc, local_block, rounds[i + 1], tag);
    timed_wait(cur.work, exposed_s);
    const int d = rounds[i];
    GradRound g;
    g.d = d;
    std::vector<P2POp> ops;
    if (cur.recv.defined()) {
      const auto rows = plan.recv_rows(d);
      g.out = alloc.zeros(with_rows(grad_shape, static_cast<std::int64_t>(rows.size())), acc, MemCategory::kCommBuffer);
      visit((r - d + p) % p, cur.recv.view(), rows, g.out.view());
      ops.push_back(P2POp::send(g.out.view(), (r - d + p) % p, tag + 1));
    }
    if (!plan.send_rows(d).empty()) {
      g.in = alloc.empty(with_rows(grad_shape, static_cast<std::int64_t>(plan.send_rows(d).size())), acc,
                         MemCategory::kCommBuffer);
      ops.push_back(P2POp::recv(g.in.view(), (r + d) % p, tag + 1));
    }
    if (!ops.empty()) g.work = comm.batch_isend_irecv(ops);
    land(pending);  // the previous round's accumulators, while this round's are in flight
    pending = std::move(g);
    cur = std::move(next);
    next = {};
  }
  land(pending);
}

}  // namespace seqpar
