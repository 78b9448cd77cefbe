// sp_bench: the main job. Times the distributed forward and backward of one attention layer under sequence
// parallelism (ring, Ulysses, USP), checks the results against the single-rank reference of the same problem, and
// prints nccl-tests style tables on rank 0 (a `#` header, fixed-width columns with units, optional JSON). Definitions
// of the printed figures: README. The parts: the options and the workload registry (sp_bench_options.h,
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

#include "benchmarks/sp_bench_check.h"
#include "benchmarks/sp_bench_decode.h"
#include "benchmarks/sp_bench_memory.h"
#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_report.h"
#include "benchmarks/sp_bench_timing.h"
#include "benchmarks/sp_bench_workload.h"
#include "runtime/comm_factory.h"
#include "runtime/error.h"
#include "runtime/mpi_comm.h"
#include "runtime/sp_grid.h"
#include "runtime/tensor_ops.h"

namespace seqpar::bench {
namespace {

// Whether a file can be created in `dir` (a probe file, removed again).
bool can_create_in(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return false;
  const std::filesystem::path probe_path = dir / ".sp_bench_write_probe";
  const bool ok = std::ofstream(probe_path).good();
  std::filesystem::remove(probe_path, ec);
  return ok;
}

// --json and --dump are written by rank 0 at the end of the run, each through a temporary file in the target
// directory; find out now whether that will work, on rank 0, and fail on every rank with the same message (one
// small all-reduce, before the grid exists).
void check_output_paths(Communicator& world, const SpBenchOptions& o) {
  std::int32_t bad[2] = {0, 0};  // json, dump
  if (world.rank() == 0) {
    // First, so that --json may name a file in the --dump directory.
    if (!o.dump_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(o.dump_dir, ec);
      bad[1] = !ec && can_create_in(o.dump_dir) ? 0 : 1;
    }
    if (!o.json_path.empty()) {
      const std::filesystem::path dir = std::filesystem::path(o.json_path).parent_path();
      bad[0] =
          can_create_in(dir.empty() ? std::filesystem::path(".") : dir) && !std::filesystem::is_directory(o.json_path)
              ? 0
              : 1;
    }
  }
  world.all_reduce(TensorView(bad, DType::kInt32, {2}), ReduceOp::kMax)->wait();
  SEQPAR_CHECK(!bad[0], "--json ", o.json_path,
               ": cannot create a file in its directory (checked on rank 0, which writes it)");
  SEQPAR_CHECK(!bad[1], "--dump ", o.dump_dir,
               ": cannot create the directory or write into it (checked on rank 0, which writes it)");
}

// --inputs: the full inputs of the configured workload, checked (shape, element type, finite) on every rank.
NamedArrays load_inputs(const SpBenchOptions& o) {
  NamedArrays inputs;
  const WorkloadKind& kind = find_workload_kind(o.attn);
  for (const TensorSpec& s : kind.input_specs(o)) {
    npy::HostArray a = npy::read_expect((std::filesystem::path(o.inputs_dir) / (s.name + ".npy")).string(), s.shape);
    SEQPAR_CHECK(a.dtype == DType::kFloat32 || a.dtype == DType::kFloat64, o.inputs_dir, "/", s.name,
                 ".npy: element type ", dtype_name(a.dtype), " (inputs must be fp32 or fp64)");
    for (std::int64_t i = 0; i < a.numel(); ++i) {
      const double x = a.dtype == DType::kFloat32 ? reinterpret_cast<const float*>(a.bytes.data())[i]
                                                  : reinterpret_cast<const double*>(a.bytes.data())[i];
      SEQPAR_CHECK(std::isfinite(x), o.inputs_dir, "/", s.name, ".npy: element ", i, " is ", x,
                   " (inputs must be finite)");
      if (!kind.input_value_rule) continue;
      const std::string rule = kind.input_value_rule(s.name, x);
      SEQPAR_CHECK(rule.empty(), o.inputs_dir, "/", s.name, ".npy: element ", i, " is ", x, " (", rule, ")");
    }
    inputs.emplace_back(s.name, std::move(a));
  }
  return inputs;
}

// --dump-inputs: the full inputs as --inputs reads them (fp64 stays fp64; every other storage dtype is widened to
// fp32, which holds its values exactly), from the loaded files or generated from the seed (rank 0).
NamedArrays inputs_to_dump(Workload& wl, const NamedArrays* loaded) {
  NamedArrays out;
  for (const auto& [name, a] : loaded != nullptr ? *loaded : wl.make_full_inputs()) {
    npy::HostArray wide(a.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32, a.shape);
    copy_convert(a.view(), wide.view());
    out.emplace_back(name, std::move(wide));
  }
  return out;
}

// Rank 0 writes the --dump files (with --dump-inputs also the inputs) and the --json file, each atomically
// (bench::write_file_atomic), after the table was printed; a failure stops at the first file that fails and is
// raised on every rank with rank 0's message.
void write_outputs(Communicator& world, const SpBenchOptions& o, Workload& wl, const NamedArrays& got,
                   const NamedArrays* loaded, const nlohmann::json* json) {
  std::string error;
  if (world.rank() == 0) {
    try {
      if (!o.dump_dir.empty()) {
        std::string names;
        const NamedArrays inputs = o.dump_inputs ? inputs_to_dump(wl, loaded) : NamedArrays{};
        NamedArrays packing;  // a packed row's cu_seqlens (int64 [N+1]), as --inputs reads it
        if (o.packed()) {
          const std::vector<std::int64_t> cu = cu_seqlens_of(o.doc_lens);
          npy::HostArray a(DType::kInt64, {static_cast<std::int64_t>(cu.size())});
          std::copy(cu.begin(), cu.end(), a.view().data_as<std::int64_t>());
          packing.emplace_back("cu_seqlens", std::move(a));
        }
        for (const NamedArrays* arrays : {static_cast<const NamedArrays*>(&packing), &inputs, &got}) {
          for (const auto& [name, a] : *arrays) {
            const std::string path = (std::filesystem::path(o.dump_dir) / (name + ".npy")).string();
            write_file_atomic(
                path, [&](std::ostream& out) { npy::write(out, a.view(), path); }, o.test_fail_write_after);
            names += " " + name;
          }
        }
        std::printf("# dumped%s to %s\n", names.c_str(), o.dump_dir.c_str());
      }
      if (json != nullptr) {
        write_file_atomic(
            o.json_path, [&](std::ostream& out) { out << json->dump(2) << "\n"; }, o.test_fail_write_after);
      }
      std::fflush(stdout);
    } catch (const Error& e) {
      error = e.message();
    } catch (const std::exception& e) {  // whatever it is, the other ranks must hear of it
      error = e.what();
    }
  }
  // The message travels from rank 0 (length, then the bytes as int32), so every rank fails with the same line.
  std::int32_t length = static_cast<std::int32_t>(error.size());
  world.broadcast(TensorView(&length, DType::kInt32, {1}), 0)->wait(kLongWaitS);
  if (length == 0) return;
  std::vector<std::int32_t> chars(error.begin(), error.end());
  chars.resize(static_cast<std::size_t>(length));
  world.broadcast(TensorView(chars.data(), DType::kInt32, {length}), 0)->wait();
  SEQPAR_THROW("writing the output files (rank 0): ", std::string(chars.begin(), chars.end()));
}

int sp_bench_main(int argc, char** argv) {
  const WorldPlace place = mpi_world_place();

  // ---- configuration: everything that can fail does so here, on every rank, before any communication ----
  const std::optional<SpBenchOptions> parsed = parse_sp_bench_options(argc, argv, place.size, place.rank);
  if (!parsed) return 0;
  const SpBenchOptions& o = *parsed;
  if (o.decode.mode == "decode") return run_decode_bench(o, place);  // benchmarks/sp_bench_decode.h
#if defined(_OPENMP)
  omp_set_num_threads(o.threads);
#endif
  RunReport report;
  report.date_utc = utc_now_iso8601();
  report.node = node_info();
  report.memory = estimate_memory(o, 0);
  // The memory estimate, before anything is allocated: --dry-run prints it; a node that cannot hold it stops every
  // rank with the node's figures.
  const MemoryVerdict verdict = compare_with_node_memory(o, estimate_memory(o, place.rank));
  // --check-against reference's size rule, before --dry-run's report: the dry run refuses what the run would.
  if (o.check && o.check_against == "reference") check_reference_fits(o);
  if (o.dry_run) {
    if (place.rank == 0) {
      const std::string packing = describe_packing(o);
      if (!packing.empty()) std::printf("%s\n", packing.c_str());
      std::printf("%s# node: %s\n", describe_memory_estimate(report.memory).c_str(),
                  !verdict.compared ? "not compared (nccl backend, or no MemAvailable)"
                                    : str_cat(verdict.text, verdict.fits ? ": fits" : ": does NOT fit").c_str());
    }
    return 0;
  }
  SEQPAR_CHECK(verdict.fits, "memory estimate: ", verdict.text,
               "; reduce --seq or --batch, or use more ranks or nodes (--dry-run prints the estimate by category)");
  const NamedArrays inputs = o.inputs_dir.empty() ? NamedArrays{} : load_inputs(o);
  const NamedArrays* input_ptr = o.inputs_dir.empty() ? nullptr : &inputs;
  Progress progress(place.rank == 0 && !o.quiet);
  const std::string oversubscribed = oversubscription_warning(report.node, o.threads);
  if (place.rank == 0 && !oversubscribed.empty())
    std::fprintf(stderr, "sp_bench: warning: %s\n", oversubscribed.c_str());
  auto world = make_world_communicator(o.backend);
  check_options_agree(*world, o);  // ranks started with other flags stop here, each naming the first that differs
  check_output_paths(*world, o);
  SpGrid grid(*world, o.grid);

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
  if (!o.json_path.empty() && !o.dump_dir.empty()) {  // rank 0 would write the JSON over a dumped array
    auto normal = [](const std::filesystem::path& p) { return std::filesystem::absolute(p).lexically_normal(); };
    for (const std::string& name : dumped) {
      SEQPAR_CHECK(normal(o.json_path) != normal(std::filesystem::path(o.dump_dir) / (name + ".npy")), "--json ",
                   o.json_path, " is the file --dump ", o.dump_dir, " writes for ", name, "; choose another path");
    }
  }
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
  }
  barrier(*world, kLongWaitS);

  // ---- report (rank 0), then the files ----
  if (place.rank == 0) print_report(o, report);
  const nlohmann::json json = o.json_path.empty() || place.rank != 0 ? nlohmann::json() : report_json(o, report);
  write_outputs(*world, o, *wl, got, input_ptr, o.json_path.empty() ? nullptr : &json);
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
