// comm_bench: message-size sweeps of the communication patterns of sequence parallelism on the groups of an SpGrid:
// ring send/recv (each rank sends to the next and receives from the previous rank of its group), all-to-all,
// all-gather and reduce-scatter, on the Ulysses, ring and SP groups. Prints nccl-tests style tables on rank 0:
// size, count, time (us), algbw and busbw (GB/s) and the number of wrong elements of a verification pass.
// Definitions (README "comm_bench"): size as in nccl-tests (all-gather: the gathered output; reduce-scatter: the
// input; all-to-all: the send buffer; send/recv: one message); algbw = size / time; busbw = algbw x factor with
// factor (n-1)/n for all-gather, reduce-scatter and all-to-all and 1 for send/recv.
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
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_common.h"
#include "runtime/comm_factory.h"
#include "runtime/error.h"
#include "runtime/mpi_comm.h"
#include "runtime/sp_grid.h"
#include "runtime/tensor.h"
#include "runtime/tensor_ops.h"
#include "runtime/version.h"

namespace seqpar::bench {
namespace {

enum class Op { kSendRecv, kAllToAll, kAllGather, kReduceScatter };
constexpr Op kAllOps[] = {Op::kSendRecv, Op::kAllToAll, Op::kAllGather, Op::kReduceScatter};
const char* op_name(Op op) {
  switch (op) {
    case Op::kSendRecv: return "sendrecv";
    case Op::kAllToAll: return "alltoall";
    case Op::kAllGather: return "allgather";
    case Op::kReduceScatter: return "reducescatter";
  }
  return "?";
}
double busbw_factor(Op op, int n) { return op == Op::kSendRecv ? 1.0 : static_cast<double>(n - 1) / n; }

struct Options {
  std::string backend = "mpi";
  SpGridConfig grid;
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
  cxxopts::Options spec("comm_bench", "communication sweeps on the groups of an SpGrid: mpirun -np N comm_bench");
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
    ("ops", "comma list: sendrecv,alltoall,allgather,reducescatter", cxxopts::value<std::string>()->default_value("sendrecv,alltoall,allgather,reducescatter"))
    ("groups", "comma list: ulysses,ring,sp", cxxopts::value<std::string>()->default_value("ulysses,ring,sp"))
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
                 "' (expected sendrecv, alltoall, allgather, reducescatter)");
  }
  for (const std::string& name : split_list(r["groups"].as<std::string>())) {
    SEQPAR_CHECK(name == "ulysses" || name == "ring" || name == "sp", "--groups: unknown group '", name,
                 "' (expected ulysses, ring, sp)");
    o.groups.push_back(name);
  }
  SEQPAR_CHECK(!o.ops.empty() && !o.groups.empty(), "--ops and --groups must each name at least one entry");
  return o;
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

struct Buffers {
  Tensor send, recv;
};

// Element counts of the send and receive buffers for `bytes` (nccl-tests sizes), rounded down to what the group
// size needs; 0 when the size is too small.
void counts_for(Op op, std::int64_t bytes, int n, std::size_t esize, std::int64_t& send, std::int64_t& recv) {
  std::int64_t elems = bytes / static_cast<std::int64_t>(esize);
  switch (op) {
    case Op::kSendRecv: send = recv = elems; break;
    case Op::kAllToAll: send = recv = elems / n * n; break;
    case Op::kAllGather:
      recv = elems / n * n;
      send = recv / n;
      break;
    case Op::kReduceScatter:
      send = elems / n * n;
      recv = send / n;
      break;
  }
}

WorkHandle post(Op op, Communicator& c, const Buffers& b) {
  const int n = c.size(), r = c.rank();
  switch (op) {
    case Op::kSendRecv:
      return c.batch_isend_irecv({P2POp::send(b.send, (r + 1) % n), P2POp::recv(b.recv, (r + n - 1) % n)});
    case Op::kAllToAll: return c.all_to_all(b.send, b.recv);
    case Op::kAllGather: return c.all_gather(b.send, b.recv);
    case Op::kReduceScatter: return c.reduce_scatter(b.send, b.recv, ReduceOp::kSum);
  }
  SEQPAR_THROW("comm_bench: unknown operation");
}

// Number of wrong elements after one run with the verification pattern.
std::int64_t verify(Op op, Communicator& c, const Buffers& b) {
  const int n = c.size(), r = c.rank();
  const std::int64_t count = b.recv.numel();
  fill_pattern(b.send, r);
  post(op, c, b)->wait();
  const std::vector<double> got = as_f64(b.recv);
  std::int64_t wrong = 0;
  for (std::int64_t j = 0; j < count; ++j) {
    double want = 0;
    switch (op) {
      case Op::kSendRecv: want = pattern((r + n - 1) % n, j); break;
      case Op::kAllToAll: {
        const std::int64_t blk = count / n;
        want = pattern(static_cast<int>(j / blk), r * blk + j % blk);
        break;
      }
      case Op::kAllGather: {
        const std::int64_t blk = count / n;
        want = pattern(static_cast<int>(j / blk), j % blk);
        break;
      }
      case Op::kReduceScatter:
        for (int s = 0; s < n; ++s) want += pattern(s, r * count + j);
        break;
    }
    if (got[static_cast<std::size_t>(j)] != want) ++wrong;
  }
  return wrong;
}

int comm_bench_main(int argc, char** argv) {
  const auto [world_size, world_rank] = mpi_world_place();
  const std::optional<Options> parsed = parse(argc, argv, world_size, world_rank);
  if (!parsed) return 0;
  const Options& o = *parsed;

  auto world = make_world_communicator(o.backend);
  SpGrid grid(*world, o.grid);
  const std::size_t esize = dtype_size(o.dtype);

  if (world_rank == 0) {
    std::printf("# seqpar comm_bench %s\n", version());
    std::printf(
        "# backend %s, world %d, grid %s, dtype %s, warmup %d, iters %d (mean per iteration, max over "
        "ranks)\n",
        world->backend_name(), world_size, grid.str().c_str(), dtype_name(o.dtype), o.warmup, o.iters);
    std::printf("# every group of a kind runs at once; busbw = algbw x (n-1)/n (sendrecv: x 1), see README\n");
  }
  nlohmann::json results = nlohmann::json::array();
  std::int64_t total_wrong = 0;
  for (const std::string& gname : o.groups) {
    Communicator& comm = gname == "ulysses" ? grid.ulysses() : gname == "ring" ? grid.ring() : grid.sp();
    const int n = comm.size();
    if (world_rank == 0) {
      std::printf("#\n# group %s: %d ranks\n", gname.c_str(), n);
    }
    if (n < 2) {
      if (world_rank == 0) std::printf("# (size 1: nothing to measure)\n");
      continue;
    }
    if (world_rank == 0) {
      std::printf("# %13s %12s %12s %10s %11s %11s %8s\n", "op", "size(B)", "count(elts)", "time(us)", "algbw(GB/s)",
                  "busbw(GB/s)", "#wrong");
    }
    for (Op op : o.ops) {
      for (std::int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.factor) {
        std::int64_t send_count = 0, recv_count = 0;
        counts_for(op, bytes, n, esize, send_count, recv_count);
        if (send_count == 0 || recv_count == 0) continue;
        Buffers b{Tensor::zeros({send_count}, o.dtype, MemCategory::kCommBuffer, comm.device()),
                  Tensor::zeros({recv_count}, o.dtype, MemCategory::kCommBuffer, comm.device())};
        const std::int64_t size_bytes =
            (op == Op::kAllGather ? recv_count : send_count) * static_cast<std::int64_t>(esize);
        for (int i = 0; i < o.warmup; ++i) post(op, comm, b)->wait();
        world->barrier()->wait();
        const double t0 = now_s();
        for (int i = 0; i < o.iters; ++i) post(op, comm, b)->wait();
        std::vector<double> stats = {(now_s() - t0) / o.iters, 0};
        stats[1] = static_cast<double>(verify(op, comm, b));
        all_reduce_max(*world, stats);
        const double t = stats[0];
        const double algbw = static_cast<double>(size_bytes) / t / 1e9;
        const double busbw = algbw * busbw_factor(op, n);
        total_wrong += static_cast<std::int64_t>(stats[1]);
        if (world_rank == 0) {
          std::printf("  %13s %12lld %12lld %10.2f %11.3f %11.3f %8lld\n", op_name(op),
                      static_cast<long long>(size_bytes), static_cast<long long>(size_bytes / esize), t * 1e6, algbw,
                      busbw, static_cast<long long>(stats[1]));
          std::fflush(stdout);
          results.push_back({{"group", gname},
                             {"group_size", n},
                             {"op", op_name(op)},
                             {"size_bytes", size_bytes},
                             {"count", size_bytes / static_cast<std::int64_t>(esize)},
                             {"time_us", t * 1e6},
                             {"algbw_gbps", algbw},
                             {"busbw_gbps", busbw},
                             {"wrong", stats[1]}});
        }
      }
    }
  }
  if (world_rank == 0) {
    std::printf("# wrong elements in total: %lld\n", static_cast<long long>(total_wrong));
    if (!o.json_path.empty()) {
      nlohmann::json j = {{"version", version()},
                          {"backend", world->backend_name()},
                          {"world_size", world_size},
                          {"grid",
                           {{"dp_size", o.grid.dp_size},
                            {"ulysses_size", o.grid.ulysses_size},
                            {"ring_size", o.grid.ring_size},
                            {"placement", placement_name(o.grid.placement)}}},
                          {"dtype", dtype_name(o.dtype)},
                          {"results", results}};
      std::ofstream out(o.json_path);
      SEQPAR_CHECK(out.good(), "--json ", o.json_path, ": cannot open for writing");
      out << j.dump(2) << "\n";
    }
  }
  world->barrier()->wait();
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace
}  // namespace seqpar::bench

int main(int argc, char** argv) { return seqpar::run_mpi_main(argc, argv, seqpar::bench::comm_bench_main); }
