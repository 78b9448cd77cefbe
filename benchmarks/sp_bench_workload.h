// The workloads sp_bench measures. A workload is one attention kind (MHA, DSA, GDN) under sequence parallelism:
// it makes (or loads) the full problem, holds this rank's shard, runs the distributed forward and backward, gathers
// the full outputs, and runs the same problem on one rank as the reference. sp_bench itself only times, counts and
// prints; adding an attention kind means adding a Workload and a line in make_workload().
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/npy.h"
#include "benchmarks/sp_bench_options.h"
#include "runtime/sp_grid.h"

namespace seqpar::bench {

// What one distributed phase (forward or backward) did on this rank.
struct PhaseCounters {
  double exposed_comm_s = 0;         // time blocked on communication that no computation hid
  std::int64_t bytes_sent = 0;       // bytes this rank sent (all groups)
  double executed_flops = 0;         // attention FLOPs this rank executed (masked blocks skipped)
  std::int64_t message_rounds = -1;  // sequential rounds of messages (GDN state passing); -1: not reported
};

// One extra single-rank timing of the whole problem (e.g. GDN --gdn-compare-token): medians in ms.
struct VariantTiming {
  std::string name;
  double fwd_ms = 0, bwd_ms = 0;
};

struct TensorSpec {
  std::string name;  // .npy file stem
  Shape shape;       // full (unsharded) shape
};

// Full tensors by name, in a workload's order.
using NamedArrays = std::vector<std::pair<std::string, npy::HostArray>>;
const npy::HostArray& find_array(const NamedArrays& arrays, const std::string& name);

// Comparison rule of --check: a tensor passes when max_abs_err <= atol + rtol * max|reference|.
struct Tolerance {
  double atol = 0, rtol = 0;
};

class Workload {
 public:
  virtual ~Workload() = default;

  // Full input tensors (names and shapes, for --inputs) and the full outputs/gradients (for --dump / --check).
  virtual std::vector<TensorSpec> input_specs() const = 0;
  virtual std::vector<std::string> output_names() const = 0;
  // Model FLOPs of the whole problem of one data-parallel replica (README "FLOPs").
  virtual double forward_flops() const = 0;
  virtual double backward_flops() const = 0;
  virtual Tolerance tolerance(const std::string& output_name) const = 0;

  // Makes this rank's shard: from `full` (loaded with --inputs, already checked against input_specs()) or, when
  // null, from the seed (each rank generates only its own positions). No communication.
  virtual void setup(const NamedArrays* full) = 0;
  // Frees the results of the previous forward / backward (called before a forward, so that memory peaks do not
  // count the previous iteration's results).
  virtual void release_outputs() = 0;
  // Distributed forward / backward; collective over the SP group of the grid.
  virtual PhaseCounters forward() = 0;
  virtual PhaseCounters backward() = 0;
  // Collective over the SP group: the full outputs and gradients of the last forward / backward on every SP rank.
  virtual NamedArrays gather_outputs() = 0;

  // The single-rank reference of the same problem (no communication; called on one rank).
  virtual void reference_setup(const NamedArrays* full) = 0;
  virtual void reference_forward() = 0;
  virtual void reference_backward() = 0;
  virtual NamedArrays reference_outputs() = 0;

  // Optional single-rank timings of kernel variants of the whole problem (called on world rank 0 only, after the
  // distributed timing; may set up its own copy of the problem from `full` or the seed). Default: none.
  virtual std::vector<VariantTiming> time_variants(const NamedArrays* /*full*/, int /*warmup*/, int /*iters*/) {
    return {};
  }
};

// Throws Error "--attn X is not available yet ..." for kinds whose distributed part has not landed (none today:
// mha, dsa and gdn are all available). Called before any communication.
void check_workload_available(const SpBenchOptions& options);
// The full input tensors of the configured workload (known before the grid exists, for --inputs).
std::vector<TensorSpec> workload_input_specs(const SpBenchOptions& options);
std::unique_ptr<Workload> make_workload(const SpBenchOptions& options, const SpGrid& grid);

// ---- helpers shared by workloads ------------------------------------------------------------------------------

// Deterministic pseudo-random value in [-1, 1) of element `index` of tensor `tensor_id` (counter-based: any rank can
// generate any element without generating the others).
double random_uniform(std::uint64_t seed, std::uint64_t tensor_id, std::uint64_t index);

// Fills the [B, S_local, ...] shard at `positions` of the full [B, seq_len, ...] random tensor `tensor_id`.
// Passing positions 0..seq_len-1 fills the full tensor; shards and the full tensor agree element by element.
void fill_random_shard(const TensorView& dst, std::uint64_t seed, std::uint64_t tensor_id, std::int64_t seq_len,
                       const std::vector<std::int64_t>& positions);

// The full tensor `name` of `full` converted to dtype and cut to `positions` (dim 1).
void shard_from_full(const npy::HostArray& full, const std::vector<std::int64_t>& positions, const TensorView& dst);

}  // namespace seqpar::bench
