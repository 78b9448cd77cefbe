// kernel_bench: GFLOP/s of the CPU MHA / GQA forward and backward (attention/mha.h) next to OpenBLAS SGEMM,
// measured in the same run with the same thread count.
//
// FLOP convention (README): forward 4 B Hq Sq Sk D, halved for causal with Sq = Sk; backward 2.5 x forward.
// SGEMM reference: the two GEMMs that an unfused attention head would run, C1[S, S] = Q[S, D] K[S, D]^T and
// C2[S, D] = P[S, S] V[S, D], with S capped at --gemm-cap (memory of the [S, S] matrix); GFLOP/s = 2 (M N K) summed
// over both, over their summed time. Ratios are kernel GFLOP/s / SGEMM GFLOP/s. Because those shapes have one
// small dimension (D), the run also measures a square SGEMM (--square, default 2048^3) once, as a peak-like
// reference, and prints the kernel's ratios to it as well (fwd/sq, bwd/sq).
//
// OpenBLAS picks its kernels from the CPU id; on CPUs newer than the library (e.g. OpenBLAS 0.3.21 on Emerald
// Rapids) it falls back to generic SSE kernels. The header prints the core OpenBLAS chose; run with
// OPENBLAS_CORETYPE=SkylakeX (AVX-512) or Haswell (AVX2) for a fair reference.
//
// Timing: per configuration, rounds of (forward, backward, SGEMM C1, SGEMM C2), one call each, interleaved so that
// kernel and SGEMM see the same machine load; --warmup untimed rounds, then rounds until --min-time seconds have
// passed (at least one). The table uses the fastest call of each kind (the machine may be shared, and the fastest
// call is the most reproducible figure); the JSON output also has the means.
// Usage: kernel_bench [--quick] [--seq 1024,4096] [--dim 64,128] [--mask both] [--batch 1 --hq 8 --hkv 2]
//   [--threads N] [--json out.json]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cxxopts.hpp>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "attention/mha.h"
#include "runtime/error.h"
#include "runtime/tensor.h"
#include "runtime/version.h"

extern "C" {
// OpenBLAS extensions (declared in its cblas.h for most builds; repeated here for the others).
void openblas_set_num_threads(int num_threads);
char* openblas_get_config(void);
char* openblas_get_corename(void);
}

namespace {

using namespace seqpar;
using Clock = std::chrono::steady_clock;

struct Timing {
  double best = 0.0;  // seconds of the fastest timed call
  double mean = 0.0;  // mean seconds per timed call
};

// Runs fn until min_time seconds have passed (at least once) after `warmup` untimed calls.
template <typename Fn>
Timing time_it(Fn&& fn, int warmup, double min_time) {
  for (int i = 0; i < warmup; ++i) fn();
  int n = 0;
  Timing t;
  t.best = 1e300;
  const auto t0 = Clock::now();
  double elapsed = 0.0;
  do {
    const auto c0 = Clock::now();
    fn();
    t.best = std::min(t.best, std::chrono::duration<double>(Clock::now() - c0).count());
    ++n;
    elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (elapsed < min_time);
  t.mean = elapsed / n;
  return t;
}

void fill(const Tensor& t, std::uint32_t seed) {
  float* p = t.data_as<float>();
  std::uint32_t s = seed * 2654435761u + 1u;
  const std::int64_t n = t.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    p[i] = static_cast<float>(s >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
  }
}

double square_sgemm_gflops(std::int64_t n, int warmup, double min_time) {
  std::vector<float> a(static_cast<std::size_t>(n * n), 0.5f), b(a.size(), 0.25f), c(a.size());
  const int m = static_cast<int>(n);
  const Timing t = time_it(
      [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.0f, a.data(), m, b.data(), m, 0.0f, c.data(),
                    m);
      },
      warmup, min_time);
  return 2.0 * static_cast<double>(n) * n * n / t.best / 1e9;
}

// The two GEMMs of one unfused attention head, C1[S, S] = Q K^T and C2[S, D] = P V, on buffers owned here.
class HeadGemms {
 public:
  HeadGemms(std::int64_t S, std::int64_t D)
      : s_(static_cast<int>(S)),
        d_(static_cast<int>(D)),
        q_(static_cast<std::size_t>(S * D), 0.5f),
        k_(q_.size(), 0.25f),
        v_(q_.size(), 0.125f),
        p_(static_cast<std::size_t>(S * S), 1e-3f),
        o_(q_.size()) {}
  void qk() {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s_, s_, d_, 1.0f, q_.data(), d_, k_.data(), d_, 0.0f,
                p_.data(), s_);
  }
  void pv() {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s_, d_, s_, 1.0f, p_.data(), s_, v_.data(), d_, 0.0f,
                o_.data(), d_);
  }
  double flops() const { return 2.0 * 2.0 * static_cast<double>(s_) * s_ * d_; }

 private:
  int s_, d_;
  std::vector<float> q_, k_, v_, p_, o_;
};

// Seconds of one call of fn.
template <typename Fn>
double seconds(Fn&& fn) {
  const auto c0 = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - c0).count();
}

int run(int argc, char** argv) {
  cxxopts::Options opts("kernel_bench", "CPU MHA / GQA forward and backward GFLOP/s vs OpenBLAS SGEMM");
  opts.add_options()("seq", "sequence lengths Sq = Sk",
                     cxxopts::value<std::vector<std::int64_t>>()->default_value("1024,4096,16384"))(
      "dim", "head dims", cxxopts::value<std::vector<std::int64_t>>()->default_value("64,128"))(
      "mask", "none, causal or both", cxxopts::value<std::string>()->default_value("both"))(
      "batch", "batch size B", cxxopts::value<std::int64_t>()->default_value("1"))(
      "hq", "query heads", cxxopts::value<std::int64_t>()->default_value("8"))(
      "hkv", "kv heads", cxxopts::value<std::int64_t>()->default_value("2"))(
      "threads", "threads for the kernels and OpenBLAS (0: OpenMP default)", cxxopts::value<int>()->default_value("0"))(
      "warmup", "untimed calls before timing", cxxopts::value<int>()->default_value("1"))(
      "min-time", "seconds of timed calls per measurement", cxxopts::value<double>()->default_value("1.0"))(
      "gemm-cap", "largest S of the SGEMM reference", cxxopts::value<std::int64_t>()->default_value("8192"))(
      "square", "size n of the square SGEMM reference (0: skip)",
      cxxopts::value<std::int64_t>()->default_value("2048"))("no-backward", "forward only")(
      "quick", "S = 1024 only, min-time 0.2 s")("json", "also write the results as JSON to this file",
                                                cxxopts::value<std::string>())("h,help", "this help")(
      "version", "print the version and exit");
  const auto args = opts.parse(argc, argv);
  if (args.count("help")) {
    std::cout << opts.help() << "\n";
    return 0;
  }
  if (args.count("version")) {
    std::printf("kernel_bench (seqpar) %s\n", seqpar::version());
    return 0;
  }
  std::vector<std::int64_t> seqs = args["seq"].as<std::vector<std::int64_t>>();
  const std::vector<std::int64_t> dims = args["dim"].as<std::vector<std::int64_t>>();
  double min_time = args["min-time"].as<double>();
  if (args.count("quick")) {
    seqs = {1024};
    min_time = 0.2;
  }
  const std::string mask_arg = args["mask"].as<std::string>();
  SEQPAR_CHECK(mask_arg == "none" || mask_arg == "causal" || mask_arg == "both", "--mask ", mask_arg,
               " must be none, causal or both");
  std::vector<bool> causals;
  if (mask_arg != "causal") causals.push_back(false);
  if (mask_arg != "none") causals.push_back(true);
  const std::int64_t B = args["batch"].as<std::int64_t>(), Hq = args["hq"].as<std::int64_t>();
  const std::int64_t Hkv = args["hkv"].as<std::int64_t>();
  const int warmup = args["warmup"].as<int>();
  const bool backward = !args.count("no-backward");
  int threads = args["threads"].as<int>();
#if defined(_OPENMP)
  if (threads > 0) omp_set_num_threads(threads);
  threads = omp_get_max_threads();
#else
  threads = 1;
#endif
  openblas_set_num_threads(threads);

  std::printf("# seqpar kernel_bench %s\n", seqpar::version());
  std::printf("# kernel_bench: MHA / GQA on CPU, fp32, B=%lld Hq=%lld Hkv=%lld, threads=%d\n",
              static_cast<long long>(B), static_cast<long long>(Hq), static_cast<long long>(Hkv), threads);
  std::printf("# OpenBLAS: %s (core %s)\n", openblas_get_config(), openblas_get_corename());
  std::printf("# FLOPs: fwd 4*B*Hq*S*S*D (x0.5 causal), bwd 2.5x fwd; SGEMM: QK^T + PV of one head, S capped at %lld\n",
              static_cast<long long>(args["gemm-cap"].as<std::int64_t>()));
  std::printf("# timing: %d warm-up round(s), then interleaved rounds (fwd, bwd, SGEMM) for >= %.2f s; fastest call\n",
              warmup, min_time);
  {
    // the machine may be shared: the load average puts the figures in context
    std::ifstream load("/proc/loadavg");
    std::string l1, l5, l15;
    if (load >> l1 >> l5 >> l15)
      std::printf("# load average at start: %s %s %s\n", l1.c_str(), l5.c_str(), l15.c_str());
  }
  const std::int64_t square = args["square"].as<std::int64_t>();
  const double sq_gf = square > 0 ? square_sgemm_gflops(square, warmup, min_time) : 0.0;
  if (square > 0) {
    std::printf("# square SGEMM %lld^3: %.1f GFLOP/s\n", static_cast<long long>(square), sq_gf);
  }
  std::printf("%7s %5s %7s %11s %10s %11s %10s %11s %9s %9s %8s %8s\n", "S", "D", "mask", "fwd_ms", "fwd_GF/s",
              "bwd_ms", "bwd_GF/s", "sgemm_GF/s", "fwd/gemm", "bwd/gemm", "fwd/sq", "bwd/sq");
  nlohmann::json results = nlohmann::json::array();
  for (std::int64_t D : dims) {
    for (std::int64_t S : seqs) {
      HeadGemms gemms(std::min(S, args["gemm-cap"].as<std::int64_t>()), D);
      const MemCategory ws = MemCategory::kWorkspace;
      Tensor q = Tensor::empty({B, S, Hq, D}, DType::kFloat32, ws),
             dout = Tensor::empty({B, S, Hq, D}, DType::kFloat32, ws);
      Tensor k = Tensor::empty({B, S, Hkv, D}, DType::kFloat32, ws),
             v = Tensor::empty({B, S, Hkv, D}, DType::kFloat32, ws);
      fill(q, 1);
      fill(k, 2);
      fill(v, 3);
      fill(dout, 4);
      Tensor out = Tensor::empty(q.shape(), DType::kFloat32, ws), lse = Tensor::empty({B, Hq, S}, DType::kFloat32, ws);
      Tensor dq = Tensor::empty(q.shape(), DType::kFloat32, ws);
      Tensor dk = Tensor::empty(k.shape(), DType::kFloat32, ws), dv = Tensor::empty(k.shape(), DType::kFloat32, ws);
      for (bool causal : causals) {
        const attn::MhaForwardArgs a{q, k, v, {}, {}, attn::MaskSpec{causal, 0}, 0.0f};
        const double fwd_flops = 4.0 * B * Hq * static_cast<double>(S) * S * D * (causal ? 0.5 : 1.0);
        auto fwd = [&] { attn::mha_forward(a, out, lse); };
        auto bwd = [&] {
          if (backward) attn::mha_backward(attn::MhaBackwardArgs{a, out, dout, lse, {}}, dq, dk, dv, false);
        };
        for (int w = 0; w < warmup; ++w) {
          fwd();
          bwd();
          gemms.qk();
          gemms.pv();
        }
        Timing tf, tb, tqk, tpv;
        tf.best = tb.best = tqk.best = tpv.best = 1e300;
        int rounds = 0;
        const auto t0 = Clock::now();
        do {
          for (auto [t, fn] : {std::pair<Timing*, std::function<void()>>{&tf, fwd},
                               {&tb, bwd},
                               {&tqk, [&] { gemms.qk(); }},
                               {&tpv, [&] { gemms.pv(); }}}) {
            const double sec = seconds(fn);
            t->best = std::min(t->best, sec);
            t->mean += sec;
          }
          ++rounds;
        } while (std::chrono::duration<double>(Clock::now() - t0).count() < min_time);
        for (Timing* t : {&tf, &tb, &tqk, &tpv}) t->mean /= rounds;
        const double gemm = gemms.flops() / (tqk.best + tpv.best) / 1e9;
        const double t_fwd = tf.best, t_bwd = tb.best;
        const double gf_fwd = fwd_flops / t_fwd / 1e9;
        const double gf_bwd = backward ? 2.5 * fwd_flops / t_bwd / 1e9 : 0.0;
        const double fwd_sq = sq_gf > 0 ? gf_fwd / sq_gf : 0.0, bwd_sq = sq_gf > 0 ? gf_bwd / sq_gf : 0.0;
        std::printf("%7lld %5lld %7s %11.2f %10.1f %11.2f %10.1f %11.1f %9.2f %9.2f %8.2f %8.2f\n",
                    static_cast<long long>(S), static_cast<long long>(D), causal ? "causal" : "none", t_fwd * 1e3,
                    gf_fwd, t_bwd * 1e3, gf_bwd, gemm, gf_fwd / gemm, gf_bwd / gemm, fwd_sq, bwd_sq);
        std::fflush(stdout);
        results.push_back({{"S", S},
                           {"D", D},
                           {"causal", causal},
                           {"B", B},
                           {"Hq", Hq},
                           {"Hkv", Hkv},
                           {"threads", threads},
                           {"fwd_ms", t_fwd * 1e3},
                           {"fwd_mean_ms", tf.mean * 1e3},
                           {"bwd_mean_ms", tb.mean * 1e3},
                           {"fwd_gflops", gf_fwd},
                           {"bwd_ms", t_bwd * 1e3},
                           {"bwd_gflops", gf_bwd},
                           {"sgemm_gflops", gemm},
                           {"rounds", rounds},
                           {"fwd_ratio", gf_fwd / gemm},
                           {"bwd_ratio", gf_bwd / gemm},
                           {"square_sgemm_gflops", sq_gf},
                           {"fwd_ratio_square", fwd_sq},
                           {"bwd_ratio_square", bwd_sq}});
      }
    }
  }
  if (args.count("json")) {
    std::ofstream f(args["json"].as<std::string>());
    SEQPAR_CHECK(f.good(), "cannot write --json file ", args["json"].as<std::string>());
    f << nlohmann::json{{"benchmark", "kernel_bench"},
                        {"version", seqpar::version()},
                        {"openblas", openblas_get_config()},
                        {"openblas_core", openblas_get_corename()},
                        {"results", results}}
             .dump(2)
      << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kernel_bench: %s\n", e.what());
    return 1;
  }
}
