// sp_bench --mode decode (benchmarks/sp_bench_decode.h): MHA / GQA with a token-sharded K/V cache, GDN with its
// state split by heads (parallel/decode_cp.h).
#include "benchmarks/sp_bench_decode.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "attention/gdn_decode.h"
#include "attention/mha.h"
#include "attention/reference/gdn_reference.h"
#include "attention/reference/mha_reference.h"
#include "benchmarks/bench_common.h"
#include "benchmarks/npy.h"
#include "benchmarks/sp_bench_decode_arrays.h"
#include "benchmarks/sp_bench_decode_internal.h"
#include "benchmarks/sp_bench_io.h"
#include "benchmarks/sp_bench_memory.h"
#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_timing.h"
#include "parallel/decode_cp.h"
#include "runtime/comm_factory.h"
#include "runtime/cp_grid.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"
#include "runtime/version.h"

namespace seqpar::bench {
namespace decode_detail {

constexpr double kMiB = 1024.0 * 1024.0;

std::int64_t persistent_bytes() {
  return memory_ledger().snapshot().current[static_cast<int>(MemCategory::kPersistentCache)];
}

double ledger_peak(Communicator& world) {
  std::vector<double> peak{static_cast<double>(memory_ledger().snapshot().total_peak)};
  all_reduce(world, peak, ReduceOp::kMax);
  return peak[0];
}

// The q-th quantile (nearest rank) of v.
double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1;
  return v[std::min(i, v.size() - 1)];
}

// Tolerance of a decode result against the single-rank kernels, relative to the largest reference value: the same
// arithmetic in another order (fp64: 1e-12; fp32: 1e-5), or the rounding of a 16-bit output (1e-2). Against the
// naive fp64 references the fp64 kernels differ by their other summation order, amplified by the softmax (1e-10, the
// training check's fp64 rule); the other dtypes as above (fp32 accumulators, 16-bit outputs rounded once).
double tolerance(DType dtype, bool vs_reference) {
  if (dtype == DType::kFloat64) return vs_reference ? 1e-10 : 1e-12;
  return dtype == DType::kFloat32 ? 1e-5 : 1e-2;
}

Tensor fp64_copy(const TensorView& t) { return Tensor::copy_of(t, DType::kFloat64, MemCategory::kWorkspace); }

// The expected out [B, Sq, Hq, D] and lse [B, Hq, Sq] of causal attention of q (at q_pos) to k, v: the training kernel
// in `dtype`, or with vs_reference the naive fp64 attention of attention/reference on fp64 copies of q, k, v.
std::pair<Tensor, Tensor> expected_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                             std::span<const std::int64_t> q_pos, bool vs_reference, DType dtype) {
  attn::MhaForwardArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.q_pos = q_pos;
  a.mask.causal = true;
  const std::int64_t B = a.q.dim(0), Sq = a.q.dim(1), Hq = a.q.dim(2), D = a.q.dim(3);
  const DType od = vs_reference ? DType::kFloat64 : dtype, ld = vs_reference ? od : accumulator_dtype(dtype);
  Tensor out = Tensor::empty({B, Sq, Hq, D}, od, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({B, Hq, Sq}, ld, MemCategory::kWorkspace);
  if (vs_reference) {
    const Tensor q64 = fp64_copy(a.q), k64 = fp64_copy(a.k), v64 = fp64_copy(a.v);
    a.q = q64;
    a.k = k64;
    a.v = v64;
    attn::reference::mha_forward(a, out, lse);
  } else {
    attn::mha_forward(a, out, lse);
  }
  return {std::move(out), std::move(lse)};
}

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

// The per-step results [.., n, ..] (along `dim`) of N steps side by side: [.., N n, ..].
Tensor concat_steps(const std::vector<Tensor>& steps, int dim) {
  Shape shape = steps.front().shape();
  const std::int64_t n = shape[dim];
  shape[dim] = n * static_cast<std::int64_t>(steps.size());
  Tensor all = Tensor::empty(shape, steps.front().dtype(), MemCategory::kWorkspace);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    scatter_rows(steps[i], dim, token_range(static_cast<std::int64_t>(i) * n, static_cast<std::int64_t>(i + 1) * n),
                 all);
  }
  return all;
}

// The full [.., H, ..] array `full_shape` from every CP rank's block of heads `local` (dimension `dim`, the same size
// on every rank, starting at head `first_head` of the rank): two all-gathers over `sp` (the first heads, then the
// blocks); ranks holding the same heads (the ring group of an MHA run) write the same values.
npy::HostArray gather_heads(Communicator& sp, const Tensor& local, int dim, const Shape& full_shape,
                            std::int64_t first_head) {
  const int P = sp.size();
  std::vector<std::int64_t> firsts(static_cast<std::size_t>(P));
  sp.all_gather(TensorView(&first_head, DType::kInt64, {1}), TensorView(firsts.data(), DType::kInt64, {P}))
      ->wait(kLongWaitS);
  Tensor all = Tensor::empty({P * local.numel()}, local.dtype(), MemCategory::kCommBuffer);
  sp.all_gather(local, all)->wait(kLongWaitS);
  npy::HostArray full(local.dtype(), full_shape);
  const std::int64_t h = local.dim(dim);
  for (int r = 0; r < P; ++r) {
    const TensorView block(static_cast<char*>(all.data()) + r * local.numel() * dtype_size(local.dtype()),
                           local.dtype(), local.shape());
    scatter_rows(block, dim, token_range(firsts[r], firsts[r] + h), full.view());
  }
  return full;
}

}  // namespace decode_detail

namespace {

using namespace decode_detail;

// --check of the MHA decode steps: `out_all` [B, N n, Hq / Pu, D] and `lse_all` of this rank's heads against the
// training kernel over the whole sequence; sets rep's errors and verdict (the largest error over the ranks).
void check_mha_steps(Communicator& world, const CpGroups& groups, const SpBenchOptions& o, const DecodeInputs& in,
                     const Tensor& out_all, const Tensor& lse_all, DecodeReport& rep) {
  const DecodeOptions& d = o.decode;
  const std::int64_t hq = o.heads, hkv = o.kv_heads;
  const std::int64_t n = d.new_tokens, N = d.decode_steps, T0 = d.context + d.chunk, S = T0 + N * n;
  const std::int64_t pu = groups.ulysses_size(), hq_l = hq / pu, hkv_l = hkv / pu, u = groups.ulysses.rank();
  // The training kernel over the whole sequence, rows T0.. (its queries at T0..S-1 against every key, causal), for
  // this rank's heads (under Ulysses: query heads [u Hq / Pu, ...) and their KV heads), on every rank; with
  // --check-against reference the naive fp64 attention of attention/reference on the same rows instead.
  const std::vector<std::int64_t> all = token_range(0, S), tail = token_range(T0, S);
  const auto heads = [&](const Tensor& t, std::int64_t local) { return slice_dim(t, 2, u * local, (u + 1) * local); };
  // KV heads of this rank's query heads: [u Hkv / Pu, ...), or head u / (Pu / Hkv) when Hkv < Pu (replicated)
  const auto kv_heads = [&](const Tensor& t) {
    return hkv % pu == 0 ? heads(t, hkv_l) : slice_dim(t, 2, u / (pu / hkv), u / (pu / hkv) + 1);
  };
  const Tensor kf = kv_heads(in.rows("k", all)), vf = kv_heads(in.rows("v", all));
  const Tensor qt = heads(in.rows("q", tail), hq_l);
  const bool vs_reference = o.check_against == "reference";
  const auto [out, lse] = expected_attention(qt, kf, vf, tail, vs_reference, o.dtype);
  std::vector<double> errs{rel_err(out_all, out), rel_err(lse_all, lse)};
  all_reduce(world, errs, ReduceOp::kMax);
  rep.out_err = errs[0];
  rep.lse_err = errs[1];
  rep.passed = rep.out_err <= tolerance(o.dtype, vs_reference) &&
               rep.lse_err <= tolerance(accumulator_dtype(o.dtype), vs_reference);
}

// --check of the chunk (--chunk): extend's out [B, L, Hq, D] and lse [B, Hq, L] on this rank's L rows of the chunk
// (tokens chunk_pos, -1: a padding row, not compared) against the training kernel (or, with --check-against
// reference, the fp64 reference) of those queries over tokens [0, T + chunk), causal, every head; sets rep's chunk
// errors (the largest over the ranks) and fails rep when they are over the steps' tolerances.
void check_mha_chunk(Communicator& world, const SpBenchOptions& o, const DecodeInputs& in,
                     const std::vector<std::int64_t>& chunk_pos, const PrefillOutput& ext, DecodeReport& rep) {
  const std::int64_t B = o.batch, hq = o.heads, D = o.head_dim, T0 = o.decode.context + o.decode.chunk;
  const std::int64_t L = static_cast<std::int64_t>(chunk_pos.size());
  SEQPAR_CHECK(ext.out.dim(0) == B && ext.out.dim(1) == L && ext.out.dim(2) == hq && ext.lse.dim(2) == L,
               "sp_bench: extend's out ", shape_str(ext.out.shape()), " and lse ", shape_str(ext.lse.shape()),
               " are not [B, L, Hq, D] and [B, Hq, L] for L = ", L, " chunk rows on this rank");
  std::vector<std::int64_t> rows, pos;  // this rank's rows that hold a token, and their tokens
  for (std::int64_t i = 0; i < L; ++i) {
    if (chunk_pos[static_cast<std::size_t>(i)] < 0) continue;
    rows.push_back(i);
    pos.push_back(chunk_pos[static_cast<std::size_t>(i)]);
  }
  const bool vs_reference = o.check_against == "reference";
  std::vector<double> errs{0.0, 0.0};
  const std::int64_t n = static_cast<std::int64_t>(rows.size());
  if (n > 0) {
    const Tensor out_h = Tensor::copy_of(ext.out.view(), DType::kFloat64, MemCategory::kWorkspace);
    const Tensor lse_h = Tensor::copy_of(ext.lse.view(), DType::kFloat64, MemCategory::kWorkspace);
    Tensor got_out = Tensor::empty({B, n, hq, D}, DType::kFloat64, MemCategory::kWorkspace);
    Tensor got_lse = Tensor::empty({B, hq, n}, DType::kFloat64, MemCategory::kWorkspace);
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t j = 0; j < n; ++j) {
        const double* src = out_h.data_as<double>() + (b * L + rows[j]) * hq * D;
        std::copy(src, src + hq * D, got_out.data_as<double>() + (b * n + j) * hq * D);
        for (std::int64_t h = 0; h < hq; ++h) {
          got_lse.data_as<double>()[(b * hq + h) * n + j] = lse_h.data_as<double>()[(b * hq + h) * L + rows[j]];
        }
      }
    }
    const std::vector<std::int64_t> keys = token_range(0, T0);
    const Tensor q = in.rows("q", pos), k = in.rows("k", keys), v = in.rows("v", keys);
    const auto [want_out, want_lse] = expected_attention(q, k, v, pos, vs_reference, o.dtype);
    errs = {rel_err(got_out, want_out), rel_err(got_lse, want_lse)};
  }
  all_reduce(world, errs, ReduceOp::kMax);
  rep.chunk_out_err = errs[0];
  rep.chunk_lse_err = errs[1];
  rep.passed = rep.passed && errs[0] <= tolerance(o.dtype, vs_reference) &&
               errs[1] <= tolerance(accumulator_dtype(o.dtype), vs_reference);
}

// --device cuda: a copy of host rows on the groups' device (made outside the timed calls), or the rows themselves;
// and a step's result back on the host (for the check and the dumps).
Tensor on_device(const CpGroups& groups, Tensor t) {
  if (groups.stream.device.is_cpu() || !t.defined()) return t;
  Tensor d = Tensor::empty(t.shape(), t.dtype(), MemCategory::kWorkspace, groups.stream.device);
  copy_convert(t, d, groups.stream);
  return d;
}
Tensor on_host(const CpGroups& groups, Tensor t) {
  if (t.view().device().is_cpu()) return t;
  Tensor h = Tensor::empty(t.shape(), t.dtype(), MemCategory::kWorkspace);
  copy_convert(t, h, groups.stream);
  return h;
}

DecodeReport run_mha(Communicator& world, const CpGroups& groups, const SpBenchOptions& o, const DecodeInputs& in,
                     DecodeResults* results) {
  const DecodeOptions& d = o.decode;
  const std::int64_t B = o.batch, hq = o.heads, hkv = o.kv_heads, D = o.head_dim, T = d.context;
  // The prompt [0, T), the optional chunk [T, T0), the decode steps [T0, S).
  const std::int64_t n = d.new_tokens, N = d.decode_steps, T0 = T + d.chunk, S = T0 + N * n;
  MhaDecodeConfig cfg;
  cfg.shard = parse_cache_shard(d.cache_shard);
  cfg.interleave = d.interleave;
  cfg.prefill_impl = o.impl;
  MhaDecodeCp layer(groups, cfg);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, T, o.layout);
  const std::vector<std::int64_t> pos = layout.token_index(groups.cp_rank());
  const bool fill = d.prefill == "fill";  // the prompt's K/V only: no queries needed
  const Tensor q = on_device(groups, in.rows("q", fill ? std::vector<std::int64_t>{} : pos));
  const Tensor k = on_device(groups, in.rows("k", pos)), v = on_device(groups, in.rows("v", pos));
  // The chunk of a persistent-cache prefill (--chunk), at T + its layout's tokens.
  std::optional<SequenceLayout> chunk_layout;
  std::vector<std::int64_t> chunk_pos;
  if (d.chunk > 0) {
    chunk_layout.emplace(SequenceLayout::for_groups(groups, d.chunk, o.layout));
    for (std::int64_t t : chunk_layout->token_index(groups.cp_rank())) chunk_pos.push_back(t < 0 ? -1 : T + t);
  }
  const Tensor qc = in.rows("q", chunk_pos), kc = in.rows("k", chunk_pos), vc = in.rows("v", chunk_pos);
  const ChunkPrefillMode chunk_mode = parse_chunk_prefill_mode(d.chunk_mode);
  DecodeReport rep;
  const std::int64_t before = persistent_bytes();
  std::optional<ShardedKvCache> cache;
  PrefillOutput ext;  // the last extend's outputs, kept for --check only
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    cache.reset();
    cache.emplace(layer.make_cache(B, S, hkv, D, o.dtype, groups.stream.device));
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
        chunk_mode == ChunkPrefillMode::kAuto ? layer.choose_chunk_mode(*cache, *chunk_layout, hq) : chunk_mode;
    rep.chunk_mode = chunk_prefill_mode_name(used);
    rep.chunk_pass_bytes =
        used == ChunkPrefillMode::kPassQ ? layer.pass_q_bytes(*cache, *chunk_layout, hq) : layer.pass_kv_bytes(*cache);
    layer.reset_counters();
    const double t_chunk = time_once(world, [&] {
      PrefillOutput e = layer.extend(*cache, *chunk_layout, qc, kc, vc, chunk_mode);
      if (o.check) ext = std::move(e);  // kept past the steps for the check only
    });
    rep.chunk_bytes = layer.counters().bytes_sent;
    rep.chunk_route_bytes = layer.chunk_route_bytes_sent();
    if (it >= o.warmup) rep.chunk_s.push_back(t_chunk);
  }
  std::vector<double> cache_bytes{static_cast<double>(persistent_bytes() - before)};
  all_reduce(world, cache_bytes, ReduceOp::kMax);
  rep.cache_bytes = cache_bytes[0];
  // with Hkv < ulysses_size each KV head is stored by ulysses_size / Hkv ranks: max(Hkv, ulysses_size) heads in all
  const std::int64_t hkv_stored = std::max<std::int64_t>(hkv, groups.ulysses_size());
  rep.cache_formula =
      static_cast<double>(attn::mha_kv_cache_bytes({B, S, hkv_stored, D, o.dtype, Device::cpu()})) / groups.cp.size();
  rep.formula_text = str_cat("M_KV / P = 2 B max(Hkv, ulysses) (T + chunk + N n) D bytes / (ring x ulysses)");
  layer.reset_counters();
  std::vector<Tensor> outs, lses;
  const bool keep = o.check || results != nullptr;
  for (std::int64_t step = 0; step < N; ++step) {
    const std::vector<std::int64_t> rows = token_range(T0 + step * n, T0 + (step + 1) * n);
    const Tensor qd = on_device(groups, in.rows("q", rows)), kd = on_device(groups, in.rows("k", rows)),
                 vd = on_device(groups, in.rows("v", rows));
    const double t0 = now_s();
    DecodeOutput r = layer.decode(*cache, qd, kd, vd);
    rep.step_s.push_back(now_s() - t0);
    if (keep) {
      outs.push_back(on_host(groups, std::move(r.out)));
      lses.push_back(on_host(groups, std::move(r.lse)));
    }
  }
  all_reduce(world, rep.step_s, ReduceOp::kMax);
  rep.mem_peak_bytes = ledger_peak(world);
  rep.bytes_per_step = layer.counters().bytes_sent / N;
  rep.bytes_formula = layer.decode_bytes_per_step(B, n, hq, D, o.dtype);
  Tensor out_all, lse_all;
  if (keep) {
    out_all = concat_steps(outs, 1);
    lse_all = concat_steps(lses, 2);
  }
  if (results != nullptr) {
    const std::int64_t first = layer.q_head_offset(hq);  // query heads [u Hq / Pu, ...) of Ulysses rank u
    results->outputs.emplace_back("out_dec", gather_heads(groups.cp, out_all, 2, {B, N * n, hq, D}, first));
    results->outputs.emplace_back("lse_dec", gather_heads(groups.cp, lse_all, 1, {B, hq, N * n}, first));
  }
  if (!o.check) return rep;
  rep.checked = true;
  check_mha_steps(world, groups, o, in, out_all, lse_all, rep);
  if (d.chunk > 0) check_mha_chunk(world, o, in, chunk_pos, ext, rep);
  return rep;
}

// The conv inputs q, k, v (x[0..2], each [B, S, H, X]) through `conv` (a short conv forward with SiLU), each with its
// rows of weight [2 Hk K + Hv V, W]; the outputs in fp64 when `fp64`, else in the inputs' dtype.
template <typename Conv>
std::array<Tensor, 3> convolved_qkv_with(const std::array<Tensor, 5>& x, const TensorView& weight, bool fp64,
                                         Conv conv) {
  std::array<Tensor, 3> y;
  std::int64_t row = 0;
  for (int i = 0; i < 3; ++i) {
    const Tensor& t = x[i];
    const std::int64_t B = t.dim(0), S = t.dim(1), c = t.dim(2) * t.dim(3);
    y[i] = Tensor::empty(t.shape(), fp64 ? DType::kFloat64 : t.dtype(), MemCategory::kWorkspace);
    attn::ShortConvArgs a;
    a.x = t.view().reshape({B, S, c});
    a.weight = weight.slice0(row, row + c);
    conv(a, y[i].view().reshape({B, S, c}));
    row += c;
  }
  return y;
}

// Through the single-rank short conv: the convolved q, k, v of the training forward (benchmarks/sp_bench_gdn.cc).
std::array<Tensor, 3> convolved_qkv(const std::array<Tensor, 5>& x, const TensorView& weight) {
  return convolved_qkv_with(x, weight, false,
                            [](const attn::ShortConvArgs& a, auto y) { attn::short_conv_forward(a, y, {}); });
}

// The same through the fp64 reference conv (attention/reference/gdn_reference.h), on fp64 x and weight.
std::array<Tensor, 3> convolved_qkv_reference(const std::array<Tensor, 5>& x, const TensorView& weight) {
  return convolved_qkv_with(
      x, weight, true, [](const attn::ShortConvArgs& a, auto y) { attn::reference::short_conv_forward(a, y, {}); });
}

DecodeReport run_gdn(Communicator& world, const CpGroups& groups, const SpBenchOptions& o, const DecodeInputs& in,
                     DecodeResults* results) {
  const DecodeOptions& d = o.decode;
  const std::int64_t B = o.batch, hv = o.heads, hk = o.kv_heads, K = o.head_dim;
  const std::int64_t V = o.dim_v > 0 ? o.dim_v : o.head_dim, T = d.context;
  const std::int64_t n = d.new_tokens, N = d.decode_steps, S = T + N * n;
  GdnCpConfig cfg;
  cfg.mode = parse_gdn_cp_mode(o.gdn_mode);
  cfg.chunk_size = o.chunk_size;
  GdnDecodeCp layer(groups, cfg, hv, hk);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, T, o.layout);
  const std::vector<std::int64_t> pos = layout.token_index(groups.cp_rank());
  const auto inputs = [&](std::span<const std::int64_t> rows) {
    return std::array<Tensor, 5>{in.rows("q", rows), in.rows("k", rows), in.rows("v", rows), in.rows("g", rows),
                                 in.rows("beta", rows)};
  };
  const std::array<Tensor, 5> prompt = inputs(pos);
  const Tensor initial_state = in.whole("initial_state"), conv_weight = in.whole("conv_weight");
  DecodeReport rep;
  const std::int64_t before = persistent_bytes();
  std::optional<attn::GdnCache> cache;
  rep.prefill_s = time_prefill(world, o, [&] {
    cache.reset();
    cache.emplace(layer.make_cache(B, K, V, o.dtype, o.conv_width));
    layer.prefill(*cache, layout, prompt[0], prompt[1], prompt[2], prompt[3], prompt[4], initial_state, conv_weight);
  });
  std::vector<double> cache_bytes{static_cast<double>(persistent_bytes() - before)};
  all_reduce(world, cache_bytes, ReduceOp::kMax);
  rep.cache_bytes = cache_bytes[0];
  rep.cache_formula = static_cast<double>(attn::gdn_cache_bytes(cache->spec()));
  rep.formula_text = o.conv_width > 0 ? "B (Hv / P) K V bytes(state) + B (W-1) C / P bytes, constant in T"
                                      : "B (Hv / P) K V bytes(state), constant in T";
  std::vector<Tensor> outs;
  for (std::int64_t step = 0; step < N; ++step) {
    const std::array<Tensor, 5> x = inputs(token_range(T + step * n, T + (step + 1) * n));
    const double t0 = now_s();
    DecodeOutput r = layer.decode(*cache, x[0], x[1], x[2], x[3], x[4], conv_weight);
    rep.step_s.push_back(now_s() - t0);
    if (o.check || results != nullptr) outs.push_back(std::move(r.out));
  }
  all_reduce(world, rep.step_s, ReduceOp::kMax);
  rep.mem_peak_bytes = ledger_peak(world);
  const std::int64_t lv = layer.local_value_heads(), lk = layer.local_key_heads(), r = groups.cp_rank();
  Tensor out_all;
  if (!outs.empty()) out_all = concat_steps(outs, 1);
  if (results != nullptr) {
    const std::int64_t first = layer.head_offset();
    results->outputs.emplace_back("out_dec", gather_heads(groups.cp, out_all, 2, {B, N * n, hv, V}, first));
    const Tensor state = Tensor::copy_of(cache->state(), cache->state().dtype(), MemCategory::kWorkspace);
    results->outputs.emplace_back("final_state", gather_heads(groups.cp, state, 1, {B, hv, K, V}, first));
  }
  if (!o.check) return rep;
  rep.checked = true;
  // The single-rank training forward over the whole sequence (the conv over all heads, then the chunked kernel) for
  // this rank's heads (value heads from head_offset(), the key heads they read), on every rank: rows T.. of out and
  // the final state. With --check-against reference the fp64 references of attention/reference instead (the direct
  // conv, the token-by-token recurrence) on the inputs widened to fp64. In 16-bit storage the recurrence of the
  // kernel reads the convolved q, k, v rounded to the storage dtype, a rounding that would move the fp32 state by
  // 16-bit errors: the reference then takes the kernel's conv outputs (the conv is checked against the fp64 one in
  // fp32 and fp64).
  const bool vs_reference = o.check_against == "reference";
  const bool rounded_conv = o.dtype == DType::kBFloat16 || o.dtype == DType::kFloat16;
  std::array<Tensor, 5> full = inputs(token_range(0, S));
  if (conv_weight.defined() && (!vs_reference || rounded_conv)) {
    std::array<Tensor, 3> y = convolved_qkv(full, conv_weight);
    for (int i = 0; i < 3; ++i) full[i] = std::move(y[i]);
  }
  Tensor initial_state64;
  if (vs_reference) {
    for (Tensor& t : full) t = fp64_copy(t);
    initial_state64 = fp64_copy(initial_state);
  }
  const TensorView initial_state_ref = vs_reference ? initial_state64.view() : initial_state.view();
  if (conv_weight.defined() && vs_reference && !rounded_conv) {
    std::array<Tensor, 3> y = convolved_qkv_reference(full, fp64_copy(conv_weight));
    for (int i = 0; i < 3; ++i) full[i] = std::move(y[i]);
  }
  const auto heads = [&](const TensorView& t, std::int64_t local, int dim = 2) {
    return slice_dim(t, dim, r * local, (r + 1) * local);
  };
  const Tensor q = heads(full[0], lk), k = heads(full[1], lk), v = heads(full[2], lv);
  const Tensor g = heads(full[3], lv), beta = heads(full[4], lv), s0 = heads(initial_state_ref, lv, 1);
  attn::GdnForwardArgs a = attn::gdn_args(q, k, v, g, beta);
  a.chunk_size = o.chunk_size;
  a.initial_state = s0;
  const DType sd = accumulator_dtype(o.dtype);
  Tensor out = Tensor::empty({B, S, lv, V}, vs_reference ? DType::kFloat64 : o.dtype, MemCategory::kWorkspace);
  Tensor final_state = Tensor::empty({B, lv, K, V}, vs_reference ? DType::kFloat64 : sd, MemCategory::kWorkspace);
  if (vs_reference) {
    attn::reference::gdn_forward(a, out, final_state);
  } else {
    attn::gdn_forward(a, out, final_state);
  }
  std::vector<double> errs{rel_err(out_all, slice_dim(out, 1, T, S)), rel_err(cache->state(), final_state)};
  all_reduce(world, errs, ReduceOp::kMax);
  rep.out_err = errs[0];
  rep.state_err = errs[1];
  rep.passed = rep.out_err <= tolerance(o.dtype, vs_reference) && rep.state_err <= tolerance(sd, vs_reference);
  return rep;
}

}  // namespace

void check_decode_options(const SpBenchOptions& o) {
  const DecodeOptions& d = o.decode;
  SEQPAR_CHECK(o.attn == "mha" || o.attn == "gdn" || o.attn == "dsa", "--mode decode: --attn ", o.attn,
               " has no decode");
  SEQPAR_CHECK(o.grid.dp_size == 1, "--mode decode: --dp-size ", o.grid.dp_size, " must be 1");
  // Every bad count in one line, each as --mode train words it ("--flag value: must be >= min").
  std::string bad;
  for (const auto& [flag, value, min] : {std::tuple{"context", d.context, 1},
                                         {"decode-steps", d.decode_steps, 1},
                                         {"new-tokens", d.new_tokens, 1},
                                         {"interleave", d.interleave, 1},
                                         {"chunk", d.chunk, 0}}) {
    if (value < min) bad += str_cat(bad.empty() ? "" : "; ", "--", flag, " ", value, ": must be >= ", min);
  }
  SEQPAR_CHECK(bad.empty(), bad);
  // The cache's capacity, --context + --chunk + --decode-steps x --new-tokens tokens, must be a count at all (an
  // int64 product that wraps would pass every later check with a small or negative capacity).
  constexpr std::int64_t kMaxTokens = std::int64_t{1} << 48;
  const bool fits = d.decode_steps <= kMaxTokens / d.new_tokens && d.context <= kMaxTokens && d.chunk <= kMaxTokens &&
                    d.context + d.chunk + d.decode_steps * d.new_tokens <= kMaxTokens;
  SEQPAR_CHECK(fits, "--context ", d.context, " + --chunk ", d.chunk, " + --decode-steps ", d.decode_steps,
               " x --new-tokens ", d.new_tokens, ": the cache would hold more than 2^48 tokens");
  // Decode splits whole heads over the ranks (parallel/decode_cp.h); refused here by flag, so that --dry-run refuses
  // it too, rather than by the library's field names once the run has started.
  const int pu = o.grid.ulysses_size, sp = o.grid.ring_size * pu;
  if (o.attn == "gdn") {
    SEQPAR_CHECK(o.heads % sp == 0 && o.kv_heads % sp == 0, "--mode decode --attn gdn: --heads ", o.heads,
                 " (value heads) and --kv-heads ", o.kv_heads,
                 " (key heads) must both be divisible by the CP group size ", sp, " (--ring-size ", o.grid.ring_size,
                 " x --ulysses-size ", pu, "): decode splits whole heads over the group");
  }
  if (o.attn == "mha") {
    SEQPAR_CHECK(o.kv_heads >= 1 && (o.kv_heads % pu == 0 || pu % o.kv_heads == 0),
                 "--mode decode --attn mha: --kv-heads ", o.kv_heads, " must be divisible by --ulysses-size ", pu,
                 " (decode splits whole KV heads over the Ulysses group) or divide it (each KV head replicated)");
  }
  parse_cache_shard(d.cache_shard);
  for (const char* flag : {"cache-shard", "interleave"}) {
    SEQPAR_CHECK(o.attn != "gdn" || !o.given(flag), "--", flag, " needs --attn mha or dsa (--attn ", o.attn,
                 " splits its heads over the ranks, not its tokens)");
  }
  SEQPAR_CHECK(d.cache_shard == "interleave" || !o.given("interleave"), "--interleave ", d.interleave,
               " needs --cache-shard interleave (--cache-shard ", d.cache_shard, " does not read it)");
  SEQPAR_CHECK(!o.packed(), "--mode decode: a packed row (--doc-lens, --doc-dist or --inputs DIR/cu_seqlens.npy) is ",
               "not supported (decode runs one prompt per batch row)");
  SEQPAR_CHECK(o.causal || !o.given("causal"), "--mode decode: --causal=false: decode attention is causal (a new ",
               "token attends to the tokens before it)");
  // The attention options decode does not support yet: each one set, with its value and the preset that set it.
  std::string unsupported;
  const auto refuse = [&](bool set, const char* flag, const std::string& value, const char* off) {
    if (!set) return;
    const bool preset = !o.model.empty() && !o.given(flag);
    unsupported += str_cat(unsupported.empty() ? "" : ", ", "--", flag, value.empty() ? "" : " ", value,
                           preset ? str_cat(" (set by --model ", o.model, *off != '\0' ? "; " : "", off, ")") : "");
  };
  refuse(o.window > 0 && o.attn != "dsa", "window", str_cat(o.window), "");  // DSA: its indexer's window
  refuse(o.softcap != 0, "softcap", str_cat(o.softcap), "--softcap 0 turns it off");
  refuse(o.alibi, "alibi", "", "");
  refuse(o.sinks, "sinks", "", "");
  refuse(o.dropout != 0, "dropout", str_cat(o.dropout), "");
  refuse(o.rope, "rope", o.rope ? attn::rope_pairing_name(o.rope_cfg.pairing) : "", "--rope none turns it off");
  SEQPAR_CHECK(unsupported.empty(), "--mode decode: ", unsupported,
               ": not supported yet (decode is plain causal attention)");
  SEQPAR_CHECK(d.prefill == "forward" || d.prefill == "fill", "--prefill '", d.prefill,
               "' is not one of forward, fill");
  SEQPAR_CHECK(d.prefill == "forward" || o.attn != "gdn", "--prefill fill needs --attn mha or dsa");
  SEQPAR_CHECK(d.chunk == 0 || o.attn == "mha", "--chunk (a persistent-cache prefill) needs --attn mha");
  SEQPAR_CHECK(d.chunk == 0 || (o.inputs_dir.empty() && o.dump_dir.empty()), "--chunk ", d.chunk,
               " cannot be combined with --inputs or --dump (the chunk's tokens have no files)");
  parse_chunk_prefill_mode(d.chunk_mode);
  SEQPAR_CHECK(d.chunk > 0 || !o.given("chunk-mode"), "--chunk-mode needs --chunk C > 0");
  SEQPAR_CHECK(!o.check || d.prefill == "forward", "--check needs --prefill forward");
}

namespace {

// The layouts of the prompt and the chunk (each holds 8 bytes per slot: built after the memory check).
void check_decode_layouts(const SpBenchOptions& o) {
  const DecodeOptions& d = o.decode;
  if (d.chunk > 0) {
    try {
      SequenceLayout(o.layout, d.chunk, o.grid.ring_size, o.grid.ulysses_size);
    } catch (const Error& e) {
      SEQPAR_THROW("--chunk ", d.chunk, " (--layout ", layout_name(o.layout), "): ", e.message());
    }
  }
  try {
    SequenceLayout(o.layout, d.context, o.grid.ring_size, o.grid.ulysses_size);
  } catch (const Error& e) {
    SEQPAR_THROW("--context ", d.context, " (--layout ", layout_name(o.layout), "): ", e.message());
  }
}

// The configuration lines of the table header (and of --dry-run).
void print_decode_header(const SpBenchOptions& o, int world_size) {
  const DecodeOptions& d = o.decode;
  std::printf("# seqpar sp_bench %s\n", version());
  std::printf("# --mode decode (commit %s), %d rank(s), grid ulysses %d x ring %d, attn %s, dtype %s\n", git_commit(),
              world_size, o.grid.ulysses_size, o.grid.ring_size, o.attn.c_str(), dtype_name(o.dtype));
  std::printf("# context %lld, decode steps %lld x %lld new token(s), ", static_cast<long long>(d.context),
              static_cast<long long>(d.decode_steps), static_cast<long long>(d.new_tokens));
  if (o.attn == "gdn") {  // the state split by heads over the CP group (--cache-shard does not apply)
    std::printf("state split by heads: Hv / P = %lld value head(s) per rank",
                static_cast<long long>(o.heads / world_size));
  } else {
    std::printf("cache shard %s", d.cache_shard.c_str());
    if (d.cache_shard == "interleave") std::printf(" %lld", static_cast<long long>(d.interleave));
  }
  const std::string shapes =
      o.attn == "mha" ? str_cat("B=", o.batch, " Hq=", o.heads, " Hkv=", o.kv_heads, " D=", o.head_dim, " causal")
      : o.attn == "dsa"
          ? str_cat("B=", o.batch, " H=", o.heads, " Dqk=", o.head_dim, " Dv=", o.dim_v, " topk=", o.topk,
                    " indexer Hi=", o.indexer_heads, " Di=", o.indexer_dim, " select=", o.dsa_select,
                    o.window > 0 ? str_cat(" window=", o.window) : std::string())
          : str_cat("B=", o.batch, " Hv=", o.heads, " Hk=", o.kv_heads, " K=", o.head_dim,
                    " V=", o.dim_v > 0 ? o.dim_v : o.head_dim, " mode=", o.gdn_mode, " conv=", o.conv_width);
  std::printf(", prefill %s, layout %s, %s\n", d.prefill.c_str(), layout_name(o.layout), shapes.c_str());
}

void print_decode_report(const SpBenchOptions& o, const DecodeReport& r, const MemoryEstimate& memory, int world_size) {
  print_decode_header(o, world_size);
  std::printf("%s# measured ledger peak (largest rank): %s\n#\n", describe_memory_estimate(memory).c_str(),
              bytes_str(r.mem_peak_bytes).c_str());
  std::printf("# %-14s %12s %12s\n", "phase", "median_ms", "p99_ms");
  std::printf("  %-14s %12.3f %12s\n", "prefill", median(r.prefill_s) * 1e3, "-");
  if (!r.chunk_s.empty()) {
    std::printf("  %-14s %12.3f %12s   (%s; sent per rank %lld bytes, of which the route's %lld, formula %lld)\n",
                "chunk prefill", median(r.chunk_s) * 1e3, "-", r.chunk_mode.c_str(),
                static_cast<long long>(r.chunk_bytes), static_cast<long long>(r.chunk_route_bytes),
                static_cast<long long>(r.chunk_pass_bytes));
  }
  std::printf("  %-14s %12.3f %12.3f\n", "decode step", median(r.step_s) * 1e3, quantile(r.step_s, 0.99) * 1e3);
  std::printf("# bytes per step (sent per rank): %lld (formula %lld)\n", static_cast<long long>(r.bytes_per_step),
              static_cast<long long>(r.bytes_formula));
  std::printf("# cache per rank: %.3f MiB (formula %s: %.3f MiB)\n", r.cache_bytes / kMiB, r.formula_text.c_str(),
              r.cache_formula / kMiB);
  if (r.checked) {
    const bool vs_reference = o.check_against == "reference";
    std::printf("# check %s against the %s: out rel err %.3g, %s rel err %.3g (tolerance %.3g)\n",
                r.passed ? "passed" : "FAILED", vs_reference ? "fp64 reference" : "single-rank kernels", r.out_err,
                o.attn == "gdn" ? "final_state" : "lse", o.attn == "gdn" ? r.state_err : r.lse_err,
                tolerance(o.dtype, vs_reference));
    if (r.topk_mismatches >= 0) {
      std::printf("# topk_indices: %lld entries differ from the single-rank selection\n",
                  static_cast<long long>(r.topk_mismatches));
    }
    if (r.chunk_out_err >= 0) {
      std::printf("# chunk (--chunk %lld, %s): out rel err %.3g, lse rel err %.3g (in the check above)\n",
                  static_cast<long long>(o.decode.chunk), r.chunk_mode.c_str(), r.chunk_out_err, r.chunk_lse_err);
    }
  }
  std::fflush(stdout);
}

nlohmann::json decode_json(const SpBenchOptions& o, const DecodeReport& r, const MemoryEstimate& memory,
                           int world_size) {
  const DecodeOptions& d = o.decode;
  nlohmann::json j;
  j["mode"] = "decode";
  j["version"] = version();
  j["git_commit"] = git_commit();
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
  if (o.attn == "gdn") j["conv_width"] = o.conv_width;
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
  if (o.attn == "gdn") {
    j["value_heads_per_rank"] = o.heads / world_size;
  } else {
    j["cache_shard"] = d.cache_shard;
    j["interleave"] = d.interleave;
  }
  j["prefill_mode"] = d.prefill;
  j["prefill_s"] = {{"median", median(r.prefill_s)}, {"iterations", r.prefill_s}};
  if (!r.chunk_s.empty()) {
    j["chunk"] = d.chunk;
    j["chunk_prefill_s"] = {{"median", median(r.chunk_s)}, {"iterations", r.chunk_s}};
    j["chunk_mode"] = r.chunk_mode;
    j["chunk_bytes_sent"] = r.chunk_bytes;
    j["chunk_route_bytes"] = r.chunk_route_bytes;
    j["chunk_route_bytes_formula"] = r.chunk_pass_bytes;
  }
  j["decode_step_s"] = {{"median", median(r.step_s)}, {"p99", quantile(r.step_s, 0.99)}, {"steps", r.step_s}};
  j["bytes_per_step"] = r.bytes_per_step;
  j["bytes_per_step_formula"] = r.bytes_formula;
  j["cache_mib_per_rank"] = r.cache_bytes / kMiB;
  j["cache_mib_formula"] = r.cache_formula / kMiB;
  j["memory_estimate"] = memory_estimate_json(memory);
  j["mem_peak_mib"] = {{"total", r.mem_peak_bytes / kMiB}};  // the ledger's, prefill to the last step, largest rank
  if (r.checked) {
    j["check"] = {{"passed", r.passed}, {"check_against", o.check_against}, {"out_rel_err", r.out_err}};
    j["check"][o.attn == "gdn" ? "final_state_rel_err" : "lse_rel_err"] = o.attn == "gdn" ? r.state_err : r.lse_err;
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
    ("cache-shard", "decode, MHA and DSA: cache sharding over the ring (DSA: the CP group): contiguous | interleave",
     cxxopts::value<std::string>()->default_value("interleave"))
    ("interleave", "decode, MHA and DSA: I of --cache-shard interleave (token t on rank (t / I) mod P)",
     cxxopts::value<std::int64_t>()->default_value("1"))
    ("chunk", "decode, MHA: a further prompt chunk of C tokens after the prompt, prefilled against the cache "
              "(persistent-cache prefill; 0: none)", cxxopts::value<std::string>()->default_value("0"))
    ("chunk-mode", "decode, MHA: the chunk's route: auto (fewer bytes) | pass-kv | pass-q",
     cxxopts::value<std::string>()->default_value("auto"))
    ("prefill", "decode: forward (the prompt's attention under CP fills the cache) | fill (MHA, DSA: the prompt's "
                "keys only, no attention)", cxxopts::value<std::string>()->default_value("forward"));
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
  } else {
    // The flags only the training step reads, refused as --mode train refuses the decode flags.
    for (const char* flag : {"doc-lens", "cu-seqlens", "doc-dist", "efficiency", "gdn-compare-token", "test-corrupt",
                             "test-logit-scale"}) {
      SEQPAR_CHECK(r.count(flag) == 0, "--", flag, " needs --mode train (--mode decode does not read it)");
    }
  }
  return d;
}

int run_decode_bench(const SpBenchOptions& o, const WorldPlace& place) {
  check_decode_options(o);  // local: every rank fails alike, before any communication
  // The memory estimate before anything is allocated (or a layout built): --dry-run prints it; a node that cannot
  // hold it stops every rank with the node's figures and the flags that set the size.
  const MemoryEstimate memory = estimate_decode_memory(o, 0);
  const MemoryEstimate mine = estimate_decode_memory(o, place.rank);
  const MemoryVerdict verdict = compare_with_node_memory(o, mine);
  if (o.dry_run) {
    if (verdict.fits) check_decode_layouts(o);  // the dry run refuses what the run would
    if (place.rank == 0) {
      print_decode_header(o, place.size);
      std::printf("%s", describe_memory_dry_run(memory, verdict).c_str());
    }
    return 0;
  }
  check_memory_fits(verdict, mine);
  check_decode_layouts(o);
#if defined(_OPENMP)
  omp_set_num_threads(o.threads);
#endif
  const DecodeArrays arrays = decode_arrays(o);
  std::vector<std::string> dumped;
  for (const TensorSpec& s : arrays.outputs) dumped.push_back(s.name);
  if (o.dump_inputs) {
    for (const TensorSpec& s : decode_input_specs(o, arrays.inputs)) dumped.push_back(s.name);
  }
  check_json_not_dumped(o, dumped);
  // --inputs: every file read and checked on every rank (g_dec and beta_dec by the rules of g and beta).
  const WorkloadKind& kind = find_workload_kind(o.attn);
  const auto rule = [&](const std::string& name, double x) {
    const std::string base = name.ends_with("_dec") ? name.substr(0, name.size() - 4) : name;
    return kind.input_value_rule ? kind.input_value_rule(base, x) : std::string();
  };
  const NamedArrays loaded =
      o.inputs_dir.empty() ? NamedArrays{} : load_inputs(o, decode_input_specs(o, arrays.inputs), rule);
  const DecodeInputs inputs(o, arrays.inputs, o.inputs_dir.empty() ? nullptr : &loaded);
  auto world = make_world_communicator(o.backend);
  check_output_paths(*world, o.json_path, o.dump_dir);
  CpGrid grid(*world, o.grid);
  // --device cuda (MHA only): the layer's kernels on the device's default stream (with --backend nccl, the GPU of the
  // rank's communicator), its cache and inputs on that device.
  const Device device = o.device.is_cpu() ? o.device : grid.cp().device().is_cuda() ? grid.cp().device() : o.device;
  const CpGroups groups = CpGroups::from(grid, Stream{device, nullptr});
  DecodeResults results;
  DecodeResults* dump = o.dump_dir.empty() ? nullptr : &results;
  memory_ledger().reset_peaks();  // DecodeReport::mem_peak_bytes: the workload's, from here to its last step
  const DecodeReport rep = o.attn == "mha" ? run_mha(*world, groups, o, inputs, dump)
                           : o.attn == "dsa"
                               ? run_dsa(*world, groups, o, inputs, dump)  // benchmarks/sp_bench_decode_dsa.cc
                               : run_gdn(*world, groups, o, inputs, dump);
  if (place.rank == 0) print_decode_report(o, rep, memory, place.size);
  const nlohmann::json json =
      o.json_path.empty() || place.rank != 0 ? nlohmann::json() : decode_json(o, rep, memory, place.size);
  write_outputs(
      *world, o, [&] { return widen_for_dump(inputs.full()); }, results.outputs, o.json_path.empty() ? nullptr : &json);
  barrier(*world);
  if (rep.checked && !rep.passed && place.rank == 0) {
    std::fprintf(stderr, "sp_bench: check failed: decode results differ from the single-rank forward\n");
  }
  return rep.checked && !rep.passed ? 1 : 0;
}

void decode_shapes_from_inputs(SpBenchOptions& o) {
  if (o.decode.mode != "decode" || o.inputs_dir.empty()) return;
  // DSA's value width Dv is no decode input's dimension (the value is the first Dv columns of the latent c): a
  // replay must name it, or it would silently become --head-dim. A dump's out_dec.npy [B, N n, H, Dv] carries it.
  if (o.attn == "dsa" && o.dim_v == 0 && !o.given("dim-v")) {
    const std::string out_path = (std::filesystem::path(o.inputs_dir) / "out_dec.npy").string();
    std::string hint;
    if (std::filesystem::exists(out_path)) {
      const Shape out = npy::read_header(out_path).shape;
      if (out.size() == 4) hint = str_cat(" (", out_path, " of the dump has Dv = ", out[3], ")");
    }
    SEQPAR_THROW("--mode decode --attn dsa --inputs ", o.inputs_dir,
                 ": give --dim-v (no decode input file carries the value width Dv)", hint);
  }
  const std::string first = decode_arrays(o).inputs.front().name;
  const auto dim1 = [&](const std::string& name, const char* what) {
    const std::string path = (std::filesystem::path(o.inputs_dir) / (name + ".npy")).string();
    const Shape shape = npy::read_header(path).shape;
    SEQPAR_CHECK(shape.size() >= 2, path, ": shape ", shape_str(shape), " has no token dimension (dimension 1)");
    SEQPAR_CHECK(shape[1] >= 1, path, ": shape ", shape_str(shape), " holds 0 ", what,
                 " tokens (dimension 1): ", "must be >= 1");
    return std::pair{path, shape[1]};
  };
  DecodeOptions& d = o.decode;
  const auto [prompt_path, t] = dim1(first, "prompt");
  SEQPAR_CHECK(!o.given("context") || d.context == t, "--context ", d.context,
               " does not match --inputs: ", prompt_path, " holds ", t,
               " tokens; leave --context out to take it from the file");
  d.context = t;
  const auto [dec_path, steps] = dim1(first + "_dec", "decode");
  if (d.new_tokens < 1) return;  // check_decode_options names it
  if (!o.given("decode-steps")) {
    SEQPAR_CHECK(steps % d.new_tokens == 0, "--inputs: ", dec_path, " holds ", steps,
                 " decode tokens, not a multiple of --new-tokens ", d.new_tokens);
    d.decode_steps = steps / d.new_tokens;
  }
  SEQPAR_CHECK(d.decode_steps * d.new_tokens == steps, "--decode-steps ", d.decode_steps, " x --new-tokens ",
               d.new_tokens, " does not match --inputs: ", dec_path, " holds ", steps,
               " decode tokens; leave --decode-steps out to take it from the file");
}

}  // namespace seqpar::bench
