// comm_bench: message-size sweeps of the communication patterns of sequence parallelism on the groups of an CpGrid:
// the primitives (ring send/recv: each rank sends to the next and receives from the previous rank of its group;
// all-to-all, all-gather, reduce-scatter, all-reduce) and the combined patterns the CP layers post (ring_step: a ring
// backward step, the packed k/v block and its fp32 gradient accumulator exchanged as one group; ulysses_qkv: the
// Ulysses all-to-alls of q, k and v posted together), on the Ulysses, ring and CP groups. Prints nccl-tests style
// tables on rank 0: size, count, data type, reduction, in/out of place, time (us), algbw and busbw (GB/s), the number
// of wrong elements of a verification pass and a status; sizes too small for a pattern are rows with status
// "too-small"; the last line is the average bus bandwidth of every measured row, as nccl-tests prints it.
// Definitions (docs/benchmarks.md, "comm_bench"): size as in nccl-tests (all-gather: the gathered output; reduce-scatter: the
// input; all-to-all: the send buffer; all-reduce: the buffer; send/recv: one message; ring_step: both messages a
// rank sends; ulysses_qkv: the three send buffers); algbw = size / time; busbw = algbw x factor with factor (n-1)/n
// for all-gather, reduce-scatter, all-to-all and ulysses_qkv, 2 (n-1)/n for all-reduce and 1 for send/recv and
// ring_step. All-reduce runs in place (the Communicator's all_reduce is in place); the other collectives need
// distinct buffers, so they run out of place.
//
// --backend mpi (default) or nccl; the world is made by make_world_communicator (runtime/comm_factory.h) and the
// buffers live on the communicator's device (host for MPI, each rank's CUDA device for NCCL).
//
//   mpirun -np 4 comm_bench --ulysses-size 2 --ring-size 2 --min-bytes 1K --max-bytes 16M
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cxxopts.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_common.h"
#include "benchmarks/sp_bench_memory.h"
#include "parallel/cp_common.h"
#include "runtime/comm_factory.h"
#include "runtime/error.h"
#include "runtime/mpi_comm.h"
#include "runtime/cp_grid.h"
#include "runtime/tensor.h"
#include "runtime/tensor_ops.h"
#include "runtime/version.h"

namespace seqpar::bench {
namespace {

enum class Op { kSendRecv, kAllToAll, kAllGather, kReduceScatter, kAllReduce, kRingStep, kUlyssesQkv };
constexpr Op kAllOps[] = {Op::kSendRecv,  Op::kAllToAll, Op::kAllGather, Op::kReduceScatter,
                          Op::kAllReduce, Op::kRingStep, Op::kUlyssesQkv};
const char* op_name(Op op) {
  switch (op) {
    case Op::kSendRecv: return "sendrecv";
    case Op::kAllToAll: return "alltoall";
    case Op::kAllGather: return "allgather";
    case Op::kReduceScatter: return "reducescatter";
    case Op::kAllReduce: return "allreduce";
    case Op::kRingStep: return "ring_step";
    case Op::kUlyssesQkv: return "ulysses_qkv";
  }
  return "?";
}
double busbw_factor(Op op, int n) {
  switch (op) {
    case Op::kSendRecv:
    case Op::kRingStep: return 1.0;
    case Op::kAllReduce: return 2.0 * (n - 1) / n;
    default: return static_cast<double>(n - 1) / n;
  }
}
bool reduces(Op op) { return op == Op::kReduceScatter || op == Op::kAllReduce; }
bool in_place(Op op) { return op == Op::kAllReduce; }
// The ring step's gradient accumulator travels in fp32 whatever the data type (parallel/ring_pass.h).
constexpr DType kGradDType = DType::kFloat32;

struct Options {
  std::string backend = "mpi";
  CpGridConfig grid;
  std::int64_t min_bytes = 1024, max_bytes = 16 << 20;
  int factor = 2;
  int warmup = 5, iters = 20;
  DType dtype = DType::kFloat32;
  std::vector<Op> ops;
  std::vector<std::string> groups;
  std::string json_path;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::optional<Options> parse(int argc, char** argv, int world_size, int world_rank) {
  cxxopts::Options spec("comm_bench", "communication sweeps on the groups of an CpGrid: mpirun -np N comm_bench");
  // clang-format off
  spec.add_options()
    ("backend", "communicator backend: mpi | nccl (nccl: buffers on each rank's CUDA device)", cxxopts::value<std::string>()->default_value("mpi"))
    ("ulysses-size", "Ulysses degree Pu", cxxopts::value<int>()->default_value("1"))
    ("ring-size", "ring degree Pr (default: world / (dp x Pu))", cxxopts::value<int>())
    ("dp-size", "data-parallel replicas", cxxopts::value<int>()->default_value("1"))
    ("placement", "ulysses_inner | ring_inner", cxxopts::value<std::string>()->default_value("ulysses_inner"))
    ("min-bytes", "smallest size (K/M suffixes)", cxxopts::value<std::string>()->default_value("1K"))
    ("max-bytes", "largest size (K/M suffixes)", cxxopts::value<std::string>()->default_value("16M"))
    ("factor", "size multiplier between steps", cxxopts::value<int>()->default_value("2"))
    ("warmup", "untimed iterations per size", cxxopts::value<int>()->default_value("5"))
    ("iters", "timed iterations per size (mean reported)", cxxopts::value<int>()->default_value("20"))
    ("dtype", "fp32 | bf16 | fp16 | fp64", cxxopts::value<std::string>()->default_value("fp32"))
    ("ops", "comma list: sendrecv,alltoall,allgather,reducescatter,allreduce,ring_step,ulysses_qkv", cxxopts::value<std::string>()->default_value("sendrecv,alltoall,allgather,reducescatter,allreduce,ring_step,ulysses_qkv"))
    ("groups", "comma list: ulysses,ring,cp", cxxopts::value<std::string>()->default_value("ulysses,ring,cp"))
    ("json", "write the results as JSON to FILE (rank 0)", cxxopts::value<std::string>())
    ("help", "print this help")
    ("version", "print the version and exit");
  // clang-format on
  const std::optional<cxxopts::ParseResult> parsed = parse_command_line(spec, argc, argv, world_rank);
  if (!parsed) return std::nullopt;
  const cxxopts::ParseResult& r = *parsed;
  Options o;
  try {
    o.backend = r["backend"].as<std::string>();
    o.grid.ulysses_size = r["ulysses-size"].as<int>();
    o.grid.dp_size = r["dp-size"].as<int>();
    o.grid.placement = parse_placement(r["placement"].as<std::string>());
    o.factor = r["factor"].as<int>();
    o.warmup = r["warmup"].as<int>();
    o.iters = r["iters"].as<int>();
    o.dtype = parse_dtype(r["dtype"].as<std::string>());
    if (r.count("json")) o.json_path = r["json"].as<std::string>();
    SEQPAR_CHECK(o.grid.ulysses_size >= 1, "--ulysses-size ", o.grid.ulysses_size, ": must be >= 1");
    SEQPAR_CHECK(o.grid.dp_size >= 1, "--dp-size ", o.grid.dp_size, ": must be >= 1");
    o.grid.ring_size = r.count("ring-size") ? r["ring-size"].as<int>()
                                            : std::max(1, world_size / (o.grid.dp_size * o.grid.ulysses_size));
  } catch (const cxxopts::exceptions::exception& e) {
    SEQPAR_THROW("bad command line: ", e.what(), " (see --help)");
  }
  o.min_bytes = parse_size(r["min-bytes"].as<std::string>(), "min-bytes");
  o.max_bytes = parse_size(r["max-bytes"].as<std::string>(), "max-bytes");
  check_communicator_backend(o.backend);
  SEQPAR_CHECK(o.grid.ring_size >= 1, "--ring-size ", o.grid.ring_size, ": must be >= 1");
  SEQPAR_CHECK(o.min_bytes >= 1 && o.min_bytes <= o.max_bytes, "--min-bytes ", o.min_bytes,
               " must be >= 1 and <= --max-bytes ", o.max_bytes);
  SEQPAR_CHECK(o.factor >= 2, "--factor ", o.factor, ": must be >= 2");
  SEQPAR_CHECK(o.warmup >= 0, "--warmup ", o.warmup, ": must be >= 0");
  SEQPAR_CHECK(o.iters >= 1, "--iters ", o.iters, ": must be >= 1");
  const std::int64_t grid_ranks = static_cast<std::int64_t>(o.grid.dp_size) * o.grid.ulysses_size * o.grid.ring_size;
  SEQPAR_CHECK(grid_ranks == world_size, "--dp-size ", o.grid.dp_size, " x --ulysses-size ", o.grid.ulysses_size,
               " x --ring-size ", o.grid.ring_size, " = ", grid_ranks, " must equal the number of MPI ranks (",
               world_size, ")");
  for (const std::string& name : split_list(r["ops"].as<std::string>())) {
    bool found = false;
    for (Op op : kAllOps) {
      if (name == op_name(op)) {
        o.ops.push_back(op);
        found = true;
      }
    }
    SEQPAR_CHECK(found, "--ops: unknown operation '", name,
                 "' (expected sendrecv, alltoall, allgather, reducescatter, allreduce, ring_step, ulysses_qkv)");
  }
  for (const std::string& name : split_list(r["groups"].as<std::string>())) {
    SEQPAR_CHECK(name == "ulysses" || name == "ring" || name == "cp", "--groups: unknown group '", name,
                 "' (expected ulysses, ring, cp)");
    o.groups.push_back(name);
  }
  SEQPAR_CHECK(!o.ops.empty() && !o.groups.empty(), "--ops and --groups must each name at least one entry");
  return o;
}

// The options every rank must share (check_ranks_agree), --backend first: a rank with another backend differs in
// what follows too. --json is not compared (rank 0 alone writes it).
Fingerprint options_fingerprint(const Options& o) {
  std::string ops, groups;
  for (Op op : o.ops) ops += str_cat(ops.empty() ? "" : ",", op_name(op));
  for (const std::string& g : o.groups) groups += str_cat(groups.empty() ? "" : ",", g);
  Fingerprint fp = options_fingerprint_start("comm_bench");
  fp.add_text("--backend", o.backend)
      .add_int("--dp-size", o.grid.dp_size)
      .add_int("--ulysses-size", o.grid.ulysses_size)
      .add_int("--ring-size", o.grid.ring_size)
      .add_text("--placement", placement_name(o.grid.placement))
      .add_text("--ops", ops)
      .add_text("--groups", groups)
      .add_text("--dtype", dtype_name(o.dtype))
      .add_int("--min-bytes", o.min_bytes)
      .add_int("--max-bytes", o.max_bytes)
      .add_int("--factor", o.factor)
      .add_int("--warmup", o.warmup)
      .add_int("--iters", o.iters);
  return fp;
}

// Verification pattern: element j of rank s's send buffer is (s + 1) + (j % 13): small integers, exact in every
// dtype and in sums over a few ranks.
double pattern(int s, std::int64_t j) { return (s + 1) + static_cast<double>(j % 13); }

// Host or device buffers (the communicator's device); the verification data go through a host copy.
void fill_pattern(const TensorView& t, int s, std::int64_t offset = 0) {
  std::vector<double> tmp(static_cast<std::size_t>(t.numel()));
  for (std::size_t j = 0; j < tmp.size(); ++j) tmp[j] = pattern(s, offset + static_cast<std::int64_t>(j));
  Tensor host = Tensor::empty(t.shape(), t.dtype(), MemCategory::kWorkspace);
  convert(tmp.data(), DType::kFloat64, host.data(), t.dtype(), tmp.size());
  copy_convert(host, t);
}

std::vector<double> as_f64(const TensorView& t) {
  Tensor host = Tensor::empty(t.shape(), t.dtype(), MemCategory::kWorkspace);
  copy_convert(t, host);
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  convert(host.data(), t.dtype(), v.data(), DType::kFloat64, v.size());
  return v;
}

// Element-wise max over the ranks of `world`, through a buffer on the communicator's device.
void all_reduce_max(Communicator& world, std::vector<double>& values) {
  const auto n = static_cast<std::int64_t>(values.size());
  Tensor buf = Tensor::empty({n}, DType::kFloat64, MemCategory::kCommBuffer, world.device());
  copy_convert(TensorView(values.data(), DType::kFloat64, {n}), buf);
  world.all_reduce(buf, ReduceOp::kMax)->wait();
  copy_convert(buf, TensorView(values.data(), DType::kFloat64, {n}));
}

// The buffers of one pattern: send[i] goes out, recv[i] comes in (all-reduce: recv[0] alone, in place).
struct Buffers {
  std::vector<Tensor> send, recv;
};

// The buffers of `op` for `bytes` (nccl-tests sizes) on a group of `n`, rounded down to what the group needs; empty
// when the size is too small for one element per rank (the caller reports the row as too-small).
Buffers buffers_for(Op op, std::int64_t bytes, int n, DType dtype, Device device) {
  const std::int64_t esize = static_cast<std::int64_t>(dtype_size(dtype)), elems = bytes / esize;
  auto make = [&](std::int64_t count, std::optional<DType> t = std::nullopt) {
    return Tensor::zeros({count}, t.value_or(dtype), MemCategory::kCommBuffer, device);
  };
  Buffers b;
  switch (op) {
    case Op::kSendRecv:
      if (elems < 1) return {};
      b.send.push_back(make(elems));
      b.recv.push_back(make(elems));
      break;
    case Op::kAllToAll:
      if (elems / n < 1) return {};
      b.send.push_back(make(elems / n * n));
      b.recv.push_back(make(elems / n * n));
      break;
    case Op::kAllGather:
      if (elems / n < 1) return {};
      b.send.push_back(make(elems / n));
      b.recv.push_back(make(elems / n * n));
      break;
    case Op::kReduceScatter:
      if (elems / n < 1) return {};
      b.send.push_back(make(elems / n * n));
      b.recv.push_back(make(elems / n));
      break;
    case Op::kAllReduce:
      if (elems < 1) return {};
      b.recv.push_back(make(elems));
      break;
    case Op::kRingStep: {  // k/v block and its fp32 gradient: count elements each, count (esize + 4) bytes
      const std::int64_t count = bytes / (esize + static_cast<std::int64_t>(dtype_size(kGradDType)));
      if (count < 1) return {};
      b.send.push_back(make(count));
      b.send.push_back(make(count, kGradDType));
      b.recv.push_back(make(count));
      b.recv.push_back(make(count, kGradDType));
      break;
    }
    case Op::kUlyssesQkv: {  // q, k, v of equal size, each divisible by the group
      const std::int64_t count = elems / 3 / n * n;
      if (count < 1) return {};
      for (int i = 0; i < 3; ++i) {
        b.send.push_back(make(count));
        b.recv.push_back(make(count));
      }
      break;
    }
  }
  return b;
}

// The size of a row (nccl-tests convention, see the top of this file) in bytes.
std::int64_t size_of(Op op, const Buffers& b) {
  std::int64_t bytes = 0;
  if (op == Op::kAllGather || op == Op::kAllReduce) return b.recv[0].view().nbytes();
  for (const Tensor& t : b.send) bytes += t.view().nbytes();
  return bytes;
}

WorkHandle post(Op op, Communicator& c, const Buffers& b) {
  const int n = c.size(), r = c.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  switch (op) {
    case Op::kSendRecv: return c.batch_isend_irecv({P2POp::send(b.send[0], next), P2POp::recv(b.recv[0], prev)});
    case Op::kAllToAll: return c.all_to_all(b.send[0], b.recv[0]);
    case Op::kAllGather: return c.all_gather(b.send[0], b.recv[0]);
    case Op::kReduceScatter: return c.reduce_scatter(b.send[0], b.recv[0], ReduceOp::kSum);
    case Op::kAllReduce: return c.all_reduce(b.recv[0], ReduceOp::kSum);
    case Op::kRingStep:
      return c.batch_isend_irecv({P2POp::send(b.send[0], next, 0), P2POp::recv(b.recv[0], prev, 0),
                                  P2POp::send(b.send[1], next, 1), P2POp::recv(b.recv[1], prev, 1)});
    case Op::kUlyssesQkv: break;
  }
  SEQPAR_THROW("comm_bench: ", op_name(op), " is not one operation");
}

// Posts the pattern and waits for it (ulysses_qkv: its three all-to-alls posted together, then waited).
void run_once(Op op, Communicator& c, const Buffers& b) {
  if (op != Op::kUlyssesQkv) {
    post(op, c, b)->wait();
    return;
  }
  WorkHandle w[3];
  for (int i = 0; i < 3; ++i) w[i] = c.all_to_all(b.send[i], b.recv[i]);
  for (WorkHandle& h : w) h->wait();
}

// Number of wrong elements after one run with the verification pattern (send buffer i of rank s carries
// pattern(s + i, j); the all-reduce buffer starts as rank s's pattern).
std::int64_t verify(Op op, Communicator& c, const Buffers& b) {
  const int n = c.size(), r = c.rank(), prev = (r + n - 1) % n;
  for (std::size_t i = 0; i < b.send.size(); ++i) fill_pattern(b.send[i], r + static_cast<int>(i));
  if (op == Op::kAllReduce) fill_pattern(b.recv[0], r);
  run_once(op, c, b);
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < b.recv.size(); ++i) {
    const std::vector<double> got = as_f64(b.recv[i]);
    const std::int64_t count = b.recv[i].numel(), blk = count / n;
    const int shift = static_cast<int>(i);
    for (std::int64_t j = 0; j < count; ++j) {
      double want = 0;
      switch (op) {
        case Op::kSendRecv:
        case Op::kRingStep: want = pattern(prev + shift, j); break;
        case Op::kAllToAll:
        case Op::kUlyssesQkv: want = pattern(static_cast<int>(j / blk) + shift, r * blk + j % blk); break;
        case Op::kAllGather: want = pattern(static_cast<int>(j / blk), j % blk); break;
        case Op::kReduceScatter:
          for (int s = 0; s < n; ++s) want += pattern(s, r * count + j);
          break;
        case Op::kAllReduce:
          for (int s = 0; s < n; ++s) want += pattern(s, j);
          break;
      }
      if (got[static_cast<std::size_t>(j)] != want) ++wrong;
    }
  }
  return wrong;
}

// What the rows measured add up to: the JSON rows, the wrong elements, the bus bandwidths and their count.
struct Totals {
  nlohmann::json results = nlohmann::json::array();
  std::int64_t wrong = 0;
  double busbw_sum = 0;
  int measured = 0;
};

// Every op and size of `o` over the groups of one kind (`comm`: this rank's; all groups of the kind run at once),
// printed by world rank 0 and added to `totals`.
void measure_group(const Options& o, Communicator& world, Communicator& comm, const std::string& gname, int world_rank,
                   Totals& totals) {
  const char* dname = dtype_name(o.dtype);
  const int n = comm.size();
  if (world_rank == 0) {
    std::printf("#\n# group %s: %d ranks\n", gname.c_str(), n);
  }
  if (n < 2) {
    if (world_rank == 0) std::printf("# (size 1: nothing to measure)\n");
    return;
  }
  if (world_rank == 0) {
    std::printf("# %13s %12s %12s %6s %6s %5s %10s %11s %11s %8s %9s\n", "op", "size(B)", "count(elts)", "type",
                "redop", "place", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "status");
  }
  for (Op op : o.ops) {
    const char* redop = reduces(op) ? "sum" : "none";
    const char* place = in_place(op) ? "in" : "out";
    for (std::int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.factor) {
      nlohmann::json row = {{"group", gname}, {"group_size", n}, {"op", op_name(op)},
                            {"dtype", dname}, {"redop", redop},  {"in_place", in_place(op)}};
      const Buffers b = buffers_for(op, bytes, n, o.dtype, comm.device());
      if (b.recv.empty()) {  // the same on every rank: a function of the sizes only
        if (world_rank == 0) {
          std::printf("  %13s %12lld %12s %6s %6s %5s %10s %11s %11s %8s %9s\n", op_name(op),
                      static_cast<long long>(bytes), "0", dname, redop, place, "-", "-", "-", "-", "too-small");
          row.update({{"size_bytes", bytes}, {"count", 0}, {"status", "too-small"}});
          totals.results.push_back(row);
        }
        continue;
      }
      // count: the elements behind `size` (ring_step: of the k/v block; its gradient has as many in fp32).
      const std::int64_t size_bytes = size_of(op, b),
                         count = op == Op::kRingStep ? b.send[0].numel()
                                                     : size_bytes / static_cast<std::int64_t>(dtype_size(o.dtype));
      for (int i = 0; i < o.warmup; ++i) run_once(op, comm, b);
      world.barrier()->wait();
      const double t0 = now_s();
      for (int i = 0; i < o.iters; ++i) run_once(op, comm, b);
      std::vector<double> stats = {(now_s() - t0) / o.iters, 0};
      stats[1] = static_cast<double>(verify(op, comm, b));
      all_reduce_max(world, stats);
      const double t = stats[0];
      const double algbw = static_cast<double>(size_bytes) / t / 1e9;
      const double busbw = algbw * busbw_factor(op, n);
      totals.wrong += static_cast<std::int64_t>(stats[1]);
      totals.busbw_sum += busbw;
      ++totals.measured;
      if (world_rank == 0) {
        std::printf("  %13s %12lld %12lld %6s %6s %5s %10.2f %11.3f %11.3f %8lld %9s\n", op_name(op),
                    static_cast<long long>(size_bytes), static_cast<long long>(count), dname, redop, place, t * 1e6,
                    algbw, busbw, static_cast<long long>(stats[1]), "ok");
        std::fflush(stdout);
        row.update({{"size_bytes", size_bytes},
                    {"count", count},
                    {"time_us", t * 1e6},
                    {"algbw_gbps", algbw},
                    {"busbw_gbps", busbw},
                    {"wrong", stats[1]},
                    {"status", "ok"}});
        totals.results.push_back(row);
      }
    }
  }
}

int comm_bench_main(int argc, char** argv) {
  const auto [world_size, world_rank] = mpi_world_place();
  const std::optional<Options> parsed = parse(argc, argv, world_size, world_rank);
  if (!parsed) return 0;
  const Options& o = *parsed;
  // The first collective, the same on every rank whatever its flags: ranks started with other flags (mpirun's MPMD
  // form) stop here, each naming the first that differs, before the node's communicator, NCCL or any measured call
  // could pair with another rank's different one. Over MPI, whatever --backend says.
  check_ranks_agree(options_fingerprint(o));

  const std::string date = utc_now_iso8601();
  const NodeInfo node = node_info();
  // The largest size's buffers against the node's memory, the same verdict on every rank before any measured call
  // (--max-bytes 999999999999M timed sendrecv at 1, 2, 4, ... GiB for minutes before an allocation failed). At least
  // a send and a receive buffer of --max-bytes per rank; only over MPI (NCCL's buffers live on the devices).
  if (o.backend == "mpi") {
    const double avail = available_memory_bytes(0);
    const double need = 2.0 * static_cast<double>(o.max_bytes) * node.ranks_per_node;
    double ratio = avail > 0 ? need / avail : 0.0, worst = 0;
    SEQPAR_CHECK_MPI(MPI_Allreduce(&ratio, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
    SEQPAR_CHECK(worst <= 1.0, "comm_bench: --max-bytes ", o.max_bytes, ": the buffers of the largest size (a send and ",
                 "a receive buffer of --max-bytes per rank, times the ranks of a node) need ", worst,
                 " times the memory available on a node (MemAvailable); lower --max-bytes");
  }
  auto world = make_world_communicator(o.backend);
  check_output_paths(*world, o.json_path);
  CpGrid grid(*world, o.grid);

  if (world_rank == 0) {
    std::printf("# seqpar comm_bench %s\n", version());
    std::printf(
        "# backend %s, world %d, grid %s, dtype %s, warmup %d, iters %d (mean per iteration, max over "
        "ranks)\n",
        world->backend_name(), world_size, grid.str().c_str(), dtype_name(o.dtype), o.warmup, o.iters);
    std::printf("# host %s (%d ranks on it, %d cores), commit %s, date %s\n", node.host.c_str(), node.ranks_per_node,
                node.cores_per_node, git_commit(), date.c_str());
    const std::string transport = single_copy_note(node);
    if (!transport.empty()) std::printf("# note: %s\n", transport.c_str());
    std::printf(
        "# every group of a kind runs at once; busbw = algbw x (n-1)/n (allreduce: x 2(n-1)/n; sendrecv, "
        "ring_step: x 1), see docs/benchmarks.md\n");
  }
  Totals totals;
  const char* dname = dtype_name(o.dtype);
  for (const std::string& gname : o.groups) {
    Communicator& comm = gname == "ulysses" ? grid.ulysses() : gname == "ring" ? grid.ring() : grid.cp();
    measure_group(o, *world, comm, gname, world_rank, totals);
  }
  const std::int64_t total_wrong = totals.wrong;
  const int measured = totals.measured;
  const nlohmann::json& results = totals.results;
  const double avg_busbw = measured > 0 ? totals.busbw_sum / measured : 0.0;
  if (world_rank == 0) {
    std::printf("# wrong elements in total: %lld\n", static_cast<long long>(total_wrong));
    // Nothing measured (every size too small for its pattern): n/a (JSON null) rather than a bandwidth of 0.
    if (measured > 0) {
      std::printf("# Avg bus bandwidth    : %g\n#\n", avg_busbw);
    } else {
      std::printf("# Avg bus bandwidth    : n/a\n#\n");
    }
    const nlohmann::json avg_busbw_json = measured > 0 ? nlohmann::json(avg_busbw) : nlohmann::json();
    if (!o.json_path.empty()) {
      nlohmann::json j = {{"version", version()},
                          {"git_commit", git_commit()},
                          {"host", node.host},
                          {"date_utc", date},
                          {"ranks_per_node", node.ranks_per_node},
                          {"cores_per_node", node.cores_per_node},
                          {"backend", world->backend_name()},
                          {"world_size", world_size},
                          {"grid",
                           {{"dp_size", o.grid.dp_size},
                            {"ulysses_size", o.grid.ulysses_size},
                            {"ring_size", o.grid.ring_size},
                            {"placement", placement_name(o.grid.placement)}}},
                          {"dtype", dname},
                          {"warmup", o.warmup},
                          {"iters", o.iters},
                          {"avg_busbw_gbps", avg_busbw_json},
                          {"wrong_total", total_wrong},
                          {"results", results}};
      write_file_atomic(o.json_path, [&](std::ostream& out) { out << j.dump(2) << "\n"; });
    }
  }
  world->barrier()->wait();
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace
}  // namespace seqpar::bench

int main(int argc, char** argv) { return seqpar::run_mpi_main(argc, argv, seqpar::bench::comm_bench_main); }
