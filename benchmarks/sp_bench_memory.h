// sp_bench's memory estimate: the peak bytes of one rank, from the shapes alone, before anything is allocated
// (docs/benchmarks.md, "Memory estimate"). Each attention kind gives what its distributed step holds, category by category of the
// memory ledger (WorkloadKind::estimate_memory, sp_bench_workload.h); this file adds the host arrays of the run's
// options (--inputs, --check, --dump, --efficiency), compares the node's sum with the memory the node has, and prints
// the estimate (--dry-run). sp_bench --mode decode makes its own estimate (estimate_decode_memory,
// sp_bench_decode.h) and shares the rest: the comparison with the node, the printing, the refusal.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/sp_bench_options.h"

namespace seqpar::bench {

struct TensorSpec;  // sp_bench_workload.h

// Bytes one phase (forward or backward) of the distributed step holds at its peak on one rank, besides the inputs.
struct PhaseMemory {
  double outputs = 0;    // outputs and gradients held (the forward's outputs stay alive through the backward)
  double saved = 0;      // the forward's saved activations (the CpContext)
  double workspace = 0;  // kernel scratch, block results and accumulators, Ulysses copies (peak)
  double comm = 0;       // communication buffers (peak)
  double total() const { return outputs + saved + workspace + comm; }
};

// What one attention kind's step holds on one rank (bytes). Upper bounds by construction: each phase's transient
// buffers are summed as if all were alive at once.
struct WorkloadMemory {
  double inputs = 0;  // this rank's input shards (Workload::setup)
  PhaseMemory forward, backward;
  double full_inputs = 0;        // the whole problem's inputs in the storage dtype (host arrays)
  double full_outputs = 0;       // the whole problem's outputs and gradients (host arrays)
  double reference_scratch = 0;  // what the single-rank reference needs besides its inputs and outputs
};

// One rank's estimate: the ledger's peak during the timed steps by category, then the host arrays of the options.
struct MemoryEstimate {
  std::vector<std::pair<std::string, double>> ledger;  // inputs, saved activations, outputs, workspace, comm buffers
  std::vector<std::pair<std::string, double>> host;    // loaded inputs, gathered outputs, reference, ... (when used)
  // --mode train: the ledger's peak of each phase ("fwd", "bwd", as the JSON names the phases): the inputs and that
  // phase's terms; the largest is ledger_bytes(). Empty for --mode decode (one peak, prefill to the last step).
  std::vector<std::pair<std::string, double>> phases;
  // The flags that set the size, for the refusal's "reduce ..." ("--seq or --batch"; decode: --context and the rest
  // with their values).
  std::string size_flags = "--seq or --batch";
  double ledger_bytes() const;  // what the ledger's total peak can reach (bytes)
  double total_bytes() const;   // ledger + host + kProcessBaselineBytes
};

// Memory a rank uses outside every estimate (MPI, libraries, the executable): a fixed allowance.
constexpr double kProcessBaselineBytes = 64.0 * 1024 * 1024;

// The estimate of world rank `world_rank` (the single-rank reference of --check runs on each replica's SP root;
// --efficiency's runs on every rank). Local arithmetic; Error when the kind has no estimate.
MemoryEstimate estimate_memory(const SpBenchOptions& o, int world_rank);

// The bytes of the --inputs files of `specs` in o.inputs_dir (what load_inputs() reads, on every rank): their sizes
// on disk, which exceed the arrays by the small .npy headers; `fallback` when a file is missing (load_inputs will
// say so).
double loaded_input_bytes(const SpBenchOptions& o, const std::vector<TensorSpec>& specs, double fallback);

// Bytes this node can still give: MemAvailable of /proc/meminfo, lowered to the cgroup's memory.max minus
// memory.current where a cgroup (v2) limit is set; `test_override` > 0 replaces both (--test-mem-available-mib).
// -1 when neither can be read.
double available_memory_bytes(double test_override);

// The estimate against the node's memory: `e` summed over the ranks of each node and compared with
// available_memory_bytes() of that node. Collective over MPI_COMM_WORLD; every rank gets the same verdict, about the
// node that falls shortest. Not compared with --backend nccl (its tensors live on the devices) or where no node can
// read its available memory.
struct MemoryVerdict {
  bool compared = false;
  bool fits = true;
  std::string text;  // "the 2 rank(s) on world rank 0's node need X of the Y available (MemAvailable)"
};
MemoryVerdict compare_with_node_memory(const SpBenchOptions& o, const MemoryEstimate& e);

// Bytes as the estimate prints them: "12.5 MiB" below 1 GiB, "3.25 GiB" below 1 TiB, else "1.50 TiB".
std::string bytes_str(double bytes);

// "# memory estimate per rank ..." lines for the table header and --dry-run.
std::string describe_memory_estimate(const MemoryEstimate& e);
// What --dry-run prints: describe_memory_estimate(e), then "# node: ..." with the verdict (fits or does NOT fit).
std::string describe_memory_dry_run(const MemoryEstimate& e, const MemoryVerdict& v);
// The refusal, before anything is allocated: Error when `v` says the node cannot hold the estimate, naming the node's
// figures, the largest part of `mine` (this rank's estimate) and its size_flags. Local; every rank gets the same
// verdict from compare_with_node_memory, so that every rank stops alike.
void check_memory_fits(const MemoryVerdict& v, const MemoryEstimate& mine);
// The estimate for --json: {"ledger_peak_bytes", "total_bytes", "ledger": {name: bytes}, "host": {name: bytes}}, and
// "phase_peak_bytes": {phase: bytes} when e.phases is not empty.
nlohmann::json memory_estimate_json(const MemoryEstimate& e);

}  // namespace seqpar::bench
