// sp_bench --mode decode --attn dsa (benchmarks/sp_bench_decode.h): DSA with a token-sharded indexer-key and latent
// cache and a global top-k per step (parallel/dsa_decode_cp.h). Shapes: --heads H, --head-dim Dqk, --dim-v Dv,
// --indexer-heads Hi, --indexer-dim Di, --topk k, --window W (the indexer's), --dsa-select (the prompt's selection).
// --check: every step's topk_indices (exactly), out and lse against the single-rank training kernels
// (attn::dsa_indexer_topk and attn::dsa_attention_forward) over the T + N n tokens, on every rank.
#include <optional>

#include "attention/dsa.h"
#include "attention/dsa_cache.h"
#include "benchmarks/sp_bench_decode_internal.h"
#include "parallel/dsa_decode_cp.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::bench::decode_detail {
namespace {

// Salts of the inputs (make_rows): q, c, q_idx, k_idx, w.
constexpr int kQ = 11, kC = 12, kQIdx = 13, kKIdx = 14, kW = 15;

// The five inputs of the token range `rows` (all heads).
struct DsaRows {
  Tensor q, c, q_idx, k_idx, w;
};
DsaRows dsa_rows(const SpBenchOptions& o, std::int64_t S, const std::vector<std::int64_t>& rows, bool queries = true) {
  const std::vector<std::int64_t> none;
  const std::vector<std::int64_t>& qr = queries ? rows : none;
  return {make_rows(o, kQ, S, qr, o.heads, o.head_dim), make_rows(o, kC, S, rows, o.head_dim, 0),
          make_rows(o, kQIdx, S, qr, o.indexer_heads, o.indexer_dim), make_rows(o, kKIdx, S, rows, o.indexer_dim, 0),
          make_rows(o, kW, S, qr, o.indexer_heads, 0)};
}

}  // namespace

DecodeReport run_dsa(Communicator& world, const CpGroups& groups, const SpBenchOptions& o) {
  const DecodeOptions& d = o.decode;
  const std::int64_t B = o.batch, H = o.heads, dqk = o.head_dim, dv = o.dim_v, di = o.indexer_dim, T = d.context;
  const std::int64_t n = d.new_tokens, N = d.decode_steps, S = T + N * n;
  DsaDecodeConfig cfg;
  cfg.shard = parse_cache_shard(d.cache_shard);
  cfg.interleave = d.interleave;
  cfg.topk = o.topk;
  cfg.dim_v = dv;
  cfg.window = o.window;
  cfg.prefill_select = parse_dsa_select_mode(o.dsa_select);
  DsaDecodeContextParallel layer(groups, cfg);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, T, o.layout);
  const bool fill = d.prefill == "fill";  // the prompt's k_idx and c only: no queries needed
  const DsaRows prompt = dsa_rows(o, S, layout.positions(groups.sp_rank()), !fill);
  DecodeReport rep;
  const std::int64_t before = persistent_bytes();
  std::optional<ShardedDsaCache> cache;
  rep.prefill_s = time_prefill(world, o, [&] {
    cache.reset();
    cache.emplace(layer.make_cache(B, S, di, dqk, o.dtype));
    if (fill) {
      layer.fill(*cache, layout, prompt.k_idx, prompt.c);
    } else {
      layer.prefill(*cache, layout, prompt.q, prompt.c, prompt.q_idx, prompt.k_idx, prompt.w);
    }
  });
  std::vector<double> cache_bytes{static_cast<double>(persistent_bytes() - before)};
  all_reduce(world, cache_bytes, ReduceOp::kMax);
  rep.cache_bytes = cache_bytes[0];
  rep.cache_formula = static_cast<double>(attn::dsa_cache_bytes({B, S, di, dqk, o.dtype})) / groups.sp.size();
  rep.formula_text = "M / P = B (T + N n) (Di + Dqk) bytes / (ring x ulysses)";
  layer.reset_counters();
  std::vector<DsaDecodeOutput> outs;
  for (std::int64_t step = 0; step < N; ++step) {
    const DsaRows in = dsa_rows(o, S, range(T + step * n, T + (step + 1) * n));
    const double t0 = now_s();
    DsaDecodeOutput r = layer.decode(*cache, in.q, in.c, in.q_idx, in.k_idx, in.w);
    rep.step_s.push_back(now_s() - t0);
    if (o.check) outs.push_back(std::move(r));
  }
  all_reduce(world, rep.step_s, ReduceOp::kMax);
  rep.bytes_per_step = layer.counters().bytes_sent / N;
  rep.bytes_formula = layer.decode_bytes_per_step(B, n, H, o.dtype);
  if (!o.check) return rep;
  rep.checked = true;
  // The single-rank training kernels over the whole sequence, rows T.. (their queries against every key), on every
  // rank: the selection over one key block, then the sparse attention.
  const DsaRows keys = dsa_rows(o, S, range(0, S), false), queries = dsa_rows(o, S, range(T, S));
  const std::vector<std::int64_t> all = range(0, S), tail = range(T, S);
  attn::DsaIndexerArgs idx{queries.q_idx, queries.w, keys.k_idx, tail, all};
  idx.window = o.window;
  Tensor topk = Tensor::empty({B, N * n, o.topk}, DType::kInt64, MemCategory::kWorkspace);
  attn::dsa_indexer_topk(idx, topk);
  attn::DsaAttentionArgs a;
  a.q = queries.q;
  a.c = keys.c;
  a.topk_indices = topk;
  a.q_pos = tail;
  a.c_pos = all;
  a.dim_v = dv;
  Tensor out = Tensor::empty({B, N * n, H, dv}, o.dtype, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({B, H, N * n}, accumulator_dtype(o.dtype), MemCategory::kWorkspace);
  attn::dsa_attention_forward(a, out, lse);
  rep.topk_mismatches = 0;
  for (std::int64_t step = 0; step < N; ++step) {
    const std::vector<std::int64_t> rows = range(step * n, (step + 1) * n);
    Tensor want_out = Tensor::empty({B, n, H, dv}, o.dtype, MemCategory::kWorkspace);
    Tensor want_lse = Tensor::empty({B, H, n}, lse.dtype(), MemCategory::kWorkspace);
    Tensor want_topk = Tensor::empty({B, n, o.topk}, DType::kInt64, MemCategory::kWorkspace);
    gather_rows(out, 1, rows, want_out);
    gather_rows(lse, 2, rows, want_lse);
    gather_rows(topk, 1, rows, want_topk);
    rep.out_err = std::max(rep.out_err, rel_err(outs[step].out, want_out));
    rep.lse_err = std::max(rep.lse_err, rel_err(outs[step].lse, want_lse));
    const auto* got = static_cast<const std::int64_t*>(outs[step].topk_indices.data());
    const auto* want = static_cast<const std::int64_t*>(want_topk.data());
    for (std::int64_t i = 0; i < want_topk.numel(); ++i) rep.topk_mismatches += got[i] != want[i] ? 1 : 0;
  }
  std::vector<double> errs{rep.out_err, rep.lse_err, static_cast<double>(rep.topk_mismatches)};
  all_reduce(world, errs, ReduceOp::kMax);
  rep.out_err = errs[0];
  rep.lse_err = errs[1];
  rep.topk_mismatches = static_cast<std::int64_t>(errs[2]);
  rep.passed = rep.out_err <= tolerance(o.dtype) && rep.lse_err <= tolerance(accumulator_dtype(o.dtype)) &&
               rep.topk_mismatches == 0;
  return rep;
}

}  // namespace seqpar::bench::decode_detail
