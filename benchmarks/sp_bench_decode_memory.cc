// sp_bench --mode decode's memory estimate (estimate_decode_memory, benchmarks/sp_bench_decode.h): the peak of one
// rank from the options alone, in the categories of --mode train's (benchmarks/sp_bench_memory.h), which then compares
// it with the node, prints it and refuses a run that does not fit. The ledger's peak is
//   prompt inputs + persistent cache + max(prefill, chunk prefill, decode step + the steps' kept outputs)
// with the prefill's forward taken from the kind's training estimate (WorkloadKind::estimate_memory over --context
// tokens: the prefill is that forward, parallel/decode_cp.h) and the caches from the library's formulas
// (attn::mha_kv_cache_bytes, attn::dsa_cache_bytes, attn::gdn_cache_bytes) over the largest shard of the sharding.
#include <algorithm>
#include <cmath>

#include "attention/dsa_cache.h"
#include "attention/gdn_decode.h"
#include "attention/kv_cache.h"
#include "benchmarks/sp_bench_decode.h"
#include "benchmarks/sp_bench_decode_arrays.h"
#include "benchmarks/sp_bench_memory.h"
#include "benchmarks/sp_bench_workload.h"
#include "parallel/decode_cp.h"
#include "runtime/error.h"

namespace seqpar::bench {
namespace {

// The longest prompt the training estimate is evaluated at: a layout holds 8 bytes per slot and GDN's estimate walks
// its segments, so a longer context is evaluated at this length and scaled by T / kExactPrefillTokens (the estimates
// are affine in the sequence with per-thread constants; scaling the constants too keeps an upper bound).
constexpr std::int64_t kExactPrefillTokens = std::int64_t{1} << 22;

// The training forward of the kind over `tokens` (its phase without the inputs; scaled beyond kExactPrefillTokens).
// Without GDN's short conv: the prefill's conv holds other buffers, which estimate_decode_memory counts itself.
PhaseMemory training_forward(const SpBenchOptions& o, std::int64_t tokens) {
  SpBenchOptions p = o;
  p.seq = std::min(tokens, kExactPrefillTokens);
  p.conv_width = 0;
  PhaseMemory f = find_workload_kind(o.attn).estimate_memory(p).forward;
  const double scale = static_cast<double>(tokens) / static_cast<double>(p.seq);
  for (double* x : {&f.outputs, &f.saved, &f.workspace, &f.comm}) *x *= scale;
  return f;
}

// The largest shard of a cache of `capacity` tokens sharded by --cache-shard / --interleave over `ranks` ranks.
double largest_shard(const SpBenchOptions& o, std::int64_t capacity, int ranks) {
  const CacheSharding sharding(parse_cache_shard(o.decode.cache_shard), capacity, ranks, o.decode.interleave);
  std::int64_t most = 0;
  for (int r = 0; r < ranks; ++r) most = std::max(most, sharding.local_capacity(r));
  return static_cast<double>(most);
}

// The sizes the kinds' decode estimates share (e, a: bytes of the dtype and of its accumulator; c: of the kernels'
// compute type; t_loc: prompt rows per rank; token_bytes: the bytes of every per-token input, all heads; widest: the
// widest of them in elements; fwd: the prefill's training forward).
struct DecodeSizes {
  const SpBenchOptions& o;
  double e, a, B, n, N, threads, c, t_loc, token_bytes, widest;
  int pr, pu, P;
  std::int64_t S;  // the cache's capacity
  PhaseMemory fwd;

  // Rows of `tokens` per rank: every layout pads them to a multiple of at most 2 P (zigzag: two chunks per ring rank,
  // then divisible by P); computed without building the layout (8 bytes per slot).
  double local_rows(std::int64_t tokens) const {
    const double unit = 2.0 * P;
    return std::ceil(static_cast<double>(tokens) / unit) * unit / P;
  }
  // The prefill: the training forward, then the prompt's keys re-sharded to their owners (the send buffer of this
  // rank's rows, with `copies` > 1 Ulysses ranks sharing a token a copy of a destination's rows before its heads are
  // taken; the receive buffer and the stored rows, each the cache's size) while the forward's outputs and saved
  // context are held (parallel/decode_shared.cc reshard_to_owners).
  double prefill_with_reshard(double key_bytes_per_token, double cache_local, int copies) const {
    const double reshard = (copies > 1 ? 2 : 1) * B * t_loc * key_bytes_per_token + 2 * cache_local;
    return std::max(fwd.total(), fwd.outputs + fwd.saved + reshard);
  }
};

// One kind's parts of the decode estimate; chunk_inputs: the rows of a persistent-cache prefill's chunk (--chunk).
struct KindDecodeMemory {
  double cache = 0, prefill = 0, chunk = 0, chunk_inputs = 0, step = 0, kept_per_step = 0, reference = 0;
  std::string dims;  // the flags that set the size, for the refusal's message
};

// MHA: the K/V cache sharded over the ring (each rank holds its Ulysses heads).
KindDecodeMemory mha_decode_memory(const DecodeSizes& z) {
  const SpBenchOptions& o = z.o;
  const double e = z.e, a = z.a, B = z.B, n = z.n, N = z.N;
  KindDecodeMemory r;
  double &cache = r.cache, &prefill = r.prefill, &step = r.step, &kept_per_step = r.kept_per_step,
         &reference = r.reference;
  std::string& dims = r.dims;
  const DecodeOptions& d = o.decode;
  const int pr = z.pr, pu = z.pu;
  const std::int64_t S = z.S;
  const double threads = z.threads, c = z.c, token_bytes = z.token_bytes;
  double& chunk = r.chunk;
  const double hq = o.heads, hkv = o.kv_heads, D = o.head_dim, hq_l = hq / pu, hkv_l = hkv / pu;
  const double slots = largest_shard(o, S, pr);
  cache =
      static_cast<double>(attn::mha_kv_cache_bytes({o.batch, 1, o.kv_heads / pu, o.head_dim, o.dtype, Device::cpu()})) *
      slots;
  prefill = z.prefill_with_reshard(2 * e * hkv * D, cache, pu);
  if (d.chunk > 0) {  // the chunk's rows, its own forward, and the route: every shard gathered (pass-KV) at most
    const double chunk_rows = B * z.local_rows(d.chunk) * token_bytes;
    r.chunk_inputs += chunk_rows;
    chunk = training_forward(o, d.chunk).total() + 2 * pr * cache + 2 * chunk_rows;
  }
  // A step: the new rows, this rank's heads of them, the kernel's copy of the shard's keys and values in the compute
  // type (D padded to 16, keys to 64-row tiles) and its per-thread tiles, lse in fp64, the merge's all-gather.
  const double dp = std::ceil(D / 16) * 16, skp = 64 * std::ceil(slots / 64);
  const double kernel = c * (2 * hkv_l * skp * dp + threads * (D + 2 * 64 * dp + 64 * 64 + 128 + dp));
  const double block = a * B * n * hq_l * (D + 2);
  step = 2 * B * n * token_bytes + kernel + 8 * B * hq_l * n + (pr + 2) * block;
  kept_per_step = B * n * hq_l * (e * D + a);
  // --check: the keys and values of every token (all heads, made in fp64, then this rank's heads), the kernel's
  // copy of them, the queries of the steps, out and lse, their fp64 copies.
  const double all_kv = B * static_cast<double>(S) * hkv * D;
  reference = all_kv * (2 * e + 8) + 2 * e * all_kv / pu + c * 2 * hkv_l * 64 * std::ceil(S / 64.0) * dp * B +
              B * N * n * (e * hq * D * 2 + 3 * (e + 16) * hq_l * D);
  dims = str_cat("--kv-heads ", o.kv_heads, ", --head-dim ", o.head_dim);
  return r;
}

// DSA: the latent and index-key cache sharded over the CP group.
KindDecodeMemory dsa_decode_memory(const DecodeSizes& z) {
  const SpBenchOptions& o = z.o;
  const double e = z.e, a = z.a, B = z.B, n = z.n, N = z.N;
  KindDecodeMemory r;
  double &cache = r.cache, &prefill = r.prefill, &step = r.step, &kept_per_step = r.kept_per_step,
         &reference = r.reference;
  std::string& dims = r.dims;
  const int P = z.P;
  const std::int64_t S = z.S;
  const double token_bytes = z.token_bytes;
  const double H = o.heads, dqk = o.head_dim, dv = o.dim_v, di = o.indexer_dim, k = o.topk;
  const double slots = largest_shard(o, S, P);
  cache = static_cast<double>(attn::dsa_cache_bytes({o.batch, 1, o.indexer_dim, o.head_dim, o.dtype})) * slots;
  prefill = z.prefill_with_reshard(e * (dqk + di), cache, 1);
  // A step (parallel/dsa_decode_cp.cc): the new rows and the owned ones appended; the selection's (score, position)
  // states of k per query (local, global, the kernel's), the candidates' all-gather, topk_indices; the merge's
  // all-gather of (out, lse hi, lo), lse in fp64.
  const double cand = B * n * k, block = a * B * n * H * (dv + 2);
  step = B * n * token_bytes + e * B * n * (dqk + di) + cand * (8 + 3 * (a + 8)) + (P + 1) * cand * (a + 8) +
         (P + 2) * block + 8 * B * H * n;
  kept_per_step = B * n * (H * (e * dv + a) + 8 * k);
  // --check: the keys of every token (made in fp64), the indexer's scores of the steps' queries against them, the
  // selection and the attention's out and lse, their fp64 copies.
  const double all = B * static_cast<double>(S);
  reference = all * (e * (dqk + di) + 8 * std::max(dqk, di)) + (a + 8) * B * N * n * static_cast<double>(S) +
              B * N * n * (token_bytes + 3 * (H * (e * dv + a) + 8 * k) + 16 * H * (dv + 1));
  dims = str_cat("--head-dim ", o.head_dim, ", --indexer-dim ", o.indexer_dim);
  return r;
}

// GDN: the state split by heads, constant in T.
KindDecodeMemory gdn_decode_memory(const DecodeSizes& z) {
  const SpBenchOptions& o = z.o;
  const double e = z.e, a = z.a, B = z.B, n = z.n, N = z.N;
  KindDecodeMemory r;
  double &cache = r.cache, &prefill = r.prefill, &step = r.step, &kept_per_step = r.kept_per_step,
         &reference = r.reference;
  std::string& dims = r.dims;
  const int P = z.P;
  const std::int64_t S = z.S;
  const double threads = z.threads, c = z.c, token_bytes = z.token_bytes, widest = z.widest, t_loc = z.t_loc;
  const PhaseMemory& fwd = z.fwd;
  const double hv = o.heads, hk = o.kv_heads, K = o.head_dim, V = o.dim_v > 0 ? o.dim_v : o.head_dim;
  const double hv_l = hv / P, hk_l = hk / P, C = 2 * hk * K + hv * V, W = o.conv_width;
  attn::GdnCacheSpec spec;
  spec.batch = o.batch;
  spec.value_heads = o.heads / P;
  spec.key_dim = o.head_dim;
  spec.value_dim = static_cast<std::int64_t>(V);
  spec.state_dtype = accumulator_dtype(o.dtype);
  spec.conv_channels = o.conv_width > 0 ? static_cast<std::int64_t>(2 * hk_l * K + hv_l * V) : 0;
  spec.conv_width = std::max<std::int64_t>(1, o.conv_width);
  spec.conv_dtype = o.dtype;
  cache = static_cast<double>(attn::gdn_cache_bytes(spec));
  // The prefill: the short conv's inputs joined (x), convolved (y) and split back into heads, then the training
  // forward; the cache takes its heads' slice of the final state.
  const double conv = W > 0 ? 3 * e * B * t_loc * C : 0;
  prefill = fwd.total() + conv + cache;
  // A step: the new rows, this rank's heads of them (and the conv's window), the state's update, out.
  const double state_l = a * B * hv_l * K * V;
  step = 3 * B * n * token_bytes + (W > 0 ? e * B * (n + W) * C : 0) + state_l + e * B * n * hv_l * V;
  kept_per_step = e * B * n * hv_l * V;
  // --check: every token's inputs (all heads, made in fp64), the conv's outputs, this rank's heads, out and the
  // final state of the single-rank forward, its scratch, the fp64 copies.
  const double all = B * static_cast<double>(S);
  reference = all * (3 * token_bytes + 8 * widest) + all * e * hv_l * V * 3 + 2 * state_l +
              threads * c * (17 * o.chunk_size * std::max<double>(o.chunk_size, K) + 3 * K * K) +
              B * N * n * 16 * hv_l * V;
  dims = str_cat("--heads ", o.heads, ", --head-dim ", o.head_dim);
  return r;
}

}  // namespace

MemoryEstimate estimate_decode_memory(const SpBenchOptions& o, int world_rank) {
  const DecodeOptions& d = o.decode;
  const double e = static_cast<double>(dtype_size(o.dtype)),
               a = static_cast<double>(dtype_size(accumulator_dtype(o.dtype)));
  const double B = static_cast<double>(o.batch), n = static_cast<double>(d.new_tokens);
  const double N = static_cast<double>(d.decode_steps), T = static_cast<double>(d.context);
  const int pr = o.grid.ring_size, pu = o.grid.ulysses_size, P = pr * pu;
  const std::int64_t S = d.context + d.chunk + d.decode_steps * d.new_tokens;  // the cache's capacity
  DecodeSizes z{o, e,  a,  B, n, N, static_cast<double>(o.threads), o.dtype == DType::kFloat64 ? 8.0 : 4.0, 0, 0,
                0, pr, pu, P, S, {}};
  const double t_loc = z.local_rows(d.context);  // rows of the prompt per rank
  const bool fill = d.prefill == "fill";
  // The inputs: bytes per token of each token input (all heads, as DecodeInputs::rows makes them) and whole inputs.
  const DecodeArrays arrays = decode_arrays(o);
  double token_bytes = 0, prompt_token_bytes = 0, whole = 0, widest = 0, widest_prompt = 0;
  for (const DecodeInput& in : arrays.inputs) {
    const double bytes = static_cast<double>(shape_numel(in.row)) * (in.state_dtype ? a : e);
    if (!in.per_token) {
      whole += bytes;
      continue;
    }
    token_bytes += bytes;
    widest = std::max(widest, static_cast<double>(shape_numel(in.row)));
    // --prefill fill reads the keys only: MHA k, v; DSA c, k_idx.
    const bool key = in.name == "k" || in.name == "v" || in.name == "c" || in.name == "k_idx";
    if (fill && !key) continue;
    prompt_token_bytes += bytes;
    widest_prompt = std::max(widest_prompt, static_cast<double>(shape_numel(in.row)));
  }
  double inputs = B * t_loc * prompt_token_bytes + whole;

  z.t_loc = t_loc;
  z.token_bytes = token_bytes;
  z.widest = widest;
  z.fwd = fill ? PhaseMemory{} : training_forward(o, d.context);
  const KindDecodeMemory r = o.attn == "mha"   ? mha_decode_memory(z)
                             : o.attn == "dsa" ? dsa_decode_memory(z)
                                               : gdn_decode_memory(z);
  inputs += r.chunk_inputs;
  const double cache = r.cache, prefill = r.prefill, chunk = r.chunk, kept_per_step = r.kept_per_step;
  const double step = r.step, reference = r.reference;
  const std::string& dims = r.dims;
  const double kept = o.check || !o.dump_dir.empty() ? N * kept_per_step : 0;

  MemoryEstimate m;
  const double work = std::max({prefill, chunk, step + kept});
  m.ledger = {{"prompt inputs", inputs},
              {"persistent cache", cache},
              {work == prefill ? "prefill"
               : work == chunk ? "chunk prefill"
                               : "decode steps",
               work}};
  // Host arrays: the layout of the prompt (8 bytes per slot, and this rank's positions), the rows made in fp64
  // before their conversion (transient), the --inputs files, --check's reference, --dump's gathered outputs.
  m.host.emplace_back("prompt layout", 8 * (t_loc * P + t_loc));
  m.host.emplace_back("inputs made in fp64 (transient)", 8 * B * t_loc * widest_prompt);
  if (!o.inputs_dir.empty()) {
    const double files = B * (T + N * n) * token_bytes + whole;  // the arrays, when a file is missing
    m.host.emplace_back("loaded inputs (--inputs, every rank)",
                        loaded_input_bytes(o, decode_input_specs(o, arrays.inputs), files));
  }
  if (o.check) m.host.emplace_back("single-rank reference (--check, every rank)", reference + N * kept_per_step);
  if (!o.dump_dir.empty()) {
    double outputs = 0;
    for (const TensorSpec& s : arrays.outputs) outputs += static_cast<double>(shape_numel(s.shape)) * 8;
    m.host.emplace_back("gathered outputs (--dump, every rank)", 2 * outputs);
  }
  if (o.dump_inputs && world_rank == 0) {
    const double all = B * (T + N * n);
    m.host.emplace_back("dumped inputs (--dump-inputs, rank 0)", all * token_bytes * (1 + 16 / e) + 2 * whole);
  }
  m.size_flags = str_cat("--context ", d.context, ", --decode-steps ", d.decode_steps, " x --new-tokens ", d.new_tokens,
                         ", --batch ", o.batch, " or ", dims);
  return m;
}

}  // namespace seqpar::bench
