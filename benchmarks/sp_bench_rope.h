// sp_bench's RoPE (--rope, --rope-dim, --rope-theta, --rope-scaling, --rope-factor, --rope-original-max-pos; the
// presets set them): the rotation of the inputs before a layer and the transposed rotation of their gradients after
// it, with the layout's global positions (0..S-1 for the single-rank reference), as a model applies RoPE around its
// attention. The kinds that own the flags (MHA, DSA) decide which columns of which inputs rotate.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <vector>

#include "attention/rope.h"
#include "benchmarks/npy.h"
#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_workload.h"
#include "runtime/tensor.h"

namespace seqpar::bench {

// The flags that only the kinds applying RoPE accept (WorkloadKind::own_flags).
std::vector<std::string> rope_flags();

// "rope=interleaved r=64@512 theta=10000 yarn(factor 40, original 4096)", or "" when --rope none.
std::string describe_rope(const SpBenchOptions& o, const attn::RopeConfig& cfg);
// The run's RoPE in its JSON ("rope": {...}; null when --rope none).
void add_rope_json(const SpBenchOptions& o, nlohmann::json& j);

// The rotated columns [o, o + r) of `cfg` within a head dim `head_dim` are inside it; Error naming --rope-dim and
// `what` otherwise (before any communication), each value followed by its note (where it came from: a preset, a
// default; empty when typed).
void check_rope_fits(const attn::RopeConfig& cfg, std::int64_t head_dim, const char* what,
                     const std::string& rope_dim_note = "", const std::string& head_dim_note = "");

// One rotated input: which tensor and with which configuration.
struct RopeTarget {
  std::string name;  // the input's name (q, k, c, q_idx, k_idx)
  attn::RopeConfig cfg;
};

// Rotated copies of the distributed inputs (workspace tensors), in the order of `targets`.
// Copies on the inputs' device, made on `stream`.
std::vector<Tensor> rope_rotated_copies(const std::vector<RopeTarget>& targets, const std::vector<TensorView>& inputs,
                                        std::span<const std::int64_t> positions, Stream stream = Stream::cpu());
// The transposed rotation of `grads` (one per target, in order), in place.
void rope_backward_all(const std::vector<RopeTarget>& targets, const std::vector<TensorView>& grads,
                       std::span<const std::int64_t> positions);

// The same on the host arrays of the single-rank reference (dim 1 is the sequence, at `positions`: empty means
// 0..S-1; a packed row passes each token's position inside its document), in place: the rotation (backward: its
// transpose) of `a`; with `fp64_reference` the fp64 reference's rotation (attention/reference/rope_reference.h,
// fp64 arrays) instead of the kernel's.
void rope_host(const attn::RopeConfig& cfg, npy::HostArray& a, bool backward, bool fp64_reference = false,
               std::span<const std::int64_t> positions = {});
// rope_host on the arrays named like the targets (forward) or their gradients "d<name>" (backward).
void rope_named(const std::vector<RopeTarget>& targets, NamedArrays& arrays, bool backward, bool fp64_reference = false,
                std::span<const std::int64_t> positions = {});

}  // namespace seqpar::bench
