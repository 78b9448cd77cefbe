// sp_bench --mode decode: inference with sharded caches (parallel/decode_cp.h). A prompt of --context T tokens is
// prefilled under CP into the caches, then --decode-steps N steps of --new-tokens n tokens each attend to them.
// Rows: prefill (median over --iters, after --warmup), decode step (median and p99 over the N steps; each step's time
// is the slowest rank's), with --chunk C a persistent-cache prefill of C more tokens (pass-KV / pass-Q) timed
// between them, bytes per step (CpCounters, against the documented formula) and cache MiB per rank (the
// ledger's persistent_cache, against M_KV / P for MHA and the state for GDN). --check compares every step's output
// (MHA: out and lse; GDN: out of every head and the final state) with the single-rank training forward over the
// T + N n tokens, on rank 0. --attn mha, gdn and dsa (DSA: out, lse and topk_indices exactly;
// benchmarks/sp_bench_decode_dsa.cc); GDN with --conv-width W runs the short conv before the recurrence
// (parallel/decode_cp.h).
// Files (benchmarks/sp_bench_io.h, the rules of --mode train): each kind names its inputs and outputs
// (DecodeArrays). A token input `x` is two files: the prompt's rows x [B, T, ...] and the decode tokens' x_dec
// [B, N n, ...] (the N steps of n tokens, in order); inputs without a token axis (GDN's initial_state, conv_weight)
// are one file. --inputs DIR reads them all (the shapes of --mode train's flags, --context and --decode-steps are
// taken from the files when not given); --dump DIR writes the outputs (MHA out_dec [B, N n, Hq, D], lse_dec
// [B, Hq, N n]; GDN out_dec [B, N n, Hv, V], final_state [B, Hv, K, V]: every rank's heads gathered; DSA out_dec
// [B, N n, H, Dv], lse_dec [B, H, N n], topk_indices_dec [B, N n, k] int64, the same on every rank), with
// --dump-inputs also the inputs, so that --inputs DIR replays the run (the names: sp_bench_decode_arrays.h).
#pragma once

#include <cstdint>
#include <cxxopts.hpp>
#include <string>

#include "benchmarks/bench_common.h"

namespace seqpar::bench {

struct SpBenchOptions;
struct MemoryEstimate;  // sp_bench_memory.h

struct DecodeOptions {
  std::string mode = "train";              // --mode train | decode
  std::int64_t context = 4096;             // --context T (prompt tokens)
  std::int64_t decode_steps = 16;          // --decode-steps N
  std::int64_t new_tokens = 1;             // --new-tokens n (queries per step)
  std::string cache_shard = "interleave";  // --cache-shard contiguous | interleave
  std::int64_t interleave = 1;             // --interleave I
  std::string prefill = "forward";         // --prefill forward | fill (MHA: fill skips the prompt's attention)
  std::int64_t chunk = 0;                  // --chunk C: a persistent-cache prefill of C tokens after the prompt
  std::string chunk_mode = "auto";         // --chunk-mode auto | pass-kv | pass-q
};

// The decode flags (help group "decode").
void add_decode_options(cxxopts::Options& spec);
// Reads them (their rules are checked by run_decode_bench, before any communication but the options' agreement); with
// --mode decode, refuses the flags only --mode train reads ("--doc-lens needs --mode train").
DecodeOptions parse_decode_options(const cxxopts::ParseResult& r);
// The rules of --mode decode on the parsed options (counts, the grid's head splits, the attention options decode does
// not support yet): local, so every rank (and sp_plan, for each configuration) refuses alike. Throws Error.
void check_decode_options(const SpBenchOptions& o);
// --mode decode --inputs: --context from dimension 1 of the prompt's first input and --decode-steps from that of its
// _dec file (N n) when not given; a given one must match. Called after --mode train's shapes_from_inputs.
void decode_shapes_from_inputs(SpBenchOptions& o);

// The decode run's estimate of world rank `world_rank`'s peak (benchmarks/sp_bench_decode_memory.cc), from the options
// alone, in --mode train's categories (sp_bench_memory.h): the ledger's peak (the prompt's input rows of this rank,
// the persistent cache's largest shard by the attention/ cache formulas, and the largest of the prefill, the chunk
// prefill and a decode step with the steps' kept outputs), then the host arrays (the prompt's layout, --inputs,
// --check's single-rank reference on every rank, --dump). Local arithmetic (no layout is built: a context too long
// to hold is refused by the estimate, not by its allocation); call after the options' rules.
MemoryEstimate estimate_decode_memory(const SpBenchOptions& o, int world_rank);

// The whole decode run (every rank), after check_options_agree (sp_bench.cc: --mode, the decode flags and --dump
// are among the options every rank agrees on); returns the exit status (1 when --check failed).
int run_decode_bench(const SpBenchOptions& o, const WorldPlace& place);

}  // namespace seqpar::bench
