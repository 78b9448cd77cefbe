// sp_bench: the main job. Times the distributed forward and backward of one attention layer under sequence
// parallelism (ring, Ulysses, USP), checks the results against the single-rank reference of the same problem, and
// prints nccl-tests style tables on rank 0 (STYLE.md items 9, 10). Definitions of the printed figures: README.
//
//   mpirun -np 4 sp_bench --ulysses-size 2 --ring-size 2 --layout zigzag --causal --seq 8K --check
#include <mpi.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_workload.h"
#include "runtime/comm_factory.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/mpi_comm.h"
#include "runtime/sp_grid.h"

namespace seqpar::bench {
namespace {

// Collectives after a long single-rank computation (reference, efficiency) may wait far beyond the default
// communication timeout; they wait this long instead.
constexpr double kLongWaitS = 24 * 3600.0;

double now_s() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

// Progress lines on rank 0 (stderr, so that stdout keeps only the tables): at most one every 2 s, and only once the
// run has taken more than 2 s.
class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled), start_(now_s()), last_(start_) {}
  void note(const std::string& what, bool force = false) {
    if (!enabled_) return;
    const double t = now_s();
    if (t - start_ < 2.0 || (!force && t - last_ < 2.0)) return;
    last_ = t;
    std::fprintf(stderr, "# [sp_bench %7.1f s] %s\n", t - start_, what.c_str());
    std::fflush(stderr);
  }

 private:
  bool enabled_;
  double start_, last_;
};

void all_reduce(Communicator& comm, std::vector<double>& values, ReduceOp op, double timeout_s = -1) {
  if (values.empty()) return;
  TensorView view(values.data(), DType::kFloat64, {static_cast<std::int64_t>(values.size())});
  WorkHandle w = comm.all_reduce(view, op);
  if (timeout_s > 0) {
    w->wait(timeout_s);
  } else {
    w->wait();
  }
}

void barrier(Communicator& comm, double timeout_s = -1) {
  WorkHandle w = comm.barrier();
  if (timeout_s > 0) {
    w->wait(timeout_s);
  } else {
    w->wait();
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

constexpr double kMiB = 1024.0 * 1024.0;

struct PhaseResult {
  std::string name;
  double time_ms = 0;           // median over iterations of the slowest rank's time
  double flops = 0;             // model FLOPs of the phase, all replicas
  double exposed_frac = 0;      // mean over ranks of exposed communication / phase time
  double bytes_sent = 0;        // max over ranks, per iteration
  double executed_flops = 0;    // attention FLOPs executed per iteration, max over ranks (JSON only)
  double message_rounds = -1;   // sequential message rounds per iteration, max over ranks (GDN); -1: none
  std::vector<double> mem_mib;  // per ledger category, then total; max over ranks and iterations
  double single_rank_ms = -1;   // --efficiency: the whole problem on one rank
  double efficiency = -1;
  double single_rank_busy_ms = -1;  // the same with every rank running its own copy at once
  double efficiency_busy = -1;
};

struct CheckResult {
  std::string name;
  double max_abs = 0, max_ref = 0, atol = 0, rtol = 0;
  bool ok() const { return max_abs <= atol + rtol * max_ref; }
  double max_rel() const { return max_ref > 0 ? max_abs / max_ref : max_abs; }
};

// The elements as fp64: floating arrays through convert(); int64 arrays (DSA topk_indices, exact below 2^53)
// element by element, since convert() does not cross between integer and floating types.
std::vector<double> to_double(const npy::HostArray& x) {
  const std::size_t n = static_cast<std::size_t>(x.numel());
  std::vector<double> r(n);
  if (x.dtype == DType::kInt64) {
    const std::int64_t* p = x.view().data_as<std::int64_t>();
    for (std::size_t i = 0; i < n; ++i) r[i] = static_cast<double>(p[i]);
  } else {
    convert(x.bytes.data(), x.dtype, r.data(), DType::kFloat64, n);
  }
  return r;
}

// max |a - b| and max |b| over finite b; equal infinities count as equal, any other non-finite difference is +inf.
void compare(const npy::HostArray& got, const npy::HostArray& want, double& max_abs, double& max_ref) {
  SEQPAR_CHECK(got.shape == want.shape, "sp_bench: gathered shape ", shape_str(got.shape),
               " differs from the reference shape ", shape_str(want.shape));
  const std::vector<double> a = to_double(got), b = to_double(want);
  const std::size_t n = a.size();
  max_abs = 0;
  max_ref = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (std::isfinite(b[i])) max_ref = std::max(max_ref, std::abs(b[i]));
    if (a[i] == b[i]) continue;  // also equal infinities
    const double d = std::abs(a[i] - b[i]);
    max_abs = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(max_abs, d);
  }
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// --json and --dump are written by rank 0 at the end of the run; find out now whether that will work, on rank 0,
// and fail on every rank with the same message (one small all-reduce, before the grid exists).
void check_output_paths(Communicator& world, const SpBenchOptions& o) {
  std::int32_t bad[2] = {0, 0};  // json, dump
  if (world.rank() == 0) {
    if (!o.json_path.empty()) {
      const bool existed = std::filesystem::exists(o.json_path);
      std::ofstream probe(o.json_path, std::ios::app);
      bad[0] = probe.good() ? 0 : 1;
      probe.close();
      if (!existed && !bad[0]) std::filesystem::remove(o.json_path);
    }
    if (!o.dump_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(o.dump_dir, ec);
      const auto probe_path = std::filesystem::path(o.dump_dir) / ".sp_bench_write_probe";
      std::ofstream probe(probe_path);
      bad[1] = (!ec && std::filesystem::is_directory(o.dump_dir) && probe.good()) ? 0 : 1;
      probe.close();
      std::filesystem::remove(probe_path, ec);
    }
  }
  world.all_reduce(TensorView(bad, DType::kInt32, {2}), ReduceOp::kMax)->wait();
  SEQPAR_CHECK(!bad[0], "--json ", o.json_path,
               ": cannot open the file for writing (checked on rank 0, which writes it)");
  SEQPAR_CHECK(!bad[1], "--dump ", o.dump_dir,
               ": cannot create the directory or write into it (checked on rank 0, which writes it)");
}

int sp_bench_main(int argc, char** argv) {
  int world_size = 1, world_rank = 0;
  SEQPAR_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  SEQPAR_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));

  // ---- configuration: everything that can fail does so here, on every rank, before any communication ----
  const std::optional<SpBenchOptions> parsed = parse_sp_bench_options(argc, argv, world_size, world_rank);
  if (!parsed) return 0;
  const SpBenchOptions& o = *parsed;
  const std::vector<TensorSpec> specs = workload_input_specs(o);
#if defined(_OPENMP)
  omp_set_num_threads(o.threads);
#endif

  NamedArrays inputs;
  if (!o.inputs_dir.empty()) {
    for (const TensorSpec& s : specs) {
      npy::HostArray a = npy::read_expect((std::filesystem::path(o.inputs_dir) / (s.name + ".npy")).string(), s.shape);
      SEQPAR_CHECK(a.dtype == DType::kFloat32 || a.dtype == DType::kFloat64, o.inputs_dir, "/", s.name,
                   ".npy: element type ", dtype_name(a.dtype), " (inputs must be fp32 or fp64)");
      for (std::int64_t i = 0; i < a.numel(); ++i) {
        const double x = a.dtype == DType::kFloat32 ? reinterpret_cast<const float*>(a.bytes.data())[i]
                                                    : reinterpret_cast<const double*>(a.bytes.data())[i];
        SEQPAR_CHECK(std::isfinite(x), o.inputs_dir, "/", s.name, ".npy: element ", i, " is ", x,
                     " (inputs must be finite)");
      }
      inputs.emplace_back(s.name, std::move(a));
    }
  }
  const NamedArrays* input_ptr = o.inputs_dir.empty() ? nullptr : &inputs;
  Progress progress(world_rank == 0 && !o.quiet);
  auto world = make_world_communicator(o.backend);
  check_output_paths(*world, o);
  SpGrid grid(*world, o.grid);
  const int sp_size = o.grid.ulysses_size * o.grid.ring_size;
  const bool sp_root = grid.coords().sp_rank == 0;

  std::unique_ptr<Workload> wl = make_workload(o, grid);
  progress.note("making inputs", true);
  wl->setup(input_ptr);

  // ---- timing ----
  for (int i = 0; i < o.warmup; ++i) {
    progress.note(str_cat("warmup ", i + 1, "/", o.warmup));
    barrier(*world);
    wl->forward();
    barrier(*world);
    wl->backward();
  }
  const int n = o.iters;
  std::vector<double> times(2 * n);  // [fwd_0, bwd_0, fwd_1, ...], seconds, this rank
  double exposed[2] = {0, 0};
  std::vector<double> bytes(2, 0);
  std::vector<double> rounds(2, -1);   // sequential message rounds of the phase (GDN), -1: not reported
  std::vector<double> executed(2, 0);  // attention FLOPs this rank executed in one iteration (masked blocks skipped)
  std::vector<double> mem(2 * (kNumMemCategories + 1), 0);  // per phase: categories, total (bytes)
  auto record_mem = [&](int phase) {
    const MemorySnapshot s = memory_ledger().snapshot();
    double* m = &mem[phase * (kNumMemCategories + 1)];
    for (int c = 0; c < kNumMemCategories; ++c) m[c] = std::max(m[c], static_cast<double>(s.peak[c]));
    m[kNumMemCategories] = std::max(m[kNumMemCategories], static_cast<double>(s.total_peak));
  };
  // --efficiency: the whole problem on one rank, same threads, same run, interleaved with the distributed
  // iterations so that a drifting machine load affects both alike. Twice per iteration: on world rank 0 while the
  // other ranks wait ("alone", the definition), and on every rank at once, each on its own copy ("busy"): the
  // second baseline sees the same contention for shared cores, caches and memory bandwidth as the distributed run,
  // which separates the algorithm's overhead from what the machine can give P busy ranks.
  bool reference_ready = false;
  std::vector<double> alone(2 * n, 0), busy(2 * n, 0);  // [fwd_0, bwd_0, ...], seconds
  auto time_reference = [&](std::vector<double>& out, int i) {
    double t0 = now_s();
    wl->reference_forward();
    out[2 * i] = now_s() - t0;
    t0 = now_s();
    wl->reference_backward();
    out[2 * i + 1] = now_s() - t0;
  };
  if (o.efficiency) {
    progress.note("efficiency: making the single-rank problem", true);
    wl->reference_setup(input_ptr);
    reference_ready = true;
    if (o.warmup > 0) {
      wl->reference_forward();
      wl->reference_backward();
    }
  }
  for (int i = 0; i < n; ++i) {
    progress.note(str_cat("iteration ", i + 1, "/", n));
    if (o.efficiency) {
      barrier(*world);
      if (world_rank == 0) time_reference(alone, i);
      barrier(*world, kLongWaitS);
      time_reference(busy, i);
      barrier(*world, kLongWaitS);
    }
    wl->release_outputs();
    barrier(*world);
    memory_ledger().reset_peaks();
    double t0 = now_s();
    PhaseCounters c = wl->forward();
    times[2 * i] = now_s() - t0;
    record_mem(0);
    exposed[0] += c.exposed_comm_s;
    bytes[0] = static_cast<double>(c.bytes_sent);
    executed[0] = c.executed_flops;
    rounds[0] = static_cast<double>(c.message_rounds);

    barrier(*world);
    memory_ledger().reset_peaks();
    t0 = now_s();
    c = wl->backward();
    times[2 * i + 1] = now_s() - t0;
    record_mem(1);
    exposed[1] += c.exposed_comm_s;
    bytes[1] = static_cast<double>(c.bytes_sent);
    executed[1] = c.executed_flops;
    rounds[1] = static_cast<double>(c.message_rounds);
  }
  double local_sum[2] = {0, 0};
  for (int i = 0; i < n; ++i) {
    local_sum[0] += times[2 * i];
    local_sum[1] += times[2 * i + 1];
  }
  std::vector<double> exposed_frac = {exposed[0] / local_sum[0], exposed[1] / local_sum[1]};
  all_reduce(*world, times, ReduceOp::kMax);
  all_reduce(*world, exposed_frac, ReduceOp::kSum);
  all_reduce(*world, bytes, ReduceOp::kMax);
  all_reduce(*world, executed, ReduceOp::kMax);
  all_reduce(*world, rounds, ReduceOp::kMax);
  const bool has_rounds = rounds[0] >= 0;
  all_reduce(*world, mem, ReduceOp::kMax);
  std::vector<double> alone_med(3, 0), busy_med(3, 0);
  if (o.efficiency) {
    all_reduce(*world, alone, ReduceOp::kMax);
    all_reduce(*world, busy, ReduceOp::kMax);
    auto medians = [&](const std::vector<double>& t) {
      std::vector<double> f(n), b(n), fb(n);
      for (int i = 0; i < n; ++i) {
        f[i] = t[2 * i];
        b[i] = t[2 * i + 1];
        fb[i] = f[i] + b[i];
      }
      return std::vector<double>{median(f), median(b), median(fb)};
    };
    alone_med = medians(alone);
    busy_med = medians(busy);
  }

  std::vector<PhaseResult> phases(3);
  {
    std::vector<double> f(n), b(n), fb(n);
    for (int i = 0; i < n; ++i) {
      f[i] = times[2 * i];
      b[i] = times[2 * i + 1];
      fb[i] = f[i] + b[i];
    }
    const double dp = o.grid.dp_size;
    auto make_phase = [](const char* name, double time_ms, double flops, double exposed_frac, double bytes_sent,
                         double executed_flops) {
      PhaseResult p;
      p.name = name;
      p.time_ms = time_ms;
      p.flops = flops;
      p.exposed_frac = exposed_frac;
      p.bytes_sent = bytes_sent;
      p.executed_flops = executed_flops;
      return p;
    };
    phases[0] = make_phase("fwd", 1e3 * median(f), dp * wl->forward_flops(), exposed_frac[0] / world_size, bytes[0],
                           executed[0]);
    phases[1] = make_phase("bwd", 1e3 * median(b), dp * wl->backward_flops(), exposed_frac[1] / world_size, bytes[1],
                           executed[1]);
    phases[2] = make_phase("fwd+bwd", 1e3 * median(fb), phases[0].flops + phases[1].flops, 0, bytes[0] + bytes[1],
                           executed[0] + executed[1]);
    if (has_rounds) {
      phases[0].message_rounds = rounds[0];
      phases[1].message_rounds = rounds[1];
      phases[2].message_rounds = rounds[0] + rounds[1];
    }
    // fwd+bwd exposed share: time-weighted mean of the two phases.
    phases[2].exposed_frac = (phases[0].exposed_frac * phases[0].time_ms + phases[1].exposed_frac * phases[1].time_ms) /
                             (phases[0].time_ms + phases[1].time_ms);
    for (int p = 0; p < 2; ++p) {
      for (int c = 0; c <= kNumMemCategories; ++c)
        phases[p].mem_mib.push_back(mem[p * (kNumMemCategories + 1) + c] / kMiB);
    }
    for (int c = 0; c <= kNumMemCategories; ++c) {
      phases[2].mem_mib.push_back(std::max(phases[0].mem_mib[c], phases[1].mem_mib[c]));
    }
  }

  if (o.efficiency) {
    for (int p = 0; p < 3; ++p) {
      phases[p].single_rank_ms = 1e3 * alone_med[p];
      phases[p].efficiency = alone_med[p] / (sp_size * phases[p].time_ms * 1e-3);
      phases[p].single_rank_busy_ms = 1e3 * busy_med[p];
      phases[p].efficiency_busy = busy_med[p] / (sp_size * phases[p].time_ms * 1e-3);
    }
  }

  // ---- check and dump ----
  std::vector<CheckResult> checks;
  bool check_failed = false;
  if (o.check || !o.dump_dir.empty()) {
    progress.note("gathering outputs", true);
    const NamedArrays got = wl->gather_outputs();
    if (!o.dump_dir.empty() && world_rank == 0) {
      for (const auto& [name, a] : got) {
        npy::write((std::filesystem::path(o.dump_dir) / (name + ".npy")).string(), a.view());
      }
    }
    if (o.check) {
      const std::vector<std::string> names = wl->output_names();
      std::vector<double> err(2 * names.size(), 0);  // max_abs, max_ref per tensor, max over replicas
      if (sp_root) {
        if (!reference_ready) {
          progress.note("check: single-rank reference", true);
          wl->reference_setup(input_ptr);
          wl->reference_forward();
          wl->reference_backward();
        }
        const NamedArrays want = wl->reference_outputs();
        for (std::size_t t = 0; t < names.size(); ++t) {
          compare(find_array(got, names[t]), find_array(want, names[t]), err[2 * t], err[2 * t + 1]);
        }
      }
      all_reduce(*world, err, ReduceOp::kMax, kLongWaitS);
      for (std::size_t t = 0; t < names.size(); ++t) {
        const Tolerance tol = wl->tolerance(names[t]);
        checks.push_back({names[t], err[2 * t], err[2 * t + 1], tol.atol, tol.rtol});
        check_failed = check_failed || !checks.back().ok();
      }
    }
  }

  // ---- single-rank kernel variants (e.g. GDN --gdn-compare-token), on world rank 0 while the others wait ----
  std::vector<VariantTiming> variants;
  if (world_rank == 0) {
    if (o.gdn_compare_token) progress.note("single-rank chunked and token-by-token kernels", true);
    variants = wl->time_variants(input_ptr, o.warmup, o.iters);
  }
  barrier(*world, kLongWaitS);

  // ---- report (rank 0) ----
  if (world_rank == 0) {
    const char* backend = world->backend_name();
    std::printf("# seqpar sp_bench %s\n", SEQPAR_VERSION);
    std::printf("# backend %s, world %d, grid %s, threads/rank %d\n", backend, world_size, grid.str().c_str(),
                o.threads);
    std::printf("# attn %s%s, layout %s, impl %s, dtype %s\n", attn_kind_name(o.attn),
                o.model.empty() ? "" : str_cat(" (model ", o.model, ")").c_str(), layout_name(o.layout),
                ring_impl_name(o.impl), dtype_name(o.dtype));
    std::printf("# shapes %s\n", describe_shapes(o).c_str());
    std::printf("# FLOPs per step (all replicas): fwd %.4g, bwd %.4g; warmup %d, iters %d (median); inputs %s\n",
                phases[0].flops, phases[1].flops, o.warmup, o.iters,
                o.inputs_dir.empty() ? str_cat("random (seed ", o.seed, ")").c_str() : o.inputs_dir.c_str());
    std::printf("#\n");
    std::string h1 = "#    phase      time   TFLOP/s   TFLOP/s   exposed        sent";
    std::string h2 = "#                (ms)     /rank     total   comm(%)  (MiB/rank)";
    const char* cat_short[] = {"model", "saved", "cache", "work", "comm", "total"};
    for (const char* c : cat_short) {
      h1 += str_cat(std::string(9 - std::string(c).size(), ' '), c);
      h2 += "    (MiB)";
    }
    if (o.efficiency) {
      h1 += "    T1 alone   effic.    T1 busy   effic.";
      h2 += "        (ms)   (alone)       (ms)   (busy)";
    }
    if (has_rounds) {
      h1 += "   rounds";
      h2 += "      (-)";
    }
    std::printf("%s\n%s\n", h1.c_str(), h2.c_str());
    for (const PhaseResult& p : phases) {
      const double tflops_total = p.flops / (p.time_ms * 1e-3) / 1e12;
      std::string row = std::string(std::max<int>(0, 10 - static_cast<int>(p.name.size())), ' ') + p.name;
      row += fmt("%10.2f", p.time_ms);
      row += fmt("%10.4f", tflops_total / world_size);
      row += fmt("%10.4f", tflops_total);
      row += fmt("%10.1f", 100.0 * p.exposed_frac);
      row += fmt("%12.2f", p.bytes_sent / kMiB);
      for (double m : p.mem_mib) row += fmt("%9.2f", m);
      if (o.efficiency) {
        row += fmt("%12.2f", p.single_rank_ms);
        row += fmt("%9.3f", p.efficiency);
        row += fmt("%11.2f", p.single_rank_busy_ms);
        row += fmt("%9.3f", p.efficiency_busy);
      }
      if (has_rounds) row += fmt("%9.0f", p.message_rounds);
      std::printf("%s\n", row.c_str());
    }
    if (o.check) {
      std::printf("#\n# check against the single-rank reference: ok when max_abs_err <= atol + rtol * max|ref|\n");
      std::printf("#        tensor  max_abs_err  max_rel_err     max|ref|       atol       rtol  result\n");
      for (const CheckResult& c : checks) {
        std::printf("%15s %12.3e %12.3e %12.3e %10.1e %10.1e  %s\n", c.name.c_str(), c.max_abs, c.max_rel(), c.max_ref,
                    c.atol, c.rtol, c.ok() ? "ok" : "FAIL");
      }
      std::printf("# check %s\n", check_failed ? "FAILED" : "passed");
    }
    if (!variants.empty()) {
      std::printf(
          "#\n# single-rank kernel on the whole problem (world rank 0 alone, %d threads; median of %d after %d "
          "warmup)\n",
          o.threads, o.iters, o.warmup);
      std::printf("#                     variant   fwd (ms)   bwd (ms) fwd+bwd (ms)  vs first\n");
      const double base = variants.front().fwd_ms + variants.front().bwd_ms;
      for (const VariantTiming& v : variants) {
        std::printf("%29s %10.2f %10.2f %12.2f %8.2fx\n", v.name.c_str(), v.fwd_ms, v.bwd_ms, v.fwd_ms + v.bwd_ms,
                    (v.fwd_ms + v.bwd_ms) / base);
      }
    }
    if (!o.dump_dir.empty()) {
      std::string names;
      for (const std::string& name : wl->output_names()) names += " " + name;
      std::printf("# dumped%s to %s\n", names.c_str(), o.dump_dir.c_str());
    }
    std::fflush(stdout);

    if (!o.json_path.empty()) {
      nlohmann::json j;
      j["version"] = SEQPAR_VERSION;
      j["backend"] = backend;
      j["world_size"] = world_size;
      j["grid"] = {{"dp_size", o.grid.dp_size},
                   {"ulysses_size", o.grid.ulysses_size},
                   {"ring_size", o.grid.ring_size},
                   {"placement", placement_name(o.grid.placement)}};
      j["attn"] = attn_kind_name(o.attn);
      j["model"] = o.model;
      j["layout"] = layout_name(o.layout);
      j["impl"] = ring_impl_name(o.impl);
      j["dtype"] = dtype_name(o.dtype);
      j["threads_per_rank"] = o.threads;
      j["shape"] = {{"batch", o.batch},       {"seq", o.seq},       {"heads", o.heads},  {"kv_heads", o.kv_heads},
                    {"head_dim", o.head_dim}, {"causal", o.causal}, {"window", o.window}};
      if (o.attn == AttnKind::kDsa) {
        j["shape"]["topk"] = o.topk;
        j["shape"]["dim_v"] = o.dim_v;
        j["shape"]["indexer_heads"] = o.indexer_heads;
        j["shape"]["indexer_dim"] = o.indexer_dim;
        j["dsa_select"] = o.dsa_select;
      }
      if (o.attn == AttnKind::kGdn) {
        j["shape"]["chunk_size"] = o.chunk_size;
        j["gdn_mode"] = o.gdn_mode;
      }
      j["warmup"] = o.warmup;
      j["iters"] = o.iters;
      j["phases"] = nlohmann::json::array();
      for (const PhaseResult& p : phases) {
        const double tflops_total = p.flops / (p.time_ms * 1e-3) / 1e12;
        nlohmann::json pj = {{"phase", p.name},
                             {"time_ms", p.time_ms},
                             {"flops", p.flops},
                             {"tflops_per_rank", tflops_total / world_size},
                             {"tflops_total", tflops_total},
                             {"exposed_comm_pct", 100.0 * p.exposed_frac},
                             {"bytes_sent_per_rank", p.bytes_sent},
                             {"executed_flops_max_rank", p.executed_flops}};
        nlohmann::json mj;
        for (int c = 0; c < kNumMemCategories; ++c) mj[mem_category_name(static_cast<MemCategory>(c))] = p.mem_mib[c];
        mj["total"] = p.mem_mib[kNumMemCategories];
        pj["mem_peak_mib"] = mj;
        if (has_rounds) pj["message_rounds"] = p.message_rounds;
        if (o.efficiency) {
          pj["single_rank_ms"] = p.single_rank_ms;
          pj["efficiency"] = p.efficiency;
          pj["single_rank_busy_ms"] = p.single_rank_busy_ms;
          pj["efficiency_busy"] = p.efficiency_busy;
        }
        j["phases"].push_back(pj);
      }
      if (!variants.empty()) {
        j["variants"] = nlohmann::json::array();
        for (const VariantTiming& v : variants) {
          j["variants"].push_back({{"name", v.name}, {"fwd_ms", v.fwd_ms}, {"bwd_ms", v.bwd_ms}});
        }
      }
      if (o.check) {
        j["check"] = nlohmann::json::array();
        for (const CheckResult& c : checks) {
          j["check"].push_back({{"tensor", c.name},
                                {"max_abs_err", c.max_abs},
                                {"max_rel_err", c.max_rel()},
                                {"max_abs_ref", c.max_ref},
                                {"atol", c.atol},
                                {"rtol", c.rtol},
                                {"ok", c.ok()}});
        }
        j["check_passed"] = !check_failed;
      }
      std::ofstream out(o.json_path);
      SEQPAR_CHECK(out.good(), "--json ", o.json_path, ": cannot open for writing");
      out << j.dump(2) << "\n";
      SEQPAR_CHECK(out.good(), "--json ", o.json_path, ": write error");
    }
  }
  barrier(*world, kLongWaitS);
  if (check_failed && world_rank == 0) {
    std::fprintf(stderr, "sp_bench: check failed: results differ from the single-rank reference beyond tolerance\n");
  }
  return check_failed ? 1 : 0;
}

}  // namespace
}  // namespace seqpar::bench

int main(int argc, char** argv) { return seqpar::run_mpi_main(argc, argv, seqpar::bench::sp_bench_main); }
