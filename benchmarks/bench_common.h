// Helpers shared by the benchmark programs (sp_bench, comm_bench): command lines, wall-clock time, medians, and
// files written atomically.
#pragma once

#include <cstdint>
#include <cxxopts.hpp>
#include <functional>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "benchmarks/atomic_file.h"  // write_file_atomic
#include "runtime/comm.h"

namespace seqpar {
class Fingerprint;  // parallel/cp_common.h
}  // namespace seqpar

namespace seqpar::bench {

// This process's place in MPI_COMM_WORLD (MPI must be initialised; Error on an MPI failure).
struct WorldPlace {
  int size = 1, rank = 0;
};
WorldPlace mpi_world_place();

// Where this run happens, for the benchmarks' headers and JSON. Collective over MPI_COMM_WORLD (MPI_Comm_split_type
// into the ranks sharing this node's memory); every rank gets its own node's values.
struct NodeInfo {
  std::string host;        // gethostname() of this rank
  int ranks_per_node = 1;  // MPI ranks on this node (MPI_COMM_TYPE_SHARED)
  int cores_per_node = 1;  // online processors of this node (sysconf(_SC_NPROCESSORS_ONLN))
};
NodeInfo node_info();

// The warning of an oversubscribed node: "ranks per node R x threads per rank T = N exceeds the C cores of node H
// (timings are not meaningful)", or "" when R x T <= C.
std::string oversubscription_warning(const NodeInfo& node, int threads_per_rank);
// A note for timing headers when OpenMPI is told to move large messages between ranks of one node through
// shared-memory fragments (OMPI_MCA_btl_vader_single_copy_mechanism=none or emulated: two copies, made only while
// both ranks are inside MPI calls, so a ring's transfer no longer overlaps its compute); empty otherwise or with
// one rank per node. scripts/mpi_single_copy.sh says which mechanism a machine allows.
std::string single_copy_note(const NodeInfo& node);

// The current time in UTC, ISO 8601 to the second: "2026-11-30T16:22:30Z".
std::string utc_now_iso8601();

// The git commit the build was configured from (CMake, at configure time: `git describe --always --dirty`), or
// "unknown" outside a git checkout.
const char* git_commit();

// The start of a program's options fingerprint for check_ranks_agree: "<program> options", then which of --help /
// --version the rank was given (exit_flag; null: neither). parse_command_line agrees on it alone before a rank
// leaves for --help or --version, so that a rank started with one of them (mpirun's MPMD form) stops the others at
// their agreement instead of leaving them waiting.
Fingerprint options_fingerprint_start(std::string_view program, const char* exit_flag = nullptr);

// Parses argv with `spec`. Returns std::nullopt after printing the help of `help_groups` (all groups when empty)
// on world rank 0 for --help, or "<program> (seqpar) <version>" for --version (when `spec` defines it). Throws Error
// (same text on every rank) for a malformed command line or a stray positional argument.
std::optional<cxxopts::ParseResult> parse_command_line(cxxopts::Options& spec, int argc, char** argv, int world_rank,
                                                       const std::vector<std::string>& help_groups = {});

// The options' agreement of a benchmark program (mpirun's MPMD form can start ranks with different command lines:
// `mpirun -np 1 prog A : -np 1 prog B`): one AgreementCheck (mode always, whatever SEQPAR_AGREEMENT_CHECK says; one
// 24-byte all-reduce, then an all-gather of the fields' text only when they differ) of `options` over MPI_COMM_WORLD,
// whatever --backend says, so that it runs before any NCCL or CUDA call. Call it as the program's FIRST collective,
// right after parsing: with every option agreed, all ranks then post the same collectives. Throws Error, the same on
// every rank, naming the first field that differs and each rank's value ("<call>: the ranks of the world group
// (world ranks 0-1) disagree on --ops: sendrecv on world rank 0; alltoall on world rank 1").
void check_ranks_agree(const Fingerprint& options);

// Parses "4096", "8K", "1M" (K = 1024, M = 1024^2; case-insensitive). Throws Error naming `flag` and the value.
std::int64_t parse_size(const std::string& text, const char* flag);
// "a,b,,c" -> {"a", "b", "", "c"}; "" -> {""}.
std::vector<std::string> split_commas(const std::string& text);

// Seconds on a monotonic clock (differences only).
double now_s();
// Median of `v` (the mean of the two middle values for an even count); `v` must not be empty.
double median(std::vector<double> v);

// Collective helpers over `comm` that wait at most `timeout_s` (<= 0: the communicator's default timeout).
void all_reduce(Communicator& comm, std::vector<double>& values, ReduceOp op, double timeout_s = -1);
void barrier(Communicator& comm, double timeout_s = -1);

// --json FILE (and sp_bench's --dump DIR; empty: not given) are written by rank 0 at the end of the run; finds out
// now whether that will work (rank 0 creates the --dump directory and probes a file in both places) and fails on
// every rank with the same Error naming the flag and the path (one small all-reduce over `world`). Call it before the
// first measured call. Collective.
void check_output_paths(Communicator& world, const std::string& json_path, const std::string& dump_dir = {});

}  // namespace seqpar::bench
