// kernel_bench's parts (kernel_bench.cc: options, the square SGEMM reference, the JSON; one file per kernel kind:
// kernel_bench_mha.cc, kernel_bench_dsa.cc, kernel_bench_gdn.cc). Each kind adds its options and runs its table;
// every row has the kind's forward and backward time, model GFLOP/s (docs/benchmarks.md, "Definitions of the benchmark figures") and the ratios to the square
// SGEMM measured at the start of the same run with the same thread count.
#pragma once

#include <cstdint>
#include <cxxopts.hpp>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/tensor.h"

namespace seqpar::bench::kernel {

// What every kind reads besides its own options.
struct Context {
  const cxxopts::ParseResult* args = nullptr;
  int threads = 1;           // OpenMP and OpenBLAS threads
  int warmup = 1;            // untimed rounds
  double min_time = 1.0;     // seconds of timed rounds per configuration (at least one round)
  bool quick = false;        // --quick: the kind's small shapes
  bool backward = true;      // false: --no-backward
  double square_gflops = 0;  // square SGEMM GFLOP/s of this run (0: not measured)
  bool cpu_time() const;     // --clock cpu: time_rounds measures CPU time of the process, not wall time

  // --seq when given; else `quick` with --quick, or `fallback` followed by `long_seqs` with --long.
  std::vector<std::int64_t> seqs(const std::vector<std::int64_t>& fallback, const std::vector<std::int64_t>& long_seqs,
                                 const std::vector<std::int64_t>& quick) const;
  // An int64 option whose value <= 0 means "the kind's default".
  std::int64_t size_or(const char* name, std::int64_t fallback) const;
};

struct Timing {
  double best = 0.0;  // seconds of the fastest timed call
  double mean = 0.0;  // mean seconds per timed call
  double median = 0.0;  // median seconds of the timed calls
};
double median_of(std::vector<double> x);  // 0 for none

// Interleaved rounds of fns (one call each per round, in order; wall time, or CPU time with --clock cpu) so that all
// of them see the same machine load: `warmup` untimed rounds, then rounds until min_time seconds have passed (at
// least one, and at least --min-rounds). One Timing per function; `rounds` gets the number of timed rounds.
std::vector<Timing> time_rounds(const std::vector<std::function<void()>>& fns, int warmup, double min_time,
                                int& rounds);

// Fills t (fp32) with uniform values in [lo, hi) from a fixed LCG stream per seed.
void fill(const Tensor& t, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f);

// The columns every kind shares: times of the fastest forward and backward, their model GFLOP/s and the ratios to
// the square SGEMM. print_* write the fixed-width header / values (after the kind's own shape columns).
struct RateColumns {
  Timing fwd, bwd;
  double fwd_flops = 0, bwd_flops = 0;
  int rounds = 0;
  double fwd_gflops() const { return fwd_flops / fwd.best / 1e9; }
  double bwd_gflops() const { return bwd.best > 0 ? bwd_flops / bwd.best / 1e9 : 0.0; }
};
void print_rate_header();
void print_rate_values(const Context& ctx, const RateColumns& r);
// The row's JSON: kind, threads, the shape fields given, times (fastest and mean), FLOPs, GFLOP/s and ratios.
nlohmann::json rate_json(const Context& ctx, const char* kind, nlohmann::json shape, const RateColumns& r);

// The kinds. add_*_options registers the kind's own flags; run_* prints its table and returns its JSON rows.
void add_mha_options(cxxopts::Options& opts);
nlohmann::json run_mha(const Context& ctx);
void add_dsa_options(cxxopts::Options& opts);
nlohmann::json run_dsa(const Context& ctx);
void add_gdn_options(cxxopts::Options& opts);
nlohmann::json run_gdn(const Context& ctx);

#if defined(SEQPAR_WITH_CUDA)
// --device cuda (kernel_bench_cuda.cc): the MHA table on `device` in bf16 (--dim, --mask, --batch, --hq, --hkv,
// --seq; default S 4096, 16384, 65536) with a cuBLAS bf16 GEMM (fp32 accumulation) timed in the same rounds;
// prints the table, writes --json; returns the exit status.
int run_mha_cuda(const cxxopts::ParseResult& args, Device device);
#endif

}  // namespace seqpar::bench::kernel
