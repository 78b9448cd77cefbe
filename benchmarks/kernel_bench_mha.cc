// kernel_bench --kernel mha: the CPU MHA / GQA forward and backward (attention/mha.h).
//
// FLOP convention (docs/benchmarks.md, "Definitions of the benchmark figures"): forward 4 B Hq Sq Sk D, halved for causal with Sq = Sk; backward 2.5 x forward.
// Besides the square SGEMM, the table has a per-head SGEMM reference: the two GEMMs that an unfused attention head
// would run, C1[S, S] = Q[S, D] K[S, D]^T and C2[S, D] = P[S, S] V[S, D], with S capped at --gemm-cap (memory of the
// [S, S] matrix); GFLOP/s = 2 (M N K) summed over both, over their summed time (sgemm_GF/s), and the kernel's ratios
// to it (fwd/gemm, bwd/gemm). Those shapes have one small dimension (D), so the square SGEMM is the peak-like one.
#include <cblas.h>

#include <cstdio>
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

}  // namespace

void add_mha_options(cxxopts::Options& opts) {
  opts.add_options("mha")("dim", "head dims D", cxxopts::value<std::vector<std::int64_t>>()->default_value("64,128"))(
      "mask", "none, causal or both", cxxopts::value<std::string>()->default_value("both"))(
      "batch", "batch size B", cxxopts::value<std::int64_t>()->default_value("1"))(
      "hq", "query heads", cxxopts::value<std::int64_t>()->default_value("8"))(
      "hkv", "kv heads", cxxopts::value<std::int64_t>()->default_value("2"))(
      "gemm-cap", "largest S of the per-head SGEMM reference", cxxopts::value<std::int64_t>()->default_value("8192"));
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

  std::printf("#\n# mha: MHA / GQA, B=%lld Hq=%lld Hkv=%lld\n", static_cast<long long>(B), static_cast<long long>(Hq),
              static_cast<long long>(Hkv));
  std::printf("# FLOPs: fwd 4*B*Hq*S*S*D (x0.5 causal), bwd 2.5x fwd; SGEMM: QK^T + PV of one head, S capped at %lld\n",
              static_cast<long long>(gemm_cap));
  std::printf("%7s %5s %7s", "S", "D", "mask");
  print_rate_header();
  std::printf(" %11s %9s %9s\n", "sgemm_GF/s", "fwd/gemm", "bwd/gemm");
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
        const std::vector<Timing> t =
            time_rounds({[&] { attn::mha_forward(a, out, lse); },
                         [&] {
                           if (ctx.backward)
                             attn::mha_backward(attn::MhaBackwardArgs{a, out, dout, lse, {}}, dq, dk, dv, false);
                         },
                         [&] { gemms.qk(); }, [&] { gemms.pv(); }},
                        ctx.warmup, ctx.min_time, r.rounds);
        r.fwd = t[0];
        r.bwd = t[1];
        const double gemm = gemms.flops() / (t[2].best + t[3].best) / 1e9;
        std::printf("%7lld %5lld %7s", static_cast<long long>(S), static_cast<long long>(D),
                    causal ? "causal" : "none");
        print_rate_values(ctx, r);
        std::printf(" %11.1f %9.2f %9.2f\n", gemm, r.fwd_gflops() / gemm, r.bwd_gflops() / gemm);
        std::fflush(stdout);
        nlohmann::json row =
            rate_json(ctx, "mha", {{"S", S}, {"D", D}, {"causal", causal}, {"B", B}, {"Hq", Hq}, {"Hkv", Hkv}}, r);
        row["sgemm_gflops"] = gemm;
        row["fwd_ratio"] = r.fwd_gflops() / gemm;
        row["bwd_ratio"] = r.bwd_gflops() / gemm;
        results.push_back(std::move(row));
      }
    }
  }
  return results;
}

}  // namespace seqpar::bench::kernel
