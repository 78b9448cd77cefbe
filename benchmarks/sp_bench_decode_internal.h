// Internal to benchmarks/: what the workloads of sp_bench --mode decode share (sp_bench_decode.cc: MHA, GDN, the
// options, the report; sp_bench_decode_dsa.cc: DSA). Not a public header.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "benchmarks/bench_common.h"
#include "benchmarks/sp_bench_decode_arrays.h"
#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_workload.h"
#include "parallel/cp_common.h"
#include "runtime/comm.h"
#include "runtime/tensor.h"

namespace seqpar::bench::decode_detail {

struct DecodeReport {
  std::vector<double> prefill_s;  // slowest rank per iteration
  std::vector<double> step_s;     // slowest rank per step
  std::vector<double> chunk_s;    // --chunk: the persistent-cache prefill, slowest rank per iteration
  std::string chunk_mode;         // the route it took
  // Sent per rank: all of extend (ring and CP groups), the route's measured, the route's formula.
  std::int64_t chunk_bytes = 0, chunk_route_bytes = 0, chunk_pass_bytes = 0;
  std::int64_t bytes_per_step = 0, bytes_formula = 0;
  double cache_bytes = 0, cache_formula = 0;  // per rank: largest over the ranks; the formula's
  std::string formula_text;
  bool checked = false, passed = true;
  double out_err = 0, lse_err = 0, state_err = 0;  // max |got - want| / max |want|
  std::int64_t topk_mismatches = -1;               // DSA: topk_indices entries that differ (-1: not checked)
  double chunk_out_err = -1, chunk_lse_err = -1;   // MHA --chunk: extend's rows (-1: not checked)
  double mem_peak_bytes = 0;  // the ledger's total peak from the prefill to the last step, largest over the ranks
};

// A run's results for --dump: its outputs gathered from every rank's heads (filled on every rank).
struct DecodeResults {
  NamedArrays outputs;
};

// The ledger's persistent_cache bytes now.
std::int64_t persistent_bytes();
// The ledger's total peak (bytes), the largest over the ranks of `world` (collective).
double ledger_peak(Communicator& world);
// Tolerance of a decode result against the single-rank kernels (vs_reference: against the fp64 references of
// attention/reference), relative to the largest reference value.
double tolerance(DType dtype, bool vs_reference);
// An fp64 copy of `t` (workspace), the input of the fp64 references.
Tensor fp64_copy(const TensorView& t);
// max |got - want| / max |want| (equal infinities ignored).
double rel_err(const TensorView& got, const TensorView& want);
// The per-step results [.., n, ..] (along `dim`) of N steps side by side: [.., N n, ..].
Tensor concat_steps(const std::vector<Tensor>& steps, int dim);

// The seconds of fn on the slowest rank (after a barrier).
template <typename Fn>
double time_once(Communicator& world, Fn&& fn) {
  barrier(world);
  const double t0 = now_s();
  fn();
  std::vector<double> t{now_s() - t0};
  all_reduce(world, t, ReduceOp::kMax);
  return t[0];
}

// Times fn once per iteration (warmup untimed); each time is the slowest rank's.
template <typename Fn>
std::vector<double> time_prefill(Communicator& world, const SpBenchOptions& o, Fn&& fn) {
  std::vector<double> times;
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    const double t = time_once(world, fn);
    if (it >= o.warmup) times.push_back(t);
  }
  return times;
}

// The DSA decode workload (benchmarks/sp_bench_decode_dsa.cc): prefill (or fill), steps, bytes, cache, --check;
// with `results`, the outputs for --dump (out_dec, lse_dec, topk_indices_dec).
DecodeReport run_dsa(Communicator& world, const CpGroups& groups, const SpBenchOptions& o, const DecodeInputs& in,
                     DecodeResults* results);

}  // namespace seqpar::bench::decode_detail
