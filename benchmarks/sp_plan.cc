// sp_plan: ranks every context-parallel configuration of one layer by predicted step time (benchmarks/sp_plan.h;
// usage: docs/benchmarks.md, "sp_plan").
//
//   sp_plan --profile profile.json --world 16 --nodes 2 --mem-per-device 80G -- --model llama3-8b --seq 128K
//   sp_plan --calibrate profile.json      # this machine's profile, from kernel_bench and comm_bench
//   sp_plan --profile p.json --world 8 --dynamic-cp --doc-dist loguniform:256:32K --tokens 256K -- --attn mha ...
//
// The flags after "--" are sp_bench's problem flags (--model / --attn, shapes, --seq or --doc-lens, --dtype, ...).
// sp_plan itself needs no MPI; --calibrate starts kernel_bench and `mpirun -np 2 comm_bench` from sp_plan's
// directory.
#include "benchmarks/sp_plan.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cxxopts.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_common.h"
#include "benchmarks/sp_plan_dynamic.h"
#include "parallel/cp_common.h"
#include "parallel/layout.h"
#include "runtime/error.h"

namespace seqpar::bench::plan {
namespace {

// The largest --world sp_plan plans for (2^20 ranks).
constexpr int kMaxPlanWorld = 1 << 20;
// --calibrate: the timed rounds per length of every kernel_bench run, whatever --calibrate-min-time, and the most
// --calibrate-pairs.
constexpr int kCalibrateMinRounds = 3, kMaxCalibratePairs = 100;

std::filesystem::path own_dir() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::current_path() : exe.parent_path();
}

// std::system's status in words: the exit code, or the signal that ended the command.
std::string describe_status(int rc) {
  if (rc == -1) return str_cat("could not be started (", std::strerror(errno), ")");
  if (WIFEXITED(rc)) return str_cat("exited with code ", WEXITSTATUS(rc));
  if (WIFSIGNALED(rc)) return str_cat("was killed by signal ", WTERMSIG(rc), " (", strsignal(WTERMSIG(rc)), ")");
  return str_cat("ended with raw status ", rc);
}

// As root, OpenMPI's mpirun refuses to start unless both of these are set.
std::string root_mpirun_hint() {
  if (geteuid() != 0 || (std::getenv("OMPI_ALLOW_RUN_AS_ROOT") && std::getenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")))
    return "";
  return "; running as root, OpenMPI's mpirun needs `export OMPI_ALLOW_RUN_AS_ROOT=1 "
         "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`";
}

void run_or_throw(const std::string& cmd) {
  std::fprintf(stderr, "sp_plan: running %s\n", cmd.c_str());
  const int rc = std::system(cmd.c_str());
  SEQPAR_CHECK(rc == 0, "sp_plan --calibrate: `", cmd, "` ", describe_status(rc),
               cmd.rfind("mpirun", 0) == 0 ? root_mpirun_hint() : "");
}

// --calibrate's sp_bench and comm_bench runs go through mpirun, after minutes of kernel_bench: a trivial mpirun is
// tried first, so that one that cannot start is named at once.
void check_mpirun_starts() {
  const char* probe = "mpirun -np 1 true > /dev/null 2>&1";
  const int rc = std::system(probe);
  SEQPAR_CHECK(rc == 0, "sp_plan --calibrate: `mpirun -np 1 true` ", describe_status(rc),
               " (its output was discarded: run it to see why); --calibrate runs sp_bench and comm_bench through "
               "mpirun",
               root_mpirun_hint());
}

nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream in(p);
  SEQPAR_CHECK(in.good(), "sp_plan --calibrate: cannot read ", p.string());
  nlohmann::json j;
  in >> j;
  return j;
}

// "80G", "512M", "4096" (bytes): K, M, G, T suffixes are powers of 1024.
double parse_memory(const std::string& text) {
  std::size_t used = 0;
  double v = -1;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string suffix = text.substr(used);
  double mult = 1;
  if (suffix == "K" || suffix == "k")
    mult = 1024.0;
  else if (suffix == "M" || suffix == "m")
    mult = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "g")
    mult = 1024.0 * 1024 * 1024;
  else if (suffix == "T" || suffix == "t")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else
    SEQPAR_CHECK(suffix.empty(), "sp_plan: --mem-per-device ", text, ": not a size (a number with K, M, G or T)");
  SEQPAR_CHECK(used > 0 && v >= 0, "sp_plan: --mem-per-device ", text, ": not a size (a number with K, M, G or T)");
  return v * mult;
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return str_cat(a, " ", b, " ", c);
}

// This machine's profile: kernel_bench (short runs, `pairs` interleaved pairs alone and busy per kind) for the kernel
// curves and the shared-node slowdown, comm_bench at 2 ranks for the link.
DeviceProfile calibrate(int threads, double min_time, int pairs, const std::string& tmp_dir) {
  const std::filesystem::path dir = own_dir(), tmp = tmp_dir;
  // The programs it starts, from sp_plan's directory: a missing one is named before anything runs (building the
  // target sp_plan alone builds none of them).
  for (const char* program : {"kernel_bench", "sp_bench", "comm_bench"})
    SEQPAR_CHECK(std::filesystem::exists(dir / program), "sp_plan --calibrate: ", (dir / program).string(),
                 " not found: --calibrate runs kernel_bench, sp_bench and comm_bench from sp_plan's directory (build "
                 "them: cmake --build <build dir> --target kernel_bench sp_bench comm_bench)");
  check_mpirun_starts();
  std::filesystem::create_directories(tmp);
  DeviceProfile p;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  p.name = str_cat("calibrated on ", host);
  p.note = str_cat("sp_plan --calibrate, ", utc_now_iso8601(), ", commit ", git_commit(), ", load average ",
                   load_average(), ", threads ", threads, "; fp32 CPU kernels");
  struct Run {
    const char* kernel;
    const char* seqs;
    const char* extra;
    const char* factors;  // flags of one more run alone for the GDN scan's factors ("": none)
  };
  // The node's cores all busy: as many copies of each kernel_bench run at once as the node has cores for `threads`
  // each; a copy's time over the run alone is the kind's shared_node slowdown (DeviceProfile::SharedNode). On a
  // shared machine one such ratio is mostly noise, so each kind runs `pairs` interleaved pairs (the run alone, then
  // the copies together), as sp_bench --efficiency interleaves its single-rank baselines, and takes the median
  // (shared_node_slowdown); the runs alone also give the curves.
  const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int busy_copies = std::max(1, hw / threads);
  const int runs_alone = busy_copies >= 2 ? pairs : 1;
  std::string busy_note;
  // Shapes of the head sizes the comparison in docs/results.md plans (the curves are per FLOPs of a call; the
  // sequence lengths span the calls of 1 to 4 ranks).
  for (const Run& r :
       {Run{"mha", "256,512,1024,2048", "--dim 64 --hq 8 --hkv 8 --mask causal --torch-ref off", ""},
        Run{"gdn", "512,1024,2048,4096", "--heads 8 --kv-heads 4 --head-dim 64 --dim-v 64", "--gdn-maps"},
        Run{"dsa", "512,1024,2048",
            "--heads 16 --head-dim 128 --dim-v 128 --indexer-heads 8 --indexer-dim 64 --topk 256", ""}}) {
    // Every run times at least kCalibrateMinRounds rounds per length (without the square SGEMM and MHA's PyTorch
    // reference, which nothing here reads).
    const std::string shape = str_cat("--kernel ", r.kernel, " --seq ", r.seqs, " ", r.extra);
    const auto bench = [&](const std::string& json, const std::string& more = "") {
      return str_cat((dir / "kernel_bench").string(), " ", shape, more, " --threads ", threads,
                     " --warmup 1 --min-time ", min_time, " --min-rounds ", kCalibrateMinRounds, " --square 0 --json ",
                     (tmp / json).string(), " > /dev/null");
    };
    // The per-length medians of a run, forward and backward.
    const auto column = [&](const nlohmann::json& run, const char* key, std::size_t rows) {
      SEQPAR_CHECK(run["results"].size() == rows, "sp_plan --calibrate: kernel_bench ", shape, " gave ",
                   run["results"].size(), " rows in one run and ", rows, " in another");
      std::vector<double> v;
      for (const auto& row : run["results"]) v.push_back(row[key].get<double>());
      return v;
    };
    static constexpr const char* kMedianKey[2] = {"fwd_median_ms", "bwd_median_ms"};
    std::vector<nlohmann::json> alone;
    std::vector<std::vector<double>> alone_ms[2];
    std::vector<std::vector<std::vector<double>>> busy_ms[2];
    for (int i = 0; i < runs_alone; ++i) {
      const std::string name = str_cat("kernel_", r.kernel, "_alone_", i, ".json");
      run_or_throw(bench(name));
      alone.push_back(read_json(tmp / name));
      const std::size_t rows = alone[0]["results"].size();
      for (int ph = 0; ph < 2; ++ph) alone_ms[ph].push_back(column(alone.back(), kMedianKey[ph], rows));
      if (busy_copies < 2) continue;
      std::string cmd = "(";
      for (int c = 0; c < busy_copies; ++c)
        cmd += bench(str_cat("kernel_", r.kernel, "_busy_", i, "_", c, ".json")) + " & ";
      run_or_throw(cmd + "wait)");
      for (int ph = 0; ph < 2; ++ph) busy_ms[ph].emplace_back();
      for (int c = 0; c < busy_copies; ++c) {
        const nlohmann::json b = read_json(tmp / str_cat("kernel_", r.kernel, "_busy_", i, "_", c, ".json"));
        for (int ph = 0; ph < 2; ++ph) busy_ms[ph].back().push_back(column(b, kMedianKey[ph], rows));
      }
    }
    const nlohmann::json& first = alone[0];
    // The GDN scan's factors from one more run alone with --gdn-maps (its extra calls kept out of the pairs' rounds).
    std::vector<nlohmann::json> factor_runs;
    if (*r.factors) {
      const std::string name = str_cat("kernel_", r.kernel, "_factors.json");
      run_or_throw(bench(name, str_cat(" ", r.factors)));
      factor_runs.push_back(read_json(tmp / name));
    }
    KernelCurve fwd, bwd;
    fwd.source = bwd.source =
        str_cat("kernel_bench ", shape, " (median over ", runs_alone,
                " run(s) alone of each run's median of >= ", kCalibrateMinRounds, " timed rounds)");
    double map_ratio = 0, sweep_ratio = 0;
    int map_rows = 0;
    // GDN work ahead: per value-head window, the work ahead over every chunk and the call that uses it, each against
    // the window call alone (same rounds).
    double ahead_sum[4] = {0, 0, 0, 0};
    int ahead_rows = 0;
    for (const nlohmann::json& run : factor_runs) {
      for (const auto& row : run["results"]) {
        // GDN scan's extra work, timed in the same rounds as the forward: a segment's map against the forward at its
        // own FLOPs (gdn_map_flops: the factor is the map's rate relative to the forward's), the dS sweep against the
        // forward's time.
        if (row.contains("map_mean_ms") && row["fwd_mean_ms"].get<double>() > 0 && row["map_flops"].get<double>() > 0) {
          const double fms = row["fwd_mean_ms"].get<double>();
          map_ratio +=
              row["map_mean_ms"].get<double>() / fms * row["fwd_flops"].get<double>() / row["map_flops"].get<double>();
          sweep_ratio += row["sweep_mean_ms"].get<double>() / fms;
          ++map_rows;
        }
        if (row.contains("window_bwd_mean_ms") && row["window_fwd_mean_ms"].get<double>() > 0 &&
            row["window_bwd_mean_ms"].get<double>() > 0) {
          const double wf = row["window_fwd_mean_ms"].get<double>(), wb = row["window_bwd_mean_ms"].get<double>();
          ahead_sum[0] += row["ahead_fwd_mean_ms"].get<double>() / wf;
          ahead_sum[1] += row["rest_fwd_mean_ms"].get<double>() / wf;
          ahead_sum[2] += row["ahead_bwd_mean_ms"].get<double>() / wb;
          ahead_sum[3] += row["rest_bwd_mean_ms"].get<double>() / wb;
          ++ahead_rows;
        }
      }
    }
    // The curves: per length, the median over the runs alone of each run's median (sp_bench reports medians, and on
    // a loaded machine the best round is the exception and the mean follows a few slow rounds).
    for (std::size_t l = 0; l < first["results"].size(); ++l) {
      for (int ph = 0; ph < 2; ++ph) {
        std::vector<double> ms;
        for (const std::vector<double>& run_ms : alone_ms[ph]) ms.push_back(run_ms[l]);
        const double flops = first["results"][l][ph == 0 ? "fwd_flops" : "bwd_flops"].get<double>(), t = median(ms);
        if (flops > 0 && t > 0) (ph == 0 ? fwd : bwd).points.emplace_back(flops, flops / (t * 1e-3));
      }
    }
    std::sort(fwd.points.begin(), fwd.points.end());
    std::sort(bwd.points.begin(), bwd.points.end());
    if (map_rows > 0) {
      p.gdn_map_factor = map_ratio / map_rows;
      p.gdn_sweep_factor = sweep_ratio / map_rows;
      p.note += str_cat(
          "; gdn_map_factor (a map's time over its FLOPs at the forward's rate) and gdn_sweep_factor (the "
          "dS sweep over the forward) from kernel_bench --kernel gdn --gdn-maps, mean over ",
          map_rows, " lengths");
    }
    if (ahead_rows > 0) {
      DeviceProfile::GdnWorkAhead& g = p.gdn_work_ahead;
      g.fwd_ahead = ahead_sum[0] / ahead_rows;
      g.fwd_rest = ahead_sum[1] / ahead_rows;
      g.bwd_ahead = ahead_sum[2] / ahead_rows;
      g.bwd_rest = ahead_sum[3] / ahead_rows;
      g.source = str_cat("kernel_bench ", shape, " ", r.factors,
                         ": one value head's window, its work ahead over every chunk and the call that uses it, "
                         "against the window alone (means of the timed rounds), mean over ",
                         ahead_rows, " lengths");
    }
    p.kernels[str_cat(r.kernel, "_fwd")] = fwd;
    p.kernels[str_cat(r.kernel, "_bwd")] = bwd;
    if (busy_copies < 2) continue;
    for (int ph = 0; ph < 2; ++ph) {
      const std::string key = str_cat(r.kernel, ph == 0 ? "_fwd" : "_bwd");
      const SharedNodeSamples s = shared_node_slowdown(alone_ms[ph], busy_ms[ph]);
      p.shared_node.slowdown[key] = s.slowdown;
      std::string per_pair;
      for (const double m : s.pair_medians) per_pair += str_cat(per_pair.empty() ? "" : " ", m);
      busy_note += str_cat(busy_note.empty() ? "" : "; ", key, " ", s.median, " (", s.samples,
                           " samples; the pairs' medians ", per_pair, ")");
    }
  }
  if (p.shared_node.present()) {
    p.shared_node.cores_busy = busy_copies * threads;
    p.shared_node.source =
        str_cat("kernel_bench per kind as for the curves, ", pairs, " interleaved pairs of a run alone and then ",
                busy_copies, " copies of ", threads,
                " thread(s) started together: median over the pairs, copies and lengths of a copy's median time over "
                "the same pair's run alone, at least 1: ",
                busy_note);
  }
  // A decode step's attention reads its shard's K and V once (memory-bound, a few FLOPs per byte): from sp_bench
  // --mode decode at 1 rank (the prompt filled without its attention) at two cache lengths, the step's median time
  // against the cache bytes it reads gives an effective bandwidth (the slope) and a per-step overhead (the rest).
  {
    double bytes[2], secs[2];
    int i = 0;
    for (const std::int64_t ctx : {2048, 16384}) {
      const std::filesystem::path out = tmp / str_cat("decode_", ctx, ".json");
      run_or_throw(str_cat("mpirun -np 1 ", (dir / "sp_bench").string(),
                           " --mode decode --attn mha --heads 8 --kv-heads 8 --head-dim 64 --context ", ctx,
                           " --decode-steps 16 --prefill fill --threads ", threads,
                           " --warmup 1 --iters 1 --quiet --json ", out.string(), " > /dev/null"));
      secs[i] = read_json(out)["decode_step_s"]["median"].get<double>();
      bytes[i] = 2.0 * 8 * 64 * 4 * (static_cast<double>(ctx) + 8 + 1);  // K and V, fp32, at the middle step
      ++i;
    }
    SEQPAR_CHECK(secs[0] > 0 && secs[1] > secs[0], "sp_plan --calibrate: sp_bench --mode decode gave step times ",
                 secs[0], " and ", secs[1], " s at 2K and 16K tokens (the longer cache must take longer)");
    p.memory_bandwidth_bps = (bytes[1] - bytes[0]) / (secs[1] - secs[0]);
    p.decode_overhead_s = std::max(0.0, secs[0] - bytes[0] / p.memory_bandwidth_bps);
    p.device_source = str_cat(
        "sp_bench --mode decode --attn mha --heads 8 --kv-heads 8 --head-dim 64 --decode-steps "
        "16 --prefill fill at 1 rank, median step ",
        secs[0] * 1e3, " ms at context 2K and ", secs[1] * 1e3,
        " ms at 16K: bandwidth = slope over the cache bytes read, overhead = the "
        "rest");
  }
  // The cores the ranks get: one MHA kernel alone, then as many copies at once as the machine has cores; on a
  // machine shared with other work they get fewer cores than it has.
  const auto mean_fwd_ms = [&](int copies) {
    std::string cmd = "(";
    for (int i = 0; i < copies; ++i) {
      cmd +=
          str_cat((dir / "kernel_bench").string(), " --kernel mha --seq 1024 --dim 64 --hq 8 --hkv 8 --mask causal",
                  " --no-backward --threads ", threads, " --warmup 1 --min-time ", 2 * min_time, " --square 0 --json ",
                  (tmp / str_cat("cores_", copies, "_", i, ".json")).string(), " > /dev/null & ");
    }
    run_or_throw(cmd + "wait)");
    double sum = 0;
    for (int i = 0; i < copies; ++i)
      sum += read_json(tmp / str_cat("cores_", copies, "_", i, ".json"))["results"][0]["fwd_mean_ms"].get<double>();
    return sum / copies;
  };
  p.mha_tile_pairs = true;
  p.note += "; mha_tile_pairs true: the CPU MHA kernels compute whole 64 x 64 tile pairs (attention/cpu/mha_cpu.h)";
  const double alone = mean_fwd_ms(1), together = mean_fwd_ms(hw);
  p.cores_per_node = std::clamp(hw * alone / together, 1.0, static_cast<double>(hw));
  p.note += str_cat("; cores_per_node ", p.cores_per_node, " of ", hw, ": kernel_bench mha S 1024 fwd ", alone,
                    " ms alone, ", together, " ms with ", hw, " copies at once");
  const std::filesystem::path comm = tmp / "comm.json";
  run_or_throw(str_cat("mpirun -np 2 --oversubscribe ", (dir / "comm_bench").string(),
                       " --ops sendrecv --groups ring --min-bytes 1K --max-bytes 16M --factor 16 --warmup 3 "
                       "--iters 10 --json ",
                       comm.string(), " > /dev/null"));
  const nlohmann::json cj = read_json(comm);
  double b0 = -1, t0 = 0, b1 = 0, t1 = 0;
  for (const auto& row : cj["results"]) {
    if (row.value("status", "") != "ok") continue;
    const double b = row["size_bytes"].get<double>(), t = row["time_us"].get<double>() * 1e-6;
    if (b0 < 0 || b < b0) b0 = b, t0 = t;
    if (b > b1) b1 = b, t1 = t;
  }
  SEQPAR_CHECK(b0 > 0 && b1 > b0 && t1 > t0, "sp_plan --calibrate: comm_bench gave no usable sendrecv sizes");
  p.intra.bandwidth_bps = (b1 - b0) / (t1 - t0);
  p.intra.latency_s = std::max(0.0, t0 - b0 / p.intra.bandwidth_bps);
  p.intra.source = str_cat("comm_bench sendrecv at 2 ranks (ring group), ", b0, " and ", b1,
                           " bytes: latency = t(small) - small / bandwidth, bandwidth = slope");
  p.inter = p.intra;
  p.inter.source = "not measured (one node): the intra-node figures";
  return p;
}

int dynamic_cp_main(const cxxopts::ParseResult& r, const PlanInput& in, const DeviceProfile& profile) {
  DynamicInput din;
  SEQPAR_CHECK(r.count("doc-lens") + r.count("doc-dist") == 1,
               "sp_plan --dynamic-cp: give the documents by exactly one of --doc-lens and --doc-dist");
  // Flags the dynamic plan would leave unread: refused by name, not ignored.
  for (const char* f : {"configs", "no-oversubscribe"}) {
    SEQPAR_CHECK(
        !r.count(f), "sp_plan --dynamic-cp: --", f, " applies to the static ranking of configurations, not ",
        "to --dynamic-cp (its micro-batches run on rings of each of --degrees, with --mb-layout and --mb-impl)");
  }
  for (const char* f : {"tokens", "seed"}) {
    SEQPAR_CHECK(!r.count(f) || r.count("doc-dist"), "sp_plan --dynamic-cp: --", f,
                 " applies to --doc-dist only (it draws the documents); --doc-lens gives them whole");
  }
  if (r.count("doc-lens")) {
    for (const std::string& t : split_commas(r["doc-lens"].as<std::string>()))
      din.doc_lens.push_back(bench::parse_size(t, "doc-lens"));
    din.doc_source = "--doc-lens";
  } else {
    const std::string mix = r["doc-dist"].as<std::string>();
    const std::int64_t tokens = bench::parse_size(r["tokens"].as<std::string>(), "tokens");
    din.doc_lens = doc_mix(mix, tokens, r["seed"].as<std::uint64_t>());
    din.doc_source = str_cat("--doc-dist ", mix, " --tokens ", tokens, " --seed ", r["seed"].as<std::uint64_t>());
  }
  din.tokens_per_rank = bench::parse_size(r["tokens-per-rank"].as<std::string>(), "tokens-per-rank");
  if (r.count("degrees")) {
    for (const std::string& t : split_commas(r["degrees"].as<std::string>())) {
      const std::int64_t d = bench::parse_size(t, "degrees");  // range first: the cast to int used to wrap 2^32 + 2 to 2
      SEQPAR_CHECK(d >= 1 && d <= in.world_size && in.world_size % d == 0, "sp_plan --dynamic-cp: --degrees ", t,
                   ": degree ", d, " must divide the world size ", in.world_size);
      din.degrees.push_back(static_cast<int>(d));
    }
  }
  din.layout = r["mb-layout"].as<std::string>();
  din.impl = r["mb-impl"].as<std::string>();
  din.impl_given = r.count("mb-impl") > 0;
  // Named here: an unknown name used to surface as "cannot run at any degree" (each prediction refused it).
  try {
    parse_layout(din.layout);
    parse_ring_impl(din.impl);
  } catch (const Error& e) {
    SEQPAR_THROW("sp_plan --dynamic-cp: --mb-layout ", din.layout, " / --mb-impl ", din.impl, ": ", e.message());
  }
  SEQPAR_CHECK(in.mode != "decode", "sp_plan --dynamic-cp: --mode decode: the dynamic plan is of a training step ",
               "(or a prefill) over packed documents, not of a decode step");
  const DynamicResult res = plan_dynamic(in, profile, din);
  std::printf("%s", dynamic_table(in, profile, din, res).c_str());
  if (r.count("json")) {
    const nlohmann::json j = dynamic_json(in, profile, din, res);
    write_file_atomic(r["json"].as<std::string>(), [&](std::ostream& os) { os << j.dump(2) << "\n"; });
  }
  return 0;
}

int sp_plan_main(int argc, char** argv) {
  // Split at "--": sp_plan's flags before, sp_bench's problem flags after.
  int split = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      split = i;
      break;
    }
  }
  cxxopts::Options spec("sp_plan",
                        "ranks the context-parallel configurations of one layer by predicted step time; sp_bench's "
                        "problem flags follow \"--\"");
  // clang-format off
  spec.add_options()
    ("profile", "device profile JSON (sp_plan --calibrate writes one; benchmarks/profiles/ has GPU ones)", cxxopts::value<std::string>())
    ("world", "ranks (world size)", cxxopts::value<int>()->default_value("1"))
    ("nodes", "nodes", cxxopts::value<int>()->default_value("1"))
    ("devices-per-node", "ranks per node (default: --world / --nodes)", cxxopts::value<int>())
    ("mem-per-device", "memory a rank may use (K/M/G suffixes; 0: unlimited)", cxxopts::value<std::string>()->default_value("0"))
    ("mode", "train (forward + backward) | prefill (forward) | decode (one step over a sharded cache)", cxxopts::value<std::string>()->default_value("train"))
    ("layers", "layers of the model (train, prefill): the layer's time times this", cxxopts::value<int>()->default_value("1"))
    ("linear-flops-per-token", "forward FLOPs per token of each layer's linear layers (the profile's gemm curve)", cxxopts::value<double>()->default_value("0"))
    ("configs", "plan only these configurations (names as the table prints them, comma-separated)", cxxopts::value<std::vector<std::string>>())
    ("tp", "tensor parallelism inside each CP rank: splits the heads and the linear FLOPs", cxxopts::value<int>()->default_value("1"))
    ("threads", "--threads of the sp_bench runs", cxxopts::value<int>()->default_value("1"))
    ("no-oversubscribe", "exclude configurations with more ranks x threads than the profile's cores")
    ("ring-function-at-one", "a ring of one still pays the profile's ring copy passes (an implementation that runs its ring function whatever the ring size)")
    ("json", "also write the plan as JSON to FILE", cxxopts::value<std::string>())
    ("calibrate", "measure this machine's profile and write it to FILE", cxxopts::value<std::string>())
    ("calibrate-min-time", "seconds per kernel_bench configuration", cxxopts::value<double>()->default_value("0.3"))
    ("calibrate-pairs", "interleaved pairs of kernel_bench runs alone and busy per kind (the shared-node slowdown is their median)", cxxopts::value<int>()->default_value("5"))
    ("help", "print this help");
  spec.add_options("dynamic CP")
    ("dynamic-cp", "plan micro-batches of documents with a CP degree each (sp_plan_dynamic.h)")
    ("doc-lens", "the documents' lengths, comma-separated (K suffix)", cxxopts::value<std::string>())
    ("doc-dist", "documents drawn with --seed, --tokens in all: longtail | short (as sp_bench's --doc-dist) | loguniform:LO:HI", cxxopts::value<std::string>())
    ("tokens", "total tokens of --doc-dist", cxxopts::value<std::string>()->default_value("128K"))
    ("seed", "seed of --doc-dist", cxxopts::value<std::uint64_t>()->default_value("1234"))
    ("tokens-per-rank", "a micro-batch of degree d holds at most d x this many tokens (default: total / world)", cxxopts::value<std::string>()->default_value("0"))
    ("degrees", "candidate CP degrees, comma-separated (default: every divisor of --world)", cxxopts::value<std::string>())
    ("mb-layout", "sp_bench --layout of the micro-batches", cxxopts::value<std::string>()->default_value("zigzag"))
    ("mb-impl", "sp_bench --impl of the micro-batches (MHA)", cxxopts::value<std::string>()->default_value("p2p"));
  // clang-format on
  cxxopts::ParseResult r;
  try {
    r = spec.parse(split, argv);
  } catch (const std::exception& e) {
    SEQPAR_THROW("sp_plan: bad command line: ", e.what(), " (see --help)");
  }
  if (r.count("help")) {
    std::printf("%s\n", spec.help().c_str());
    return 0;
  }
  SEQPAR_CHECK(r["threads"].as<int>() >= 1, "sp_plan: --threads ", r["threads"].as<int>(), " must be >= 1");
  SEQPAR_CHECK(r["calibrate-min-time"].as<double>() > 0, "sp_plan: --calibrate-min-time ",
               r["calibrate-min-time"].as<double>(), " must be > 0 (seconds)");
  SEQPAR_CHECK(r["calibrate-pairs"].as<int>() >= 1 && r["calibrate-pairs"].as<int>() <= kMaxCalibratePairs,
               "sp_plan: --calibrate-pairs ", r["calibrate-pairs"].as<int>(), " must be in [1, ", kMaxCalibratePairs,
               "]");
  if (r.count("calibrate")) {
    const std::string out = r["calibrate"].as<std::string>();
    const DeviceProfile p = calibrate(r["threads"].as<int>(), r["calibrate-min-time"].as<double>(),
                                      r["calibrate-pairs"].as<int>(), out + ".d");
    write_file_atomic(out, [&](std::ostream& os) { os << profile_json(p).dump(2) << "\n"; });
    std::printf("# sp_plan: wrote the profile %s (%s)\n", out.c_str(), p.note.c_str());
    return 0;
  }
  SEQPAR_CHECK(r.count("profile"), "sp_plan: --profile FILE is required (or --calibrate FILE to make one)");
  SEQPAR_CHECK(split < argc,
               "sp_plan: the problem's sp_bench flags follow \"--\" (e.g. -- --model llama3-8b --seq 32K)");
  PlanInput in;
  for (int i = split + 1; i < argc; ++i) in.problem_flags.emplace_back(argv[i]);
  in.world_size = r["world"].as<int>();
  in.nodes = r["nodes"].as<int>();
  // The plan enumerates the divisors of --world and builds a layout over each ring size: bounded, so that a huge
  // value is refused at once (INT_MAX used to overflow the divisor loop into a division by zero).
  SEQPAR_CHECK(in.world_size >= 1 && in.world_size <= kMaxPlanWorld, "sp_plan: --world ", in.world_size,
               " must be in [1, ", kMaxPlanWorld, "]");
  SEQPAR_CHECK(in.nodes >= 1 && in.world_size % in.nodes == 0, "sp_plan: --world ", in.world_size,
               " must be a multiple of --nodes ", in.nodes);
  in.devices_per_node = r.count("devices-per-node") ? r["devices-per-node"].as<int>() : in.world_size / in.nodes;
  in.memory_per_device = parse_memory(r["mem-per-device"].as<std::string>());
  in.mode = r["mode"].as<std::string>();
  in.threads = r["threads"].as<int>();
  if (std::string(argv[0]).find('/') != std::string::npos)
    in.sp_bench = (std::filesystem::path(argv[0]).parent_path() / "sp_bench").string();
  in.layers = r["layers"].as<int>();
  in.linear_flops_per_token = r["linear-flops-per-token"].as<double>();
  in.tp = r["tp"].as<int>();
  in.ring_function_at_one = r.count("ring-function-at-one") > 0;
  if (r.count("configs")) in.only_configs = r["configs"].as<std::vector<std::string>>();
  in.oversubscribed_ok = !r.count("no-oversubscribe");
  const DeviceProfile profile = load_profile(r["profile"].as<std::string>());
  if (r.count("dynamic-cp")) return dynamic_cp_main(r, in, profile);
  for (const char* f : {"doc-lens", "doc-dist", "tokens", "seed", "tokens-per-rank", "degrees", "mb-layout", "mb-impl"}) {
    SEQPAR_CHECK(!r.count(f), "sp_plan: --", f, " before \"--\" is a --dynamic-cp flag (without --dynamic-cp, a packed ",
                 "row is given after \"--\" as sp_bench's --doc-lens / --doc-dist)");
  }
  const std::vector<PlanRow> rows = plan(in, profile);
  std::printf("%s", plan_table(in, profile, rows).c_str());
  if (r.count("json")) {
    const nlohmann::json j = plan_json(in, profile, rows);
    write_file_atomic(r["json"].as<std::string>(), [&](std::ostream& os) { os << j.dump(2) << "\n"; });
  }
  // Nothing feasible is a failed plan, not an empty table with exit status 0 (a script would read no first choice).
  const bool any = std::any_of(rows.begin(), rows.end(), [](const PlanRow& row) { return row.excluded.empty(); });
  SEQPAR_CHECK(any, "sp_plan: no configuration of this problem fits at --world ", in.world_size,
               ": every one is excluded (the reasons are listed above)");
  return 0;
}

}  // namespace
}  // namespace seqpar::bench::plan

int main(int argc, char** argv) {
  try {
    return seqpar::bench::plan::sp_plan_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
