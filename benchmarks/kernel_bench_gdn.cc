// kernel_bench --kernel gdn: the chunked gated delta rule forward and backward (attention/gdn.h) at Qwen3-Next's
// head shapes (K = V = 128, chunk 64; value heads --heads, default 8, on --kv-heads key heads, default half as many
// as Qwen3-Next's 32 on 16), batch 1, q and k L2-normalised, zero initial state. The forward writes out and
// final_state; the backward every gradient (dq, dk, dv, dg, dbeta, dinitial_state) for a random dout.
// FLOPs: benchmarks/flop_models.h (docs/benchmarks.md, "Definitions of the benchmark figures"), as sp_bench counts them without the short conv.
#include <cstdio>
#include <functional>

#include "attention/gdn.h"
#include "benchmarks/flop_models.h"
#include "benchmarks/kernel_bench.h"
#include "runtime/error.h"

namespace seqpar::bench::kernel {

void add_gdn_options(cxxopts::Options& opts) {
  opts.add_options("gdn")("kv-heads", "GDN key heads Hk (0: heads / 2, at least 1)",
                          cxxopts::value<std::int64_t>()->default_value("0"))(
      "chunk-size", "GDN chunk length C", cxxopts::value<std::int64_t>()->default_value("64"))(
      "gdn-maps",
      "GDN: also time a segment's map (gdn_transition) and the backward scan's dS sweep (gdn_backward writing only "
      "dinitial_state), interleaved with the forward and backward (JSON: map_flops, map_mean_ms, sweep_mean_ms); and "
      "the calls GDN context parallelism makes, one value head at a time (gdn_forward_window, gdn_backward_window) "
      "without and with their work ahead, the work ahead alone (gdn_ahead_step over every chunk) and the call that "
      "uses it (JSON: window_fwd_mean_ms, ahead_fwd_mean_ms, rest_fwd_mean_ms and the same for bwd)");
}

nlohmann::json run_gdn(const Context& ctx) {
  const std::vector<std::int64_t> seqs = ctx.seqs({8192}, {32768}, {2048});
  const std::int64_t B = 1, Hv = ctx.size_or("heads", 8),
                     Hk = ctx.size_or("kv-heads", std::max<std::int64_t>(Hv / 2, 1));
  const std::int64_t K = ctx.size_or("head-dim", 128), V = ctx.size_or("dim-v", 128);
  const std::int64_t chunk_given = (*ctx.args)["chunk-size"].as<std::int64_t>();
  std::printf(
      "#\n# gdn: chunked gated delta rule, B=%lld Hv=%lld Hk=%lld K=%lld V=%lld chunk_size=%lld (column C: the chunk "
      "run, at most S and %lld), qk L2 norm\n",
      static_cast<long long>(B), static_cast<long long>(Hv), static_cast<long long>(Hk), static_cast<long long>(K),
      static_cast<long long>(V), static_cast<long long>(chunk_given), static_cast<long long>(attn::kGdnMaxChunkSize));
  std::printf("# FLOPs: fwd B*S*Hv*(6*C*K + 4*C*V + 6*K*V), bwd 2.5x fwd\n");
  std::printf("%7s %4s %4s %5s %5s %5s", "S", "Hv", "Hk", "K", "V", "C");
  print_rate_header();
  std::printf("\n");
  nlohmann::json results = nlohmann::json::array();
  for (std::int64_t S : seqs) {
    // The chunk the kernels run (attention/gdn.h): the rows and the JSON report it, as the FLOP model counts it.
    const std::int64_t C = attn::gdn_run_chunk_size(chunk_given, S);
    const MemCategory ws = MemCategory::kWorkspace;
    auto make = [&](Shape shape, std::uint32_t seed, float lo, float hi) {
      Tensor t = Tensor::empty(std::move(shape), DType::kFloat32, ws);
      fill(t, seed, lo, hi);
      return t;
    };
    const Tensor q = make({B, S, Hk, K}, 1, -1, 1), k = make({B, S, Hk, K}, 2, -1, 1),
                 v = make({B, S, Hv, V}, 3, -1, 1);
    const Tensor g = make({B, S, Hv}, 4, -0.2f, -0.01f), beta = make({B, S, Hv}, 5, 0.05f, 0.95f);
    const Tensor dout = make({B, S, Hv, V}, 6, -1, 1);
    const Tensor out = Tensor::empty({B, S, Hv, V}, DType::kFloat32, ws),
                 final_state = Tensor::empty({B, Hv, K, V}, DType::kFloat32, ws);
    const Tensor dq = Tensor::empty(q.shape(), DType::kFloat32, ws), dk = Tensor::empty(k.shape(), DType::kFloat32, ws),
                 dv = Tensor::empty(v.shape(), DType::kFloat32, ws), dg = Tensor::empty(g.shape(), DType::kFloat32, ws),
                 dbeta = Tensor::empty(g.shape(), DType::kFloat32, ws),
                 dinit = Tensor::empty(final_state.shape(), DType::kFloat32, ws);
    // zero initial state, q and k L2-normalised, scale 1 / sqrt(K)
    const attn::GdnForwardArgs a{q, k, v, g, beta, {}, true, 0.0f, chunk_given};
    const GdnFlopShape shape{B, S, Hv, K, V, C, 0, 0};
    RateColumns r;
    r.fwd_flops = gdn_forward_flops(shape);
    r.bwd_flops = ctx.backward ? gdn_backward_flops(shape) : 0.0;
    const bool maps = ctx.args->count("gdn-maps") > 0;
    const Tensor m = maps ? Tensor::empty({B, Hv, K, K}, DType::kFloat32, ws) : Tensor(),
                 u = maps ? Tensor::empty({B, Hv, K, V}, DType::kFloat32, ws) : Tensor(),
                 sweep = maps ? Tensor::empty({B, Hv, K, V}, DType::kFloat32, ws) : Tensor();
    std::vector<std::function<void()>> fns = {[&] { attn::gdn_forward(a, out, final_state); },
                                              [&] {
                                                if (ctx.backward)
                                                  attn::gdn_backward({a, dout, {}}, dq, dk, dv, dg, dbeta, dinit);
                                              }};
    // One value head at a time, as GdnCp runs a segment: the window call alone; its work ahead over every chunk
    // (what a rank computes while it waits for the window's state); the call that uses it.
    const Tensor wdq = maps ? Tensor::empty({B, S, Hv, K}, DType::kFloat32, ws) : Tensor(),
                 wdk = maps ? Tensor::empty({B, S, Hv, K}, DType::kFloat32, ws) : Tensor(),
                 wfin = maps ? Tensor::empty({B, 1, K, V}, DType::kFloat32, ws) : Tensor();
    std::vector<attn::GdnAhead> ahead_f(static_cast<std::size_t>(Hv)), ahead_b(static_cast<std::size_t>(Hv));
    const attn::GdnBackwardArgs ba{a, dout, {}};
    const auto windows = [&](const std::function<void(std::size_t, const attn::GdnWindow&)>& fn) {
      for (std::int64_t h = 0; h < Hv; ++h) fn(static_cast<std::size_t>(h), attn::GdnWindow{0, S, h, 1});
    };
    if (maps) {
      fns.push_back([&] { attn::gdn_transition(a, m, u); });
      fns.push_back([&] { attn::gdn_backward({a, dout, {}}, {}, {}, {}, {}, {}, sweep); });
      fns.push_back([&] {
        windows([&](std::size_t, const attn::GdnWindow& w) { attn::gdn_forward_window(a, w, out, wfin); });
      });
      fns.push_back([&] {
        windows([&](std::size_t h, const attn::GdnWindow& w) {
          ahead_f[h] = attn::gdn_forward_ahead(a, w);
          while (!attn::gdn_ahead_step(a, ahead_f[h], 4)) {
          }
        });
      });
      fns.push_back([&] {
        windows([&](std::size_t h, const attn::GdnWindow& w) {
          attn::gdn_forward_window(a, w, out, wfin, &ahead_f[h]);
          ahead_f[h] = {};
        });
      });
      if (ctx.backward) {
        fns.push_back([&] {
          windows([&](std::size_t, const attn::GdnWindow& w) {
            attn::gdn_backward_window(ba, w, wdq, wdk, dv, dg, dbeta, wfin);
          });
        });
        fns.push_back([&] {
          windows([&](std::size_t h, const attn::GdnWindow& w) {
            ahead_b[h] = attn::gdn_backward_ahead(ba, w);
            while (!attn::gdn_ahead_step(a, ahead_b[h], 4)) {
            }
          });
        });
        fns.push_back([&] {
          windows([&](std::size_t h, const attn::GdnWindow& w) {
            attn::gdn_backward_window(ba, w, wdq, wdk, dv, dg, dbeta, wfin, &ahead_b[h]);
            ahead_b[h] = {};
          });
        });
      }
    }
    const std::vector<Timing> t = time_rounds(fns, ctx.warmup, ctx.min_time, r.rounds);
    r.fwd = t[0];
    r.bwd = t[1];
    std::printf("%7lld %4lld %4lld %5lld %5lld %5lld", static_cast<long long>(S), static_cast<long long>(Hv),
                static_cast<long long>(Hk), static_cast<long long>(K), static_cast<long long>(V),
                static_cast<long long>(C));
    print_rate_values(ctx, r);
    std::printf("\n");
    std::fflush(stdout);
    nlohmann::json row =
        rate_json(ctx, "gdn", {{"S", S}, {"B", B}, {"Hv", Hv}, {"Hk", Hk}, {"K", K}, {"V", V}, {"chunk_size", C}}, r);
    if (maps) {
      row["map_flops"] = gdn_map_flops(shape);
      row["map_mean_ms"] = t[2].mean * 1e3;
      row["sweep_mean_ms"] = t[3].mean * 1e3;
      const char* names[] = {"window_fwd_mean_ms", "ahead_fwd_mean_ms", "rest_fwd_mean_ms",
                             "window_bwd_mean_ms", "ahead_bwd_mean_ms", "rest_bwd_mean_ms"};
      for (std::size_t i = 4; i < t.size(); ++i) row[names[i - 4]] = t[i].mean * 1e3;
      std::printf("#   one value head at a time: forward %.3f ms, its work ahead %.3f + the rest %.3f ms", t[4].mean * 1e3,
                  t[5].mean * 1e3, t[6].mean * 1e3);
      if (t.size() > 7)
        std::printf("; backward %.3f ms, ahead %.3f + the rest %.3f ms", t[7].mean * 1e3, t[8].mean * 1e3,
                    t[9].mean * 1e3);
      std::printf(" (means)\n");
      std::printf("#   map (gdn_transition) %.3f ms mean, dS sweep %.3f ms mean\n", t[2].mean * 1e3, t[3].mean * 1e3);
    }
    results.push_back(row);
  }
  return results;
}

}  // namespace seqpar::bench::kernel
