// sp_bench output on world rank 0: the results table (a `#` header with the configuration, fixed-width columns with
// units, printed by rank 0 only) and the same results as JSON. The figures are defined in docs/benchmarks.md.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "benchmarks/sp_bench_check.h"
#include "benchmarks/sp_bench_memory.h"
#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_timing.h"
#include "benchmarks/sp_bench_workload.h"

namespace seqpar::bench {

// Everything a run reports.
struct RunReport {
  const char* backend = "";
  int world_size = 1;
  std::string grid;       // CpGrid::str()
  NodeInfo node;          // rank 0's node
  std::string date_utc;   // start of the run, utc_now_iso8601()
  MemoryEstimate memory;  // world rank 0's estimate (the largest)
  std::vector<PhaseResult> phases;
  const CheckReport* check = nullptr;  // null without --check
  std::vector<VariantTiming> variants;
  // --device cuda: a square cuBLAS bf16 GEMM (gemm_n^3) timed on world rank 0's device after the iterations, in
  // TFLOP/s; 0 without one.
  std::int64_t gemm_n = 0;
  double gemm_tflops = 0;
};

// The header's "# packing: ..." line (document count, partition, padded_len, causal FLOP and per-step imbalance) for a
// packed or padded row; "" otherwise. Local arithmetic (sp_bench_layout).
std::string describe_packing(const SpBenchOptions& o);

// Prints the tables to stdout (call on rank 0 only).
void print_report(const SpBenchOptions& o, const RunReport& r);

// The JSON of --json: configuration, phases, variants and check.
nlohmann::json report_json(const SpBenchOptions& o, const RunReport& r);

}  // namespace seqpar::bench
