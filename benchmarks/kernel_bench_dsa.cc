// kernel_bench --kernel dsa: DeepSeek sparse attention on one device through the public API of attention/dsa.h,
// at DeepSeek-V3.2's shapes (latent Dqk 576, value Dv 512, indexer 64 heads x 128) with --heads query heads
// (default 16; the model has 128) and --topk 512 (the model: 2048), batch 1, causal, one key block.
//   forward:  dsa_topk_init, dsa_indexer_topk_block, dsa_topk_finalize (indexer + top-k), dsa_attention_forward
//   backward: dsa_attention_backward (with the head-summed probabilities of the indexer loss),
//   dsa_topk_selected_scores,
//             dsa_indexer_loss, dsa_indexer_backward
// FLOPs: benchmarks/flop_models.h (docs/benchmarks.md, "Definitions of the benchmark figures"), as sp_bench counts them.
#include <algorithm>
#include <cstdio>

#include "attention/dsa.h"
#include "benchmarks/flop_models.h"
#include "benchmarks/kernel_bench.h"
#include "runtime/error.h"

namespace seqpar::bench::kernel {

void add_dsa_options(cxxopts::Options& opts) {
  opts.add_options("dsa")("topk", "DSA selected keys per query k",
                          cxxopts::value<std::int64_t>()->default_value("512"))(
      "indexer-heads", "DSA indexer heads Hi", cxxopts::value<std::int64_t>()->default_value("64"))(
      "indexer-dim", "DSA indexer head dim Di", cxxopts::value<std::int64_t>()->default_value("128"));
}

nlohmann::json run_dsa(const Context& ctx) {
  const cxxopts::ParseResult& args = *ctx.args;
  const std::vector<std::int64_t> seqs = ctx.seqs({4096}, {16384}, {1024});
  DsaFlopShape fs;
  fs.heads = ctx.size_or("heads", 16);
  fs.head_dim = ctx.size_or("head-dim", attn::kDsaHeadDimQk);
  fs.dim_v = ctx.size_or("dim-v", attn::kDsaHeadDimV);
  fs.indexer_heads = args["indexer-heads"].as<std::int64_t>();
  fs.indexer_dim = args["indexer-dim"].as<std::int64_t>();
  fs.topk = args["topk"].as<std::int64_t>();
  const std::int64_t B = fs.batch, H = fs.heads, Dqk = fs.head_dim, Dv = fs.dim_v, Hi = fs.indexer_heads,
                     Di = fs.indexer_dim, topk_given = fs.topk;
  std::printf(
      "#\n# dsa: DeepSeek sparse attention, B=%lld H=%lld Dqk=%lld Dv=%lld Hi=%lld Di=%lld topk=%lld (at most S: a "
      "row has S keys), causal\n",
      static_cast<long long>(B), static_cast<long long>(H), static_cast<long long>(Dqk), static_cast<long long>(Dv),
      static_cast<long long>(Hi), static_cast<long long>(Di), static_cast<long long>(topk_given));
  std::printf(
      "# FLOPs: fwd sel*2*H*(Dqk+Dv) + vis*2*Hi*Di, bwd sel*(2.5*2*H*(Dqk+Dv) + 3*2*Hi*Di); sel, vis: "
      "selected and visible (query, key) pairs\n");
  std::printf("%7s %4s %5s", "S", "H", "topk");
  print_rate_header();
  std::printf("\n");
  nlohmann::json results = nlohmann::json::array();
  for (std::int64_t S : seqs) {
    fs.seq = S;
    // A query selects at most its S visible keys: slots beyond S would be -1 padding, arrays of [B, S, topk] and
    // time spent on nothing (a --topk far above S ran out of memory). The rows report the k that ran.
    const std::int64_t topk = std::min(topk_given, S);
    fs.topk = topk;
    const MemCategory ws = MemCategory::kWorkspace;
    auto make = [&](Shape shape, std::uint32_t seed, float lo, float hi) {
      Tensor t = Tensor::empty(std::move(shape), DType::kFloat32, ws);
      fill(t, seed, lo, hi);
      return t;
    };
    auto empty = [&](Shape shape, DType dtype = DType::kFloat32) { return Tensor::empty(std::move(shape), dtype, ws); };
    const Tensor q = make({B, S, H, Dqk}, 1, -1, 1), c = make({B, S, Dqk}, 2, -1, 1);
    const Tensor q_idx = make({B, S, Hi, Di}, 3, -1, 1), k_idx = make({B, S, Di}, 4, -1, 1),
                 w = make({B, S, Hi}, 5, 0, 1), dout = make({B, S, H, Dv}, 6, -1, 1);
    const Tensor scores = empty({B, S, topk}), positions = empty({B, S, topk}, DType::kInt64),
                 topk_indices = empty({B, S, topk}, DType::kInt64);
    const Tensor out = empty({B, S, H, Dv}), lse = empty({B, H, S});
    const Tensor probs = empty({B, S, topk}), sel_scores = empty({B, S, topk}), dscores = empty({B, S, topk});
    const Tensor dq = empty(q.shape()), dc = empty(c.shape()), dq_idx = empty(q_idx.shape()), dw = empty(w.shape()),
                 dk_idx = empty(k_idx.shape());
    const attn::DsaIndexerArgs idx{q_idx, w, k_idx, {}, {}, 0};
    const attn::DsaTopkState state{scores, positions};
    const attn::DsaAttentionArgs att{q, c, topk_indices, {}, {}, Dv, 0.0f};
    auto forward = [&] {
      attn::dsa_topk_init(state);
      attn::dsa_indexer_topk_block(idx, state);
      attn::dsa_topk_finalize(state, topk_indices);
      attn::dsa_attention_forward(att, out, lse);
    };
    auto backward = [&] {
      if (!ctx.backward) return;
      attn::dsa_attention_backward({att, out, dout, lse, {}, probs}, dq, dc, false);
      attn::dsa_topk_selected_scores(state, sel_scores);
      attn::dsa_indexer_loss({probs, sel_scores, topk_indices, 1.0f}, dscores);
      attn::dsa_indexer_backward(idx, topk_indices, dscores, dq_idx, dw, dk_idx, false);
    };
    RateColumns r;
    r.fwd_flops = dsa_forward_flops(fs);
    r.bwd_flops = ctx.backward ? dsa_backward_flops(fs) : 0.0;
    const std::vector<Timing> t = time_rounds({forward, backward}, ctx.warmup, ctx.min_time, r.rounds);
    r.fwd = t[0];
    r.bwd = t[1];
    std::printf("%7lld %4lld %5lld", static_cast<long long>(S), static_cast<long long>(H),
                static_cast<long long>(topk));
    print_rate_values(ctx, r);
    std::printf("\n");
    std::fflush(stdout);
    results.push_back(
        rate_json(ctx, "dsa",
                  {{"S", S}, {"B", B}, {"H", H}, {"Dqk", Dqk}, {"Dv", Dv}, {"Hi", Hi}, {"Di", Di}, {"topk", topk}}, r));
  }
  return results;
}

}  // namespace seqpar::bench::kernel
