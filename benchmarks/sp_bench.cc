// sp_bench: the main job. Times the distributed forward and backward of one attention layer under sequence
// parallelism (ring, Ulysses, USP), checks the results against the single-rank reference of the same problem, and
// prints nccl-tests style tables on rank 0 (a `#` header, fixed-width columns with units, optional JSON). Definitions
// of the printed figures: docs/benchmarks.md. The parts: the options and the workload registry (sp_bench_options.h,
// sp_bench_workload.h), timing and the cross-rank reduction (sp_bench_timing.h), the check (sp_bench_check.h), the
// table and the JSON (sp_bench_report.h); this file runs them in order and writes the output files.
//
//   mpirun -np 4 sp_bench --ulysses-size 2 --ring-size 2 --layout zigzag --causal --seq 8K --check
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "benchmarks/bench_common.h"
#include "benchmarks/sp_bench_check.h"
#include "benchmarks/sp_bench_decode.h"
#include "benchmarks/sp_bench_io.h"
#include "benchmarks/sp_bench_memory.h"
#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_report.h"
#include "benchmarks/sp_bench_timing.h"
#include "benchmarks/sp_bench_workload.h"
#include "runtime/comm_factory.h"
#if defined(SEQPAR_WITH_CUDA)
#include "benchmarks/cuda_gemm_ref.h"
#endif
#include "runtime/comm_factory.h"
#if defined(SEQPAR_WITH_CUDA)
#include "benchmarks/cuda_gemm_ref.h"
#endif
#include "runtime/error.h"
#include "runtime/mpi_comm.h"
#include "runtime/cp_grid.h"
#include "runtime/tensor_ops.h"

namespace seqpar::bench {
namespace {

#if defined(SEQPAR_WITH_CUDA)
constexpr std::int64_t kGemmReferenceN = 8192;  // --device cuda: the square bf16 GEMM of the report's reference line
#endif

// The workload of --attn on the grid, after the checks that need its outputs: --test-corrupt names one of them,
// and no --dump file (outputs, and with --dump-inputs the inputs) is written twice or overwritten by --json.
std::unique_ptr<Workload> make_checked_workload(const SpBenchOptions& o, CpGrid& grid) {
  std::unique_ptr<Workload> wl = find_workload_kind(o.attn).make(o, grid);
  const std::vector<std::string> outputs = wl->output_names();
  SEQPAR_CHECK(o.test_corrupt.empty() || std::find(outputs.begin(), outputs.end(), o.test_corrupt) != outputs.end(),
               "--test-corrupt ", o.test_corrupt, ": no such output");
  std::vector<std::string> dumped = outputs;
  if (o.dump_inputs) {
    for (const TensorSpec& s : wl->input_specs()) {
      SEQPAR_CHECK(std::find(outputs.begin(), outputs.end(), s.name) == outputs.end(), "sp_bench: input and output ",
                   s.name, " would share one --dump file");
      dumped.push_back(s.name);
    }
  }
  check_json_not_dumped(o, dumped);
  return wl;
}

int sp_bench_main(int argc, char** argv) {
  const WorldPlace place = mpi_world_place();

  // ---- configuration: everything that can fail does so here, on every rank, after the options' agreement only ----
  const std::optional<SpBenchOptions> parsed = parse_sp_bench_options(argc, argv, place.size, place.rank);
  if (!parsed) return 0;
  const SpBenchOptions& o = *parsed;
  // The first collective, the same on every rank whatever its flags: ranks started with other flags (mpirun's MPMD
  // form) stop here, each naming the first that differs, before any collective of one mode or backend (the node's
  // communicator, NCCL's device agreement) could pair with another rank's different one. Over MPI, whatever
  // --backend says.
  check_options_agree(o);
  check_backend_rules(o);  // --backend nccl needs --device cuda, refused in every build before the build's own rule
  check_communicator_backend_built(o.backend);
  if (place.rank == 0 && find_workload_kind(o.attn).warnings) {
    for (const std::string& w : find_workload_kind(o.attn).warnings(o))
      std::fprintf(stderr, "sp_bench: warning: %s\n", w.c_str());
  }
  if (o.decode.mode == "decode") return run_decode_bench(o, place);  // benchmarks/sp_bench_decode.h
#if defined(_OPENMP)
  omp_set_num_threads(o.threads);
#endif
  RunReport report;
  report.date_utc = utc_now_iso8601();
  report.node = node_info();
  // The estimate below builds the run's layout (GDN's segment count, the balanced kind's assignment), which holds
  // int64 positions per slot and their copies (about 32 bytes a slot): a sequence whose layout alone does not fit
  // the node is reported (--dry-run) or refused here, on every rank, before a layout is built.
  MemoryEstimate layout_alone;
  layout_alone.host.emplace_back("the sequence layout (int64 positions and token indices per slot)",
                                 32.0 * static_cast<double>(std::max(o.seq, o.layout == LayoutKind::kBalanced
                                                                                ? o.seq
                                                                                : sp_bench_padded_len(o))));
  const MemoryVerdict layout_verdict = compare_with_node_memory(o, layout_alone);
  if (!layout_verdict.fits) {
    if (o.dry_run) {
      if (place.rank == 0) {
        std::printf("%s# the sequence layout alone does not fit: the run's tensors (inputs, activations, workspace, "
                    "comm buffers) were not estimated, the figures above are a lower bound\n",
                    describe_memory_dry_run(layout_alone, layout_verdict).c_str());
      }
      return 0;
    }
    check_memory_fits(layout_verdict, layout_alone);
  }
  report.memory = estimate_memory(o, 0);
  // The memory estimate, before anything is allocated: --dry-run prints it; a node that cannot hold it stops every
  // rank with the node's figures.
  const MemoryEstimate mine = estimate_memory(o, place.rank);
  const MemoryVerdict verdict = compare_with_node_memory(o, mine);
  // --check-against reference's size rule, before --dry-run's report: the dry run refuses what the run would.
  if (o.check && o.check_against == "reference") check_reference_fits(o);
  if (o.dry_run) {
    if (place.rank == 0) {
      // The layout behind the packing line holds padded_len positions: only for a run the node can hold.
      const std::string packing = verdict.fits ? describe_packing(o) : std::string();
      if (!packing.empty()) std::printf("%s\n", packing.c_str());
      std::printf("%s", describe_memory_dry_run(report.memory, verdict).c_str());
    }
    return 0;
  }
  check_memory_fits(verdict, mine);
  const WorkloadKind& kind = find_workload_kind(o.attn);
  const NamedArrays inputs =
      o.inputs_dir.empty() ? NamedArrays{} : load_inputs(o, kind.input_specs(o), kind.input_value_rule);
  const NamedArrays* input_ptr = o.inputs_dir.empty() ? nullptr : &inputs;
  Progress progress(place.rank == 0 && !o.quiet);
  const std::string oversubscribed = oversubscription_warning(report.node, o.threads);
  if (place.rank == 0 && !oversubscribed.empty())
    std::fprintf(stderr, "sp_bench: warning: %s\n", oversubscribed.c_str());
  auto world = make_world_communicator(o.backend);
  check_output_paths(*world, o.json_path, o.dump_dir);
  CpGrid grid(*world, o.grid);

  std::unique_ptr<Workload> wl = make_checked_workload(o, grid);
  progress.note("making inputs", true);
  wl->setup(input_ptr);

  // ---- timing and the cross-rank reduction ----
  LocalTimings timings = time_iterations(*world, *wl, o, input_ptr, progress);
  const bool reference_ready = timings.reference_ready;
  report.backend = world->backend_name();
  report.world_size = place.size;
  report.grid = grid.str();
  report.phases = reduce_phases(*world, std::move(timings), *wl, o);

  // ---- gather, check ----
  NamedArrays got;
  CheckReport check;
  if (o.check || !o.dump_dir.empty()) {
    progress.note("gathering outputs", true);
    got = wl->gather_outputs();
    if (!o.test_corrupt.empty()) corrupt_for_test(got, o.test_corrupt);
    if (o.check) {
      check = check_outputs(*world, grid, *wl, o, got, input_ptr, reference_ready, progress);
      report.check = &check;
    }
  }

  // ---- single-rank kernel variants (e.g. GDN --gdn-compare-token), on world rank 0 while the others wait ----
  if (place.rank == 0) {
    if (o.gdn_compare_token) progress.note("single-rank chunked and token-by-token kernels", true);
    report.variants = wl->time_variants(input_ptr, o.warmup, o.iters);
#if defined(SEQPAR_WITH_CUDA)
    if (o.device.is_cuda()) {
      // the figures' reference on the device of world rank 0's layer (with --backend nccl, its communicator's GPU)
      progress.note("cuBLAS bf16 GEMM reference", true);
      report.gemm_n = kGemmReferenceN;
      report.gemm_tflops = square_bf16_gemm_tflops(kGemmReferenceN, grid.cp().device().is_cuda() ? grid.cp().device()
                                                                                                  : o.device,
                                                   std::max(o.warmup, 1), std::max(o.iters, 3));
    }
#endif
  }
  barrier(*world, kLongWaitS);

  // ---- report (rank 0), then the files ----
  if (place.rank == 0) print_report(o, report);
  const nlohmann::json json = o.json_path.empty() || place.rank != 0 ? nlohmann::json() : report_json(o, report);
  write_outputs(
      *world, o, [&] { return widen_for_dump(input_ptr != nullptr ? *input_ptr : wl->make_full_inputs()); }, got,
      o.json_path.empty() ? nullptr : &json);
  barrier(*world, kLongWaitS);
  const bool check_failed = o.check && !check.passed;
  if (check_failed && place.rank == 0) {
    std::fprintf(stderr, "sp_bench: check failed: results differ from the %s beyond tolerance\n",
                 o.check_against == "reference" ? "fp64 reference" : "single-rank reference");
  }
  return check_failed ? 1 : 0;
}

}  // namespace
}  // namespace seqpar::bench

int main(int argc, char** argv) { return seqpar::run_mpi_main(argc, argv, seqpar::bench::sp_bench_main); }
