#include "torch_comm.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <utility>

#include "dlpack_bridge.h"
#include "runtime/comm_keepalive.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/tensor_ops.h"

namespace py = pybind11;

namespace seqpar::python {
namespace {

// torch and torch.distributed, looked up once (with the GIL held); never freed (the interpreter may be gone when
// static destructors run).
struct TorchApi {
  py::object torch = py::module_::import("torch");
  py::object dist = py::module_::import("torch.distributed");
  py::object frombuffer = torch.attr("frombuffer");
  py::object empty = torch.attr("empty");
  py::object timedelta = py::module_::import("datetime").attr("timedelta");
  py::object sum = dist.attr("ReduceOp").attr("SUM");
  py::object max = dist.attr("ReduceOp").attr("MAX");
};

TorchApi& api() {
  static TorchApi* instance = new TorchApi();  // NOLINT: deliberately never destroyed
  return *instance;
}

py::object torch_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return api().torch.attr("float64");
    case DType::kFloat32: return api().torch.attr("float32");
    case DType::kBFloat16: return api().torch.attr("bfloat16");
    case DType::kFloat16: return api().torch.attr("float16");
    case DType::kInt32: return api().torch.attr("int32");
    case DType::kInt64: return api().torch.attr("int64");
  }
  SEQPAR_THROW("no torch dtype for dtype ", static_cast<int>(dtype));
}

// A flat torch tensor over the view's memory (no copy; the caller keeps the memory alive while torch uses it): host
// memory through torch.frombuffer, device memory through DLPack (on the view's CUDA device).
py::object as_torch(const TensorView& t) {
  if (!t.device().is_cpu()) return borrow_torch(t);
  if (t.numel() == 0) return api().empty(0, py::arg("dtype") = torch_dtype(t.dtype()));
  PyObject* memory =
      PyMemoryView_FromMemory(static_cast<char*>(t.data()), static_cast<Py_ssize_t>(t.nbytes()), PyBUF_WRITE);
  if (memory == nullptr) throw py::error_already_set();
  return api().frombuffer(py::reinterpret_steal<py::object>(memory), py::arg("dtype") = torch_dtype(t.dtype()));
}

// The text of the Python exception being handled ("RuntimeError: ..." without the traceback).
std::string python_error_text(const py::error_already_set& e) {
  std::string text = py::str(e.value());
  return str_cat(e.type() ? std::string(py::str(e.type().attr("__name__"))) : std::string("error"), ": ", text);
}

// The state a communicator shares with its Work handles: the first failure, after which the group is unusable
// (gloo closes the connections of a timed-out operation and cannot cancel a pending one).
struct SharedState {
  std::string failure;
};

bool interpreter_alive() { return Py_IsInitialized() != 0; }

// One state per ProcessGroup: the communicators over the same group (the ring and cp groups of a ring-only grid)
// share its failure. Keyed by the group object, which the communicators keep alive.
std::shared_ptr<SharedState> state_of(const py::object& process_group) {
  static std::map<PyObject*, std::weak_ptr<SharedState>> states;
  if (process_group.is_none()) return std::make_shared<SharedState>();
  std::weak_ptr<SharedState>& slot = states[process_group.ptr()];
  std::shared_ptr<SharedState> state = slot.lock();
  if (!state) {
    state = std::make_shared<SharedState>();
    slot = state;
  }
  return state;
}

// One posted operation: torch Work objects (none for a local operation), the torch tensors they use, and the
// seqpar buffers under them (kept alive if the operation is abandoned).
class TorchWork final : public Work {
 public:
  TorchWork(std::shared_ptr<SharedState> state, std::string description, std::vector<py::object> works,
            std::vector<py::object> tensors, std::vector<TensorView> buffers)
      : state_(std::move(state)),
        description_(std::move(description)),
        works_(std::move(works)),
        tensors_(std::move(tensors)),
        buffers_(std::move(buffers)) {
    for (const TensorView& b : buffers_) {
      if (!b.device().is_cpu()) device_ = b.device();
    }
  }

  ~TorchWork() override {
    if (!interpreter_alive()) {  // the process is ending: leak the Python objects, never touch the interpreter
      for (auto& w : works_) w.release();
      for (auto& t : tensors_) t.release();
      return;
    }
    py::gil_scoped_acquire gil;
    if (!done_ && failure_.empty()) {
      bool complete = false;
      try {
        complete = test();
      } catch (...) {  // a destructor never throws; the failure is recorded in the shared state
        complete = true;
      }
      if (!complete) {
        try {
          SEQPAR_LOG(kWarn) << description_ << " was destroyed before it completed: its buffers are kept instead "
                            << "of freed, and the group is not used again";
        } catch (...) {
        }
        abandon(str_cat(description_, " was abandoned before it completed"));
      }
    }
    works_.clear();
    tensors_.clear();
  }

  bool test() override {
    if (!failure_.empty()) SEQPAR_THROW(failure_);
    if (done_) return true;
    py::gil_scoped_acquire gil;
    for (const py::object& w : works_) {
      if (!w.attr("is_completed")().cast<bool>()) return false;
    }
    for (const py::object& w : works_) {
      try {
        w.attr("wait")();  // completed: returns at once, or raises the operation's error
      } catch (py::error_already_set& e) {
        fail(str_cat(description_, " failed: ", python_error_text(e)));
      }
    }
    finish_device();
    done_ = true;
    return true;
  }

  void wait(double timeout_s) override {
    SEQPAR_CHECK(std::isfinite(timeout_s) && timeout_s >= 0, description_, ": wait timeout ", timeout_s,
                 " s must be finite and >= 0");
    if (!failure_.empty()) SEQPAR_THROW(failure_);
    if (done_) return;
    py::gil_scoped_acquire gil;
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    for (const py::object& w : works_) {
      const double waited = std::chrono::duration<double>(clock::now() - start).count();
      // torch takes 0 as "no timeout": wait at least a millisecond.
      const double remaining = std::max(timeout_s - waited, 1e-3);
      bool completed = true;
      try {
        py::object r = w.attr("wait")(api().timedelta(py::arg("seconds") = remaining));
        completed = r.is_none() || r.cast<bool>();
      } catch (py::error_already_set& e) {
        const double now = std::chrono::duration<double>(clock::now() - start).count();
        const std::string text = python_error_text(e);
        const bool timed_out = now >= timeout_s || text.find("imed out") != std::string::npos;
        if (!timed_out) fail(str_cat(description_, " failed: ", text));
        fail(timeout_text(timeout_s, now, text));
      }
      if (!completed) {
        fail(timeout_text(timeout_s, std::chrono::duration<double>(clock::now() - start).count(), "not completed"));
      }
    }
    finish_device();
    done_ = true;
  }

 private:
  // Device buffers: torch's Work.wait() orders the operation before torch's current stream, not before the host;
  // seqpar's schedules read the buffers next on their own stream, so the host waits for that stream here.
  void finish_device() {
    if (device_.is_cpu() || works_.empty()) return;
    try {
      api().torch.attr("cuda").attr("current_stream")(device_.index).attr("synchronize")();
    } catch (py::error_already_set& e) {
      fail(str_cat(description_, " failed: ", python_error_text(e)));
    }
  }

  std::string timeout_text(double timeout_s, double waited, const std::string& torch_text) const {
    return str_cat(description_, " did not complete within ", timeout_s, " s (waited ", waited,
                   " s): a peer has failed, is stuck, or posted a mismatched operation; this group cannot be used ",
                   "again (torch.distributed: ", torch_text, ")");
  }

  [[noreturn]] void fail(std::string message) {
    abandon(message);
    failure_ = std::move(message);
    SEQPAR_THROW(failure_);
  }

  // The operation will not be waited for again: its buffers stay allocated for as long as the process lives
  // (torch may still write them), and the group is marked unusable.
  void abandon(const std::string& why) {
    for (const TensorView& t : buffers_) keep_alive_for_transport(t.data(), t.nbytes());
    if (state_->failure.empty()) state_->failure = why;
    done_ = true;
  }

  std::shared_ptr<SharedState> state_;
  std::string description_;
  std::vector<py::object> works_;
  std::vector<py::object> tensors_;
  std::vector<TensorView> buffers_;
  Device device_;  // the buffers' CUDA device, or the CPU
  bool done_ = false;
  std::string failure_;
};

// The first `bytes` bytes of `from` into `to` (host memcpy; a device buffer: one same-dtype copy_convert, a
// cudaMemcpy on the legacy default stream, synchronised).
void copy_bytes(const TensorView& from, const TensorView& to, std::size_t bytes) {
  if (bytes == 0) return;
  if (from.device().is_cpu() && to.device().is_cpu()) {
    std::memcpy(to.data(), from.data(), bytes);
    return;
  }
  const auto n = static_cast<std::int64_t>(bytes / dtype_size(from.dtype()));
  copy_convert(TensorView(from.data(), from.dtype(), {n}, from.device()),
               TensorView(to.data(), from.dtype(), {n}, to.device()));
}

// Which buffers a ProcessGroup's backend takes (torch.distributed.get_backend's name: "gloo", "nccl", "mpi", or
// "cpu:gloo,cuda:nccl" for a group of several): host buffers unless its only backend is nccl; CUDA buffers when
// one of its backends is nccl.
bool backend_takes_host(const std::string& backend) { return backend != "nccl"; }
bool backend_takes_cuda(const std::string& backend) { return backend.find("nccl") != std::string::npos; }

class TorchCommunicator final : public Communicator {
 public:
  TorchCommunicator(py::object process_group, std::vector<int> world_ranks, int rank, std::string name)
      : pg_(std::move(process_group)) {
    const int size = static_cast<int>(world_ranks.size());
    SEQPAR_CHECK(size >= 1 && 0 <= rank && rank < size, name, ": rank ", rank, " is outside the group of ", size,
                 " world ranks");
    SEQPAR_CHECK(!pg_.is_none() || size == 1, name, ": a group of ", size,
                 " ranks needs a torch.distributed ProcessGroup (None only for a group of one rank)");
    py::gil_scoped_acquire gil;
    // An nccl-only group wants its buffers (the agreement checks' too) on this process's current CUDA device.
    Device device = Device::cpu();
    if (!pg_.is_none()) {
      pg_backend_ = py::str(api().dist.attr("get_backend")(pg_));
      backend_ = str_cat("torch (", pg_backend_, ")");
#if defined(SEQPAR_WITH_CUDA)
      if (!backend_takes_host(pg_backend_)) {
        device = Device::cuda(api().torch.attr("cuda").attr("current_device")().cast<int>());
      }
#endif
    }
    set_group(rank, size, std::move(world_ranks), device);
    set_name(std::move(name));
    state_ = state_of(pg_);
    if (process_rank() < 0) set_process_rank(world_ranks_of_this_rank());  // torch's rank in messages and logs
  }

  ~TorchCommunicator() override {
    if (!interpreter_alive()) {
      pg_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    pg_ = py::object();
  }

  const char* backend_name() const override { return backend_.c_str(); }

 protected:
  // Host buffers on a group whose backend takes them (gloo, mpi); CUDA buffers on one whose backend is nccl (passed
  // to it as they are, no host staging); a group of one rank (no ProcessGroup) copies either. Refused on each rank
  // before its message is posted.
  void check_buffer(const TensorView& t, const std::string& op) const override {
    if (t.device().is_cpu()) {
      SEQPAR_CHECK(local() || backend_takes_host(pg_backend_), op, ": the torch.distributed backend ", pg_backend_,
                   " takes CUDA buffers only; got the host buffer ", t.str(),
                   " (use a ProcessGroup with gloo for host tensors)");
    } else {
      SEQPAR_CHECK(local() || backend_takes_cuda(pg_backend_), op, ": the torch.distributed backend ", pg_backend_,
                   " takes host buffers only; got the device buffer ", t.str(),
                   " (device buffers need a ProcessGroup whose backend takes CUDA tensors: nccl)");
    }
    SEQPAR_CHECK(state_->failure.empty(), op, ": the group is not usable after an earlier failure: ", state_->failure);
  }

  WorkHandle do_isend(const TensorView& buffer, int peer, int tag, std::string what) override {
    return post_p2p({P2POp::send(buffer, peer, tag)}, std::move(what));
  }
  WorkHandle do_irecv(const TensorView& buffer, int peer, int tag, std::string what) override {
    return post_p2p({P2POp::recv(buffer, peer, tag)}, std::move(what));
  }
  WorkHandle do_batch_isend_irecv(const std::vector<P2POp>& ops, std::string what) override {
    return post_p2p(ops, std::move(what));
  }

  WorkHandle do_all_to_all(const TensorView& send, const TensorView& recv, std::string what) override {
    if (local()) return local_copy(send, recv, recv.nbytes(), std::move(what));
    finish_caller_stream(send);
    py::gil_scoped_acquire gil;
    py::object s = as_torch(send), r = as_torch(recv);
    return collective(std::move(what),
                      api().dist.attr("all_to_all_single")(r, s, py::arg("group") = pg_, py::arg("async_op") = true),
                      {s, r}, {send, recv});
  }

  WorkHandle do_all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts,
                             const TensorView& recv, const std::vector<std::int64_t>& recv_counts,
                             std::string what) override {
    std::int64_t send_total = 0, recv_total = 0;
    for (int r = 0; r < size(); ++r) {
      send_total += send_counts[r];
      recv_total += recv_counts[r];
    }
    const auto esize = static_cast<std::int64_t>(dtype_size(send.dtype()));
    if (local()) return local_copy(send, recv, static_cast<std::size_t>(send_counts[0] * esize), std::move(what));
    finish_caller_stream(send);
    py::gil_scoped_acquire gil;
    // all_to_all_single needs tensors of exactly the counts' totals: the leading elements of the buffers.
    const TensorView s_view(send.data(), send.dtype(), {send_total}, send.device());
    const TensorView r_view(recv.data(), recv.dtype(), {recv_total}, recv.device());
    py::object s = as_torch(s_view), r = as_torch(r_view);
    py::object w = api().dist.attr("all_to_all_single")(r, s, py::arg("output_split_sizes") = recv_counts,
                                                        py::arg("input_split_sizes") = send_counts,
                                                        py::arg("group") = pg_, py::arg("async_op") = true);
    return collective(std::move(what), std::move(w), {s, r}, {send, recv});
  }

  WorkHandle do_all_gather(const TensorView& send, const TensorView& recv, std::string what) override {
    if (local()) return local_copy(send, recv, send.nbytes(), std::move(what));
    finish_caller_stream(send);
    py::gil_scoped_acquire gil;
    py::object s = as_torch(send), r = as_torch(recv);
    return collective(
        std::move(what),
        api().dist.attr("all_gather_into_tensor")(r, s, py::arg("group") = pg_, py::arg("async_op") = true), {s, r},
        {send, recv});
  }

  WorkHandle do_reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op, std::string what) override {
    if (local()) return local_copy(send, recv, recv.nbytes(), std::move(what));
    finish_caller_stream(send);
    py::gil_scoped_acquire gil;
    py::object s = as_torch(send), r = as_torch(recv);
    py::object w = api().dist.attr("reduce_scatter_tensor")(r, s, py::arg("op") = torch_op(op), py::arg("group") = pg_,
                                                            py::arg("async_op") = true);
    return collective(std::move(what), std::move(w), {s, r}, {send, recv});
  }

  WorkHandle do_all_reduce(const TensorView& buffer, ReduceOp op, std::string what) override {
    if (local()) return local_copy(buffer, buffer, 0, std::move(what));
    finish_caller_stream(buffer);
    py::gil_scoped_acquire gil;
    py::object t = as_torch(buffer);
    py::object w = api().dist.attr("all_reduce")(t, py::arg("op") = torch_op(op), py::arg("group") = pg_,
                                                 py::arg("async_op") = true);
    return collective(std::move(what), std::move(w), {t}, {buffer});
  }

  WorkHandle do_broadcast(const TensorView& buffer, int root, std::string what) override {
    if (local()) return local_copy(buffer, buffer, 0, std::move(what));
    finish_caller_stream(buffer);
    py::gil_scoped_acquire gil;
    py::object t = as_torch(buffer);
    py::object w = api().dist.attr("broadcast")(t, py::arg("src") = world_rank_of(root), py::arg("group") = pg_,
                                                py::arg("async_op") = true);
    return collective(std::move(what), std::move(w), {t}, {buffer});
  }

  WorkHandle do_barrier(std::string what) override {
    SEQPAR_CHECK(state_->failure.empty(), what,
                 ": the group is not usable after an earlier failure: ", state_->failure);
    if (local()) return local_copy({}, {}, 0, std::move(what));
    py::gil_scoped_acquire gil;
    py::object w = api().dist.attr("barrier")(py::arg("group") = pg_, py::arg("async_op") = true);
    return collective(std::move(what), std::move(w), {}, {});
  }

 private:
  bool local() const { return pg_.is_none(); }
  int world_ranks_of_this_rank() const { return world_rank_of(rank()); }

  static py::object torch_op(ReduceOp op) { return op == ReduceOp::kSum ? api().sum : api().max; }

  WorkHandle collective(std::string what, py::object work, std::vector<py::object> tensors,
                        std::vector<TensorView> buffers) {
    SEQPAR_CHECK(!work.is_none(), what, ": torch.distributed returned no Work for an asynchronous operation");
    return std::make_unique<TorchWork>(state_, std::move(what), std::vector<py::object>{std::move(work)},
                                       std::move(tensors), std::move(buffers));
  }

  // A group of this rank alone: the operation is a copy of `bytes` bytes, complete at once.
  WorkHandle local_copy(const TensorView& from, const TensorView& to, std::size_t bytes, std::string what) {
    if (from.data() != to.data()) copy_bytes(from, to, bytes);
    return std::make_unique<TorchWork>(state_, std::move(what), std::vector<py::object>{}, std::vector<py::object>{},
                                       std::vector<TensorView>{});
  }

  // Point-to-point operations: receives posted first (so that no order of the group can deadlock), then sends.
  WorkHandle post_p2p(const std::vector<P2POp>& ops, std::string what) {
    // seqpar's layers send no point-to-point message within a group of one rank (its exchanges are local copies).
    SEQPAR_CHECK(!local(), what,
                 ": point-to-point messages to itself are not supported in a group of one rank "
                 "without a ProcessGroup");
    for (const P2POp& op : ops) finish_caller_stream(op.buffer);
    py::gil_scoped_acquire gil;
    std::vector<py::object> works, tensors;
    std::vector<TensorView> buffers;
    for (int pass = 0; pass < 2; ++pass) {
      for (const P2POp& op : ops) {
        const bool recv = op.kind == P2POp::Kind::kRecv;
        if (recv != (pass == 0)) continue;
        py::object t = as_torch(op.buffer);
        const int peer = world_rank_of(op.peer);
        py::object w =
            recv ? api().dist.attr("irecv")(t, py::arg("src") = peer, py::arg("group") = pg_, py::arg("tag") = op.tag)
                 : api().dist.attr("isend")(t, py::arg("dst") = peer, py::arg("group") = pg_, py::arg("tag") = op.tag);
        SEQPAR_CHECK(!w.is_none(), what, ": torch.distributed returned no Work for a point-to-point operation");
        works.push_back(std::move(w));
        tensors.push_back(std::move(t));
        buffers.push_back(op.buffer);
      }
    }
    return std::make_unique<TorchWork>(state_, std::move(what), std::move(works), std::move(tensors),
                                       std::move(buffers));
  }

  // Device buffers: the work queued on the caller's stream (set_stream) is finished before torch posts the
  // operation (torch orders it after its own current stream only).
  void finish_caller_stream(const TensorView& t) const {
    if (!t.device().is_cpu()) stream().synchronize();
  }

  py::object pg_;
  std::string pg_backend_;  // torch.distributed.get_backend(pg_); empty without a ProcessGroup
  std::string backend_ = "torch";
  std::shared_ptr<SharedState> state_;
};

}  // namespace

std::unique_ptr<Communicator> make_torch_communicator(py::object process_group, std::vector<int> world_ranks, int rank,
                                                      std::string name) {
  return std::make_unique<TorchCommunicator>(std::move(process_group), std::move(world_ranks), rank, std::move(name));
}

std::unique_ptr<Communicator> torch_communicator_from_spec(py::handle spec, const char* name) {
  const auto t = py::reinterpret_borrow<py::tuple>(spec);
  SEQPAR_CHECK(t.size() == 3, name, ": expected (process_group, world_ranks, rank), got a tuple of ", t.size());
  return make_torch_communicator(py::reinterpret_borrow<py::object>(t[0]), t[1].cast<std::vector<int>>(),
                                 t[2].cast<int>(), name);
}

}  // namespace seqpar::python
