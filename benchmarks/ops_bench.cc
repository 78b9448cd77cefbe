// ops_bench: the GDN forward and the DSA stages composed from an ops table (attention/ops/gdn_composed.h,
// dsa_composed.h), fp32, on the CPU table (--table cpu) or the CUDA table of device 0 (--table cuda,
// attention/cuda/ops_cuda.h). Batch 1, random inputs.
//   gdn: gdn_forward_composed, then gdn_backward_composed on the same inputs (dout random, every gradient written,
//        no dfinal_state), at Qwen3-Next's shapes (defaults S 8192, a comma list with --gdn-seq; Hv 32 value heads
//        on Hk 16 key heads, K = V = 128, chunk 64), q and k L2-normalised, zero initial state, final state written.
//   dsa: the two stages separately: dsa_indexer_topk_composed (indexer logits over every key, ReLU, weighted head
//        sum, top-k per query over its causal candidates) and dsa_attention_forward_composed on the selection
//        (defaults S 4096, H 16, Dqk 576, Dv 512, Hi 64, Di 128, k 2048).
// The composed entry points take host tensors: a call uploads its inputs and downloads its outputs through the
// table. "io ms" times that part alone (the host-side fp32 copies of the inputs, upload, download of the outputs'
// bytes) so that the device's share is about total - io. A square fp32 GEMM through the same table (--square) is
// timed first, and every row gives its model FLOP rate as a fraction of that GEMM's ("of_gemm"). Times: median of the
// timed rounds (--warmup untimed rounds first; rounds until --min-time seconds, at least 3). Model FLOPs:
// benchmarks/flop_models.h (the DSA indexer counted over the causal pairs, as sp_bench does; the composition computes
// every pair of the rectangle; the GDN backward 2.5 x the forward). Each DSA stage is also set against its floor,
// max(its model FLOPs at the square GEMM's rate, its bytes at the memory bandwidth): bytes = inputs read once +
// outputs written once (fp32 tensors, int64 top-k indices); the bandwidth is --mem-bw GB/s, or (default) measured by
// a device-to-device copy of --copy-mb through the table (read + write counted), or with --mem-bw 0 not measured
// (the floor is then the FLOP floor alone, and the output says so). "of_floor" = floor / time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cxxopts.hpp>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "attention/cuda/ops_cuda.h"
#include "attention/ops/dsa_composed.h"
#include "attention/ops/gdn_composed.h"
#include "attention/ops/ops_cpu.h"
#include "benchmarks/bench_common.h"
#include "benchmarks/flop_models.h"
#include "benchmarks/json_path.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/tensor.h"

namespace seqpar::bench::ops_bench {
namespace {

using attn::ops::Buffer;
using attn::ops::Ops;

struct Timer {
  int warmup = 1;
  double min_time = 0.5;
  // Median seconds of fn over the timed rounds.
  double median(const std::function<void()>& fn) const {
    for (int i = 0; i < warmup; ++i) fn();
    std::vector<double> t;
    double total = 0.0;
    while (t.size() < 3 || total < min_time) {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      total += t.back();
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

Tensor random_tensor(const Shape& shape, std::uint32_t seed, float lo, float hi) {
  Tensor t = Tensor::empty(shape, DType::kFloat32);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  float* p = t.data_as<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = u(rng);
  return t;
}

// The host side of a composed call alone: fp32 copies of the inputs uploaded, then the outputs' bytes downloaded.
double io_seconds(Ops<float>& ops, const std::vector<const Tensor*>& in, std::size_t out_bytes, const Timer& timer) {
  std::size_t in_bytes = 0;
  for (const Tensor* t : in) in_bytes = std::max(in_bytes, t->nbytes());
  Buffer<char> dev(ops, static_cast<std::int64_t>(std::max(in_bytes, out_bytes)));
  std::vector<char> host(std::max(in_bytes, out_bytes));
  return timer.median([&] {
    for (const Tensor* t : in) {
      const std::vector<float> copy(t->data_as<float>(), t->data_as<float>() + t->numel());
      ops.upload(dev.get(), copy.data(), t->nbytes());
    }
    ops.download(host.data(), dev.get(), out_bytes);
  });
}

// Model FLOP/s of a square fp32 GEMM [n, n] x [n, n] through the table (a 4-byte download waits for it).
double gemm_rate(Ops<float>& ops, std::int64_t n, const Timer& timer) {
  const Buffer<float> a(ops, std::vector<float>(static_cast<std::size_t>(n * n), 0.5f)),
      b(ops, std::vector<float>(static_cast<std::size_t>(n * n), 0.25f));
  Buffer<float> c(ops, n * n);
  float sink = 0.0f;
  const double t = timer.median([&] {
    ops.gemm(attn::ops::Trans::kN, attn::ops::Trans::kN, n, n, n, 1.0f, {a.get(), n}, {b.get(), n}, 0.0f, {c.get(), n},
             {});
    ops.download(&sink, c.get(), sizeof sink);
  });
  const double rate = 2.0 * double(n) * double(n) * double(n) / t;
  std::printf("# square fp32 GEMM %lld^3 through the table: %.3f ms, %.4g TFLOP/s\n", static_cast<long long>(n),
              t * 1e3, rate * 1e-12);
  return rate;
}

nlohmann::json run_gdn(Ops<float>& ops, const cxxopts::ParseResult& a, const Timer& timer, double gemm) {
  const std::int64_t Hv = a["heads"].as<std::int64_t>(), Hk = a["kv-heads"].as<std::int64_t>();
  const std::int64_t K = a["head-dim"].as<std::int64_t>(), V = a["dim-v"].as<std::int64_t>();
  const std::int64_t C = a["chunk-size"].as<std::int64_t>();
  std::printf(
      "#\n# gdn: gdn_forward_composed and gdn_backward_composed (every gradient, dout random), fp32, B=1 Hv=%lld "
      "Hk=%lld K=%lld V=%lld chunk=%lld, qk L2 norm\n",
      static_cast<long long>(Hv), static_cast<long long>(Hk), static_cast<long long>(K), static_cast<long long>(V),
      static_cast<long long>(C));
  std::printf("# model FLOPs: forward S*Hv*(6*C*K + 4*C*V + 6*K*V), backward 2.5 x the forward\n");
  std::printf("%7s %4s %4s %5s %5s %5s %10s %10s %10s %10s %10s %8s %10s %8s\n", "S", "Hv", "Hk", "K", "V", "C",
              "fwd_ms", "fwd_io_ms", "bwd_ms", "bwd_io_ms", "fwd_TF/s", "fwd_gemm", "bwd_TF/s", "bwd_gemm");
  nlohmann::json rows = nlohmann::json::array();
  for (const std::int64_t S : a["gdn-seq"].as<std::vector<std::int64_t>>()) {
    const Tensor q = random_tensor({1, S, Hk, K}, 1, -1, 1), k = random_tensor({1, S, Hk, K}, 2, -1, 1),
                 v = random_tensor({1, S, Hv, V}, 3, -1, 1), g = random_tensor({1, S, Hv}, 4, -0.2f, -0.01f),
                 beta = random_tensor({1, S, Hv}, 5, 0.05f, 0.95f), dout = random_tensor({1, S, Hv, V}, 6, -1, 1);
    Tensor out = Tensor::empty({1, S, Hv, V}, DType::kFloat32), fin = Tensor::empty({1, Hv, K, V}, DType::kFloat32);
    const attn::GdnForwardArgs args{q, k, v, g, beta, {}, true, 0.0f, C};
    const double t = timer.median([&] { attn::ops::gdn_forward_composed(ops, args, out, fin); });
    const double io = io_seconds(ops, {&q, &k, &v, &g, &beta}, out.nbytes() + fin.nbytes(), timer);
    Tensor dq = Tensor::empty({1, S, Hk, K}, DType::kFloat32), dk = Tensor::empty({1, S, Hk, K}, DType::kFloat32),
           dv = Tensor::empty({1, S, Hv, V}, DType::kFloat32), dg = Tensor::empty({1, S, Hv}, DType::kFloat32),
           dbeta = Tensor::empty({1, S, Hv}, DType::kFloat32), dh0 = Tensor::empty({1, Hv, K, V}, DType::kFloat32);
    const attn::GdnBackwardArgs bargs{args, dout, {}};
    const double tb = timer.median([&] { attn::ops::gdn_backward_composed(ops, bargs, dq, dk, dv, dg, dbeta, dh0); });
    const double iob =
        io_seconds(ops, {&q, &k, &v, &g, &beta, &dout},
                   dq.nbytes() + dk.nbytes() + dv.nbytes() + dg.nbytes() + dbeta.nbytes() + dh0.nbytes(), timer);
    const GdnFlopShape fs{1, S, Hv, K, V, C, 0, 0};
    const double flops = gdn_forward_flops(fs), bflops = gdn_backward_flops(fs);
    std::printf("%7lld %4lld %4lld %5lld %5lld %5lld %10.3f %10.3f %10.3f %10.3f %10.4g %8.3f %10.4g %8.3f\n",
                static_cast<long long>(S), static_cast<long long>(Hv), static_cast<long long>(Hk),
                static_cast<long long>(K), static_cast<long long>(V), static_cast<long long>(C), t * 1e3, io * 1e3,
                tb * 1e3, iob * 1e3, flops / t * 1e-12, flops / t / gemm, bflops / tb * 1e-12, bflops / tb / gemm);
    std::fflush(stdout);
    rows.push_back({{"kernel", "gdn"},
                    {"S", S},
                    {"Hv", Hv},
                    {"Hk", Hk},
                    {"K", K},
                    {"V", V},
                    {"chunk_size", C},
                    {"fwd_ms", t * 1e3},
                    {"io_ms", io * 1e3},
                    {"model_tflops", flops / t * 1e-12},
                    {"of_gemm", flops / t / gemm},
                    {"bwd_ms", tb * 1e3},
                    {"bwd_io_ms", iob * 1e3},
                    {"bwd_model_tflops", bflops / tb * 1e-12},
                    {"bwd_of_gemm", bflops / tb / gemm}});
  }
  return rows;
}

// Device memory bandwidth in bytes/s by a copy of n_bytes through the table (read + write: 2 n_bytes moved; a
// 4-byte download waits for it).
double copy_bandwidth(Ops<float>& ops, std::int64_t n_bytes, const Timer& timer) {
  const std::int64_t cols = 1 << 14, rows = std::max<std::int64_t>(1, n_bytes / (4 * cols));
  const Buffer<float> src(ops, std::vector<float>(static_cast<std::size_t>(rows * cols), 0.5f));
  Buffer<float> dst(ops, rows * cols);
  float sink = 0.0f;
  const double t = timer.median([&] {
    ops.copy(rows, cols, {src.get(), cols}, {dst.get(), cols}, {});
    ops.download(&sink, dst.get(), sizeof sink);
  });
  const double bw = 2.0 * 4.0 * double(rows * cols) / t;
  std::printf("# device copy of %.0f MB through the table: %.3f ms, %.4g GB/s (read + write)\n",
              4.0 * double(rows * cols) * 1e-6, t * 1e3, bw * 1e-9);
  return bw;
}

// A stage's floor: its model FLOPs at the square GEMM's rate or its bytes (inputs read once, outputs written once) at
// the memory bandwidth, whichever is longer; bandwidth 0 (not measured): the FLOP floor alone.
struct Floor {
  double seconds;
  const char* bound;
};
Floor stage_floor(double flops, double bytes, double gemm, double mem_bw) {
  const double tf = flops / gemm, tb = mem_bw > 0 ? bytes / mem_bw : 0.0;
  return tb > tf ? Floor{tb, "bytes"} : Floor{tf, "flops"};
}

nlohmann::json run_dsa(Ops<float>& ops, const cxxopts::ParseResult& a, const Timer& timer, double gemm, double mem_bw) {
  DsaFlopShape fs;
  fs.heads = a["dsa-heads"].as<std::int64_t>();
  fs.head_dim = a["dsa-dim"].as<std::int64_t>();
  fs.dim_v = a["dsa-dim-v"].as<std::int64_t>();
  fs.indexer_heads = a["indexer-heads"].as<std::int64_t>();
  fs.indexer_dim = a["indexer-dim"].as<std::int64_t>();
  fs.topk = a["topk"].as<std::int64_t>();
  const std::int64_t H = fs.heads, Dqk = fs.head_dim, Dv = fs.dim_v, Hi = fs.indexer_heads, Di = fs.indexer_dim,
                     k = fs.topk;
  std::printf(
      "#\n# dsa: dsa_indexer_topk_composed, dsa_attention_forward_composed, fp32, B=1 H=%lld Dqk=%lld "
      "Dv=%lld Hi=%lld Di=%lld topk=%lld, causal\n",
      static_cast<long long>(H), static_cast<long long>(Dqk), static_cast<long long>(Dv), static_cast<long long>(Hi),
      static_cast<long long>(Di), static_cast<long long>(k));
  std::printf(
      "# model FLOPs: indexer 2*Hi*Di per causal pair (+ the head sum), attention 2*H*(Dqk+Dv) per "
      "selected pair\n");
  char bw_buf[64];
  std::snprintf(bw_buf, sizeof bw_buf, "bytes at %.4g GB/s", mem_bw * 1e-9);
  const std::string bw_text = mem_bw > 0 ? bw_buf : "bytes not timed: memory bandwidth not measured";
  std::printf(
      "# floor of a stage: max(model FLOPs at the square GEMM's rate, %s); bytes: inputs read once + "
      "outputs written once (fp32, int64 indices); of_floor = floor / time\n",
      bw_text.c_str());
  std::printf("%7s %5s %5s %11s %10s %9s %10s %8s %6s %11s %10s %9s %10s %8s %6s\n", "S", "H", "k", "indexer_ms",
              "idx_io_ms", "idx_MB", "floor_ms", "of_floor", "bound", "attn_ms", "attn_io_ms", "attn_MB", "floor_ms",
              "of_floor", "bound");
  nlohmann::json rows = nlohmann::json::array();
  for (const std::int64_t S : a["dsa-seq"].as<std::vector<std::int64_t>>()) {
    fs.seq = S;
    const Tensor q_idx = random_tensor({1, S, Hi, Di}, 11, -1, 1), w = random_tensor({1, S, Hi}, 12, 0, 1),
                 k_idx = random_tensor({1, S, Di}, 13, -1, 1);
    const Tensor q = random_tensor({1, S, H, Dqk}, 14, -1, 1), c = random_tensor({1, S, Dqk}, 15, -1, 1);
    Tensor topk = Tensor::empty({1, S, k}, DType::kInt64), out = Tensor::empty({1, S, H, Dv}, DType::kFloat32),
           lse = Tensor::empty({1, H, S}, DType::kFloat32);
    const attn::DsaIndexerArgs iargs{q_idx, w, k_idx, {}, {}};
    const double t_idx = timer.median([&] { attn::ops::dsa_indexer_topk_composed(ops, iargs, topk); });
    attn::DsaAttentionArgs aargs;
    aargs.q = q;
    aargs.c = c;
    aargs.topk_indices = topk;
    aargs.dim_v = Dv;
    const double t_att = timer.median([&] { attn::ops::dsa_attention_forward_composed(ops, aargs, out, lse); });
    const double io_idx = io_seconds(ops, {&q_idx, &w, &k_idx}, topk.nbytes(), timer);
    const double io_att = io_seconds(ops, {&q, &c}, out.nbytes() + 2 * lse.nbytes(), timer);
    const double flops = dsa_forward_flops(fs);
    const double rate = flops / (t_idx + t_att);
    const double idx_flops = dsa_visible_pairs(fs) * dsa_indexer_flops_per_pair(fs),
                 att_flops = dsa_selected_pairs(fs) * dsa_attention_flops_per_pair(fs);
    const double idx_bytes = double(q_idx.nbytes() + w.nbytes() + k_idx.nbytes() + topk.nbytes()),
                 att_bytes = double(q.nbytes() + c.nbytes() + topk.nbytes() + out.nbytes() + lse.nbytes());
    const Floor f_idx = stage_floor(idx_flops, idx_bytes, gemm, mem_bw),
                f_att = stage_floor(att_flops, att_bytes, gemm, mem_bw);
    std::printf("%7lld %5lld %5lld %11.3f %10.3f %9.1f %10.3f %8.3f %6s %11.3f %10.3f %9.1f %10.3f %8.3f %6s\n",
                static_cast<long long>(S), static_cast<long long>(H), static_cast<long long>(k), t_idx * 1e3,
                io_idx * 1e3, idx_bytes * 1e-6, f_idx.seconds * 1e3, f_idx.seconds / t_idx, f_idx.bound, t_att * 1e3,
                io_att * 1e3, att_bytes * 1e-6, f_att.seconds * 1e3, f_att.seconds / t_att, f_att.bound);
    std::fflush(stdout);
    rows.push_back({{"kernel", "dsa"},
                    {"S", S},
                    {"H", H},
                    {"Dqk", Dqk},
                    {"Dv", Dv},
                    {"Hi", Hi},
                    {"Di", Di},
                    {"topk", k},
                    {"indexer_ms", t_idx * 1e3},
                    {"indexer_io_ms", io_idx * 1e3},
                    {"indexer_model_flops", idx_flops},
                    {"indexer_bytes", idx_bytes},
                    {"indexer_floor_ms", f_idx.seconds * 1e3},
                    {"indexer_floor_bound", f_idx.bound},
                    {"indexer_of_floor", f_idx.seconds / t_idx},
                    {"attention_ms", t_att * 1e3},
                    {"attention_io_ms", io_att * 1e3},
                    {"attention_model_flops", att_flops},
                    {"attention_bytes", att_bytes},
                    {"attention_floor_ms", f_att.seconds * 1e3},
                    {"attention_floor_bound", f_att.bound},
                    {"attention_of_floor", f_att.seconds / t_att},
                    {"mem_bw_gbs", mem_bw > 0 ? nlohmann::json(mem_bw * 1e-9) : nlohmann::json(nullptr)},
                    {"model_tflops", rate * 1e-12},
                    {"of_gemm", rate / gemm}});
  }
  return rows;
}

int run(int argc, char** argv) {
  cxxopts::Options opts("ops_bench", "the GDN forward and DSA stages composed from an ops table");
  opts.add_options()("table", "cpu or cuda", cxxopts::value<std::string>()->default_value("cpu"))(
      "kernel", "gdn, dsa, or both (comma list)", cxxopts::value<std::vector<std::string>>()->default_value("gdn,dsa"))(
      "gdn-seq", "GDN sequence lengths", cxxopts::value<std::vector<std::int64_t>>()->default_value("8192"))(
      "heads", "GDN value heads Hv", cxxopts::value<std::int64_t>()->default_value("32"))(
      "kv-heads", "GDN key heads Hk", cxxopts::value<std::int64_t>()->default_value("16"))(
      "head-dim", "GDN K", cxxopts::value<std::int64_t>()->default_value("128"))(
      "dim-v", "GDN V", cxxopts::value<std::int64_t>()->default_value("128"))(
      "chunk-size", "GDN chunk C", cxxopts::value<std::int64_t>()->default_value("64"))(
      "dsa-seq", "DSA sequence lengths", cxxopts::value<std::vector<std::int64_t>>()->default_value("4096"))(
      "dsa-heads", "DSA query heads H", cxxopts::value<std::int64_t>()->default_value("16"))(
      "dsa-dim", "DSA latent dim Dqk", cxxopts::value<std::int64_t>()->default_value("576"))(
      "dsa-dim-v", "DSA value dim Dv", cxxopts::value<std::int64_t>()->default_value("512"))(
      "indexer-heads", "DSA indexer heads Hi", cxxopts::value<std::int64_t>()->default_value("64"))(
      "indexer-dim", "DSA indexer dim Di", cxxopts::value<std::int64_t>()->default_value("128"))(
      "topk", "DSA selected keys k", cxxopts::value<std::int64_t>()->default_value("2048"))(
      "square", "the reference GEMM's size n", cxxopts::value<std::int64_t>()->default_value("4096"))(
      "mem-bw",
      "memory bandwidth in GB/s for the DSA stages' byte floors; -1: measured by a device copy through the table; "
      "0: not measured (FLOP floors only)",
      cxxopts::value<double>()->default_value("-1"))("copy-mb", "MB copied to measure the bandwidth",
                                                     cxxopts::value<double>()->default_value("1024"))(
      "warmup", "untimed rounds", cxxopts::value<int>()->default_value("1"))(
      "min-time", "seconds of timed rounds per row (at least 3 rounds)",
      cxxopts::value<double>()->default_value("0.5"))("json", "also write the rows to this file",
                                                      cxxopts::value<std::string>())("h,help", "this help");
  const cxxopts::ParseResult a = opts.parse(argc, argv);
  if (a.count("help")) {
    std::printf("%s\n", opts.help().c_str());
    return 0;
  }
  const std::string table = a["table"].as<std::string>();
  SEQPAR_CHECK(table == "cpu" || table == "cuda", "ops_bench: --table must be cpu or cuda, got ", table);
  if (a.count("json")) bench::check_json_path(a["json"].as<std::string>());
  const Timer timer{a["warmup"].as<int>(), a["min-time"].as<double>()};
  std::unique_ptr<Ops<float>> cuda;
  if (table == "cuda") cuda = attn::ops::cuda_ops<float>(Device::cuda(0), Stream{Device::cuda(0), nullptr});
  Ops<float>& ops = cuda ? *cuda : attn::ops::cpu_ops_f32();
  std::printf("# ops_bench: table %s%s\n", ops.name(),
              table == "cpu" ? (attn::ops::cpu_ops_use_cblas() ? " (OpenBLAS)" : " (loops)") : "");
  const double gemm = gemm_rate(ops, a["square"].as<std::int64_t>(), timer);
  const double mem_bw_arg = a["mem-bw"].as<double>();
  SEQPAR_CHECK(mem_bw_arg == -1 || mem_bw_arg >= 0,
               "ops_bench: --mem-bw must be -1 (measure), 0 (not measured) "
               "or a positive GB/s, got ",
               mem_bw_arg);
  const double copy_mb = a["copy-mb"].as<double>();
  SEQPAR_CHECK(copy_mb > 0, "ops_bench: --copy-mb must be positive, got ", copy_mb);
  const auto kinds = a["kernel"].as<std::vector<std::string>>();
  const bool dsa = std::find(kinds.begin(), kinds.end(), "dsa") != kinds.end();
  const double mem_bw = !dsa               ? 0.0
                        : mem_bw_arg == -1 ? copy_bandwidth(ops, static_cast<std::int64_t>(copy_mb * 1e6), timer)
                                           : mem_bw_arg * 1e9;
  if (dsa && mem_bw_arg == 0)
    std::printf("# memory bandwidth: not measured (--mem-bw 0): DSA floors from FLOPs only\n");
  if (mem_bw_arg > 0) std::printf("# memory bandwidth: %.4g GB/s (--mem-bw)\n", mem_bw_arg);
  nlohmann::json rows = nlohmann::json::array();
  rows.push_back({{"kernel", "gemm_fp32"}, {"n", a["square"].as<std::int64_t>()}, {"tflops", gemm * 1e-12}});
  if (dsa)
    rows.push_back({{"kernel", "mem_bw"},
                    {"source", mem_bw_arg == -1  ? "copy"
                               : mem_bw_arg == 0 ? "not measured"
                                                 : "given"},
                    {"gbs", mem_bw > 0 ? nlohmann::json(mem_bw * 1e-9) : nlohmann::json(nullptr)}});
  for (const std::string& kind : kinds) {
    SEQPAR_CHECK(kind == "gdn" || kind == "dsa", "ops_bench: --kernel takes gdn and dsa, got ", kind);
    for (auto& r : kind == "gdn" ? run_gdn(ops, a, timer, gemm) : run_dsa(ops, a, timer, gemm, mem_bw)) {
      r["table"] = table;
      rows.push_back(r);
    }
  }
  if (a.count("json"))
    bench::write_file_atomic(a["json"].as<std::string>(), [&](std::ostream& os) { os << rows.dump(1) << "\n"; });
  return 0;
}

}  // namespace
}  // namespace seqpar::bench::ops_bench

int main(int argc, char** argv) {
  try {
    return seqpar::bench::ops_bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ops_bench: %s\n", e.what());
    return 1;
  }
}
