// sp_bench timing: the iteration loop (warm-up, per-iteration phase times, counters and memory peaks of this rank)
// and the cross-rank reduction of those measurements into the figures of the results table (docs/benchmarks.md, "sp_bench" and
// "Definitions of the benchmark figures").
#pragma once

#include <string>
#include <vector>

#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_workload.h"
#include "runtime/comm.h"
#include "runtime/memory.h"

namespace seqpar::bench {

// Collectives after a long single-rank computation (reference, efficiency) may wait far beyond the default
// communication timeout; they wait this long instead.
constexpr double kLongWaitS = 24 * 3600.0;

// Progress lines on rank 0 (stderr, so that stdout keeps only the tables): at most one every 2 s, and only once the
// run has taken more than 2 s.
class Progress {
 public:
  explicit Progress(bool enabled);
  void note(const std::string& what, bool force = false);

 private:
  bool enabled_;
  double start_, last_;
};

// This rank's measurements. Per phase p (0 forward, 1 backward), iteration i: times[2 i + p] in seconds.
struct LocalTimings {
  int iters = 0;
  std::vector<double> times;
  double exposed_s[2] = {0, 0};           // exposed communication summed over the iterations
  std::vector<double> bytes = {0, 0};     // bytes sent in one iteration
  std::vector<double> executed = {0, 0};  // attention FLOPs executed in one iteration (masked blocks skipped)
  std::vector<double> rounds = {-1, -1};  // sequential message rounds (GDN); -1: not reported
  std::vector<double> mem;                // per phase: ledger peaks per category, then the total (bytes)
  // --efficiency: the whole problem on one rank, [fwd_0, bwd_0, ...] seconds; "alone" on world rank 0 only.
  std::vector<double> alone, busy;
  bool reference_ready = false;  // reference_setup() ran (--efficiency), so --check can reuse it
};

// Runs --warmup untimed and --iters timed iterations of `wl` (forward, then backward, the ranks synchronised before
// each phase); with --efficiency also the single-rank problem, interleaved. Collective over `world`.
LocalTimings time_iterations(Communicator& world, Workload& wl, const SpBenchOptions& o, const NamedArrays* inputs,
                             Progress& progress);

// One row of the results table.
struct PhaseResult {
  std::string name;
  double time_ms = 0;             // median over iterations of the slowest rank's time
  double min_ms = 0, max_ms = 0;  // the fastest and slowest iteration (each the slowest rank's time)
  std::vector<double> iter_ms;    // every timed iteration, in order (each the slowest rank's time)
  double flops = 0;               // model FLOPs of the phase, all replicas
  double exposed_frac = 0;        // mean over ranks of exposed communication / phase time
  double bytes_sent = 0;          // max over ranks, per iteration
  double executed_flops = 0;      // attention FLOPs executed per iteration, max over ranks (JSON only)
  double message_rounds = -1;     // sequential message rounds per iteration, max over ranks (GDN); -1: none
  std::vector<double> mem_mib;    // per ledger category, then total; max over ranks and iterations
  double single_rank_ms = -1;     // --efficiency: the whole problem on one rank
  double efficiency = -1;
  double single_rank_busy_ms = -1;  // the same with every rank running its own copy at once
  double efficiency_busy = -1;
};

// The rows fwd, bwd, fwd+bwd: every rank's `t` reduced over `world` (max, sum or mean as PhaseResult says); model
// FLOPs from `wl` times the data-parallel replicas. Collective over `world`; every rank gets the same rows.
std::vector<PhaseResult> reduce_phases(Communicator& world, LocalTimings t, const Workload& wl,
                                       const SpBenchOptions& o);

}  // namespace seqpar::bench
