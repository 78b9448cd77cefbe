// sp_bench --check: the gathered distributed outputs against the single-rank reference of the same problem.
//
// The rule, per tensor (docs/benchmarks.md, "sp_bench", --check):
//   1. "1-rank": the distributed result D passes when max|D - K| <= atol + rtol * max|K|, K the one-rank kernel
//      (the workload's tolerance). A well-conditioned problem is judged by this rule alone.
//   2. "fp64": where D fails rule 1 and the workload's fp64 reference R fits (Fp64ReferenceCost within
//      kFp64ReferenceMaxBytes and kFp64ReferenceMaxFlops), D passes when it is no further from the exact answer than
//      the one-rank kernel is, up to a factor: max|D - R| <= max(kFp64ErrorFactor * max|K - R|, atol + rtol * max|R|).
//      On ill-conditioned inputs (logits of 3e4, where fp32 rounding of the softmax dominates) the one-rank kernel
//      is itself off against fp64, and D differs from K only by rounding of the same size: rule 2 passes it, while a
//      wrong D is far from R however far K is. Tensors without an fp64 counterpart (DSA topk_indices) keep rule 1.
// --check-against reference replaces both rules, for every tensor the fp64 reference defines, by
//   3. "reference": max|D - R| <= atol + rtol * max|R| (the workload's tolerance), R the fp64 reference of
//      attention/reference (sizes that fit only: check_reference_fits). Tensors without an fp64 counterpart keep
//      rule 1.
// The table says which rule judged each tensor and which comparison the run asked for.
#pragma once

#include <string>
#include <vector>

#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_timing.h"
#include "benchmarks/sp_bench_workload.h"
#include "runtime/cp_grid.h"

namespace seqpar::bench {

constexpr double kFp64ErrorFactor = 2.0;
constexpr double kFp64ReferenceMaxBytes = 2.0 * 1024 * 1024 * 1024;
constexpr double kFp64ReferenceMaxFlops = 2e11;

struct CheckResult {
  std::string name;
  double max_abs = 0, max_ref = 0, atol = 0, rtol = 0;         // rule 1: D against the one-rank kernel K
  double fp64_err = -1, one_rank_fp64_err = -1, max_fp64 = 0;  // rule 2: max|D - R|, max|K - R|, max|R|; -1: none
  const char* rule = "1-rank";                                 // the rule that judged
  bool ok = false;
  double max_rel() const { return max_ref > 0 ? max_abs / max_ref : max_abs; }
};

struct CheckReport {
  std::string against = "1-rank";  // --check-against
  std::vector<CheckResult> tensors;
  bool passed = true;
  std::string fp64_note;  // why the fp64 reference was not computed where rule 1 failed; empty otherwise
};

// The rules above for `got` (the gathered outputs, on every CP rank): each data-parallel replica's SP root runs the
// reference (reference_setup() unless `reference_ready`) and, where rule 1 fails, the fp64 reference; the errors
// are reduced (max) over `world`. Collective over `world`; every rank gets the same report.
// o.check_against: "1-rank" (rules 1 and 2) or "reference" (rule 3).
CheckReport check_outputs(Communicator& world, const CpGrid& grid, Workload& wl, const SpBenchOptions& o,
                          const NamedArrays& got, const NamedArrays* inputs, bool reference_ready, Progress& progress);

// --check-against reference: Error naming the size rule when the workload's fp64 reference does not fit
// (WorkloadKind::fp64_reference_cost within kFp64ReferenceMaxBytes and kFp64ReferenceMaxFlops) or does not exist.
// Local arithmetic on the options (identical on every rank); called before --dry-run's report and before anything
// is allocated or sent, so that --dry-run refuses what the run would.
void check_reference_fits(const SpBenchOptions& o);

// --test-corrupt: adds 0.1 (max|x| + 1) to element 0 of the floating tensor `name` (1 to an integer one), as a
// wrong distributed result would. Throws Error naming the registered outputs when `name` is none of them.
void corrupt_for_test(NamedArrays& got, const std::string& name);

}  // namespace seqpar::bench
