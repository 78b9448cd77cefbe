// kernel_bench --kernel mha: the CPU MHA / GQA forward and backward (attention/mha.h).
//
// FLOP convention (docs/benchmarks.md, "Definitions of the benchmark figures"): forward 4 B Hq Sq Sk D, halved for
// causal with Sq = Sk; backward 2.5 x forward. Besides the square SGEMM, the table has a per-head SGEMM reference: the
// two GEMMs that an unfused attention head would run, C1[S, S] = Q[S, D] K[S, D]^T and C2[S, D] = P[S, S] V[S, D], with
// S capped at --gemm-cap (memory of the [S, S] matrix); GFLOP/s = 2 (M N K) summed over both, over their summed time
// (sgemm_GF/s), and the kernel's ratios to it (fwd/gemm, bwd/gemm). Those shapes have one small dimension (D), so the
// square SGEMM is the peak-like one.
//
// PyTorch reference (--torch-ref auto, the default): when python3 can import torch, benchmarks/torch_flash_ref.py
// runs as a co-process and times PyTorch's CPU flash-attention forward and backward (the FLASH_ATTENTION backend of
// scaled_dot_product_attention) on the same shapes, with the same thread count, one call per round interleaved with
// seqpar's calls; the script times its own calls (on the same clock, wall or CPU), so the pipe adds nothing. Columns
// torch/fwd and torch/bwd: PyTorch's fastest time over seqpar's (> 1: seqpar is faster); the JSON has both times
// (torch_fwd_ms, torch_bwd_ms) and their medians. The script's path is the source tree's (compiled in).
#include <cblas.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "attention/mha.h"
#include "benchmarks/kernel_bench.h"
#include "runtime/error.h"

namespace seqpar::bench::kernel {
namespace {

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

// PyTorch's CPU flash kernels in a python3 co-process (benchmarks/torch_flash_ref.py's line protocol). available()
// is false when python3 or torch is missing; the table then has no reference columns.
class TorchRef {
 public:
  TorchRef(const std::string& python, const std::string& script, int threads, bool cpu_time) {
    signal(SIGPIPE, SIG_IGN);  // a co-process that died must not take kernel_bench with it
    std::fflush(stdout);       // nothing buffered may be duplicated into the child
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0) return;
    if (pipe(from_child) != 0) {
      close(to_child[0]);
      close(to_child[1]);
      return;
    }
    pid_ = fork();
    if (pid_ == 0) {
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      close(to_child[0]);
      close(to_child[1]);
      close(from_child[0]);
      close(from_child[1]);
      execlp(python.c_str(), python.c_str(), script.c_str(), static_cast<char*>(nullptr));
      const char msg[] = "unavailable cannot run the python interpreter\n";
      if (write(1, msg, sizeof msg - 1) < 0) _exit(126);
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    if (pid_ < 0) {
      close(to_child[1]);
      close(from_child[0]);
      return;
    }
    in_ = fdopen(to_child[1], "w");
    out_ = fdopen(from_child[0], "r");
    const std::string hello = reply();
    if (hello.rfind("ready", 0) != 0) {
      note_ = hello.empty() ? "no reply from " + script : hello;
      return;
    }
    note_ = hello.substr(6);
    ok_ = request("threads " + std::to_string(threads)) == "ok" &&
          request(std::string("clock ") + (cpu_time ? "cpu" : "wall")) == "ok";
  }
  ~TorchRef() {
    if (in_ != nullptr) {
      std::fputs("quit\n", in_);
      std::fclose(in_);
    }
    if (out_ != nullptr) std::fclose(out_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }
  bool available() const { return ok_; }
  const std::string& note() const { return note_; }  // torch's version, or why there is no reference
  bool setup(std::int64_t B, std::int64_t S, std::int64_t Hq, std::int64_t Hkv, std::int64_t D, bool causal) {
    char line[160];
    std::snprintf(line, sizeof line, "setup %lld %lld %lld %lld %lld %d 7", static_cast<long long>(B),
                  static_cast<long long>(S), static_cast<long long>(Hq), static_cast<long long>(Hkv),
                  static_cast<long long>(D), causal ? 1 : 0);
    ok_ = ok_ && request(line) == "ok";
    return ok_;
  }
  // One call ("fwd" or "bwd"), its seconds as timed by the script (0 after a failure).
  double call(const char* what) {
    if (!ok_) return 0.0;
    const std::string r = request(what);
    char* end = nullptr;
    const double sec = std::strtod(r.c_str(), &end);
    if (end == r.c_str()) ok_ = false;
    return ok_ ? sec : 0.0;
  }

 private:
  std::string reply() {
    char buf[512];
    if (out_ == nullptr || std::fgets(buf, sizeof buf, out_) == nullptr) return "";
    std::string r(buf);
    while (!r.empty() && (r.back() == '\n' || r.back() == '\r')) r.pop_back();
    return r;
  }
  std::string request(const std::string& line) {
    if (in_ == nullptr) return "";
    std::fputs((line + "\n").c_str(), in_);
    std::fflush(in_);
    return reply();
  }
  pid_t pid_ = -1;
  FILE* in_ = nullptr;
  FILE* out_ = nullptr;
  bool ok_ = false;
  std::string note_ = "not started";
};

// Fastest, mean and median of the seconds a co-process reported.
Timing timing_of(const std::vector<double>& secs) {
  Timing t{0.0, 0.0, 0.0};
  if (secs.empty()) return t;
  t.best = *std::min_element(secs.begin(), secs.end());
  for (double x : secs) t.mean += x;
  t.mean /= static_cast<double>(secs.size());
  t.median = median_of(secs);
  return t;
}

}  // namespace

void add_mha_options(cxxopts::Options& opts) {
  opts.add_options("mha")("dim", "head dims D", cxxopts::value<std::vector<std::int64_t>>()->default_value("64,128"))(
      "mask", "none, causal or both", cxxopts::value<std::string>()->default_value("both"))(
      "batch", "batch size B", cxxopts::value<std::int64_t>()->default_value("1"))(
      "hq", "query heads", cxxopts::value<std::int64_t>()->default_value("8"))(
      "hkv", "kv heads", cxxopts::value<std::int64_t>()->default_value("2"))(
      "gemm-cap", "largest S of the per-head SGEMM reference", cxxopts::value<std::int64_t>()->default_value("8192"))(
      "torch-ref", "PyTorch CPU flash reference rows: auto (when python3 imports torch) or off",
      cxxopts::value<std::string>()->default_value("auto"))("python", "the python interpreter of the PyTorch reference",
                                                            cxxopts::value<std::string>()->default_value("python3"));
}

nlohmann::json run_mha(const Context& ctx) {
  const cxxopts::ParseResult& args = *ctx.args;
  const std::vector<std::int64_t> seqs = ctx.seqs({1024, 4096}, {16384}, {1024});
  const std::vector<std::int64_t> dims = args["dim"].as<std::vector<std::int64_t>>();
  const std::string mask_arg = args["mask"].as<std::string>();
  SEQPAR_CHECK(mask_arg == "none" || mask_arg == "causal" || mask_arg == "both", "--mask ", mask_arg,
               " must be none, causal or both");
  std::vector<bool> causals;
  if (mask_arg != "causal") causals.push_back(false);
  if (mask_arg != "none") causals.push_back(true);
  const std::int64_t B = args["batch"].as<std::int64_t>(), Hq = args["hq"].as<std::int64_t>();
  const std::int64_t Hkv = args["hkv"].as<std::int64_t>(), gemm_cap = args["gemm-cap"].as<std::int64_t>();
  const std::string torch_arg = args["torch-ref"].as<std::string>();
  SEQPAR_CHECK(torch_arg == "auto" || torch_arg == "off", "--torch-ref ", torch_arg, " must be auto or off");
  std::unique_ptr<TorchRef> torch;
  if (torch_arg == "auto") {
    torch = std::make_unique<TorchRef>(args["python"].as<std::string>(), SEQPAR_TORCH_FLASH_REF_SCRIPT, ctx.threads,
                                       ctx.cpu_time());
    std::printf("# PyTorch CPU flash reference: %s%s\n",
                torch->available() ? "torch " : "none: ", torch->note().c_str());
  }

  std::printf("#\n# mha: MHA / GQA, B=%lld Hq=%lld Hkv=%lld\n", static_cast<long long>(B), static_cast<long long>(Hq),
              static_cast<long long>(Hkv));
  std::printf("# FLOPs: fwd 4*B*Hq*S*S*D (x0.5 causal), bwd 2.5x fwd; SGEMM: QK^T + PV of one head, S capped at %lld\n",
              static_cast<long long>(gemm_cap));
  std::printf("%7s %5s %7s", "S", "D", "mask");
  print_rate_header();
  std::printf(" %11s %9s %9s %9s %9s\n", "sgemm_GF/s", "fwd/gemm", "bwd/gemm", "torch/fwd", "torch/bwd");
  nlohmann::json results = nlohmann::json::array();
  for (std::int64_t D : dims) {
    for (std::int64_t S : seqs) {
      HeadGemms gemms(std::min(S, gemm_cap), D);
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
        RateColumns r;
        r.fwd_flops = 4.0 * B * Hq * static_cast<double>(S) * S * D * (causal ? 0.5 : 1.0);
        r.bwd_flops = ctx.backward ? 2.5 * r.fwd_flops : 0.0;
        const bool with_torch = torch && torch->available() && torch->setup(B, S, Hq, Hkv, D, causal);
        std::vector<double> torch_fwd, torch_bwd;  // seconds per call, as the co-process timed them
        const std::vector<Timing> t =
            time_rounds({[&] { attn::mha_forward(a, out, lse); },
                         [&] {
                           if (ctx.backward)
                             attn::mha_backward(attn::MhaBackwardArgs{a, out, dout, lse, {}}, dq, dk, dv, false);
                         },
                         [&] { gemms.qk(); }, [&] { gemms.pv(); },
                         [&] {
                           if (with_torch) torch_fwd.push_back(torch->call("fwd"));
                           if (with_torch && ctx.backward) torch_bwd.push_back(torch->call("bwd"));
                         }},
                        ctx.warmup, ctx.min_time, r.rounds);
        // the warm-up rounds' calls are not timings
        const std::size_t skip = static_cast<std::size_t>(ctx.warmup);
        if (torch_fwd.size() > skip) torch_fwd.erase(torch_fwd.begin(), torch_fwd.begin() + static_cast<long>(skip));
        if (torch_bwd.size() > skip) torch_bwd.erase(torch_bwd.begin(), torch_bwd.begin() + static_cast<long>(skip));
        const bool torch_ok = with_torch && torch->available();
        const Timing tf = timing_of(torch_fwd), tb = timing_of(torch_bwd);
        r.fwd = t[0];
        r.bwd = t[1];
        const double gemm = gemms.flops() / (t[2].best + t[3].best) / 1e9;
        const double gemm_median = gemms.flops() / (t[2].median + t[3].median) / 1e9;
        std::printf("%7lld %5lld %7s", static_cast<long long>(S), static_cast<long long>(D),
                    causal ? "causal" : "none");
        print_rate_values(ctx, r);
        std::printf(" %11.1f %9.2f %9.2f", gemm, r.fwd_gflops() / gemm, r.bwd_gflops() / gemm);
        if (torch_ok) {
          std::printf(" %9.2f %9.2f\n", tf.best / r.fwd.best, r.bwd.best > 0 ? tb.best / r.bwd.best : 0.0);
        } else {
          std::printf(" %9s %9s\n", "-", "-");
        }
        std::fflush(stdout);
        nlohmann::json row =
            rate_json(ctx, "mha", {{"S", S}, {"D", D}, {"causal", causal}, {"B", B}, {"Hq", Hq}, {"Hkv", Hkv}}, r);
        row["sgemm_gflops"] = gemm;
        row["fwd_ratio"] = r.fwd_gflops() / gemm;
        row["bwd_ratio"] = r.bwd_gflops() / gemm;
        row["sgemm_median_gflops"] = gemm_median;
        row["fwd_ratio_median"] = r.fwd_flops / r.fwd.median / 1e9 / gemm_median;
        if (ctx.backward) row["bwd_ratio_median"] = r.bwd_flops / r.bwd.median / 1e9 / gemm_median;
        if (torch_ok) {
          row["torch_fwd_ms"] = tf.best * 1e3;
          row["torch_fwd_mean_ms"] = tf.mean * 1e3;
          row["torch_fwd_median_ms"] = tf.median * 1e3;
          row["fwd_vs_torch"] = tf.best / r.fwd.best;
          row["fwd_vs_torch_median"] = tf.median / r.fwd.median;
          if (ctx.backward) {
            row["torch_bwd_ms"] = tb.best * 1e3;
            row["torch_bwd_mean_ms"] = tb.mean * 1e3;
            row["torch_bwd_median_ms"] = tb.median * 1e3;
            row["bwd_vs_torch"] = tb.best / r.bwd.best;
            row["bwd_vs_torch_median"] = tb.median / r.bwd.median;
          }
        }
        results.push_back(std::move(row));
      }
    }
  }
  return results;
}

}  // namespace seqpar::bench::kernel
