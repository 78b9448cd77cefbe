// kernel_bench: GFLOP/s of the single-device CPU kernels next to OpenBLAS SGEMM, measured in the same run with the
// same thread count. --kernel mha|dsa|gdn|all picks the tables (kernel_bench.h; one file per kind):
//   mha  flash-attention forward / backward (attention/mha.h), GQA, causal and not       kernel_bench_mha.cc
//   dsa  indexer + top-k + sparse latent attention forward; attention backward + indexer loss / backward
//        (attention/dsa.h), DeepSeek-V3.2 shapes with --heads 16, top-k 512             kernel_bench_dsa.cc
//   gdn  chunked gated delta rule forward / backward (attention/gdn.h), Qwen3-Next shapes with 8 value heads
//                                                                                         kernel_bench_gdn.cc
// FLOPs are the model FLOPs of docs/benchmarks.md, "Definitions of the benchmark figures" (benchmarks/flop_models.h for
// DSA and GDN, as sp_bench counts them). The square SGEMM (--square, default 2048^3) is measured once at the start;
// every row reports the kernel's ratios to it (fwd/sq, bwd/sq).
//
// OpenBLAS picks its kernels from the CPU id; on CPUs newer than the library (e.g. OpenBLAS 0.3.21 on Emerald
// Rapids) it falls back to generic SSE kernels. The header prints the core OpenBLAS chose; run with
// OPENBLAS_CORETYPE=SkylakeX (AVX-512) or Haswell (AVX2) for a fair reference.
//
// Timing: per configuration, rounds of (forward, backward, and the kind's references), one call each, interleaved
// so that kernel and SGEMM see the same machine load; --warmup untimed rounds, then rounds until --min-time seconds
// have passed (at least one). The table uses the fastest call of each kind (the machine may be shared, and the
// fastest call is the most reproducible figure); the JSON output also has the means. --clock cpu times the calls in
// CPU time of the process (the sum over its threads, idle OpenMP workers that spin included): with --threads 1 that
// is the time the call ran on a core, which other processes on a shared machine do not inflate as they do the wall
// time (they still share the caches).
// Usage: kernel_bench [--kernel mha|dsa|gdn|all] [--quick | --long] [--seq 1024,4096] [--threads N] [--json out.json]
//   (kind options: --help)
#include "benchmarks/kernel_bench.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "benchmarks/bench_common.h"
#include "benchmarks/bench_device.h"
#include "benchmarks/json_path.h"
#include "runtime/error.h"
#include "runtime/version.h"

extern "C" {
// OpenBLAS extensions (declared in its cblas.h for most builds; repeated here for the others).
void openblas_set_num_threads(int num_threads);
char* openblas_get_config(void);
char* openblas_get_corename(void);
}

namespace seqpar::bench::kernel {

using Clock = std::chrono::steady_clock;

namespace {
bool cpu_clock = false;  // --clock cpu
int min_rounds = 1;      // --min-rounds
// Seconds on the chosen clock (wall: steady_clock; cpu: CPU time of the process), from an arbitrary origin.
double clock_seconds() {
  if (cpu_clock) {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}
}  // namespace

bool Context::cpu_time() const { return cpu_clock; }

namespace {
// The ranges of the numeric flags of every kind, checked before anything runs (a negative size used to reach a
// std::vector, --threads 100000 OpenBLAS, --seq 0 a table of nan). Sizes whose help says "0: default" may be 0.
void check_numeric_flags(const cxxopts::ParseResult& args) {
  const auto in_range = [&args](const char* name, std::int64_t lo, std::int64_t hi) {
    if (!args.count(name)) return;
    const std::int64_t v = args[name].as<std::int64_t>();
    SEQPAR_CHECK(v >= lo && v <= hi, "--", name, " ", v, " must be in [", lo, ", ", hi, "]");
  };
  constexpr std::int64_t kBig = std::int64_t{1} << 40;
  if (args.count("seq")) {
    for (const std::int64_t s : args["seq"].as<std::vector<std::int64_t>>())
      SEQPAR_CHECK(s >= 1 && s <= kBig, "--seq ", s, " must be in [1, ", kBig, "]");
  }
  if (args.count("dim")) {
    for (const std::int64_t d : args["dim"].as<std::vector<std::int64_t>>())
      SEQPAR_CHECK(d >= 1 && d <= 4096, "--dim ", d, " must be in [1, 4096]");
  }
  const int threads = args["threads"].as<int>();
  SEQPAR_CHECK(threads >= 0 && threads <= 1024, "--threads ", threads, " must be in [0, 1024] (0: OpenMP's default)");
  const double min_time = args["min-time"].as<double>();
  SEQPAR_CHECK(std::isfinite(min_time) && min_time >= 0, "--min-time ", min_time,
               " must be a finite number >= 0 (0: --min-rounds rounds)");
  SEQPAR_CHECK(!args.count("quick") || !args.count("min-time"), "--quick sets --min-time 0.2: pass one of them");
  // --square n: three n x n fp32 matrices and an int n for cblas (10^8 ended in a bare std::bad_alloc; 2^40 overflowed
  // n * n): at most 32768 (12 GiB, 7e13 FLOPs a round).
  in_range("square", 0, 32768);  // 0: skip
  in_range("gemm-cap", 0, kBig);  // 0: no cap
  for (const char* name : {"batch", "hq", "hkv", "topk", "indexer-heads", "indexer-dim", "chunk-size"})
    in_range(name, 1, kBig);
  for (const char* name : {"heads", "head-dim", "dim-v", "kv-heads"}) in_range(name, 0, kBig);  // 0: the default
}

// A shape flag of a kind that does not run is refused, naming the kind's own: MHA's shapes are --hq, --hkv and --dim,
// and --heads, --kv-heads, --head-dim (sp_bench's names) are DSA's and GDN's (`--kernel mha --heads 32 --head-dim 128`
// used to time the default 8 heads at D 64 and 128 without a word).
void check_flags_of_kinds(const cxxopts::ParseResult& args, const std::string& which) {
  const auto runs = [&which](const char* kind) { return which == "all" || which == kind; };
  struct Flag {
    const char* name;
    const char* kinds;  // the kinds that read it
    bool mha, dsa, gdn;
  };
  for (const Flag& f :
       {Flag{"dim", "mha", true, false, false}, Flag{"mask", "mha", true, false, false},
        Flag{"batch", "mha", true, false, false}, Flag{"hq", "mha", true, false, false},
        Flag{"hkv", "mha", true, false, false}, Flag{"gemm-cap", "mha", true, false, false},
        Flag{"torch-ref", "mha", true, false, false}, Flag{"python", "mha", true, false, false},
        Flag{"heads", "dsa and gdn", false, true, true}, Flag{"head-dim", "dsa and gdn", false, true, true},
        Flag{"dim-v", "dsa and gdn", false, true, true}, Flag{"topk", "dsa", false, true, false},
        Flag{"indexer-heads", "dsa", false, true, false}, Flag{"indexer-dim", "dsa", false, true, false},
        Flag{"kv-heads", "gdn", false, false, true}, Flag{"chunk-size", "gdn", false, false, true},
        Flag{"gdn-maps", "gdn", false, false, true}}) {
    if (!args.count(f.name) || (f.mha && runs("mha")) || (f.dsa && runs("dsa")) || (f.gdn && runs("gdn"))) continue;
    SEQPAR_CHECK(false, "--", f.name, " is read by --kernel ", f.kinds, " only, not by --kernel ", which,
                 runs("mha") ? " (MHA's shapes: --hq, --hkv, --dim, --batch)" : "");
  }
}
}  // namespace

std::vector<std::int64_t> Context::seqs(const std::vector<std::int64_t>& fallback,
                                        const std::vector<std::int64_t>& long_seqs,
                                        const std::vector<std::int64_t>& quick_seqs) const {
  if (args->count("seq")) return (*args)["seq"].as<std::vector<std::int64_t>>();
  if (quick) return quick_seqs;
  std::vector<std::int64_t> s = fallback;
  if (args->count("long")) s.insert(s.end(), long_seqs.begin(), long_seqs.end());
  return s;
}

std::int64_t Context::size_or(const char* name, std::int64_t fallback) const {
  const std::int64_t v = (*args)[name].as<std::int64_t>();
  return v > 0 ? v : fallback;
}

std::vector<Timing> time_rounds(const std::vector<std::function<void()>>& fns, int warmup, double min_time,
                                int& rounds) {
  for (int w = 0; w < warmup; ++w) {
    for (const auto& fn : fns) fn();
  }
  std::vector<Timing> t(fns.size(), Timing{1e300, 0.0, 0.0});
  std::vector<std::vector<double>> samples(fns.size());
  rounds = 0;
  const auto t0 = Clock::now();
  do {
    for (std::size_t i = 0; i < fns.size(); ++i) {
      const double c0 = clock_seconds();
      fns[i]();
      const double sec = clock_seconds() - c0;
      t[i].best = std::min(t[i].best, sec);
      t[i].mean += sec;
      samples[i].push_back(sec);
    }
    ++rounds;
  } while (std::chrono::duration<double>(Clock::now() - t0).count() < min_time || rounds < min_rounds);
  for (std::size_t i = 0; i < t.size(); ++i) {
    t[i].mean /= rounds;
    t[i].median = median_of(samples[i]);
  }
  return t;
}

double median_of(std::vector<double> x) {
  if (x.empty()) return 0.0;
  std::sort(x.begin(), x.end());
  const std::size_t n = x.size();
  return n % 2 == 1 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

void fill(const Tensor& t, std::uint32_t seed, float lo, float hi) {
  float* p = t.data_as<float>();
  std::uint32_t s = seed * 2654435761u + 1u;
  const std::int64_t n = t.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    p[i] = lo + static_cast<float>(s >> 8) * (1.0f / 16777216.0f) * (hi - lo);
  }
}

void print_rate_header() {
  std::printf(" %11s %10s %11s %10s %8s %8s", "fwd_ms", "fwd_GF/s", "bwd_ms", "bwd_GF/s", "fwd/sq", "bwd/sq");
}

namespace {
double ratio(double gflops, double ref) { return ref > 0 ? gflops / ref : 0.0; }
}  // namespace

void print_rate_values(const Context& ctx, const RateColumns& r) {
  std::printf(" %11.2f %10.1f %11.2f %10.1f %8.2f %8.2f", r.fwd.best * 1e3, r.fwd_gflops(), r.bwd.best * 1e3,
              r.bwd_gflops(), ratio(r.fwd_gflops(), ctx.square_gflops), ratio(r.bwd_gflops(), ctx.square_gflops));
}

nlohmann::json rate_json(const Context& ctx, const char* kind, nlohmann::json shape, const RateColumns& r) {
  nlohmann::json j = std::move(shape);
  j["kernel"] = kind;
  j["threads"] = ctx.threads;
  j["rounds"] = r.rounds;
  j["fwd_ms"] = r.fwd.best * 1e3;
  j["fwd_mean_ms"] = r.fwd.mean * 1e3;
  j["fwd_median_ms"] = r.fwd.median * 1e3;
  j["fwd_flops"] = r.fwd_flops;
  j["fwd_gflops"] = r.fwd_gflops();
  j["bwd_ms"] = r.bwd.best * 1e3;
  j["bwd_mean_ms"] = r.bwd.mean * 1e3;
  j["bwd_median_ms"] = r.bwd.median * 1e3;
  j["bwd_flops"] = r.bwd_flops;
  j["bwd_gflops"] = r.bwd_gflops();
  j["square_sgemm_gflops"] = ctx.square_gflops;
  j["fwd_ratio_square"] = ratio(r.fwd_gflops(), ctx.square_gflops);
  j["bwd_ratio_square"] = ratio(r.bwd_gflops(), ctx.square_gflops);
  return j;
}

namespace {

double square_sgemm_gflops(std::int64_t n, int warmup, double min_time) {
  std::vector<float> a(static_cast<std::size_t>(n * n), 0.5f), b(a.size(), 0.25f), c(a.size());
  const int m = static_cast<int>(n);
  int rounds = 0;
  const Timing t = time_rounds({[&] {
                                 cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.0f, a.data(), m,
                                             b.data(), m, 0.0f, c.data(), m);
                               }},
                               warmup, min_time, rounds)[0];
  return 2.0 * static_cast<double>(n) * n * n / t.best / 1e9;
}

struct Kind {
  const char* name;
  nlohmann::json (*run)(const Context&);
};
constexpr Kind kKinds[] = {{"mha", run_mha}, {"dsa", run_dsa}, {"gdn", run_gdn}};

int run(int argc, char** argv) {
  cxxopts::Options opts("kernel_bench", "CPU MHA / DSA / GDN forward and backward GFLOP/s vs OpenBLAS SGEMM");
  opts.add_options()("kernel", "mha, dsa, gdn or all", cxxopts::value<std::string>()->default_value("mha"))(
      "seq", "sequence lengths (default per kind: mha 1024,4096; dsa 4096; gdn 8192)",
      cxxopts::value<std::vector<std::int64_t>>())("long", "also the long lengths: mha 16384, dsa 16384, gdn 32768")(
      "threads", "threads for the kernels and OpenBLAS (0: OpenMP default)", cxxopts::value<int>()->default_value("0"))(
      "warmup", "untimed rounds before timing", cxxopts::value<int>()->default_value("1"))(
      "min-time", "seconds of timed rounds per configuration", cxxopts::value<double>()->default_value("1.0"))(
      "square", "size n of the square SGEMM reference (0: skip)",
      cxxopts::value<std::int64_t>()->default_value("2048"))("no-backward", "forward only")(
      "quick", "small shapes per kind (mha S 1024, dsa S 1024, gdn S 2048), min-time 0.2 s")(
      "json", "also write the results as JSON to this file", cxxopts::value<std::string>())(
      "clock", "wall, or cpu: CPU time of the process (for a shared machine; meaningful with --threads 1)",
      cxxopts::value<std::string>()->default_value("wall"))(
      "min-rounds", "at least this many timed rounds per configuration, whatever --min-time",
      cxxopts::value<int>()->default_value("1"))(
      "device", "cpu, or cuda[:N] (mha only: the CUDA MHA against a cuBLAS bf16 GEMM timed in the same run; "
                "kernel_bench_cuda.cc)",
      cxxopts::value<std::string>()->default_value("cpu"))("h,help", "this help")("version", "print the version and exit");
  // Shapes shared by dsa and gdn (sp_bench's names); 0 takes the kind's default.
  opts.add_options("dsa / gdn")("heads", "DSA query heads H (default 16) / GDN value heads Hv (default 8)",
                                cxxopts::value<std::int64_t>()->default_value("0"))(
      "head-dim", "DSA latent width Dqk (default 576) / GDN key dim K (default 128)",
      cxxopts::value<std::int64_t>()->default_value("0"))(
      "dim-v", "DSA value width Dv (default 512) / GDN value dim V (default 128)",
      cxxopts::value<std::int64_t>()->default_value("0"));
  add_mha_options(opts);
  add_dsa_options(opts);
  add_gdn_options(opts);
  const auto args = opts.parse(argc, argv);
  if (args.count("help")) {
    std::cout << opts.help() << "\n";
    return 0;
  }
  if (args.count("version")) {
    std::printf("kernel_bench (seqpar) %s\n", seqpar::version());
    return 0;
  }
  const std::string which = args["kernel"].as<std::string>();
  [[maybe_unused]] const Device device = parse_bench_device(args["device"].as<std::string>());
#if defined(SEQPAR_WITH_CUDA)
  if (device.is_cuda()) {
    SEQPAR_CHECK(which == "mha", "--kernel ", which, " with --device ", device.str(),
                 ": only mha has a CUDA path (dsa and gdn run on the CPU)");
    return run_mha_cuda(args, device);
  }
#endif
  std::vector<const Kind*> kinds;
  for (const Kind& k : kKinds) {
    if (which == "all" || which == k.name) kinds.push_back(&k);
  }
  SEQPAR_CHECK(!kinds.empty(), "--kernel ", which, " must be mha, dsa, gdn or all");
  check_flags_of_kinds(args, which);
  check_numeric_flags(args);
  Context ctx;
  ctx.args = &args;
  ctx.quick = args.count("quick") > 0;
  ctx.min_time = ctx.quick ? 0.2 : args["min-time"].as<double>();
  ctx.warmup = args["warmup"].as<int>();
  ctx.backward = !args.count("no-backward");
  SEQPAR_CHECK(ctx.warmup >= 0, "--warmup ", ctx.warmup, " must be >= 0");
  const std::string clock = args["clock"].as<std::string>();
  SEQPAR_CHECK(clock == "wall" || clock == "cpu", "--clock ", clock, " must be wall or cpu");
  cpu_clock = clock == "cpu";
  min_rounds = args["min-rounds"].as<int>();
  SEQPAR_CHECK(min_rounds >= 1, "--min-rounds ", min_rounds, " must be >= 1");
  if (args.count("json")) check_json_path(args["json"].as<std::string>());
  int threads = args["threads"].as<int>();
#if defined(_OPENMP)
  if (threads > 0) omp_set_num_threads(threads);
  threads = omp_get_max_threads();
#else
  threads = 1;
#endif
  openblas_set_num_threads(threads);
  ctx.threads = threads;

  std::printf("# seqpar kernel_bench %s\n", seqpar::version());
  std::printf("# kernel_bench: %s on CPU, fp32, threads=%d\n", which.c_str(), threads);
  std::printf("# OpenBLAS: %s (core %s)\n", openblas_get_config(), openblas_get_corename());
  std::printf(
      "# timing: %d warm-up round(s), then interleaved rounds (fwd, bwd, references) for >= %.2f s (%s time); "
      "fastest call\n",
      ctx.warmup, ctx.min_time, cpu_clock ? "process CPU" : "wall");
  {
    // the machine may be shared: the load average puts the figures in context
    std::ifstream load("/proc/loadavg");
    std::string l1, l5, l15;
    if (load >> l1 >> l5 >> l15)
      std::printf("# load average at start: %s %s %s\n", l1.c_str(), l5.c_str(), l15.c_str());
  }
  const std::int64_t square = args["square"].as<std::int64_t>();
  ctx.square_gflops = square > 0 ? square_sgemm_gflops(square, ctx.warmup, ctx.min_time) : 0.0;
  if (square > 0) {
    std::printf("# square SGEMM %lld^3: %.1f GFLOP/s (fwd/sq, bwd/sq: kernel GFLOP/s over it)\n",
                static_cast<long long>(square), ctx.square_gflops);
  }
  nlohmann::json results = nlohmann::json::array();
  for (const Kind* k : kinds) {
    for (auto& row : k->run(ctx)) results.push_back(std::move(row));
  }
  if (args.count("json")) {
    const nlohmann::json j{{"benchmark", "kernel_bench"},
                           {"version", seqpar::version()},
                           {"kernel", which},
                           {"threads", threads},
                           {"openblas", openblas_get_config()},
                           {"openblas_core", openblas_get_corename()},
                           {"square_n", square},
                           {"square_sgemm_gflops", ctx.square_gflops},
                           {"warmup", ctx.warmup},
                           {"min_time_s", ctx.min_time},
                           {"clock", clock},
                           {"results", results}};
    write_file_atomic(args["json"].as<std::string>(), [&](std::ostream& os) { os << j.dump(2) << "\n"; });
  }
  return 0;
}

}  // namespace
}  // namespace seqpar::bench::kernel

int main(int argc, char** argv) {
  try {
    return seqpar::bench::kernel::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kernel_bench: %s\n", e.what());
    return 1;
  }
}
