// sp_bench --mode decode (benchmarks/sp_bench_decode.h): MHA / GQA with a token-sharded K/V cache, GDN with its
// state split by heads (parallel/decode_cp.h).
#include "benchmarks/sp_bench_decode.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "attention/gdn_decode.h"
#include "attention/mha.h"
#include "benchmarks/sp_bench_decode_internal.h"
#include "benchmarks/sp_bench_options.h"
#include "parallel/decode_cp.h"
#include "runtime/comm_factory.h"
#include "runtime/error.h"
#include "runtime/sp_grid.h"
#include "runtime/tensor_ops.h"

namespace seqpar::bench {
namespace decode_detail {

constexpr double kMiB = 1024.0 * 1024.0;

// Deterministic inputs: element (b, t, h, x) of input `salt` is a function of the seed and its global index in the
// whole [B, S, H, X] sequence, so that every rank makes the rows of any positions without the rest.
double input_value(std::uint64_t seed, int salt, std::uint64_t index, double lo, double hi) {
  std::uint64_t z = seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(salt) * 0xbf58476d1ce4e5b9ull + index;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return lo + (hi - lo) * static_cast<double>(z >> 11) * 0x1.0p-53;
}

// Rows `positions` of the [B, S, heads, width] input `salt` (width 0: [B, S, heads]), in `dtype`.
Tensor make_rows(const SpBenchOptions& o, int salt, std::int64_t S, const std::vector<std::int64_t>& positions,
                 std::int64_t heads, std::int64_t width, double lo, double hi) {
  const std::int64_t B = o.batch, n = static_cast<std::int64_t>(positions.size()), w = std::max<std::int64_t>(width, 1);
  std::vector<double> values(static_cast<std::size_t>(B * n * heads * w));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t e = 0; e < heads * w; ++e) {
        const std::uint64_t index = static_cast<std::uint64_t>((b * S + positions[i]) * heads * w + e);
        values[static_cast<std::size_t>((b * n + i) * heads * w + e)] = input_value(o.seed, salt, index, lo, hi);
      }
    }
  }
  Shape shape{B, n, heads};
  if (width > 0) shape.push_back(width);
  Tensor t = Tensor::empty(shape, o.dtype, MemCategory::kWorkspace);
  copy_convert(TensorView(values.data(), DType::kFloat64, shape), t);
  return t;
}

std::vector<std::int64_t> range(std::int64_t begin, std::int64_t end) {
  std::vector<std::int64_t> v;
  for (std::int64_t t = begin; t < end; ++t) v.push_back(t);
  return v;
}

std::int64_t persistent_bytes() {
  return memory_ledger().snapshot().current[static_cast<int>(MemCategory::kPersistentCache)];
}

// The q-th quantile (nearest rank) of v.
double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1;
  return v[std::min(i, v.size() - 1)];
}

// Tolerance of a decode result against the single-rank kernels, relative to the largest reference value: the same
// arithmetic in another order (fp64: 1e-12; fp32: 1e-5), or the rounding of a 16-bit output (1e-2).
double tolerance(DType dtype) { return dtype == DType::kFloat64 ? 1e-12 : (dtype == DType::kFloat32 ? 1e-5 : 1e-2); }

double rel_err(const TensorView& got, const TensorView& want) {
  Tensor g = Tensor::copy_of(got, DType::kFloat64, MemCategory::kWorkspace);
  Tensor w = Tensor::copy_of(want, DType::kFloat64, MemCategory::kWorkspace);
  double err = 0, ref = 0;
  for (std::int64_t i = 0; i < g.numel(); ++i) {
    const double a = g.data_as<double>()[i], b = w.data_as<double>()[i];
    if (std::isinf(b) && a == b) continue;
    err = std::max(err, std::fabs(a - b));
    ref = std::max(ref, std::isfinite(b) ? std::fabs(b) : 0.0);
  }
  return ref > 0 ? err / ref : err;
}

}  // namespace decode_detail

namespace {

using namespace decode_detail;

DecodeReport run_mha(Communicator& world, const CpGroups& groups, const SpBenchOptions& o) {
  const DecodeOptions& d = o.decode;
  const std::int64_t B = o.batch, hq = o.heads, hkv = o.kv_heads, D = o.head_dim, T = d.context;
  // The prompt [0, T), the optional chunk [T, T0), the decode steps [T0, S).
  const std::int64_t n = d.new_tokens, N = d.decode_steps, T0 = T + d.chunk, S = T0 + N * n;
  MhaDecodeConfig cfg;
  cfg.shard = parse_cache_shard(d.cache_shard);
  cfg.interleave = d.interleave;
  cfg.prefill_impl = o.impl;
  MhaDecodeContextParallel layer(groups, cfg);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, T, o.layout);
  const std::vector<std::int64_t> pos = layout.positions(groups.sp_rank());
  const bool fill = d.prefill == "fill";  // the prompt's K/V only: no queries needed
  const Tensor q = make_rows(o, 1, S, fill ? std::vector<std::int64_t>{} : pos, hq, D);
  const Tensor k = make_rows(o, 2, S, pos, hkv, D);
  const Tensor v = make_rows(o, 3, S, pos, hkv, D);
  // The chunk of a persistent-cache prefill (--chunk), at T + its layout's positions.
  std::optional<SequenceLayout> chunk_layout;
  std::vector<std::int64_t> chunk_pos;
  if (d.chunk > 0) {
    chunk_layout.emplace(o.layout, d.chunk, groups.ring.size());
    for (std::int64_t t : chunk_layout->positions(groups.ring.rank())) chunk_pos.push_back(T + t);
  }
  const Tensor qc = make_rows(o, 1, S, chunk_pos, hq, D), kc = make_rows(o, 2, S, chunk_pos, hkv, D);
  const Tensor vc = make_rows(o, 3, S, chunk_pos, hkv, D);
  const ChunkPrefillMode chunk_mode = parse_chunk_prefill_mode(d.chunk_mode);
  DecodeReport rep;
  const std::int64_t before = persistent_bytes();
  std::optional<ShardedKvCache> cache;
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    cache.reset();
    cache.emplace(layer.make_cache(B, S, hkv, D, o.dtype));
    const double t_prefill = time_once(world, [&] {
      if (fill) {
        layer.fill(*cache, layout, k, v);
      } else {
        layer.prefill(*cache, layout, q, k, v);
      }
    });
    if (it >= o.warmup) rep.prefill_s.push_back(t_prefill);
    if (d.chunk == 0) continue;
    const ChunkPrefillMode used =
        chunk_mode == ChunkPrefillMode::kAuto ? layer.choose_chunk_mode(*cache, d.chunk, hq) : chunk_mode;
    rep.chunk_mode = chunk_prefill_mode_name(used);
    rep.chunk_pass_bytes =
        used == ChunkPrefillMode::kPassQ ? layer.pass_q_bytes(*cache, d.chunk, hq) : layer.pass_kv_bytes(*cache);
    layer.reset_counters();
    const double t_chunk = time_once(world, [&] { layer.extend(*cache, *chunk_layout, qc, kc, vc, chunk_mode); });
    rep.chunk_bytes = layer.counters().bytes_sent;
    if (it >= o.warmup) rep.chunk_s.push_back(t_chunk);
  }
  std::vector<double> cache_bytes{static_cast<double>(persistent_bytes() - before)};
  all_reduce(world, cache_bytes, ReduceOp::kMax);
  rep.cache_bytes = cache_bytes[0];
  rep.cache_formula = static_cast<double>(attn::mha_kv_cache_bytes({B, S, hkv, D, o.dtype})) / groups.sp.size();
  rep.formula_text = str_cat("M_KV / P = 2 B Hkv (T + chunk + N n) D bytes / (ring x ulysses)");
  layer.reset_counters();
  std::vector<Tensor> outs, lses;
  for (std::int64_t step = 0; step < N; ++step) {
    const std::vector<std::int64_t> rows = range(T0 + step * n, T0 + (step + 1) * n);
    const Tensor qd = make_rows(o, 1, S, rows, hq, D), kd = make_rows(o, 2, S, rows, hkv, D);
    const Tensor vd = make_rows(o, 3, S, rows, hkv, D);
    const double t0 = now_s();
    DecodeOutput r = layer.decode(*cache, qd, kd, vd);
    rep.step_s.push_back(now_s() - t0);
    if (o.check) {
      outs.push_back(std::move(r.out));
      lses.push_back(std::move(r.lse));
    }
  }
  all_reduce(world, rep.step_s, ReduceOp::kMax);
  rep.bytes_per_step = layer.counters().bytes_sent / N;
  rep.bytes_formula = layer.decode_bytes_per_step(B, n, hq, D, o.dtype);
  if (!o.check) return rep;
  rep.checked = true;
  // The training kernel over the whole sequence, rows T.. (its queries at T..S-1 against every key, causal), for this
  // rank's heads (under Ulysses: query heads [u Hq / Pu, ...) and their KV heads), on every rank.
  const std::int64_t pu = groups.ulysses_size(), hq_l = hq / pu, hkv_l = hkv / pu, u = groups.ulysses.rank();
  const std::vector<std::int64_t> all = range(0, S), tail = range(T0, S);
  const auto heads = [&](const Tensor& t, std::int64_t local) { return slice_dim(t, 2, u * local, (u + 1) * local); };
  const Tensor kf = heads(make_rows(o, 2, S, all, hkv, D), hkv_l), vf = heads(make_rows(o, 3, S, all, hkv, D), hkv_l);
  const Tensor qt = heads(make_rows(o, 1, S, tail, hq, D), hq_l);
  attn::MhaForwardArgs a;
  a.q = qt;
  a.k = kf;
  a.v = vf;
  a.q_pos = tail;
  a.mask.causal = true;
  Tensor out = Tensor::empty({B, N * n, hq_l, D}, o.dtype, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({B, hq_l, N * n}, accumulator_dtype(o.dtype), MemCategory::kWorkspace);
  attn::mha_forward(a, out, lse);
  for (std::int64_t step = 0; step < N; ++step) {
    const std::vector<std::int64_t> rows = range(step * n, (step + 1) * n);
    Tensor want_out = Tensor::empty({B, n, hq_l, D}, o.dtype, MemCategory::kWorkspace);
    Tensor want_lse = Tensor::empty({B, hq_l, n}, lse.dtype(), MemCategory::kWorkspace);
    gather_rows(out, 1, rows, want_out);
    gather_rows(lse, 2, rows, want_lse);
    rep.out_err = std::max(rep.out_err, rel_err(outs[step], want_out));
    rep.lse_err = std::max(rep.lse_err, rel_err(lses[step], want_lse));
  }
  std::vector<double> errs{rep.out_err, rep.lse_err};
  all_reduce(world, errs, ReduceOp::kMax);
  rep.out_err = errs[0];
  rep.lse_err = errs[1];
  rep.passed = rep.out_err <= tolerance(o.dtype) && rep.lse_err <= tolerance(accumulator_dtype(o.dtype));
  return rep;
}

DecodeReport run_gdn(Communicator& world, const CpGroups& groups, const SpBenchOptions& o) {
  const DecodeOptions& d = o.decode;
  const std::int64_t B = o.batch, hv = o.heads, hk = o.kv_heads, K = o.head_dim;
  const std::int64_t V = o.dim_v > 0 ? o.dim_v : o.head_dim, T = d.context;
  const std::int64_t n = d.new_tokens, N = d.decode_steps, S = T + N * n;
  GdnCpConfig cfg;
  cfg.mode = parse_gdn_cp_mode(o.gdn_mode);
  cfg.chunk_size = o.chunk_size;
  GdnDecodeContextParallel layer(groups, cfg, hv, hk);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, T, o.layout);
  const std::vector<std::int64_t> pos = layout.positions(groups.sp_rank());
  // Inputs of the token range `rows`: q, k, v, g (log decay in [-0.1, -0.001)), beta in [0.05, 0.5).
  const auto inputs = [&](const std::vector<std::int64_t>& rows) {
    return std::array<Tensor, 5>{make_rows(o, 1, S, rows, hk, K), make_rows(o, 2, S, rows, hk, K),
                                 make_rows(o, 3, S, rows, hv, V), make_rows(o, 4, S, rows, hv, 0, -0.1, -0.001),
                                 make_rows(o, 5, S, rows, hv, 0, 0.05, 0.5)};
  };
  const std::array<Tensor, 5> prompt = inputs(pos);
  DecodeReport rep;
  const std::int64_t before = persistent_bytes();
  std::optional<attn::GdnCache> cache;
  rep.prefill_s = time_prefill(world, o, [&] {
    cache.reset();
    cache.emplace(layer.make_cache(B, K, V, o.dtype));
    layer.prefill(*cache, layout, prompt[0], prompt[1], prompt[2], prompt[3], prompt[4]);
  });
  std::vector<double> cache_bytes{static_cast<double>(persistent_bytes() - before)};
  all_reduce(world, cache_bytes, ReduceOp::kMax);
  rep.cache_bytes = cache_bytes[0];
  rep.cache_formula = static_cast<double>(attn::gdn_cache_bytes(cache->spec()));
  rep.formula_text = "B (Hv / P) K V bytes(state), constant in T";
  std::vector<Tensor> outs;
  for (std::int64_t step = 0; step < N; ++step) {
    const std::array<Tensor, 5> in = inputs(range(T + step * n, T + (step + 1) * n));
    const double t0 = now_s();
    DecodeOutput r = layer.decode(*cache, in[0], in[1], in[2], in[3], in[4]);
    rep.step_s.push_back(now_s() - t0);
    if (o.check) outs.push_back(std::move(r.out));
  }
  all_reduce(world, rep.step_s, ReduceOp::kMax);
  if (!o.check) return rep;
  rep.checked = true;
  // The single-rank chunked kernel over the whole sequence for this rank's heads (value heads from head_offset(), the
  // key heads they read), on every rank: rows T.. of out and the final state.
  const std::int64_t lv = layer.local_value_heads(), lk = layer.local_key_heads(), r = groups.sp_rank();
  const std::array<Tensor, 5> full = inputs(range(0, S));
  const auto heads = [&](const Tensor& t, std::int64_t local) { return slice_dim(t, 2, r * local, (r + 1) * local); };
  const Tensor q = heads(full[0], lk), k = heads(full[1], lk), v = heads(full[2], lv);
  const Tensor g = heads(full[3], lv), beta = heads(full[4], lv);
  attn::GdnForwardArgs a = attn::gdn_args(q, k, v, g, beta);
  a.chunk_size = o.chunk_size;
  const DType sd = accumulator_dtype(o.dtype);
  Tensor out = Tensor::empty({B, S, lv, V}, o.dtype, MemCategory::kWorkspace);
  Tensor final_state = Tensor::empty({B, lv, K, V}, sd, MemCategory::kWorkspace);
  attn::gdn_forward(a, out, final_state);
  for (std::int64_t step = 0; step < N; ++step) {
    Tensor want = Tensor::empty({B, n, lv, V}, o.dtype, MemCategory::kWorkspace);
    gather_rows(out, 1, range(T + step * n, T + (step + 1) * n), want);
    rep.out_err = std::max(rep.out_err, rel_err(outs[step], want));
  }
  rep.state_err = rel_err(cache->state(), final_state);
  std::vector<double> errs{rep.out_err, rep.state_err};
  all_reduce(world, errs, ReduceOp::kMax);
  rep.out_err = errs[0];
  rep.state_err = errs[1];
  rep.passed = rep.out_err <= tolerance(o.dtype) && rep.state_err <= tolerance(sd);
  return rep;
}

void check_decode_options(const SpBenchOptions& o) {
  const DecodeOptions& d = o.decode;
  SEQPAR_CHECK(o.attn == "mha" || o.attn == "gdn" || o.attn == "dsa", "--mode decode: --attn ", o.attn,
               " has no decode");
  SEQPAR_CHECK(o.grid.dp_size == 1, "--mode decode: --dp-size ", o.grid.dp_size, " must be 1");
  SEQPAR_CHECK(d.context >= 1 && d.decode_steps >= 1 && d.new_tokens >= 1 && d.interleave >= 1, "--context ", d.context,
               ", --decode-steps ", d.decode_steps, ", --new-tokens ", d.new_tokens, " and --interleave ", d.interleave,
               " must be >= 1");
  parse_cache_shard(d.cache_shard);
  SEQPAR_CHECK(o.conv_width == 0,
               "--mode decode: --conv-width is not supported yet (the short conv's tail is in "
               "attn::GdnCache, its decode under CP is not)");
  SEQPAR_CHECK(
      (o.window == 0 || o.attn == "dsa") && o.softcap == 0 && !o.alibi && !o.sinks && o.dropout == 0 && !o.rope,
      "--mode decode: --window (but for --attn dsa's indexer), --softcap, --alibi, --sinks, --dropout and --rope "
      "are not supported yet (decode is plain causal attention)");
  SEQPAR_CHECK(d.prefill == "forward" || d.prefill == "fill", "--prefill '", d.prefill,
               "' is not one of forward, fill");
  SEQPAR_CHECK(d.prefill == "forward" || o.attn != "gdn", "--prefill fill needs --attn mha or dsa");
  SEQPAR_CHECK(d.chunk >= 0, "--chunk ", d.chunk, " must be >= 0");
  SEQPAR_CHECK(d.chunk == 0 || (o.attn == "mha" && o.grid.ulysses_size == 1),
               "--chunk (a persistent-cache prefill) needs --attn mha and --ulysses-size 1");
  parse_chunk_prefill_mode(d.chunk_mode);
  if (d.chunk > 0) {
    try {
      SequenceLayout(o.layout, d.chunk, o.grid.ring_size);
    } catch (const Error& e) {
      SEQPAR_THROW("--chunk ", d.chunk, " (--layout ", layout_name(o.layout), "): ", e.message());
    }
  }
  SEQPAR_CHECK(!o.check || d.prefill == "forward", "--check needs --prefill forward");
  SEQPAR_CHECK(o.check_against == "1-rank", "--mode decode: --check-against ", o.check_against,
               " is not supported (decode checks against the single-rank training forward)");
  SEQPAR_CHECK(o.inputs_dir.empty() && o.dump_dir.empty(), "--mode decode: --inputs and --dump are not supported yet");
  try {
    SequenceLayout(o.layout, d.context, o.grid.ring_size, o.grid.ulysses_size);
  } catch (const Error& e) {
    SEQPAR_THROW("--context ", d.context, " (--layout ", layout_name(o.layout), "): ", e.message());
  }
}

void print_decode_report(const SpBenchOptions& o, const DecodeReport& r, int world_size) {
  const DecodeOptions& d = o.decode;
  std::printf("# sp_bench --mode decode (seqpar %s), %d rank(s), grid ulysses %d x ring %d, attn %s, dtype %s\n",
              git_commit(), world_size, o.grid.ulysses_size, o.grid.ring_size, o.attn.c_str(), dtype_name(o.dtype));
  std::printf("# context %lld, decode steps %lld x %lld new token(s), cache shard %s",
              static_cast<long long>(d.context), static_cast<long long>(d.decode_steps),
              static_cast<long long>(d.new_tokens), d.cache_shard.c_str());
  if (d.cache_shard == "interleave") std::printf(" %lld", static_cast<long long>(d.interleave));
  const std::string shapes =
      o.attn == "mha"   ? str_cat("B=", o.batch, " Hq=", o.heads, " Hkv=", o.kv_heads, " D=", o.head_dim, " causal")
      : o.attn == "dsa" ? str_cat("B=", o.batch, " H=", o.heads, " Dqk=", o.head_dim, " Dv=", o.dim_v, " topk=", o.topk,
                                  " indexer Hi=", o.indexer_heads, " Di=", o.indexer_dim, " select=", o.dsa_select,
                                  o.window > 0 ? str_cat(" window=", o.window) : std::string())
                        : str_cat("B=", o.batch, " Hv=", o.heads, " Hk=", o.kv_heads, " K=", o.head_dim,
                                  " V=", o.dim_v > 0 ? o.dim_v : o.head_dim, " mode=", o.gdn_mode);
  std::printf(", prefill %s, layout %s, %s\n", d.prefill.c_str(), layout_name(o.layout), shapes.c_str());
  std::printf("# %-14s %12s %12s\n", "phase", "median_ms", "p99_ms");
  std::printf("  %-14s %12.3f %12s\n", "prefill", median(r.prefill_s) * 1e3, "-");
  if (!r.chunk_s.empty()) {
    std::printf("  %-14s %12.3f %12s   (%s; sent per rank %lld bytes, of which the route's %lld)\n", "chunk prefill",
                median(r.chunk_s) * 1e3, "-", r.chunk_mode.c_str(), static_cast<long long>(r.chunk_bytes),
                static_cast<long long>(r.chunk_pass_bytes));
  }
  std::printf("  %-14s %12.3f %12.3f\n", "decode step", median(r.step_s) * 1e3, quantile(r.step_s, 0.99) * 1e3);
  std::printf("# bytes per step (sent per rank): %lld (formula %lld)\n", static_cast<long long>(r.bytes_per_step),
              static_cast<long long>(r.bytes_formula));
  std::printf("# cache per rank: %.3f MiB (formula %s: %.3f MiB)\n", r.cache_bytes / kMiB, r.formula_text.c_str(),
              r.cache_formula / kMiB);
  if (r.checked) {
    std::printf("# check %s: out rel err %.3g, %s rel err %.3g (tolerance %.3g)\n", r.passed ? "passed" : "FAILED",
                r.out_err, o.attn == "gdn" ? "final_state" : "lse", o.attn == "gdn" ? r.state_err : r.lse_err,
                tolerance(o.dtype));
    if (r.topk_mismatches >= 0) {
      std::printf("# topk_indices: %lld entries differ from the single-rank selection\n",
                  static_cast<long long>(r.topk_mismatches));
    }
  }
  std::fflush(stdout);
}

nlohmann::json decode_json(const SpBenchOptions& o, const DecodeReport& r, int world_size) {
  const DecodeOptions& d = o.decode;
  nlohmann::json j;
  j["mode"] = "decode";
  j["commit"] = git_commit();
  j["date_utc"] = utc_now_iso8601();
  j["attn"] = o.attn;
  j["dtype"] = dtype_name(o.dtype);
  j["world_size"] = world_size;
  j["ring_size"] = o.grid.ring_size;
  j["ulysses_size"] = o.grid.ulysses_size;
  j["batch"] = o.batch;
  j["heads"] = o.heads;
  j["kv_heads"] = o.kv_heads;
  j["head_dim"] = o.head_dim;
  if (o.attn == "dsa") {
    j["dsa"] = {{"dim_v", o.dim_v},
                {"topk", o.topk},
                {"indexer_heads", o.indexer_heads},
                {"indexer_dim", o.indexer_dim},
                {"window", o.window},
                {"select", o.dsa_select}};
  }
  j["context"] = d.context;
  j["decode_steps"] = d.decode_steps;
  j["new_tokens"] = d.new_tokens;
  j["cache_shard"] = d.cache_shard;
  j["interleave"] = d.interleave;
  j["prefill_mode"] = d.prefill;
  j["prefill_s"] = {{"median", median(r.prefill_s)}, {"iterations", r.prefill_s}};
  if (!r.chunk_s.empty()) {
    j["chunk"] = d.chunk;
    j["chunk_prefill_s"] = {{"median", median(r.chunk_s)}, {"iterations", r.chunk_s}};
    j["chunk_mode"] = r.chunk_mode;
    j["chunk_bytes_sent"] = r.chunk_bytes;
    j["chunk_route_bytes"] = r.chunk_pass_bytes;
  }
  j["decode_step_s"] = {{"median", median(r.step_s)}, {"p99", quantile(r.step_s, 0.99)}, {"steps", r.step_s}};
  j["bytes_per_step"] = r.bytes_per_step;
  j["bytes_per_step_formula"] = r.bytes_formula;
  j["cache_mib_per_rank"] = r.cache_bytes / kMiB;
  j["cache_mib_formula"] = r.cache_formula / kMiB;
  if (r.checked) {
    j["check"] = {{"passed", r.passed},
                  {"out_rel_err", r.out_err},
                  {"lse_rel_err", r.lse_err},
                  {"final_state_rel_err", r.state_err}};
    if (r.topk_mismatches >= 0) j["check"]["topk_indices_mismatches"] = r.topk_mismatches;
  }
  return j;
}

}  // namespace

void add_decode_options(cxxopts::Options& spec) {
  // clang-format off
  spec.add_options("decode")
    ("mode", "train (the default: forward and backward of one layer) | decode (prefill, then decode steps)",
     cxxopts::value<std::string>()->default_value("train"))
    ("context", "decode: prompt length T (K, M suffixes; --seq is not used by --mode decode, but still has to fit "
                "the grid)", cxxopts::value<std::string>()->default_value("4K"))
    ("decode-steps", "decode: steps N after the prompt", cxxopts::value<std::int64_t>()->default_value("16"))
    ("new-tokens", "decode: new tokens (queries) n per step, e.g. speculative drafts",
     cxxopts::value<std::int64_t>()->default_value("1"))
    ("cache-shard", "decode, MHA: K/V cache sharding over the ring: contiguous | interleave",
     cxxopts::value<std::string>()->default_value("interleave"))
    ("interleave", "decode, MHA: I of --cache-shard interleave (token t on rank (t / I) mod P)",
     cxxopts::value<std::int64_t>()->default_value("1"))
    ("chunk", "decode, MHA: a further prompt chunk of C tokens after the prompt, prefilled against the cache "
              "(persistent-cache prefill; 0: none)", cxxopts::value<std::string>()->default_value("0"))
    ("chunk-mode", "decode, MHA: the chunk's route: auto (fewer bytes) | pass-kv | pass-q",
     cxxopts::value<std::string>()->default_value("auto"))
    ("prefill", "decode: forward (the prompt's attention under CP fills the cache) | fill (MHA: the prompt's K/V "
                "only, no attention)", cxxopts::value<std::string>()->default_value("forward"));
  // clang-format on
}

DecodeOptions parse_decode_options(const cxxopts::ParseResult& r) {
  DecodeOptions d;
  try {
    d.mode = r["mode"].as<std::string>();
    d.context = parse_size(r["context"].as<std::string>(), "context");
    d.decode_steps = r["decode-steps"].as<std::int64_t>();
    d.new_tokens = r["new-tokens"].as<std::int64_t>();
    d.cache_shard = r["cache-shard"].as<std::string>();
    d.interleave = r["interleave"].as<std::int64_t>();
    d.prefill = r["prefill"].as<std::string>();
    d.chunk = parse_size(r["chunk"].as<std::string>(), "chunk");
    d.chunk_mode = r["chunk-mode"].as<std::string>();
  } catch (const cxxopts::exceptions::exception& e) {
    SEQPAR_THROW("decode flags: ", e.what());
  }
  SEQPAR_CHECK(d.mode == "train" || d.mode == "decode", "--mode '", d.mode, "' is not one of train, decode");
  if (d.mode == "train") {
    for (const char* flag :
         {"context", "decode-steps", "new-tokens", "cache-shard", "interleave", "prefill", "chunk", "chunk-mode"}) {
      SEQPAR_CHECK(r.count(flag) == 0, "--", flag, " needs --mode decode");
    }
  }
  return d;
}

int run_decode_bench(const SpBenchOptions& o, const WorldPlace& place) {
  check_decode_options(o);  // local: every rank fails alike, before any communication
  auto world = make_world_communicator(o.backend);
  check_options_agree(*world, o);
  const DecodeOptions& d = o.decode;
  Fingerprint fp("sp_bench decode options");
  fp.add_int("--context", d.context)
      .add_int("--decode-steps", d.decode_steps)
      .add_int("--new-tokens", d.new_tokens)
      .add_text("--cache-shard", d.cache_shard)
      .add_int("--interleave", d.interleave)
      .add_text("--prefill", d.prefill)
      .add_int("--chunk", d.chunk)
      .add_text("--chunk-mode", d.chunk_mode);
  AgreementCheck(AgreementMode::kAlways).run(*world, fp);
  SpGrid grid(*world, o.grid);
  const CpGroups groups = CpGroups::from(grid);
  const DecodeReport rep = o.attn == "mha"   ? run_mha(*world, groups, o)
                           : o.attn == "dsa" ? run_dsa(*world, groups, o)  // benchmarks/sp_bench_decode_dsa.cc
                                             : run_gdn(*world, groups, o);
  if (place.rank == 0) {
    print_decode_report(o, rep, place.size);
    if (!o.json_path.empty()) {
      const nlohmann::json j = decode_json(o, rep, place.size);
      write_file_atomic(o.json_path, [&](std::ostream& out) { out << j.dump(2) << "\n"; });
    }
  }
  barrier(*world);
  if (rep.checked && !rep.passed && place.rank == 0) {
    std::fprintf(stderr, "sp_bench: check failed: decode results differ from the single-rank forward\n");
  }
  return rep.checked && !rep.passed ? 1 : 0;
}

}  // namespace seqpar::bench
