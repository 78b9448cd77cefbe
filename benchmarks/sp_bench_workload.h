// The workloads sp_bench measures. A workload is one attention kind (MHA, DSA, GDN) under sequence parallelism:
// it makes (or loads) the full problem, holds this rank's shard, runs the distributed forward and backward, gathers
// the full outputs, and runs the same problem on one rank as the reference. sp_bench itself only times, counts and
// prints. Each workload file registers one WorkloadKind (SEQPAR_WORKLOAD_KIND): adding an attention kind means
// adding one such file to sp_bench's sources; the option parser and sp_bench reach every kind through the registry.
#pragma once

#include <cstdint>
#include <cxxopts.hpp>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/npy.h"
#include "benchmarks/sp_bench_memory.h"
#include "benchmarks/sp_bench_options.h"
#include "parallel/cp_common.h"
#include "runtime/cp_grid.h"
#include "runtime/tensor.h"

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

// Tolerance of --check for one tensor: max_abs_err <= atol + rtol * max|reference| (the rules: sp_bench_check.h).
struct Tolerance {
  double atol = 0, rtol = 0;
};

// The tolerances of results whose cross-block accumulators (lse, merge weights, dot products) are fp32 for every
// storage dtype: fp64 agrees to fp32 precision; 16-bit results are rounded once from fp32 accumulators, so another
// merge order moves them by about one unit in the last place (2^-8 relative for bf16, 2^-11 for fp16). Throws Error
// for a non-floating dtype, naming `what`.
Tolerance fp32_accumulator_tolerance(DType dtype, const std::string& what);

// The tolerance of fp64 results of kernels and merges that compute fp64 storage in fp64 throughout (MHA): the
// distributed result agrees with the one-rank kernel and the fp64 reference to fp64 rounding, amplified by the
// conditioning of the softmax backward at large logits (measured below 1e-12 relative at logits up to 1e4).
inline constexpr Tolerance kFp64Tolerance{1e-12, 1e-10};

// What the fp64 reference of a workload would take (bytes of memory, floating-point operations); zeros: none.
struct Fp64ReferenceCost {
  double bytes = 0, flops = 0;
};

// The number of elements of all of `specs` together (as a double, for cost estimates).
double spec_elements(const std::vector<TensorSpec>& specs);

class Workload {
 public:
  virtual ~Workload() = default;

  // Full input tensors (names and shapes, for --inputs) and the full outputs/gradients (for --dump / --check).
  virtual std::vector<TensorSpec> input_specs() const = 0;
  virtual std::vector<std::string> output_names() const = 0;
  // Model FLOPs of the whole problem of one data-parallel replica (docs/benchmarks.md, "Definitions of the benchmark figures").
  virtual double forward_flops() const = 0;
  virtual double backward_flops() const = 0;
  virtual Tolerance tolerance(const std::string& output_name) const = 0;

  // Makes this rank's shard: from `full` (loaded with --inputs, already checked against input_specs()) or, when
  // null, from the seed (each rank generates only its own positions). No communication.
  virtual void setup(const NamedArrays* full) = 0;
  // Frees the results of the previous forward / backward (called before a forward, so that memory peaks do not
  // count the previous iteration's results).
  virtual void release_outputs() = 0;
  // Distributed forward / backward; collective over the CP group of the grid.
  virtual PhaseCounters forward() = 0;
  virtual PhaseCounters backward() = 0;
  // Collective over the CP group: the full outputs and gradients of the last forward / backward on every CP rank.
  virtual NamedArrays gather_outputs() = 0;

  // The full inputs generated from the seed, exactly as setup() draws this rank's shard of them, in input_specs()
  // order and the storage dtype (GDN's initial_state: the state dtype); for --dump-inputs (no communication).
  virtual NamedArrays make_full_inputs() const = 0;

  // The single-rank reference of the same problem (no communication; called on one rank).
  virtual void reference_setup(const NamedArrays* full) = 0;
  virtual void reference_forward() = 0;
  virtual void reference_backward() = 0;
  virtual NamedArrays reference_outputs() = 0;

  // The fp64 reference (attention/reference/: naive, every tensor fp64) of the same problem, on the inputs of
  // reference_setup() widened to fp64 (so it sees the same rounded inputs as the kernels), for the tensors it
  // defines (a subset of output_names(), fp64). Called on one rank after reference_forward() and
  // reference_backward(), only when --check needs it and its kind's fp64_reference_cost fits. Default: none.
  virtual NamedArrays fp64_reference_outputs() { return {}; }

  // The rounding floor of a tensor after fp64_reference_outputs(): an error a correct 16-bit run can carry where
  // the exact value is ~0 because its terms cancel (docs/benchmarks.md: the rounding floor); the reference and
  // fp64 rules accept fp64_err up to it. Default: 0 (none).
  virtual double rounding_floor(const std::string& /*output_name*/) const { return 0; }

  // Optional single-rank timings of kernel variants of the whole problem (called on world rank 0 only, after the
  // distributed timing; may set up its own copy of the problem from `full` or the seed). Default: none.
  virtual std::vector<VariantTiming> time_variants(const NamedArrays* /*full*/, int /*warmup*/, int /*iters*/) {
    return {};
  }
};

// The shared body of a workload that runs one CP layer (parallel/): its last outputs (with the context the backward
// takes) and gradients. forward() and backward() drop the previous results and reset the layer's counters before
// running the phase, so that each phase's counters are its own. Output has a CpContext `ctx`.
template <typename Output, typename Grads>
class CpLayerWorkload : public Workload {
 public:
  void release_outputs() override {
    out_ = Output{};
    grads_ = Grads{};
  }
  PhaseCounters forward() override {
    out_ = Output{};
    reset_layer_counters();
    out_ = run_forward();
    return forward_counters();
  }
  PhaseCounters backward() override {
    grads_ = Grads{};
    reset_layer_counters();
    grads_ = run_backward(std::move(out_.ctx));
    return backward_counters();
  }

 protected:
  virtual void reset_layer_counters() = 0;
  virtual Output run_forward() = 0;
  virtual Grads run_backward(CpContext&& ctx) = 0;
  // The counters of the phase just run (read from the layer after it).
  virtual PhaseCounters forward_counters() = 0;
  virtual PhaseCounters backward_counters() = 0;

  Output out_;
  Grads grads_;
};

// A CP layer's counters as a phase's: exposed time (ring waits and Ulysses exchanges), bytes sent over every group,
// executed FLOPs (those the layer counts; 0 otherwise). message_rounds is left unreported.
PhaseCounters phase_counters(const CpCounters& c);
// The same plus the message rounds (GDN state passing, MHA and DSA ring exchanges), which give the table its `rounds`
// column.
PhaseCounters phase_counters_with_rounds(const CpCounters& c);

// This rank's uninitialised tensors of `shapes`, one dtype and category, in order.
std::vector<Tensor> local_tensors(DType dtype, const std::vector<Shape>& shapes,
                                  MemCategory category = MemCategory::kSavedActivation);
// Their views, in order.
std::vector<TensorView> views_of(const std::vector<Tensor>& tensors);

// ---- the registry of attention kinds ----------------------------------------------------------------------------

// Real shapes of a model; explicit flags override them. 0: not part of the preset (the flag's default applies).
struct ModelPreset {
  std::string name;  // --model value
  std::int64_t heads = 0, kv_heads = 0, head_dim = 0, topk = 0, chunk_size = 0, dim_v = 0, indexer_heads = 0,
               indexer_dim = 0;
  std::string note;             // one line for --help
  std::int64_t conv_width = 0;  // GDN short conv width (0: none)
  // The model's RoPE (sp_bench_rope.h); none: --rope's default (none).
  std::optional<attn::RopeConfig> rope;
  double softcap = 0;  // MHA logit soft-capping (0: none)
  bool sinks = false;  // MHA attention sinks
};

// The sp_bench --help groups a kind's own flags join.
enum class FlagGroup { kProblem, kParallel, kRun };
// Each kind's own flags of `group`, in its sp_bench_<kind>.cc. One registry calls them in --help's order:
// add_sp_bench_flags (sp_bench_options.cc).
void add_mha_flags(cxxopts::Options& spec, FlagGroup group);
void add_dsa_flags(cxxopts::Options& spec, FlagGroup group);
void add_gdn_flags(cxxopts::Options& spec, FlagGroup group);
// Every flag of sp_bench (sp_bench_options.cc).
void add_sp_bench_flags(cxxopts::Options& spec);

// One attention kind of sp_bench. Every function is local arithmetic (no communication) except `make`.
struct WorkloadKind {
  std::string name;         // --attn value, e.g. "mha"
  std::string description;  // one line: what runs (--help)
  std::vector<ModelPreset> presets;
  // Flags only some kinds accept: given with an --attn that does not list them they are an error naming the kinds
  // that do (a flag may be listed by several kinds).
  std::vector<std::string> own_flags;
  // Shape flags read from the --inputs files when not given (a given one must match its file): the flag, the input
  // file stem, the dimension, and the option it sets. An optional file (GDN's conv_weight) may be absent: the flag
  // is then 0 when not given, and a given non-zero value is refused.
  struct InputShapeFlag {
    std::string flag, tensor;
    int dim;
    std::int64_t SpBenchOptions::*field;
    bool optional_file = false;
  };
  std::vector<InputShapeFlag> input_shape_flags;
  // The kind's rules on the parsed options, after the common ones (may set kind defaults, e.g. DSA's --causal;
  // optional). Throws Error naming the flag, the value and the rule.
  std::function<void(SpBenchOptions&)> validate;
  // Notes on valid options that cannot run efficiently (sp_bench prints each on rank 0, once, as "sp_bench: warning:
  // ..."); null: none.
  std::function<std::vector<std::string>(const SpBenchOptions&)> warnings;
  // One-line shape summary for the table header.
  std::function<std::string(const SpBenchOptions&)> describe_shapes;
  // Adds the kind's own fields to the JSON of a run (optional).
  std::function<void(const SpBenchOptions&, nlohmann::json&)> add_json;
  // The full input tensors (known before the grid exists, for --inputs).
  std::function<std::vector<TensorSpec>(const SpBenchOptions&)> input_specs;
  // The kind's rule on the values of --inputs tensors, beyond "finite" (optional): "" when element value `x` of
  // `tensor` is allowed, else the rule it breaks (sp_bench stops every rank naming the file, the element and it).
  std::function<std::string(const std::string& tensor, double x)> input_value_rule;
  // What one rank's distributed step holds, by ledger category (sp_bench_memory.h), from the options alone: the
  // estimate that sp_bench compares with the node's memory before it allocates.
  std::function<WorkloadMemory(const SpBenchOptions&)> estimate_memory;
  // What Workload::fp64_reference_outputs() takes, from the options alone (so that --dry-run and the start of a run
  // apply the same size rule before anything is allocated); null: the kind has no fp64 reference.
  std::function<Fp64ReferenceCost(const SpBenchOptions&)> fp64_reference_cost;
  // The workload on this rank's place in `grid` (constructors may communicate over the grid); set by
  // SEQPAR_WORKLOAD_KIND.
  std::function<std::unique_ptr<Workload>(const SpBenchOptions&, const CpGrid&)> make;
};

// Adds `kind` to the registry (at static initialisation; use SEQPAR_WORKLOAD_KIND). Throws Error for a name
// registered twice. Returns true.
bool register_workload_kind(WorkloadKind kind);
// Every registered kind, sorted by name.
const std::vector<WorkloadKind>& workload_kinds();
// The kind named `name`; Error "--attn X: unknown attention kind (registered: dsa, gdn, mha)" otherwise.
const WorkloadKind& find_workload_kind(const std::string& name);
// The registered names joined by `separator` ("dsa | gdn | mha").
std::string workload_kind_names(const std::string& separator);

// Registers the WorkloadKind that the function body after the macro returns, with `make` constructing a `W` from
// (options, grid). In one workload file, at namespace scope:
//   SEQPAR_WORKLOAD_KIND(MhaWorkload) {
//     WorkloadKind k;
//     k.name = "mha";
//     ...
//     return k;
//   }
#define SEQPAR_WORKLOAD_KIND(W)                                                               \
  ::seqpar::bench::WorkloadKind seqpar_workload_kind_##W();                                   \
  [[maybe_unused]] static const bool seqpar_workload_registered_##W = [] {                    \
    ::seqpar::bench::WorkloadKind k = seqpar_workload_kind_##W();                             \
    k.make = [](const ::seqpar::bench::SpBenchOptions& o,                                     \
                const ::seqpar::CpGrid& grid) -> std::unique_ptr<::seqpar::bench::Workload> { \
      return std::make_unique<W>(o, grid);                                                    \
    };                                                                                        \
    return ::seqpar::bench::register_workload_kind(std::move(k));                             \
  }();                                                                                        \
  ::seqpar::bench::WorkloadKind seqpar_workload_kind_##W()

// ---- helpers shared by workloads ------------------------------------------------------------------------------

// Deterministic pseudo-random value in [-1, 1) of element `index` of tensor `tensor_id` (counter-based: any rank can
// generate any element without generating the others).
double random_uniform(std::uint64_t seed, std::uint64_t tensor_id, std::uint64_t index);

// Fills the [B, S_local, ...] shard at `positions` of the full [B, seq_len, ...] random tensor `tensor_id`.
// Passing positions 0..seq_len-1 fills the full tensor; shards and the full tensor agree element by element. A
// negative position (a padding row, SequenceLayout::token_index) gets zeros.
void fill_random_shard(const TensorView& dst, std::uint64_t seed, std::uint64_t tensor_id, std::int64_t seq_len,
                       const std::vector<std::int64_t>& positions);

// The full tensor `name` of `full` converted to dtype and cut to `positions` (dim 1; a negative position, a padding
// row, gets zeros).
void shard_from_full(const npy::HostArray& full, const std::vector<std::int64_t>& positions, const TensorView& dst);

// x -> offset + slope * x, in place (floating dtypes; maps the uniform [-1, 1) inputs to the ranges a kind needs).
void affine_inplace(const TensorView& t, double offset, double slope);

// Positions 0 .. seq_len - 1 (the whole sequence, for the single-rank reference).
std::vector<std::int64_t> all_positions(std::int64_t seq_len);

// Zero-filled host arrays, one per (name, dtype, shape), in that order.
struct ArraySpec {
  std::string name;
  DType dtype;
  Shape shape;
};
NamedArrays zero_arrays(const std::vector<ArraySpec>& specs);

// The views of `arrays`, in order.
std::vector<TensorView> views_of(const NamedArrays& arrays);

// `arrays` converted to fp64 (int64 arrays kept), for the fp64 references.
NamedArrays widen_to_fp64(const NamedArrays& arrays);

}  // namespace seqpar::bench
