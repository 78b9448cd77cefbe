// sp_plan: predicts the step time of every context-parallel configuration of one layer on a cluster and ranks them
// (docs/benchmarks.md, "sp_plan"). It shares sp_bench's option parser (so a configuration is valid for the planner
// exactly when sp_bench accepts its flags, with sp_bench's error as the reason), sp_bench's memory estimate (so
// "fits" means sp_bench --dry-run says it fits), the layouts' per-step work (SequenceLayout::step_work) and the
// closed-form byte counts of parallel/comm_volume.h (tested against the communicators' counters).
//
// The time model is an event simulation of one layer's schedule on every rank of the CP group: ring steps whose
// compute overlaps the double-buffered transfer of the next block, all-gathers, the Ulysses all-to-alls, GDN's chain
// (sequential over segments) or scan (log-depth rounds), DSA's selection ring and latent ring. The slowest rank
// decides, so layout imbalance shows. Compute comes from a device profile's throughput curves (achieved FLOP/s as a
// function of the FLOPs of one call, per kernel kind and phase); messages from its link classes (latency + bytes /
// bandwidth, intra-node and inter-node, with the ranks sharing one NIC).
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_plan_tiles.h"
#include "parallel/gdn_cp.h"

namespace seqpar::bench::plan {

// Achieved FLOP/s of one kernel kind and phase as a function of the FLOPs of one call: points (flops, flop/s),
// interpolated linearly in log(flops), constant beyond the ends.
struct KernelCurve {
  std::vector<std::pair<double, double>> points;  // sorted by flops
  std::string source;                             // where the numbers come from
  double rate(double flops) const;                // flop/s; Error when the curve is empty
};

// One link class: a message of n bytes takes latency_s + n / bandwidth_bps (per direction, per rank).
struct LinkClass {
  double latency_s = 0;
  double bandwidth_bps = 0;  // bytes per second
  std::string source;
  double seconds(double bytes) const { return bytes <= 0 ? 0.0 : latency_s + bytes / bandwidth_bps; }
};

// The order of GdnCp's forward work ahead that the GDN simulation follows: false, the waiting windows in the order
// they run (GdnCp::AheadQueue as GdnCp's forward fills it); true, the last of them first, then the others in run order.
// It describes the runtime, not the device: GdnCp's default.
inline constexpr bool kPlanGdnAheadLastFirst = GdnCpConfig{}.ahead_last_first;

struct DeviceProfile {
  std::string name, note;
  // Keys: "mha_fwd", "mha_bwd", "gdn_fwd", "gdn_bwd", "dsa_fwd", "dsa_bwd"; optional "gemm" (the linear layers of
  // --linear-flops-per-token).
  std::map<std::string, KernelCurve> kernels;
  // The device: memory (bytes) and memory bandwidth (bytes/s), 0 when not given; a decode step's fixed cost
  // (seconds: the step's calls, its agreement check; --calibrate measures it); their source.
  double memory_bytes = 0, memory_bandwidth_bps = 0, decode_overhead_s = 0;
  std::string device_source;
  LinkClass intra, inter;
  // A send/receive pair inside a node (the ring's p2p transfers when the ring stays in the node), bytes/s per
  // direction: links.intra.p2p_bandwidth_bytes_per_s, its source links.intra's; 0: links.intra's bandwidth. The
  // collectives (all-to-all, all-gather) keep links.intra's.
  double intra_p2p_bandwidth_bps = 0;
  int ranks_per_nic = 1;  // ranks of a node sharing one inter-node NIC (its bandwidth divides among them); its
                          // source is links.inter's
  // CPU profiles: the cores a node's ranks can use at once (measured: --calibrate runs two kernel_bench copies at
  // once against one alone; on a shared machine fewer than it has); ranks x threads beyond it slow compute down
  // proportionally. 0: no limit.
  double cores_per_node = 0;
  // CPU profiles: ranks of one node share its memory system (bandwidth, last-level cache), so a kernel runs slower
  // while the node's other cores run kernels too. JSON block "shared_node" (absent: none; GPU profiles, each device
  // with its own memory, omit it): "slowdown", per kernel key, a kernel's time with `cores_busy` cores of the node
  // running the same kernel at once over its time alone (>= 1; --calibrate runs kernel_bench alone, then as many
  // copies at once as the node has cores, in interleaved pairs, and takes the median ratio: shared_node_slowdown);
  // "cores_busy", the cores busy in that measurement. Where a plan puts more than one rank on a node, a kernel of a
  // listed kind costs its time alone x slowdown x max(1, ranks x threads / cores_busy) (the measurement already holds
  // what cores_per_node charges); elsewhere, and for kinds not listed, cores_per_node as above. The factor is taken as
  // measured, with every core busy, also when the node's ranks use fewer cores (an upper bound then).
  struct SharedNode {
    std::map<std::string, double> slowdown;
    double cores_busy = 0;
    std::string source;
    bool present() const { return !slowdown.empty(); }
  } shared_node;
  // GDN scan: a segment's map (gdn_transition) costs gdn_map_factor x its FLOPs (gdn_map_flops) at the forward
  // curve's rate; the backward's dS sweep costs gdn_sweep_factor x the segment's forward.
  double gdn_map_factor = 1.0, gdn_sweep_factor = 1.0;
  // GDN work ahead (GdnCp's AheadQueue, attn::GdnAhead): while a rank waits for a window's state it computes the
  // window's state-independent part, which costs `ahead` x the window's time; the window then costs `rest` x its time
  // for the chunks done ahead (the rest at full cost). Forward and backward. --calibrate measures them with
  // kernel_bench --kernel gdn --gdn-maps (JSON block "gdn_work_ahead" with its source); absent: no work ahead
  // (ahead 0, rest 1).
  struct GdnWorkAhead {
    double fwd_ahead = 0.0, fwd_rest = 1.0, bwd_ahead = 0.0, bwd_rest = 1.0;
    std::string source;
    bool present() const { return fwd_ahead > 0 || bwd_ahead > 0; }
  } gdn_work_ahead;
  // MHA under a causal mask costs the 64 x 64 tile pairs its kernels compute (the CPU kernels: any pair of tiles in
  // which some query sees some key, masked or not; SequenceLayout::step_work) rather than its visible pairs, which
  // matters for packed rows of short documents. false: visible pairs (profiles of other kernels). --calibrate sets
  // it (JSON "mha_tile_pairs", its source in "factors").
  bool mha_tile_pairs = false;
  // The ring's execution on this device and software stack (JSON block "ring", with its source; absent: the
  // defaults, the ideal double-buffered ring).
  // transfer_overlaps_compute: a ring step's transfer of the next block (MHA's ring, DSA's selection and latent
  // rings) runs while the step's kernel computes. false:
  // the communication kernel waits until the attention kernel frees the SMs (a persistent kernel holds them all), so
  // every step pays its compute and then its transfer.
  // merge_pass: every ring step's partial result is folded into the running one by a separate memory-bound pass
  // (forward: the rank's out and lse; backward: dq, and dk/dv into the travelling accumulator), at the device's
  // memory bandwidth (device.memory_bandwidth_bytes_per_s), on the compute stream after the step's kernel. The same
  // flag charges the all-gather's whole-sequence passes likewise (the gathered K and V reordered, forward and
  // backward; the backward's dK, dV zeroed, accumulated per kernel call, reordered, and the kernel's own fp32 dK, dV
  // accumulator under GQA zeroed and converted), not overlapped with anything.
  bool ring_transfer_overlaps_compute = true, ring_merge_pass = false;
  // storage_dtype_gradients: the ring's running out, dq and travelling dK/dV (p2p) and the all-gather's dK/dV (its
  // reduce-scatter) are kept in the storage dtype, not the accumulator dtype: the transfer time of the gradient blocks
  // and the merge pass's bytes use storage bytes (the byte counts reported stay seqpar's own, accumulator dtype).
  bool ring_storage_dtype_gradients = false;
  // copy_passes: the ring function's copies besides the per-step merge, at the memory bandwidth on the compute
  // stream (bytes per rank over its B S / P rows; ring_copy_pass_bytes): forward, K and V concatenated into the first
  // send buffer, out zero-filled, the first lse cloned and step 0's output folded in like every later step's;
  // backward, K and V copied into the first buffer, step 0's dq, dk, dv copied into the accumulators, and every
  // step's dk, dv concatenated before their update. For a ring of one only when PlanInput::ring_function_at_one.
  bool ring_copy_passes = false;
  std::string ring_source;
  // MHA's kernel as tiles (JSON block "mha_tiles", sp_plan_tiles.h; absent: the curves alone): when present, an MHA
  // call of the zigzag layout's ring steps, of the all-gather's halves or of a ring of one costs what its tiles cost,
  // per document of a packed row, instead of its FLOPs at the curve's rate for FLOPs of one call.
  AttnTiles mha_tiles;
  // The Ulysses all-to-all's layout copies (JSON block "ulysses": {"layout_pass": true, "source"}; absent: none):
  // every tensor that crosses an all-to-all (forward q, k, v, out; backward dout, dq, dk, dv) is copied into the
  // all-to-all's layout before it and out of it after (a read and a write each), on the compute stream, at the
  // device's memory bandwidth.
  bool ulysses_layout_pass = false;
  std::string ulysses_source;
  // The memory passes around every FlashAttention-3 varlen call (JSON block "fa3_calls": {"unpad_pad_pass": true,
  // "source"}; absent: none): the inputs gathered to their valid rows and the outputs scattered into zero-filled
  // tensors (unpad_pad_bytes), and the ring p2p step's half reads (half_read_bytes), at the memory bandwidth, for the
  // zigzag layout's calls and a ring of one.
  bool fa3_unpad_pad_pass = false;
  std::string fa3_calls_source;
  const KernelCurve& kernel(const std::string& key) const;  // Error naming the key and the profile when absent
};

// Reads / writes a profile (the JSON format: docs/benchmarks.md, "sp_plan"). Errors name the file and the field.
// Every block of numbers names where they come from: each kernel curve, each link class, the device block and the
// scalar factors carry a "source" (a non-empty string, or a non-empty array of {"what", "url"} / {"what",
// "assumption"} objects, each naming what was read where or why a number is assumed); a block without one is refused
// (check_sources).
DeviceProfile load_profile(const std::string& path);
DeviceProfile profile_from_json(const nlohmann::json& j, const std::string& what);
nlohmann::json profile_json(const DeviceProfile& p);

// parse_sp_bench_options' refusal of a grid flag among sp_plan's problem flags (after "--"): the problem holds no
// grid, sp_plan chooses them.
inline constexpr const char* kPlanProblemHasNoGrid =
    "after sp_plan's \"--\": the problem's flags hold no grid; sp_plan chooses the grids over --world itself "
    "(--configs plans only the named configurations; with --dynamic-cp, --degrees gives the rings' sizes)";

// What to plan.
struct PlanInput {
  std::vector<std::string> problem_flags;  // sp_bench flags of the problem: --model / --attn, shapes, --seq, ...
  // train (forward + backward) | prefill (forward only) | decode (one step of sp_bench --mode decode: the queries
  // attend each rank's cache shard, the shards' partial results merge; the decode flags are sp_bench's)
  std::string mode = "train";
  int world_size = 1, nodes = 1;
  int devices_per_node = 1;      // ranks per node (world_size = nodes x devices_per_node)
  double memory_per_device = 0;  // bytes a rank may use; the node holds devices_per_node times this
  int threads = 1;               // --threads of the sp_bench runs (CPU)
  // sp_bench in the printed commands: next to sp_plan, as sp_plan was called (build/benchmarks/sp_plan ->
  // build/benchmarks/sp_bench, runnable from the same directory), or "sp_bench" (on the PATH, as sp_plan was)
  std::string sp_bench = "sp_bench";
  // A model of several layers (train and prefill): `layers` copies of the layer, each followed by its linear layers
  // (QKV, output projection, MLP) of linear_flops_per_token forward FLOPs per token (the backward twice that), run on
  // every rank's own tokens at the profile's "gemm" curve with no communication. tp: tensor parallelism inside each
  // CP rank (tp devices per CP rank, which split the heads and the linear FLOPs; the world, nodes and devices per
  // node count CP ranks); its own communication is not modelled.
  int layers = 1;
  double linear_flops_per_token = 0;
  int tp = 1;
  std::vector<std::string> only_configs;  // when not empty: plan only the configurations of these names
  // A ring of one (ring_size 1) still runs the ring function and pays its copy passes (DeviceProfile's
  // ring_copy_passes), as an implementation that calls its ring whatever the ring size does (--ring-function-at-one).
  bool ring_function_at_one = false;
  bool oversubscribed_ok = true;  // CPU: allow more ranks x threads than cores (marked in the output)
};

// One configuration: the grid and the algorithm choices sp_bench takes as flags.
struct PlanConfig {
  int ulysses_size = 1, ring_size = 1;
  std::string layout = "zigzag";
  std::string impl = "p2p";                // MHA ring: p2p | allgather
  std::string gdn_mode;                    // GDN: chain | scan
  std::string dsa_select;                  // DSA: ring | allgather
  std::string cache_shard;                 // --mode decode: contiguous | interleave
  std::string name() const;                // "u2xr1 zigzag p2p"
  std::vector<std::string> flags() const;  // the sp_bench flags of the configuration
};

// The predicted times (seconds, one layer's step: forward, and backward in train mode) on the slowest rank.
struct Prediction {
  double step_s = 0;          // the slowest rank's finish
  double compute_s = 0;       // that rank's busy time in kernels
  double exposed_comm_s = 0;  // time no computation hides (waits on messages, all-to-alls, all-gathers)
  double imbalance_s = 0;     // slowest rank's compute minus the mean rank's compute
  double forward_s = 0, backward_s = 0;
  double linear_s = 0;                           // the linear layers' time, all layers (part of step_s and compute_s)
  std::map<std::string, double> bytes_per_link;  // bytes sent per rank, by link class ("intra", "inter")
  double bytes_sent_forward = 0, bytes_sent_backward = 0;  // per rank, the largest over ranks
  bool bytes_exact = false;  // true where a tested closed form gives them (MHA); false: the model's estimate
  bool oversubscribed = false;
};

struct PlanRow {
  PlanConfig config;
  std::string excluded;  // empty: valid; else the reason (sp_bench's own error, or the memory verdict)
  Prediction prediction;
  std::vector<std::pair<std::string, double>> memory;  // per rank by category (bytes), sp_bench's estimate
  double memory_total = 0;                             // per rank, with the process allowance
  std::string command;                                 // the mpirun + sp_bench command that runs it
};

// Every configuration of `in` (grids ulysses_size x ring_size over the world, layouts, algorithms), valid ones
// ranked by predicted step time first, then the excluded ones with their reasons. Local arithmetic. A ring of one
// has one layout, zigzag (every kind places the tokens alike there), and its flags leave --layout to sp_bench's
// default, zigzag.
// The largest rings planned (train and prefill; larger ones are excluded, the reason naming the limit): the layout
// a configuration is predicted on holds a ring_size^2 table of per-step work, built by sweeping ring_size x the
// row's slots, and the balanced kind's step refinement costs O(ring_size^4) (docs/design.md, "The balanced
// partitioner").
inline constexpr int kPlanMaxRing = 1024, kPlanMaxBalancedRing = 16;
std::vector<PlanRow> plan(const PlanInput& in, const DeviceProfile& profile);

// The parsed sp_bench options of one configuration (what sp_bench would run), or Error with sp_bench's reason.
SpBenchOptions config_options(const PlanInput& in, const PlanConfig& c);

// The prediction of one parsed configuration (no validity or memory check).
Prediction predict(const SpBenchOptions& o, const PlanInput& in, const DeviceProfile& profile);

// The factor on a kernel's time alone (the curve `key`'s rate) for a rank of this plan: the profile's shared_node
// slowdown x max(1, ranks x threads / cores_busy) where the node holds more than one rank and the kind is listed,
// else the oversubscription by cores_per_node (max(1, ranks x threads / cores_per_node); 1 without it).
double kernel_slowdown(const PlanInput& in, const DeviceProfile& p, const std::string& key);

// --calibrate's shared_node slowdown of one kernel key (docs/benchmarks.md, "sp_plan"), from interleaved pairs of
// runs: alone_ms[p][l], the kernel's time at length l in pair p's run alone; busy_ms[p][c][l], copy c's in the run of
// every copy at once that followed it. Each (pair, copy, length) with both times > 0 is one sample busy / alone (of
// the same pair); the slowdown is the median of all samples, at least 1 (below 1 is the noise of a shared machine: the
// node's other cores cannot speed a kernel up). Error when the pairs' copies or lengths do not match or no sample has
// both times.
struct SharedNodeSamples {
  double slowdown = 1;               // max(1, median)
  double median = 0;                 // the median of every sample
  std::vector<double> pair_medians;  // the median of each pair's samples (0 for a pair without any), for the source
  int samples = 0;
};
SharedNodeSamples shared_node_slowdown(const std::vector<std::vector<double>>& alone_ms,
                                       const std::vector<std::vector<std::vector<double>>>& busy_ms);

// The fit rule of sp_bench (compare_with_node_memory): the estimates of the ranks of one node summed against the
// node's memory, devices_per_node x memory_per_device. Returns "" when it fits, else the reason.
std::string memory_verdict(const SpBenchOptions& o, const PlanInput& in, double* per_rank_total);

nlohmann::json plan_json(const PlanInput& in, const DeviceProfile& profile, const std::vector<PlanRow>& rows);
std::string plan_table(const PlanInput& in, const DeviceProfile& profile, const std::vector<PlanRow>& rows);

// Closed forms of the ring's event simulation, for tests: P ranks, per-step compute c and transfer t per step, each
// rank's compute the same. forward: P steps of compute, P - 1 transfers overlapping the first P - 1 steps.
// overlap false (DeviceProfile::ring_transfer_overlaps_compute): each transfer starts when the step's kernel ends,
// P c + (P - 1) t.
double ring_forward_closed_form(int P, double compute_step_s, double transfer_s, bool overlap = true);
// The simulation itself on given per-rank, per-step compute times ([r][s]) and one transfer time per step: the
// finish time of each rank, and (out) the exposed wait of each rank. overlap false: the block for step s + 1 leaves
// when both its sender and its receiver have finished step s's kernel.
std::vector<double> simulate_ring(const std::vector<std::vector<double>>& compute, double transfer_s,
                                  std::vector<double>* exposed, bool overlap = true);

// The time of an all-gather of one block of `block_bytes` per rank over a ring group of P ranks with
// `members_per_node` of them on each node (the ring algorithm, P - 1 hops). Inside one node (P <= members_per_node)
// every hop is an intra-node message. Across nodes the ring enters and leaves each node once per channel and the
// channels spread over the NICs of the group's members on the node, so the P - 1 blocks leave a node through
// members_per_node NICs at once (each at links.inter's bandwidth shared by min(ranks_per_nic, devices_per_node)
// ranks) while each member forwards them over the intra-node links: (P - 1) x (inter latency + block / min(intra
// bandwidth, members x per-rank inter bandwidth)). The backward's reduce-scatter of the same bytes takes as long.
double allgather_seconds(double block_bytes, int P, int members_per_node, int devices_per_node, const DeviceProfile& p);

}  // namespace seqpar::bench::plan
