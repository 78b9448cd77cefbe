// sp_bench --mode decode --attn dsa (benchmarks/sp_bench_decode.h): DSA with a token-sharded indexer-key and latent
// cache and a global top-k per step (parallel/dsa_decode_cp.h). Shapes: --heads H, --head-dim Dqk, --dim-v Dv,
// --indexer-heads Hi, --indexer-dim Di, --topk k, --window W (the indexer's), --dsa-select (the prompt's selection).
// Inputs q, c, q_idx, k_idx, w (sp_bench_decode_arrays.h); --check: every step's topk_indices (exactly), out and lse
// against the single-rank training kernels (attn::dsa_indexer_topk and attn::dsa_attention_forward) over the
// T + N n tokens, on every rank; --dump: out_dec, lse_dec, topk_indices_dec (the same on every rank).
#include <functional>
#include <numeric>
#include <optional>

#include "attention/dsa.h"
#include "attention/dsa_cache.h"
#include "attention/reference/dsa_reference.h"
#include "benchmarks/sp_bench_decode_internal.h"
#include "parallel/dsa_decode_cp.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::bench::decode_detail {
namespace {

// The five inputs of the tokens `rows` (all heads; -1: a padding row, zeros); without queries, q, q_idx and w are
// empty (a fill reads only k_idx and c).
struct DsaRows {
  Tensor q, c, q_idx, k_idx, w;
};
DsaRows dsa_rows(const DecodeInputs& in, const std::vector<std::int64_t>& rows, bool queries = true) {
  const std::vector<std::int64_t> none;
  const std::vector<std::int64_t>& qr = queries ? rows : none;
  return {in.rows("q", qr), in.rows("c", rows), in.rows("q_idx", qr), in.rows("k_idx", rows), in.rows("w", qr)};
}

// A tensor as an array for --dump.
npy::HostArray host_array(const Tensor& t) {
  npy::HostArray a(t.dtype(), t.shape());
  copy_convert(t, a.view());
  return a;
}

// --check of the DSA decode steps: `out_all`, `lse_all` and `topk_all` (every head, every step) against the
// single-rank training kernels over the whole sequence; sets rep's errors and verdict (the largest over the ranks).
void check_dsa_steps(Communicator& world, const SpBenchOptions& o, const DecodeInputs& in, const Tensor& out_all,
                     const Tensor& lse_all, const Tensor& topk_all, DecodeReport& rep) {
  const DecodeOptions& d = o.decode;
  const std::int64_t B = o.batch, H = o.heads, dv = o.dim_v, T = d.context;
  const std::int64_t n = d.new_tokens, N = d.decode_steps, S = T + N * n;
  // The single-rank training kernels over the whole sequence, rows T.. (their queries against every key), on every
  // rank: the selection over one key block, then the sparse attention. With --check-against reference the sparse
  // attention is the naive fp64 one of attention/reference on that selection (topk_indices stay exact against the
  // kernel's, as in the training check).
  const std::vector<std::int64_t> all = token_range(0, S), tail = token_range(T, S);
  const DsaRows keys = dsa_rows(in, all, false), queries = dsa_rows(in, tail);
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
  const bool vs_reference = o.check_against == "reference";
  Tensor out = Tensor::empty({B, N * n, H, dv}, vs_reference ? DType::kFloat64 : o.dtype, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({B, H, N * n}, vs_reference ? DType::kFloat64 : accumulator_dtype(o.dtype),
                             MemCategory::kWorkspace);
  if (vs_reference) {
    const Tensor q64 = fp64_copy(queries.q), c64 = fp64_copy(keys.c);
    a.q = q64;
    a.c = c64;
    attn::reference::dsa_attention_forward(a, out, lse);
  } else {
    attn::dsa_attention_forward(a, out, lse);
  }
  const auto* got = static_cast<const std::int64_t*>(topk_all.data());
  const auto* want = static_cast<const std::int64_t*>(topk.data());
  const std::int64_t mismatches = std::inner_product(got, got + topk.numel(), want, std::int64_t{0}, std::plus<>(),
                                                     [](std::int64_t g, std::int64_t w) { return g != w ? 1 : 0; });
  std::vector<double> errs{rel_err(out_all, out), rel_err(lse_all, lse), static_cast<double>(mismatches)};
  all_reduce(world, errs, ReduceOp::kMax);
  rep.out_err = errs[0];
  rep.lse_err = errs[1];
  rep.topk_mismatches = static_cast<std::int64_t>(errs[2]);
  rep.passed = rep.out_err <= tolerance(o.dtype, vs_reference) &&
               rep.lse_err <= tolerance(accumulator_dtype(o.dtype), vs_reference) && rep.topk_mismatches == 0;
}

}  // namespace

DecodeReport run_dsa(Communicator& world, const CpGroups& groups, const SpBenchOptions& o, const DecodeInputs& in,
                     DecodeResults* results) {
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
  DsaDecodeCp layer(groups, cfg);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, T, o.layout);
  const bool fill = d.prefill == "fill";  // the prompt's k_idx and c only: no queries needed
  const DsaRows prompt = dsa_rows(in, layout.token_index(groups.cp_rank()), !fill);
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
  rep.cache_formula = static_cast<double>(attn::dsa_cache_bytes({B, S, di, dqk, o.dtype})) / groups.cp.size();
  rep.formula_text = "M / P = B (T + N n) (Di + Dqk) bytes / (ring x ulysses)";
  layer.reset_counters();
  std::vector<Tensor> outs, lses, topks;
  const bool keep = o.check || results != nullptr;
  for (std::int64_t step = 0; step < N; ++step) {
    const DsaRows x = dsa_rows(in, token_range(T + step * n, T + (step + 1) * n));
    const double t0 = now_s();
    DsaDecodeOutput r = layer.decode(*cache, x.q, x.c, x.q_idx, x.k_idx, x.w);
    rep.step_s.push_back(now_s() - t0);
    if (keep) {
      outs.push_back(std::move(r.out));
      lses.push_back(std::move(r.lse));
      topks.push_back(std::move(r.topk_indices));
    }
  }
  all_reduce(world, rep.step_s, ReduceOp::kMax);
  rep.mem_peak_bytes = ledger_peak(world);
  rep.bytes_per_step = layer.counters().bytes_sent / N;
  rep.bytes_formula = layer.decode_bytes_per_step(B, n, H, o.dtype);
  Tensor out_all, lse_all, topk_all;
  if (keep) {
    out_all = concat_steps(outs, 1);
    lse_all = concat_steps(lses, 2);
    topk_all = concat_steps(topks, 1);
  }
  if (results != nullptr) {  // every rank holds all heads: nothing to gather
    results->outputs.emplace_back("out_dec", host_array(out_all));
    results->outputs.emplace_back("lse_dec", host_array(lse_all));
    results->outputs.emplace_back("topk_indices_dec", host_array(topk_all));
  }
  if (!o.check) return rep;
  rep.checked = true;
  check_dsa_steps(world, o, in, out_all, lse_all, topk_all, rep);
  return rep;
}

}  // namespace seqpar::bench::decode_detail
