#include "runtime/comm.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

#include "runtime/fault.h"

namespace seqpar {

void wait_all(std::vector<WorkHandle>& works) {
  for (auto& w : works) {
    if (w) w->wait();
  }
}

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "max"; }

bool poll_until(const std::function<bool()>& done, double timeout_s, const std::string& what, double& waited_s) {
  SEQPAR_CHECK(std::isfinite(timeout_s) && timeout_s >= 0, what, ": wait timeout ", timeout_s,
               " s must be finite and >= 0");
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (long polls = 0; !done(); ++polls) {
    waited_s = std::chrono::duration<double>(clock::now() - start).count();
    if (waited_s > timeout_s) return false;
    // Spin briefly for latency, then back off so that oversubscribed ranks let their peers run.
    if (polls > 2000) {
      std::this_thread::sleep_for(std::chrono::microseconds(polls > 20000 ? 200 : 20));
    } else if (polls > 200) {
      std::this_thread::yield();
    }
  }
  waited_s = std::chrono::duration<double>(clock::now() - start).count();
  return true;
}

// ---- group identity ---------------------------------------------------------------------------------------------

void Communicator::set_group(int rank, int size, std::vector<int> world_ranks, Device device) {
  SEQPAR_ASSERT(size >= 1 && 0 <= rank && rank < size && static_cast<int>(world_ranks.size()) == size,
                "communicator rank ", rank, " of ", size, " with ", world_ranks.size(), " world ranks");
  rank_ = rank;
  size_ = size;
  world_ranks_ = std::move(world_ranks);
  device_ = device;
}

int Communicator::world_rank_of(int group_rank) const {
  SEQPAR_CHECK(0 <= group_rank && group_rank < size_, name_, ": rank ", group_rank,
               " is outside the communicator of size ", size_);
  return world_ranks_[static_cast<std::size_t>(group_rank)];
}

std::string Communicator::peer_str(int group_rank) const {
  const int w = world_rank_of(group_rank);
  bool world = name_ == "world";  // the world communicator: group ranks are world ranks
  for (int r = 0; r < size_ && world; ++r) world = world_ranks_[static_cast<std::size_t>(r)] == r;
  return world ? str_cat("world rank ", w) : str_cat("world rank ", w, " (", name_, " rank ", group_rank, ")");
}

std::string Communicator::members_str() const {
  if (size_ == 1) return str_cat("world rank ", world_ranks_[0]);
  bool consecutive = true;
  for (int r = 1; r < size_ && consecutive; ++r) consecutive = world_ranks_[r] == world_ranks_[r - 1] + 1;
  if (consecutive) return str_cat("world ranks ", world_ranks_.front(), "-", world_ranks_.back());
  std::string out = "world ranks ";
  constexpr int kListed = 16;
  for (int r = 0; r < size_ && r < kListed; ++r) out += str_cat(r ? ", " : "", world_ranks_[r]);
  if (size_ > kListed) out += str_cat(", ... (", size_, " ranks)");
  return out;
}

std::vector<int> Communicator::split_world_ranks(const std::vector<std::int32_t>& color_key, int color) const {
  SEQPAR_ASSERT(static_cast<int>(color_key.size()) == 2 * size_, "split table of ", color_key.size(), " entries");
  if (color < 0) return {};
  std::vector<std::tuple<std::int32_t, int>> members;  // (key, parent rank)
  for (int r = 0; r < size_; ++r) {
    if (color_key[2 * r] == color) members.emplace_back(color_key[2 * r + 1], r);
  }
  std::sort(members.begin(), members.end());
  std::vector<int> out;
  out.reserve(members.size());
  for (const auto& [key, r] : members) out.push_back(world_ranks_[static_cast<std::size_t>(r)]);
  return out;
}

// ---- argument checks --------------------------------------------------------------------------------------------

std::string Communicator::where(const char* op) const { return str_cat(name_, ": ", op); }

void Communicator::check_peer(int peer, const char* op) const {
  SEQPAR_CHECK(0 <= peer && peer < size_, where(op), ": peer ", peer, " is outside the communicator of size ", size_,
               " (", members_str(), ")");
}

void Communicator::check_tag(int tag, const char* op) const {
  SEQPAR_CHECK(0 <= tag && tag <= max_tag(), where(op), ": tag ", tag, " must be in [0, ", max_tag(), "] (backend ",
               backend_name(), ")");
}

void Communicator::check_elements(std::int64_t count, const char* op) const {
  SEQPAR_CHECK(count >= 0 && count <= max_message_elements(), where(op), ": element count ", count, " exceeds the ",
               backend_name(), " backend's limit of ", max_message_elements(), " per message");
}

// MPI and NCCL forbid overlapping send and receive buffers in a collective (outside the in-place layouts).
void Communicator::check_disjoint(const TensorView& send, const TensorView& recv, const char* op,
                                  const std::string& names) const {
  if (send.nbytes() == 0 || recv.nbytes() == 0) return;
  const char* s = static_cast<const char*>(send.data());
  const char* r = static_cast<const char*>(recv.data());
  SEQPAR_CHECK(s + send.nbytes() <= r || r + recv.nbytes() <= s, where(op), ": ", names.empty() ? "send" : names, " ",
               send.str(), " and ", names.empty() ? "recv " : "", recv.str(),
               " overlap; they must be distinct buffers");
}

// SEQPAR_FAULT (runtime/fault.h): every public operation is one counted communication call.
void Communicator::fault_point(const char* op) const { fault::on_comm_call(where(op).c_str()); }

void Communicator::unsupported(const char* op) const {
  SEQPAR_THROW(name_, ": backend ", backend_name(), " does not support ", op);
}

void Communicator::count(std::int64_t sent, std::int64_t received) {
  counters_.bytes_sent += sent;
  counters_.bytes_received += received;
  ++counters_.num_ops;
}

// ---- point to point ---------------------------------------------------------------------------------------------

// Checks one point-to-point operation and returns "<bytes> bytes to/from <peer> with tag <tag>".
std::string Communicator::check_p2p(const P2POp& op, const char* name) const {
  check_peer(op.peer, name);
  check_tag(op.tag, name);
  check_buffer(op.buffer, where(name));
  check_elements(op.buffer.numel(), name);
  return str_cat(op.buffer.nbytes(), " bytes ", op.kind == P2POp::Kind::kRecv ? "from " : "to ", peer_str(op.peer),
                 " with tag ", op.tag);
}

WorkHandle Communicator::isend(const TensorView& buffer, int peer, int tag) {
  return post_p2p(P2POp::send(buffer, peer, tag));
}

WorkHandle Communicator::irecv(const TensorView& buffer, int peer, int tag) {
  return post_p2p(P2POp::recv(buffer, peer, tag));
}

WorkHandle Communicator::post_p2p(const P2POp& op) {
  const bool recv = op.kind == P2POp::Kind::kRecv;
  const char* name = recv ? "irecv" : "isend";
  fault_point(name);
  std::string what = str_cat(where(name), " of ", check_p2p(op, name));
  WorkHandle w = recv ? do_irecv(op.buffer, op.peer, op.tag, std::move(what))
                      : do_isend(op.buffer, op.peer, op.tag, std::move(what));
  const auto bytes = static_cast<std::int64_t>(op.buffer.nbytes());
  count(recv ? 0 : bytes, recv ? bytes : 0);
  return w;
}

WorkHandle Communicator::batch_isend_irecv(const std::vector<P2POp>& ops) {
  fault_point("batch_isend_irecv");
  std::int64_t sent = 0, received = 0;
  std::string list;
  for (const P2POp& op : ops) {
    const bool recv = op.kind == P2POp::Kind::kRecv;
    list += str_cat(list.empty() ? "" : "; ", recv ? "recv " : "send ", check_p2p(op, "batch_isend_irecv"));
    (recv ? received : sent) += static_cast<std::int64_t>(op.buffer.nbytes());
  }
  // A receive may not share bytes with any other operation of the group (sends may share a buffer: they only read).
  // Sweep over the buffers in address order, O(n log n) for batches of thousands of operations: an overlapping pair
  // (a before b) that involves a receive shows as b starting below the furthest end of the receives before it, or,
  // when b is a receive, below the furthest end of anything before it.
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].buffer.nbytes() > 0) order.push_back(i);
  }
  const auto begin_of = [&](std::size_t i) { return static_cast<const char*>(ops[i].buffer.data()); };
  const auto end_of = [&](std::size_t i) { return begin_of(i) + ops[i].buffer.nbytes(); };
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return begin_of(a) < begin_of(b); });
  std::optional<std::size_t> furthest_recv, furthest_any;
  for (const std::size_t i : order) {
    const bool recv = ops[i].kind == P2POp::Kind::kRecv;
    const std::optional<std::size_t> rival = recv ? furthest_any : furthest_recv;
    if (rival && begin_of(i) < end_of(*rival)) {
      check_disjoint(ops[std::min(i, *rival)].buffer, ops[std::max(i, *rival)].buffer, "batch_isend_irecv",
                     str_cat("operations ", std::min(i, *rival), " and ", std::max(i, *rival)));
    }
    if (!furthest_any || end_of(i) > end_of(*furthest_any)) furthest_any = i;
    if (recv && (!furthest_recv || end_of(i) > end_of(*furthest_recv))) furthest_recv = i;
  }
  WorkHandle w = do_batch_isend_irecv(ops, str_cat(where("batch_isend_irecv"), " (", list, ")"));
  count(sent, received);
  return w;
}

// ---- collectives ------------------------------------------------------------------------------------------------

WorkHandle Communicator::all_to_all(const TensorView& send, const TensorView& recv) {
  fault_point("all_to_all");
  check_buffer(send, where("all_to_all"));
  check_buffer(recv, where("all_to_all"));
  SEQPAR_CHECK(send.dtype() == recv.dtype() && send.numel() == recv.numel(), where("all_to_all"), ": send ", send.str(),
               " and recv ", recv.str(), " must have the same dtype and element count");
  SEQPAR_CHECK(send.numel() % size_ == 0, where("all_to_all"), ": element count ", send.numel(),
               " must be divisible by the communicator size ", size_);
  check_disjoint(send, recv, "all_to_all");
  const std::int64_t block = send.numel() / size_;
  check_elements(block, "all_to_all");
  WorkHandle w = do_all_to_all(
      send, recv,
      str_cat(where("all_to_all"), " of ", send.nbytes(), " bytes over ", size_, " ranks (", members_str(), ")"));
  const std::int64_t moved = block * (size_ - 1) * static_cast<std::int64_t>(dtype_size(send.dtype()));
  count(moved, moved);
  return w;
}

WorkHandle Communicator::all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts,
                                      const TensorView& recv, const std::vector<std::int64_t>& recv_counts) {
  fault_point("all_to_all_v");
  const std::string op = where("all_to_all_v");
  check_buffer(send, op);
  check_buffer(recv, op);
  SEQPAR_CHECK(send.dtype() == recv.dtype(), op, ": send and recv dtypes differ (", dtype_name(send.dtype()), " vs ",
               dtype_name(recv.dtype()), ")");
  SEQPAR_CHECK(static_cast<int>(send_counts.size()) == size_ && static_cast<int>(recv_counts.size()) == size_, op,
               ": send_counts and recv_counts need one entry per rank (", size_, "), got ", send_counts.size(), " and ",
               recv_counts.size());
  std::int64_t send_total = 0, recv_total = 0;
  for (int r = 0; r < size_; ++r) {
    SEQPAR_CHECK(send_counts[r] >= 0 && recv_counts[r] >= 0, op, ": negative count for rank ", r);
    // Counts and offsets (the running totals) are both message-sized quantities for the backend.
    check_elements(send_total, "all_to_all_v");
    check_elements(recv_total, "all_to_all_v");
    send_total += send_counts[r];
    recv_total += recv_counts[r];
    check_elements(send_counts[r], "all_to_all_v");
    check_elements(recv_counts[r], "all_to_all_v");
  }
  SEQPAR_CHECK(send_total <= send.numel() && recv_total <= recv.numel(), op, ": counts sum to ", send_total, " sent / ",
               recv_total, " received, more than the buffers hold (", send.numel(), " / ", recv.numel(), ")");
  SEQPAR_CHECK(send_counts[rank_] == recv_counts[rank_], op, ": rank ", rank_, " sends ", send_counts[rank_],
               " elements to itself but expects to receive ", recv_counts[rank_]);
  check_disjoint(send, recv, "all_to_all_v");
  const auto esize = static_cast<std::int64_t>(dtype_size(send.dtype()));
  WorkHandle w = do_all_to_all_v(send, send_counts, recv, recv_counts,
                                 str_cat(op, " of ", send_total * esize, " bytes sent / ", recv_total * esize,
                                         " received over ", size_, " ranks (", members_str(), ")"));
  count((send_total - send_counts[rank_]) * esize, (recv_total - recv_counts[rank_]) * esize);
  return w;
}

WorkHandle Communicator::all_gather(const TensorView& send, const TensorView& recv) {
  fault_point("all_gather");
  check_buffer(send, where("all_gather"));
  check_buffer(recv, where("all_gather"));
  SEQPAR_CHECK(send.dtype() == recv.dtype() && recv.numel() == send.numel() * size_, where("all_gather"), ": recv ",
               recv.str(), " must hold size (", size_, ") x send ", send.str());
  check_disjoint(send, recv, "all_gather");
  check_elements(send.numel(), "all_gather");
  WorkHandle w = do_all_gather(send, recv,
                               str_cat(where("all_gather"), " of ", send.nbytes(), " bytes per rank over ", size_,
                                       " ranks (", members_str(), ")"));
  const std::int64_t moved = static_cast<std::int64_t>(send.nbytes()) * (size_ - 1);
  count(moved, moved);
  return w;
}

WorkHandle Communicator::reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) {
  fault_point("reduce_scatter");
  check_buffer(send, where("reduce_scatter"));
  check_buffer(recv, where("reduce_scatter"));
  SEQPAR_CHECK(send.dtype() == recv.dtype() && send.numel() == recv.numel() * size_, where("reduce_scatter"), ": send ",
               send.str(), " must hold size (", size_, ") x recv ", recv.str());
  check_disjoint(send, recv, "reduce_scatter");
  check_elements(recv.numel(), "reduce_scatter");
  WorkHandle w = do_reduce_scatter(send, recv, op,
                                   str_cat(where("reduce_scatter"), "(", reduce_op_name(op), ") of ", send.nbytes(),
                                           " bytes over ", size_, " ranks (", members_str(), ")"));
  const std::int64_t moved = static_cast<std::int64_t>(recv.nbytes()) * (size_ - 1);
  count(moved, moved);
  return w;
}

WorkHandle Communicator::all_reduce(const TensorView& buffer, ReduceOp op) {
  fault_point("all_reduce");
  check_buffer(buffer, where("all_reduce"));
  check_elements(buffer.numel(), "all_reduce");
  WorkHandle w = do_all_reduce(buffer, op,
                               str_cat(where("all_reduce"), "(", reduce_op_name(op), ") of ", buffer.nbytes(),
                                       " bytes over ", size_, " ranks (", members_str(), ")"));
  // Counted as a ring all-reduce would move it: 2 (P-1)/P of the buffer each way.
  const std::int64_t moved = size_ > 1 ? 2 * static_cast<std::int64_t>(buffer.nbytes()) * (size_ - 1) / size_ : 0;
  count(moved, moved);
  return w;
}

WorkHandle Communicator::broadcast(const TensorView& buffer, int root) {
  fault_point("broadcast");
  check_peer(root, "broadcast");
  check_buffer(buffer, where("broadcast"));
  check_elements(buffer.numel(), "broadcast");
  WorkHandle w = do_broadcast(buffer, root,
                              str_cat(where("broadcast"), " of ", buffer.nbytes(), " bytes from ", peer_str(root),
                                      " over ", size_, " ranks (", members_str(), ")"));
  const auto bytes = static_cast<std::int64_t>(buffer.nbytes());
  count(rank_ == root ? bytes * (size_ - 1) : 0, rank_ == root ? 0 : bytes);
  return w;
}

WorkHandle Communicator::barrier() {
  fault_point("barrier");
  WorkHandle w = do_barrier(str_cat(where("barrier"), " over ", size_, " ranks (", members_str(), ")"));
  count(0, 0);
  return w;
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  fault_point("split");
  std::unique_ptr<Communicator> child = do_split(
      color, key,
      str_cat(where("split"), " (color ", color, ", key ", key, ") over ", size_, " ranks (", members_str(), ")"));
  if (child) {
    child->set_name("split");
    child->set_stream(stream_);  // device buffers are staged / ordered on the same compute stream
  }
  return child;
}

void Communicator::set_stream(const Stream& stream) {
  do_set_stream(stream);
  stream_ = stream;
}

// ---- defaults of the backend hooks ------------------------------------------------------------------------------

void Communicator::do_set_stream(const Stream&) {}

WorkHandle Communicator::do_isend(const TensorView&, int, int, std::string) { unsupported("isend"); }
WorkHandle Communicator::do_irecv(const TensorView&, int, int, std::string) { unsupported("irecv"); }
WorkHandle Communicator::do_batch_isend_irecv(const std::vector<P2POp>&, std::string) {
  unsupported("batch_isend_irecv");
}
WorkHandle Communicator::do_all_to_all(const TensorView&, const TensorView&, std::string) { unsupported("all_to_all"); }
WorkHandle Communicator::do_all_to_all_v(const TensorView&, const std::vector<std::int64_t>&, const TensorView&,
                                         const std::vector<std::int64_t>&, std::string) {
  unsupported("all_to_all_v");
}
WorkHandle Communicator::do_all_gather(const TensorView&, const TensorView&, std::string) { unsupported("all_gather"); }
WorkHandle Communicator::do_reduce_scatter(const TensorView&, const TensorView&, ReduceOp, std::string) {
  unsupported("reduce_scatter");
}
WorkHandle Communicator::do_all_reduce(const TensorView&, ReduceOp, std::string) { unsupported("all_reduce"); }
WorkHandle Communicator::do_broadcast(const TensorView&, int, std::string) { unsupported("broadcast"); }
WorkHandle Communicator::do_barrier(std::string) { unsupported("barrier"); }
std::unique_ptr<Communicator> Communicator::do_split(int, int, std::string) { unsupported("split"); }

}  // namespace seqpar
