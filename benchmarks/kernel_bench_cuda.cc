// kernel_bench --device cuda: MHA / GQA forward and backward on a CUDA device (attention/mha.h on device tensors:
// cuDNN's SDPA graphs, or the cuBLAS fallback) next to a cuBLAS bf16 GEMM timed in the same rounds.
//
// Inputs bf16 [B, S, H, D], outputs bf16, lse fp32. FLOPs as the CPU table (docs/benchmarks.md, "Definitions of the
// benchmark figures"): forward 4 B Hq S S D (x0.5 causal), backward 2.5 x forward. The reference is a square
// cublasGemmEx of --square n (default 8192 here) in bf16 with fp32 accumulation, 2 n^3 FLOPs; every round times
// forward, backward and the GEMM once each with CUDA events on one stream, so that all three see the same clocks
// and load; the table reports the fastest of each and the ratios fwd/gemm, bwd/gemm (goals on Hopper at S >= 4K:
// 0.6 and 0.45).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <vector>

#include "attention/mha.h"
#include "benchmarks/bench_common.h"
#include "benchmarks/cuda_gemm_ref.h"
#include "benchmarks/kernel_bench.h"
#include "runtime/cuda_check.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"
#include "runtime/version.h"

namespace seqpar::bench::kernel {
namespace {

constexpr MemCategory kWs = MemCategory::kWorkspace;

}  // namespace

int run_mha_cuda(const cxxopts::ParseResult& args, Device device) {
  SEQPAR_CHECK_CUDA(cudaSetDevice(device.index));
  const bool quick = args.count("quick") > 0;
  std::vector<std::int64_t> seqs = args.count("seq") ? args["seq"].as<std::vector<std::int64_t>>()
                                   : quick           ? std::vector<std::int64_t>{1024}
                                                     : std::vector<std::int64_t>{4096, 16384, 65536};
  const std::vector<std::int64_t> dims =
      args.count("dim") ? args["dim"].as<std::vector<std::int64_t>>() : std::vector<std::int64_t>{128};
  const std::string mask_arg = args["mask"].as<std::string>();
  SEQPAR_CHECK(mask_arg == "none" || mask_arg == "causal" || mask_arg == "both", "--mask ", mask_arg,
               " must be none, causal or both");
  const std::int64_t B = args["batch"].as<std::int64_t>(), Hq = args["hq"].as<std::int64_t>(),
                     Hkv = args["hkv"].as<std::int64_t>();
  const int warmup = args["warmup"].as<int>();
  const double min_time = quick ? 0.2 : args["min-time"].as<double>();
  const bool backward = !args.count("no-backward");
  std::int64_t square = args["square"].as<std::int64_t>();
  if (!args.count("square")) square = 8192;
  SEQPAR_CHECK(warmup >= 0, "--warmup ", warmup, " must be >= 0");
  SEQPAR_CHECK(square > 0, "--square ", square, " must be > 0 with --device cuda (the GEMM reference)");

  cudaDeviceProp prop{};
  SEQPAR_CHECK_CUDA(cudaGetDeviceProperties(&prop, device.index));
  std::printf("# seqpar kernel_bench %s\n", seqpar::version());
  std::printf("# kernel_bench: mha on %s (%s, sm_%d%d), bf16, B=%lld Hq=%lld Hkv=%lld\n", device.str().c_str(),
              prop.name, prop.major, prop.minor, static_cast<long long>(B), static_cast<long long>(Hq),
              static_cast<long long>(Hkv));
  std::printf(
      "# reference: cuBLAS bf16 GEMM %lld^3 (fp32 accumulation) timed in every round; fwd/gemm, bwd/gemm: "
      "attention TFLOP/s over its TFLOP/s\n",
      static_cast<long long>(square));
  std::printf(
      "# timing: %d warm-up round(s), then rounds of (fwd, bwd, gemm) with CUDA events for >= %.2f s; "
      "fastest call\n",
      warmup, min_time);
  std::printf("%7s %5s %7s %10s %10s %10s %10s %10s %9s %9s\n", "S", "D", "mask", "fwd_ms", "fwd_TF/s", "bwd_ms",
              "bwd_TF/s", "gemm_TF/s", "fwd/gemm", "bwd/gemm");

  cudaStream_t stream = nullptr;
  SEQPAR_CHECK_CUDA(cudaStreamCreate(&stream));
  const Stream st{device, stream};
  nlohmann::json results = nlohmann::json::array();
  {
    CudaEventTimer timer(stream);
    SquareBf16Gemm gemm(square, device, stream);
    for (const std::int64_t D : dims) {
      for (const std::int64_t S : seqs) {
        for (const bool causal : {false, true}) {
          if ((causal && mask_arg == "none") || (!causal && mask_arg == "causal")) continue;
          auto host = [&](const Shape& s, std::uint32_t seed) {
            Tensor h = Tensor::empty(s, DType::kFloat32, kWs);
            fill(h, seed);
            Tensor d = Tensor::empty(s, DType::kBFloat16, kWs, device);
            Tensor hb = Tensor::empty(s, DType::kBFloat16, kWs);
            copy_convert(h.view(), hb.view());
            copy_convert(hb.view(), d.view(), st);
            return d;
          };
          const Tensor q = host({B, S, Hq, D}, 1), k = host({B, S, Hkv, D}, 2), v = host({B, S, Hkv, D}, 3),
                       dout = host({B, S, Hq, D}, 4);
          Tensor out = Tensor::empty(q.shape(), DType::kBFloat16, kWs, device);
          Tensor lse = Tensor::empty({B, Hq, S}, DType::kFloat32, kWs, device);
          Tensor dq = Tensor::empty(q.shape(), DType::kBFloat16, kWs, device);
          Tensor dk = Tensor::empty(k.shape(), DType::kBFloat16, kWs, device);
          Tensor dv = Tensor::empty(k.shape(), DType::kBFloat16, kWs, device);
          attn::MhaForwardArgs a;
          a.q = q;
          a.k = k;
          a.v = v;
          a.mask = attn::MaskSpec(causal);
          attn::MhaBackwardArgs b;
          b.fwd = a;
          b.out = out;
          b.dout = dout;
          b.lse = lse;
          const std::function<void()> fwd = [&] { attn::mha_forward(a, out, lse, st); };
          const std::function<void()> bwd = [&] { attn::mha_backward(b, dq, dk, dv, false, st); };
          const std::function<void()> gem = [&] { gemm.run(); };
          for (int w = 0; w < warmup; ++w) {
            fwd();
            if (backward) bwd();
            gem();
          }
          double t_fwd = 1e300, t_bwd = 1e300, t_gemm = 1e300;
          int rounds = 0;
          const auto t0 = std::chrono::steady_clock::now();
          do {
            t_fwd = std::min(t_fwd, timer.time(fwd));
            if (backward) t_bwd = std::min(t_bwd, timer.time(bwd));
            t_gemm = std::min(t_gemm, timer.time(gem));
            ++rounds;
          } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < min_time);
          const double fwd_flops = 4.0 * B * Hq * static_cast<double>(S) * S * D * (causal ? 0.5 : 1.0);
          const double bwd_flops = 2.5 * fwd_flops;
          const double fwd_tf = fwd_flops / t_fwd / 1e12, gemm_tf = gemm.flops() / t_gemm / 1e12;
          const double bwd_tf = backward ? bwd_flops / t_bwd / 1e12 : 0.0;
          std::printf("%7lld %5lld %7s %10.3f %10.1f %10.3f %10.1f %10.1f %9.2f %9.2f\n", static_cast<long long>(S),
                      static_cast<long long>(D), causal ? "causal" : "none", t_fwd * 1e3, fwd_tf,
                      backward ? t_bwd * 1e3 : 0.0, bwd_tf, gemm_tf, fwd_tf / gemm_tf, bwd_tf / gemm_tf);
          std::fflush(stdout);
          results.push_back({{"kernel", "mha"},
                             {"device", device.str()},
                             {"dtype", "bf16"},
                             {"batch", B},
                             {"hq", Hq},
                             {"hkv", Hkv},
                             {"seq", S},
                             {"head_dim", D},
                             {"causal", causal},
                             {"rounds", rounds},
                             {"fwd_ms", t_fwd * 1e3},
                             {"fwd_tflops", fwd_tf},
                             {"bwd_ms", backward ? t_bwd * 1e3 : 0.0},
                             {"bwd_tflops", bwd_tf},
                             {"gemm_n", square},
                             {"gemm_tflops", gemm_tf},
                             {"fwd_ratio_gemm", fwd_tf / gemm_tf},
                             {"bwd_ratio_gemm", bwd_tf / gemm_tf}});
        }
      }
    }
  }
  SEQPAR_CHECK_CUDA(cudaStreamDestroy(stream));
  if (args.count("json")) {
    const nlohmann::json j{{"benchmark", "kernel_bench"},
                           {"version", seqpar::version()},
                           {"device", device.str()},
                           {"device_name", prop.name},
                           {"results", results}};
    write_file_atomic(args["json"].as<std::string>(), [&](std::ostream& os) { os << j.dump(2) << "\n"; });
  }
  return 0;
}

}  // namespace seqpar::bench::kernel
