// Inference under CP (parallel/decode_cp.h) against the fp64 references over the whole sequence: N decode steps of n
// tokens after a T-token prefill under CP return rows T..T+Nn-1 of the causal attention (MHA, B = 2, GQA: out and
// lse on every rank) or of the token-by-token recurrence (GDN: each rank's heads of out and of the final state) over
// the T + Nn tokens. The ledger's persistent_cache per rank is the shard's 2 B Hkv D bytes per owned slot (about
// capacity / P) for MHA and B (Hv / P) K V state bytes for GDN, whatever T; the bytes of a step equal the documented
// merge bytes (CpCounters); bad input fails on every rank with one message and leaves every cache unchanged.
// Tolerances: test::decode_atol / decode_rtol.
#include <gtest/gtest.h>

#include <limits>

#include "attention/lowering.h"
#include "parallel/decode_cp.h"
#include "runtime/cp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/decode_problem.h"
#include "tests/util/mpi_test.h"

namespace seqpar {
namespace {

using test::all_close, test::rows_of, test::to_double, test::world;

using test::fails_everywhere, test::persistent_bytes;

// ---- MHA ---------------------------------------------------------------------------------------------------------

struct MhaCase {
  CacheShardKind shard;
  std::int64_t interleave;
  LayoutKind layout;  // of the prompt's forward
  std::int64_t n;     // tokens per step
  DType dtype = DType::kFloat32;
  RingImpl impl = RingImpl::kP2P;
  bool usp = false;  // Ulysses 2 (heads) x ring P/2 (the cache) when the world size is even
};
std::string case_name(const MhaCase& c) {
  return str_cat(cache_shard_name(c.shard), c.shard == CacheShardKind::kInterleave ? str_cat(c.interleave) : "", "_",
                 layout_name(c.layout), "_n", c.n, "_", dtype_name(c.dtype), "_", ring_impl_name(c.impl),
                 c.usp ? "_usp" : "");
}

constexpr std::int64_t kB = 2, kHq = 4, kHkv = 2, kD = 16, kPrompt = 96, kSteps = 4;

class MhaDecodeCpTest : public ::testing::TestWithParam<MhaCase> {};

TEST_P(MhaDecodeCpTest, StepsEqualRowsOfTheWholeSequence) {
  const MhaCase c = GetParam();
  const CpGrid grid(world(), c.usp ? test::small_grid_config() : test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  const int P = groups.ring.size(), me = groups.ring.rank(), pu = groups.ulysses_size();
  const std::int64_t hq = kHq / pu, hkv = kHkv / pu;  // this rank's heads
  const test::DecodeSchedule sched{kPrompt, kSteps, c.n};
  const test::MhaDecodeProblem p(kB, sched.total(), kHq, kHkv, kD, c.dtype, 7);
  MhaDecodeConfig cfg;
  cfg.shard = c.shard;
  cfg.interleave = c.interleave;
  cfg.prefill_impl = c.impl;
  MhaDecodeCp layer(groups, cfg);

  const std::int64_t before = persistent_bytes();
  ShardedKvCache cache = layer.make_cache(kB, sched.total(), kHkv, kD, c.dtype);
  const std::int64_t slots = cache.sharding().local_capacity(me);
  EXPECT_EQ(persistent_bytes() - before, 2 * kB * hkv * kD * slots * static_cast<std::int64_t>(dtype_size(c.dtype)));
  // About capacity / P slots per rank: at most one interleave block (or one contiguous rounding) away.
  const std::int64_t spread = c.shard == CacheShardKind::kInterleave ? c.interleave : P;
  EXPECT_LE(std::abs(slots * P - sched.total()), spread * P) << "slots " << slots;

  const SequenceLayout layout = SequenceLayout::for_groups(groups, sched.prompt, c.layout);
  const std::vector<std::int64_t> pos = layout.positions(groups.cp_rank());
  const auto local = [&](const TensorView& full) {
    Tensor prompt = rows_of(full, 0, sched.prompt);
    Tensor t = Tensor::empty({kB, layout.local_len(), full.dim(2), kD}, c.dtype, MemCategory::kWorkspace);
    shard_sequence(prompt, pos, t);
    return t;
  };
  const PrefillOutput pre = layer.prefill(cache, layout, local(p.q), local(p.k), local(p.v));
  EXPECT_EQ(cache.length(), sched.prompt);
  EXPECT_EQ(cache.local().positions(), cache.sharding().owned(me, 0, sched.prompt));
  Tensor ref_prompt = rows_of(p.ref_out, 0, sched.prompt);
  Tensor ref_local = Tensor::empty({kB, layout.local_len(), kHq, kD}, DType::kFloat64, MemCategory::kWorkspace);
  shard_sequence(ref_prompt, pos, ref_local);
  EXPECT_TRUE(all_close(to_double(pre.out), to_double(ref_local), test::decode_atol(c.dtype),
                        test::decode_rtol(c.dtype), "prefill out"));

  layer.reset_counters();
  // The lowered test mode runs the device schedule of each step on the host (its attention through the lowered
  // kernel path); the default mode runs the host schedule.
  const std::int64_t device_steps = mha_decode_device_schedule_steps();
  const std::int64_t h0 = layer.q_head_offset(kHq);
  EXPECT_EQ(h0, groups.ulysses.rank() * hq);
  for (std::int64_t step = 0; step < sched.steps; ++step) {
    const std::int64_t t0 = sched.first(step), t1 = t0 + c.n;
    const DecodeOutput o = layer.decode(cache, rows_of(p.q, t0, t1), rows_of(p.k, t0, t1), rows_of(p.v, t0, t1));
    const Tensor want_out = rows_of(rows_of(p.ref_out, t0, t1), h0, h0 + hq, 2);  // this rank's heads
    const Tensor want_lse = rows_of(rows_of(p.ref_lse, t0, t1, 2), h0, h0 + hq, 1);
    EXPECT_TRUE(all_close(to_double(o.out), to_double(want_out), test::decode_atol(c.dtype), test::decode_rtol(c.dtype),
                          str_cat("out of step ", step)));
    EXPECT_TRUE(all_close(to_double(o.lse), to_double(want_lse), test::decode_atol(c.dtype), test::decode_rtol(c.dtype),
                          str_cat("lse of step ", step)));
  }
  EXPECT_EQ(cache.length(), sched.total());
  EXPECT_EQ(cache.local().positions(), cache.sharding().owned(me, 0, sched.total()));
  const bool lowered = attn::lowered_attention_enabled();
  EXPECT_EQ(mha_decode_device_schedule_steps() - device_steps, lowered ? sched.steps : 0);
  // (P - 1) B n (Hq / Pu) (D + 2) accumulator elements per step, each way (the device schedule sends the same bytes:
  // an fp64 lse in the place of hi + lo).
  const std::int64_t per_step =
      (P - 1) * kB * c.n * hq * (kD + 2) * static_cast<std::int64_t>(dtype_size(accumulator_dtype(c.dtype)));
  EXPECT_EQ(layer.decode_bytes_per_step(kB, c.n, kHq, kD, c.dtype), per_step);
  EXPECT_EQ(layer.counters().bytes_sent, sched.steps * per_step);
  EXPECT_EQ(layer.counters().bytes_received, sched.steps * per_step);
  EXPECT_EQ(persistent_bytes() - before, 2 * kB * hkv * kD * slots * static_cast<std::int64_t>(dtype_size(c.dtype)));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MhaDecodeCpTest,
    ::testing::Values(
        MhaCase{CacheShardKind::kContiguous, 1, LayoutKind::kZigzag, 1},
        MhaCase{CacheShardKind::kInterleave, 1, LayoutKind::kContiguous, 1},
        MhaCase{CacheShardKind::kInterleave, 16, LayoutKind::kZigzag, 3},
        MhaCase{CacheShardKind::kInterleave, 1, LayoutKind::kStripe, 2, DType::kFloat64},
        MhaCase{CacheShardKind::kContiguous, 1, LayoutKind::kContiguous, 2, DType::kFloat64, RingImpl::kAllGather},
        MhaCase{CacheShardKind::kInterleave, 16, LayoutKind::kContiguous, 1, DType::kFloat32, RingImpl::kAllGather},
        MhaCase{CacheShardKind::kInterleave, 1, LayoutKind::kZigzag, 2, DType::kFloat32, RingImpl::kP2P, true},
        MhaCase{CacheShardKind::kContiguous, 1, LayoutKind::kContiguous, 1, DType::kFloat64, RingImpl::kP2P, true}),
    test::CaseName());

// Fewer KV heads than Ulysses ranks (Hkv < Pu, Pu % Hkv == 0): each KV head is replicated to Pu / Hkv ranks, as the
// training forward does, and the prefill, a chunk after it (extend) and the decode steps equal the rows of one causal
// attention over the whole sequence (fp64 reference), on every grid whose Ulysses size exceeds Hkv.
TEST(MhaDecodeCpReplicatedKv, FewerKvHeadsThanUlyssesRanksEqualTheWholeSequence) {
  const int n = world().size();
  constexpr std::int64_t hq_all = 12;  // divisible by every Ulysses size of 1..4 ranks
  std::vector<std::pair<CpGridConfig, std::int64_t>> cases;  // (grid, Hkv)
  for (int pu = 2; pu <= n; ++pu) {
    if (n % pu != 0 || hq_all % pu != 0) continue;
    for (std::int64_t hkv = 1; hkv < pu; ++hkv)
      if (pu % hkv == 0) cases.push_back({{1, pu, n / pu, Placement::kUlyssesInner}, hkv});
  }
  if (cases.empty()) GTEST_SKIP() << "no Ulysses size above 1 divides " << n << " ranks and " << hq_all << " heads";
  for (const auto& [gc, hkv] : cases) {
   for (ChunkPrefillMode mode : {ChunkPrefillMode::kPassKv, ChunkPrefillMode::kPassQ}) {
    const CpGrid grid(world(), gc);
    const CpGroups groups = CpGroups::from(grid);
    const int pu = groups.ulysses_size();
    const std::int64_t hq = hq_all / pu, chunk = 17, steps = 3;
    const std::int64_t total = kPrompt + chunk + steps;
    const test::MhaDecodeProblem p(kB, total, hq_all, hkv, kD, DType::kFloat64, 11);
    MhaDecodeCp layer(groups, MhaDecodeConfig{});
    ShardedKvCache cache = layer.make_cache(kB, total, hkv, kD, DType::kFloat64);
    EXPECT_EQ(cache.spec().kv_heads, 1);  // one replica per rank
    const std::string what = str_cat(grid.str(), " Hkv=", hkv, mode == ChunkPrefillMode::kPassQ ? " pass-Q" : " pass-KV");
    const auto local = [&](const SequenceLayout& layout, const TensorView& full, std::int64_t t0, std::int64_t t1) {
      Tensor rows = rows_of(full, t0, t1);
      Tensor t = Tensor::empty({kB, layout.local_len(), full.dim(2), kD}, full.dtype(), MemCategory::kWorkspace);
      shard_sequence(layout, groups.cp_rank(), rows, t);
      return t;
    };
    const auto expect_rows = [&](const SequenceLayout& layout, const TensorView& got, std::int64_t t0, std::int64_t t1,
                                 const std::string& name) {
      Tensor want = local(layout, p.ref_out, t0, t1);
      std::vector<double> g = to_double(got);  // real rows only (padding rows as shard_sequence writes them: 0)
      const std::vector<std::int64_t> tok = layout.token_index(groups.cp_rank());
      const std::int64_t row = static_cast<std::int64_t>(g.size()) / (kB * layout.local_len());
      for (std::size_t e = 0; e < g.size(); ++e)
        if (tok[static_cast<std::size_t>(static_cast<std::int64_t>(e) / row % layout.local_len())] < 0) g[e] = 0.0;
      EXPECT_TRUE(all_close(g, to_double(want), 1e-10, 1e-10, str_cat(what, " ", name)));
    };
    const SequenceLayout prompt = SequenceLayout::for_groups(groups, kPrompt, LayoutKind::kZigzag);
    const PrefillOutput pre = layer.prefill(cache, prompt, local(prompt, p.q, 0, kPrompt),
                                            local(prompt, p.k, 0, kPrompt), local(prompt, p.v, 0, kPrompt));
    expect_rows(prompt, pre.out, 0, kPrompt, "prefill out");
    const SequenceLayout next = SequenceLayout::for_groups(groups, chunk, LayoutKind::kZigzag);
    const PrefillOutput ext =
        layer.extend(cache, next, local(next, p.q, kPrompt, kPrompt + chunk), local(next, p.k, kPrompt, kPrompt + chunk),
                     local(next, p.v, kPrompt, kPrompt + chunk), mode);
    expect_rows(next, ext.out, kPrompt, kPrompt + chunk, "extend out");
    const std::int64_t h0 = layer.q_head_offset(hq_all);
    for (std::int64_t t = kPrompt + chunk; t < total; ++t) {
      const DecodeOutput o = layer.decode(cache, rows_of(p.q, t, t + 1), rows_of(p.k, t, t + 1), rows_of(p.v, t, t + 1));
      const Tensor want_out = rows_of(rows_of(p.ref_out, t, t + 1), h0, h0 + hq, 2);
      const Tensor want_lse = rows_of(rows_of(p.ref_lse, t, t + 1, 2), h0, h0 + hq, 1);
      EXPECT_TRUE(all_close(to_double(o.out), to_double(want_out), 1e-10, 1e-10, str_cat(what, " out of token ", t)));
      EXPECT_TRUE(all_close(to_double(o.lse), to_double(want_lse), 1e-10, 1e-10, str_cat(what, " lse of token ", t)));
    }
   }
  }
}

// ---- persistent-cache prefill: a chunk after a cache (pass-KV, pass-Q) ----------------------------------------------

struct ExtendCase {
  CacheShardKind shard;
  std::int64_t interleave;
  LayoutKind layout;  // of the prompt's and the chunk's forward
  ChunkPrefillMode mode;
  DType dtype = DType::kFloat32;
  bool usp = false;         // Ulysses 2 (heads) x ring P/2 (the cache) when the world size is even
  std::int64_t chunk = 48;  // tokens; 17 pads the chunk's shards on any grid of more than one rank
};
std::string case_name(const ExtendCase& c) {
  return str_cat(cache_shard_name(c.shard), c.shard == CacheShardKind::kInterleave ? str_cat(c.interleave) : "", "_",
                 layout_name(c.layout), "_",
                 c.mode == ChunkPrefillMode::kAuto ? "auto" : (c.mode == ChunkPrefillMode::kPassQ ? "passq" : "passkv"),
                 "_", dtype_name(c.dtype), c.usp ? "_usp" : "", c.chunk == 48 ? "" : str_cat("_chunk", c.chunk));
}

class MhaExtendCp : public ::testing::TestWithParam<ExtendCase> {};

// Prompt of 96, a chunk of 48 (or 17) after it, then 2 decode steps: every output equals the rows of one causal
// attention over the 146 (115) tokens (the fp64 reference), so the chunk equals one prefill of the concatenation; the
// bytes the route sent are its formula's, padding rows included.
TEST_P(MhaExtendCp, ChunkAfterTheCacheEqualsOnePrefillOfTheConcatenation) {
  const ExtendCase c = GetParam();
  const CpGrid grid(world(), c.usp ? test::small_grid_config() : test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  const int me = groups.ring.rank(), sp = groups.cp_rank(), pu = groups.ulysses_size();
  const std::int64_t u = groups.ulysses.rank(), hq = kHq / pu;  // this rank's query heads in decode
  const std::int64_t chunk_len = c.chunk, steps = 2;
  const std::int64_t total = kPrompt + chunk_len + steps;
  const test::MhaDecodeProblem p(kB, total, kHq, kHkv, kD, c.dtype, 13);
  MhaDecodeConfig cfg;
  cfg.shard = c.shard;
  cfg.interleave = c.interleave;
  MhaDecodeCp layer(groups, cfg);
  ShardedKvCache cache = layer.make_cache(kB, total, kHkv, kD, c.dtype);
  // Rows [first, first + len) of `full`, this rank's part under a layout of len tokens (zeros in its padding rows).
  const auto local = [&](const TensorView& full, const SequenceLayout& layout, std::int64_t first) {
    Tensor rows = rows_of(full, first, first + layout.seq_len());
    Shape shape = full.shape();
    shape[1] = layout.local_len();
    Tensor t = Tensor::empty(shape, full.dtype(), MemCategory::kWorkspace);
    shard_sequence(layout, sp, rows, t);
    return t;
  };
  const SequenceLayout prompt = SequenceLayout::for_groups(groups, kPrompt, c.layout);
  const SequenceLayout chunk = SequenceLayout::for_groups(groups, chunk_len, c.layout);
  layer.prefill(cache, prompt, local(p.q, prompt, 0), local(p.k, prompt, 0), local(p.v, prompt, 0));
  if (c.mode == ChunkPrefillMode::kAuto) {
    // The rule: pass-Q exactly when it sends fewer bytes than pass-KV.
    const bool q_fewer = layer.pass_q_bytes(cache, chunk, kHq) < layer.pass_kv_bytes(cache);
    EXPECT_EQ(layer.choose_chunk_mode(cache, chunk, kHq),
              q_fewer ? ChunkPrefillMode::kPassQ : ChunkPrefillMode::kPassKv);
  }
  // The route's bytes by the formulas (Hq / Pu, Hkv / Pu under USP), before the chunk changes the cache.
  const ChunkPrefillMode used = c.mode == ChunkPrefillMode::kAuto ? layer.choose_chunk_mode(cache, chunk, kHq) : c.mode;
  const std::int64_t route_bytes =
      used == ChunkPrefillMode::kPassQ ? layer.pass_q_bytes(cache, chunk, kHq) : layer.pass_kv_bytes(cache);
  const PrefillOutput o = layer.extend(cache, chunk, local(p.q, chunk, kPrompt), local(p.k, chunk, kPrompt),
                                       local(p.v, chunk, kPrompt), c.mode);
  // What the route sent (CommMeter) is the formula's, padded ring shards (a chunk of 17) included.
  if (chunk_len == 17 && groups.cp.size() > 1) {
    EXPECT_TRUE(chunk.has_padding());
  }
  EXPECT_EQ(layer.chunk_route_bytes_sent(), route_bytes) << chunk_prefill_mode_name(used);
  EXPECT_EQ(cache.length(), kPrompt + chunk_len);
  EXPECT_EQ(cache.local().positions(), cache.sharding().owned(me, 0, kPrompt + chunk_len));
  const Tensor want_out = local(p.ref_out, chunk, kPrompt);
  Tensor lse_rows = rows_of(p.ref_lse, kPrompt, kPrompt + chunk_len, 2);
  Tensor want_lse = Tensor::empty({kB, kHq, chunk.local_len()}, DType::kFloat64, MemCategory::kWorkspace);
  shard_sequence(chunk, sp, lse_rows, want_lse, 2);
  // This rank's chunk rows of `got` (along dim) in fp64, its padding rows zeroed as shard_sequence writes them.
  const auto real_rows = [&](const TensorView& got, int dim) {
    const Tensor g = Tensor::copy_of(got, DType::kFloat64, MemCategory::kWorkspace);
    Shape full = g.shape();
    full[dim] = chunk_len;
    Tensor all = Tensor::zeros(full, DType::kFloat64, MemCategory::kWorkspace);
    unshard_sequence(chunk, sp, g, all, dim);
    Tensor back = Tensor::empty(g.shape(), DType::kFloat64, MemCategory::kWorkspace);
    shard_sequence(chunk, sp, all, back, dim);
    return to_double(back);
  };
  // Padding rows: out 0 (as shard_sequence writes them into want_out) and lse -inf.
  EXPECT_TRUE(all_close(to_double(o.out), to_double(want_out), test::decode_atol(c.dtype),
                        test::decode_rtol(c.dtype), "chunk out"));
  EXPECT_TRUE(all_close(real_rows(o.lse, 2), to_double(want_lse), test::decode_atol(c.dtype),
                        test::decode_rtol(c.dtype), "chunk lse"));
  const std::vector<std::int64_t> tokens = chunk.token_index(groups.cp_rank());
  const std::vector<double> lse_got = to_double(o.lse);
  for (std::int64_t i = 0; i < chunk.local_len(); ++i) {
    if (tokens[i] >= 0) continue;
    for (std::int64_t bh = 0; bh < o.lse.dim(0) * o.lse.dim(1); ++bh) {
      EXPECT_EQ(lse_got[bh * chunk.local_len() + i], -std::numeric_limits<double>::infinity()) << "padding row " << i;
    }
  }
  for (std::int64_t t = kPrompt + chunk_len; t < total; ++t) {
    const DecodeOutput d = layer.decode(cache, rows_of(p.q, t, t + 1), rows_of(p.k, t, t + 1), rows_of(p.v, t, t + 1));
    const Tensor want = rows_of(rows_of(p.ref_out, t, t + 1), u * hq, (u + 1) * hq, 2);
    EXPECT_TRUE(all_close(to_double(d.out), to_double(want), test::decode_atol(c.dtype), test::decode_rtol(c.dtype),
                          str_cat("out at ", t)));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MhaExtendCp,
    ::testing::Values(
        ExtendCase{CacheShardKind::kInterleave, 1, LayoutKind::kZigzag, ChunkPrefillMode::kPassKv},
        ExtendCase{CacheShardKind::kInterleave, 1, LayoutKind::kZigzag, ChunkPrefillMode::kPassQ},
        ExtendCase{CacheShardKind::kContiguous, 1, LayoutKind::kContiguous, ChunkPrefillMode::kPassKv},
        ExtendCase{CacheShardKind::kInterleave, 16, LayoutKind::kContiguous, ChunkPrefillMode::kPassQ},
        ExtendCase{CacheShardKind::kInterleave, 16, LayoutKind::kZigzag, ChunkPrefillMode::kAuto},
        ExtendCase{CacheShardKind::kContiguous, 1, LayoutKind::kStripe, ChunkPrefillMode::kPassQ, DType::kFloat64},
        ExtendCase{CacheShardKind::kInterleave, 1, LayoutKind::kZigzag, ChunkPrefillMode::kPassKv, DType::kFloat64},
        // Under USP (2 x 1, 2 x 2, 2 x 4 at 2, 4, 8 ranks): the Ulysses group splits the heads, the ring the cache.
        ExtendCase{CacheShardKind::kInterleave, 1, LayoutKind::kZigzag, ChunkPrefillMode::kPassKv, DType::kFloat32,
                   true},
        ExtendCase{CacheShardKind::kInterleave, 1, LayoutKind::kZigzag, ChunkPrefillMode::kPassQ, DType::kFloat32,
                   true},
        ExtendCase{CacheShardKind::kContiguous, 1, LayoutKind::kContiguous, ChunkPrefillMode::kPassQ, DType::kFloat64,
                   true},
        ExtendCase{CacheShardKind::kInterleave, 16, LayoutKind::kBalanced, ChunkPrefillMode::kAuto, DType::kFloat32,
                   true},
        // A padded chunk (17 tokens): both routes send their padding rows, as the formulas count them.
        ExtendCase{CacheShardKind::kInterleave, 1, LayoutKind::kContiguous, ChunkPrefillMode::kPassKv, DType::kFloat64,
                   false, 17},
        ExtendCase{CacheShardKind::kInterleave, 1, LayoutKind::kContiguous, ChunkPrefillMode::kPassQ, DType::kFloat64,
                   false, 17},
        ExtendCase{CacheShardKind::kContiguous, 1, LayoutKind::kZigzag, ChunkPrefillMode::kPassQ, DType::kFloat32, true,
                   17}),
    test::CaseName());

// The cache per rank grows as T / P: twice the context, twice the bytes (up to one interleave block per rank).
TEST(MhaDecodeCpMemory, CacheBytesPerRankGrowAsTOverP) {
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  const int P = groups.ring.size();
  MhaDecodeCp layer(groups, MhaDecodeConfig{});
  for (const std::int64_t T : {1024, 4096}) {
    const std::int64_t before = persistent_bytes();
    ShardedKvCache cache = layer.make_cache(1, T, 8, 128, DType::kBFloat16);
    const double per_rank = static_cast<double>(persistent_bytes() - before);
    const double formula = 2.0 * 1 * 8 * T * 128 * 2 / P;  // M_KV / P for L = 1, B = 1, bf16
    EXPECT_NEAR(per_rank / formula, 1.0, P * 1.0 / T) << "T " << T;
  }
}

struct Bad {
  test::MhaDecodeProblem p{kB, kPrompt + 4, kHq, kHkv, kD, DType::kFloat32, 9};
  CpGrid grid{world(), test::ring_over_world()};
  CpGroups groups = CpGroups::from(grid);
  SequenceLayout layout{LayoutKind::kZigzag, kPrompt, groups.ring.size()};
  Tensor local(const TensorView& full) const {
    Tensor prompt = rows_of(full, 0, kPrompt);
    Tensor t = Tensor::empty({kB, layout.local_len(), full.dim(2), kD}, full.dtype(), MemCategory::kWorkspace);
    shard_sequence(prompt, layout.positions(groups.ring.rank()), t);
    return t;
  }
  void prefill(MhaDecodeCp& layer, ShardedKvCache& cache) const {
    layer.prefill(cache, layout, local(p.q), local(p.k), local(p.v));
  }
  DecodeOutput step(MhaDecodeCp& layer, ShardedKvCache& cache, std::int64_t n) const {
    return layer.decode(cache, rows_of(p.q, kPrompt, kPrompt + n), rows_of(p.k, kPrompt, kPrompt + n),
                        rows_of(p.v, kPrompt, kPrompt + n));
  }
};

// A decode cache holds one request per batch row: a prompt layout packing several documents is refused on every rank
// before any data moves (its prompt attention would keep the documents apart while the steps attend across them).
TEST(MhaDecodeCpErrors, PackedPromptFailsEverywhereAndChangesNothing) {
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  MhaDecodeCp layer(groups, MhaDecodeConfig{});
  ShardedKvCache cache = layer.make_cache(1, 64, kHkv, kD, DType::kFloat32);
  const auto inputs = [](const SequenceLayout& l, std::int64_t heads, std::uint64_t seed) {
    return test::random_tensor({1, l.local_len(), heads, kD}, DType::kFloat32, seed);
  };
  const SequenceLayout two = SequenceLayout::packed_for_groups(groups, std::vector<std::int64_t>{0, 13, 40});
  const Tensor q = inputs(two, kHq, 3), k = inputs(two, kHkv, 4), v = inputs(two, kHkv, 5);
  const char* rule = "the layout packs 2 documents into one row";
  EXPECT_TRUE(fails_everywhere([&] { layer.prefill(cache, two, q, k, v); }, str_cat("prefill: ", rule)));
  EXPECT_TRUE(fails_everywhere([&] { layer.fill(cache, two, k, v); }, str_cat("fill: ", rule)));
  EXPECT_TRUE(fails_everywhere([&] { layer.extend(cache, two, q, k, v); }, str_cat("extend: ", rule)));
  EXPECT_EQ(cache.length(), 0);
  // One document in a packed layout is one request.
  const SequenceLayout one = SequenceLayout::packed_for_groups(groups, std::vector<std::int64_t>{0, 40});
  layer.fill(cache, one, inputs(one, kHkv, 6), inputs(one, kHkv, 7));
  EXPECT_EQ(cache.length(), 40);
}

TEST(MhaDecodeCpErrors, PastTheCapacityFailsEverywhereAndChangesNothing) {
  Bad b;
  MhaDecodeCp layer(b.groups, MhaDecodeConfig{});
  ShardedKvCache cache = layer.make_cache(kB, kPrompt + 1, kHkv, kD, DType::kFloat32);
  b.prefill(layer, cache);
  const std::vector<std::int64_t> held = cache.local().positions();
  EXPECT_TRUE(fails_everywhere(
      [&] { b.step(layer, cache, 2); },
      "2 new tokens after 96 would run past the cache capacity 97: make the cache with a capacity of at least 98"));
  EXPECT_EQ(cache.length(), kPrompt);
  EXPECT_EQ(cache.num_steps(), 0);
  EXPECT_EQ(cache.local().positions(), held);
  b.step(layer, cache, 1);  // the one token that fits still works
  EXPECT_EQ(cache.length(), kPrompt + 1);
}

// A host cache: CUDA inputs (a fake device pointer, never read) are refused by name on every rank before any message,
// in any build, and the cache is untouched.
TEST(MhaDecodeCpErrors, CudaInputsFailEverywhereBeforeAnyMessage) {
  Bad b;
  MhaDecodeCp layer(b.groups, MhaDecodeConfig{});
  ShardedKvCache cache = layer.make_cache(kB, kPrompt + 4, kHkv, kD, DType::kFloat32);
  auto cuda = [](const Tensor& t) {
    return TensorView(reinterpret_cast<void*>(std::uintptr_t{0x1000}), t.dtype(), t.shape(), Device::cuda(0));
  };
  const Tensor q = b.local(b.p.q), k = b.local(b.p.k), v = b.local(b.p.v);
  auto ops = [&] { return b.groups.cp.counters().num_ops + b.groups.ring.counters().num_ops; };
  const std::int64_t before = ops();
  std::string m;
  try {
    layer.prefill(cache, b.layout, q, cuda(k), v);
  } catch (const Error& e) {
    m = e.what();
  }
  EXPECT_NE(m.find(str_cat("MhaDecodeCp::prefill: k ", cuda(k).str(),
                           " is on cuda:0, but the cache lives on cpu")),
            std::string::npos)
      << m;
  EXPECT_TRUE(test::all_ranks(world(), !m.empty()));
  EXPECT_EQ(ops(), before) << "a message before the refusal";
  EXPECT_EQ(cache.length(), 0);
  b.prefill(layer, cache);
  const Tensor qn = rows_of(b.p.q, kPrompt, kPrompt + 1);
  EXPECT_TRUE(fails_everywhere([&] { layer.decode(cache, cuda(qn), qn, qn); }, "MhaDecodeCp::decode: q_new"));
  EXPECT_EQ(cache.length(), kPrompt);
}

// kv_heads below 1 names its own rule (0 used to read "must be divisible by ulysses_size 1 ... or divide it").
TEST(MhaDecodeCpErrors, KvHeadsBelowOneNamesTheRule) {
  Bad b;
  MhaDecodeCp layer(b.groups, MhaDecodeConfig{});
  for (const std::int64_t hkv : {0, -1}) {
    test::expect_error([&] { layer.make_cache(kB, 8, hkv, kD, DType::kFloat32); },
                       str_cat("MhaDecodeCp::make_cache: kv_heads Hkv = ", hkv, " must be >= 1"));
  }
}

// A cache on a CUDA device needs one: without a device (or without CUDA) make_cache names the device; with one, the
// decode steps run on it (sp_bench --mode decode --device cuda --check compares them with the fp64 references).
TEST(MhaDecodeCpErrors, DeviceCacheWithoutADeviceFailsNamingIt) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present: the cache is made on it";
  Bad b;
  MhaDecodeCp layer(b.groups, MhaDecodeConfig{});
  EXPECT_TRUE(fails_everywhere([&] { (void)layer.make_cache(kB, kPrompt, kHkv, kD, DType::kBFloat16, Device::cuda(0)); },
                               "MhaDecodeCp::make_cache: device cuda:0 is not usable ("));
}

TEST(MhaDecodeCpErrors, CacheOfAnotherShardingOrShapeFailsEverywhere) {
  Bad b;
  MhaDecodeConfig contiguous;
  contiguous.shard = CacheShardKind::kContiguous;
  MhaDecodeCp layer(b.groups, MhaDecodeConfig{}), other(b.groups, contiguous);
  ShardedKvCache cache = other.make_cache(kB, kPrompt + 4, kHkv, kD, DType::kFloat32);
  EXPECT_TRUE(fails_everywhere([&] { b.prefill(layer, cache); }, "the cache is sharded contiguous over"));
  EXPECT_EQ(cache.length(), 0);
  ShardedKvCache wide = layer.make_cache(kB, kPrompt + 4, 2 * kHkv, kD, DType::kFloat32);
  EXPECT_TRUE(fails_everywhere([&] { b.prefill(layer, wide); }, "prefill k (the cache's [B, S_local, Hkv, D])"));
  EXPECT_EQ(wide.length(), 0);
  EXPECT_EQ(wide.local().length(), 0);
}

TEST(MhaDecodeCpErrors, RanksThatDisagreeOnTheLengthFailEverywhereAndChangeNothing) {
  if (world().size() == 1) GTEST_SKIP() << "one rank cannot disagree with itself";
  Bad b;
  MhaDecodeCp layer(b.groups, MhaDecodeConfig{});
  ShardedKvCache fresh = layer.make_cache(kB, kPrompt + 4, kHkv, kD, DType::kFloat32);
  ShardedKvCache filled = layer.make_cache(kB, kPrompt + 4, kHkv, kD, DType::kFloat32);
  b.prefill(layer, filled);
  ShardedKvCache& mine = world().rank() == 0 ? fresh : filled;
  const std::int64_t length = mine.length(), local = mine.local().length();
  EXPECT_TRUE(fails_everywhere([&] { b.step(layer, mine, 1); }, "disagree on cache_length"));
  EXPECT_EQ(mine.length(), length);
  EXPECT_EQ(mine.local().length(), local);
}

// ---- GDN ---------------------------------------------------------------------------------------------------------

constexpr std::int64_t kGK = 8, kGV = 8;
// Hk = 2P key heads and Hv = 2 Hk value heads: two key heads and four value heads per rank at every world size.
std::int64_t key_heads() { return 2 * world().size(); }
std::int64_t value_heads() { return 4 * world().size(); }

struct GdnCase {
  GdnCpMode mode;
  LayoutKind layout;
  std::int64_t n;
  bool usp = false;  // Ulysses 2 x ring P/2 for the prefill when the world size is even
  DType dtype = DType::kFloat32;
};
std::string case_name(const GdnCase& c) {
  return str_cat(gdn_cp_mode_name(c.mode), "_", layout_name(c.layout), "_n", c.n, c.usp ? "_usp" : "", "_",
                 dtype_name(c.dtype));
}

class GdnDecodeCpTest : public ::testing::TestWithParam<GdnCase> {};

// The decode steps of `sched` after the prompt (with p's conv when it has one): each step's out of this rank's heads
// and then the final state equal the fp64 reference over the whole sequence.
void expect_steps_and_final_state(GdnDecodeCp& layer, attn::GdnCache& cache,
                                  const test::GdnDecodeProblem& p, const test::DecodeSchedule& sched, DType dtype) {
  const std::int64_t lv = layer.local_value_heads(), h0 = layer.head_offset();
  const auto my_heads = [&](const TensorView& t) { return rows_of(t, h0, h0 + lv, 2); };
  for (std::int64_t step = 0; step < sched.steps; ++step) {
    const std::int64_t t0 = sched.first(step), t1 = t0 + sched.n;
    const auto rows = [&](const TensorView& t) { return rows_of(t, t0, t1); };
    const DecodeOutput o = layer.decode(cache, rows(p.q), rows(p.k), rows(p.v), rows(p.g), rows(p.beta), p.conv_weight);
    EXPECT_TRUE(all_close(to_double(o.out), to_double(my_heads(rows(p.ref_out))), test::decode_atol(dtype),
                          test::decode_rtol(dtype), str_cat("out of step ", step)));
  }
  EXPECT_EQ(cache.length(), sched.total());
  const Tensor ref_final = rows_of(p.ref_final, h0, h0 + lv, 1);
  EXPECT_TRUE(all_close(to_double(cache.state()), to_double(ref_final), test::decode_atol(dtype),
                        test::decode_rtol(dtype), "final_state of this rank's heads"));
}

TEST_P(GdnDecodeCpTest, StepsEqualTheRecurrenceOverTheWholeSequence) {
  const GdnCase c = GetParam();
  const CpGrid grid(world(), c.usp ? test::small_grid_config() : test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  const test::DecodeSchedule sched{kPrompt, 3, c.n};
  const test::GdnDecodeProblem p(kB, sched.total(), key_heads(), value_heads(), kGK, kGV, c.dtype, 17);
  GdnCpConfig cfg;
  cfg.mode = c.mode;
  GdnDecodeCp layer(groups, cfg, value_heads(), key_heads());
  const std::int64_t lv = layer.local_value_heads();
  EXPECT_EQ(lv * world().size(), value_heads());

  const std::int64_t before = persistent_bytes();
  attn::GdnCache cache = layer.make_cache(kB, kGK, kGV, c.dtype);
  const std::int64_t state_bytes =
      kB * lv * kGK * kGV * static_cast<std::int64_t>(dtype_size(accumulator_dtype(c.dtype)));
  EXPECT_EQ(persistent_bytes() - before, state_bytes);

  const SequenceLayout layout = SequenceLayout::for_groups(groups, sched.prompt, c.layout);
  const std::vector<std::int64_t> pos = layout.positions(groups.cp_rank());
  const auto local = [&](const TensorView& full) {
    Tensor prompt = rows_of(full, 0, sched.prompt);
    Shape shape = full.shape();
    shape[1] = layout.local_len();
    Tensor t = Tensor::empty(shape, full.dtype(), MemCategory::kWorkspace);
    shard_sequence(prompt, pos, t);
    return t;
  };
  layer.prefill(cache, layout, local(p.q), local(p.k), local(p.v), local(p.g), local(p.beta));
  EXPECT_EQ(cache.length(), sched.prompt);
  expect_steps_and_final_state(layer, cache, p, sched, c.dtype);
  EXPECT_EQ(persistent_bytes() - before, state_bytes);  // constant in T
}

INSTANTIATE_TEST_SUITE_P(Cases, GdnDecodeCpTest,
                         ::testing::Values(GdnCase{GdnCpMode::kScan, LayoutKind::kZigzag, 1},
                                           GdnCase{GdnCpMode::kChain, LayoutKind::kContiguous, 2},
                                           GdnCase{GdnCpMode::kScan, LayoutKind::kContiguous, 1, true},
                                           GdnCase{GdnCpMode::kChain, LayoutKind::kZigzag, 3, false, DType::kFloat64}),
                         test::CaseName());

// The short conv under CP: a prompt of `prompt` tokens (any layout) whose conv tail may lie on several ranks, then
// decode steps with the conv. Every step's out and the final state equal the fp64 training forward (conv, then the
// recurrence) over the whole sequence; the tail in each rank's cache is the last W-1 inputs of its channels; the tail
// exchange sent m B (C - C_r) bytes(x) from a rank holding m of the tail tokens.
struct GdnConvCase {
  std::int64_t prompt;
  std::int64_t width;
  LayoutKind layout;
  GdnCpMode mode = GdnCpMode::kScan;
  bool usp = false;
  DType dtype = DType::kFloat32;
};
std::string case_name(const GdnConvCase& c) {
  return str_cat("T", c.prompt, "_W", c.width, "_", layout_name(c.layout), "_", gdn_cp_mode_name(c.mode),
                 c.usp ? "_usp" : "", "_", dtype_name(c.dtype));
}

class GdnConvDecodeCp : public ::testing::TestWithParam<GdnConvCase> {};

TEST_P(GdnConvDecodeCp, StepsWithTheConvEqualTheTrainingForward) {
  const GdnConvCase c = GetParam();
  const CpGrid grid(world(), c.usp ? test::small_grid_config() : test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  const test::DecodeSchedule sched{c.prompt, 3, 2};
  const test::GdnDecodeProblem p(kB, sched.total(), key_heads(), value_heads(), kGK, kGV, c.dtype, 23, c.width);
  GdnCpConfig cfg;
  cfg.mode = c.mode;
  GdnDecodeCp layer(groups, cfg, value_heads(), key_heads());
  const std::int64_t lv = layer.local_value_heads();
  const std::int64_t before = persistent_bytes();
  attn::GdnCache cache = layer.make_cache(kB, kGK, kGV, c.dtype, c.width);
  const std::vector<std::int64_t> mine = layer.local_conv_channels(groups.cp_rank(), kGK, kGV);
  const std::int64_t C = layer.conv_channels(kGK, kGV), c_r = static_cast<std::int64_t>(mine.size());
  const std::int64_t esize = static_cast<std::int64_t>(dtype_size(c.dtype));
  EXPECT_EQ(C, c_r * world().size());
  EXPECT_EQ(persistent_bytes() - before,
            kB * lv * kGK * kGV * static_cast<std::int64_t>(dtype_size(accumulator_dtype(c.dtype))) +
                kB * (c.width - 1) * c_r * esize);

  const SequenceLayout layout = SequenceLayout::for_groups(groups, sched.prompt, c.layout);
  const auto local = [&](const TensorView& full) {
    Tensor prompt = rows_of(full, 0, sched.prompt);
    Shape shape = full.shape();
    shape[1] = layout.local_len();
    Tensor t = Tensor::zeros(shape, full.dtype(), MemCategory::kWorkspace);  // padding rows stay zero
    std::vector<std::int64_t> rows, toks;
    const std::vector<std::int64_t> tokens = layout.token_index(groups.cp_rank());
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] < 0) continue;
      rows.push_back(static_cast<std::int64_t>(i));
      toks.push_back(tokens[i]);
    }
    shape[1] = static_cast<std::int64_t>(rows.size());
    Tensor picked = Tensor::empty(shape, full.dtype(), MemCategory::kWorkspace);
    gather_rows(prompt, 1, toks, picked);
    scatter_rows(picked, 1, rows, t);
    return t;
  };
  layer.prefill(cache, layout, local(p.q), local(p.k), local(p.v), local(p.g), local(p.beta), {}, p.conv_weight);
  EXPECT_EQ(cache.length(), sched.prompt);
  // The tail: the last W-1 inputs of the prompt (zeros before token 0), this rank's channels of x = [q | k | v].
  {
    const std::int64_t keep = c.width - 1, first = sched.prompt - keep;
    Tensor x = Tensor::zeros({kB, keep, C}, c.dtype, MemCategory::kWorkspace);
    const std::int64_t lo = std::max<std::int64_t>(first, 0);
    std::int64_t off = 0;
    for (const Tensor* t : {&p.q, &p.k, &p.v}) {
      const std::int64_t ch = t->dim(2) * t->dim(3);
      Tensor rows = rows_of(*t, lo, sched.prompt);
      Tensor place = Tensor::zeros({kB, keep, ch}, c.dtype, MemCategory::kWorkspace);
      std::vector<std::int64_t> at;
      for (std::int64_t tok = lo; tok < sched.prompt; ++tok) at.push_back(tok - first);
      scatter_rows(rows.view().reshape({kB, sched.prompt - lo, ch}), 1, at, place);
      std::vector<std::int64_t> cols;
      for (std::int64_t i = 0; i < ch; ++i) cols.push_back(off + i);
      scatter_rows(place, 2, cols, x);
      off += ch;
    }
    Tensor want = Tensor::empty({kB, keep, c_r}, c.dtype, MemCategory::kWorkspace);
    gather_rows(x, 2, mine, want);
    EXPECT_EQ(to_double(cache.conv_state()), to_double(want)) << "conv tail of cp rank " << groups.cp_rank();
    std::int64_t m = 0;
    for (std::int64_t tok : layout.token_index(groups.cp_rank())) m += tok >= lo ? 1 : 0;
    EXPECT_EQ(layer.conv_tail_bytes_sent(), m * kB * (C - c_r) * esize);
  }
  expect_steps_and_final_state(layer, cache, p, sched, c.dtype);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GdnConvDecodeCp,
    ::testing::Values(GdnConvCase{96, 4, LayoutKind::kZigzag},
                      GdnConvCase{96, 4, LayoutKind::kContiguous, GdnCpMode::kChain},
                      GdnConvCase{97, 4, LayoutKind::kContiguous, GdnCpMode::kScan, false, DType::kFloat64},
                      GdnConvCase{40, 16, LayoutKind::kZigzag},    // a tail of 15 tokens over several ranks
                      GdnConvCase{2, 4, LayoutKind::kContiguous},  // shorter than W - 1: zeros before the prompt
                      GdnConvCase{96, 4, LayoutKind::kBalanced, GdnCpMode::kScan, true},
                      GdnConvCase{96, 1, LayoutKind::kZigzag}),  // W = 1: an empty tail
    test::CaseName());

TEST(GdnDecodeCpErrors, ConvWeightAgainstTheCacheFailsAndChangesNothing) {
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  GdnDecodeCp layer(groups, GdnCpConfig{}, value_heads(), key_heads());
  const test::GdnDecodeProblem p(kB, 1, key_heads(), value_heads(), kGK, kGV, DType::kFloat32, 3, 4);
  attn::GdnCache plain = layer.make_cache(kB, kGK, kGV, DType::kFloat32);
  EXPECT_TRUE(fails_everywhere([&] { layer.decode(plain, p.q, p.k, p.v, p.g, p.beta, p.conv_weight); },
                               "conv_weight is given, but the cache was made without"));
  attn::GdnCache with_tail = layer.make_cache(kB, kGK, kGV, DType::kFloat32, 4);
  EXPECT_TRUE(fails_everywhere([&] { layer.decode(with_tail, p.q, p.k, p.v, p.g, p.beta); },
                               "conv_weight is absent, but the cache was made with"));
  const Tensor narrow = rows_of(p.conv_weight, 0, 3, 1);  // W = 3 against the cache's 4
  EXPECT_TRUE(fails_everywhere([&] { layer.decode(with_tail, p.q, p.k, p.v, p.g, p.beta, narrow); }, "conv_weight"));
  EXPECT_EQ(plain.length(), 0);
  EXPECT_EQ(with_tail.length(), 0);
  EXPECT_EQ(to_double(with_tail.conv_state()), std::vector<double>(to_double(with_tail.conv_state()).size(), 0.0));
}

// As for MHA: a prompt layout packing several documents is refused on every rank before GdnCp's forward runs.
TEST(GdnDecodeCpErrors, PackedPromptFailsEverywhereBeforeAnyMessage) {
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  GdnDecodeCp layer(groups, GdnCpConfig{}, value_heads(), key_heads());
  attn::GdnCache cache = layer.make_cache(1, kGK, kGV, DType::kFloat32);
  const SequenceLayout two = SequenceLayout::packed_for_groups(groups, std::vector<std::int64_t>{0, 3, 7});
  const std::int64_t s = two.local_len();
  const Tensor q = test::random_tensor({1, s, key_heads(), kGK}, DType::kFloat32, 3);
  const Tensor k = test::random_tensor({1, s, key_heads(), kGK}, DType::kFloat32, 4);
  const Tensor v = test::random_tensor({1, s, value_heads(), kGV}, DType::kFloat32, 5);
  const Tensor g = test::random_tensor({1, s, value_heads()}, DType::kFloat32, 6);
  const Tensor beta = test::random_tensor({1, s, value_heads()}, DType::kFloat32, 7);
  EXPECT_TRUE(fails_everywhere([&] { layer.prefill(cache, two, q, k, v, g, beta); },
                               "GdnDecodeCp::prefill: the layout packs 2 documents into one row"));
  EXPECT_EQ(cache.length(), 0);
}

TEST(GdnDecodeCpErrors, HeadsThatDoNotDivideFailEverywhere) {
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  const int P = world().size();
  const std::int64_t hk = P + 1, hv = 2 * (P + 1);  // P + 1 never divides by P > 1; P = 1 takes any
  if (P == 1) GTEST_SKIP() << "every head count divides over one rank";
  EXPECT_TRUE(fails_everywhere([&] { GdnDecodeCp(groups, GdnCpConfig{}, hv, hk); },
                               str_cat("must both be divisible by the CP group size ", P)));
}

// GdnCp's config rules hold at construction for both GDN layers (GdnDecodeCp refused them only at the first prefill).
TEST(GdnDecodeCpErrors, BadConfigIsRefusedAtConstructionLikeGdnCp) {
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, 8 * world().size());
  GdnCpConfig no_chunk;
  no_chunk.chunk_size = 0;
  GdnCpConfig inf_scale;
  inf_scale.scale = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(fails_everywhere([&] { GdnDecodeCp(groups, no_chunk, value_heads(), key_heads()); },
                               "GdnDecodeCp: chunk_size 0 must be >= 1"));
  EXPECT_TRUE(fails_everywhere([&] { GdnDecodeCp(groups, inf_scale, value_heads(), key_heads()); },
                               "GdnDecodeCp: scale inf must be finite"));
  EXPECT_TRUE(fails_everywhere([&] { GdnCp(groups, layout, no_chunk); }, "GDN chunk_size 0 must be >= 1"));
  EXPECT_TRUE(fails_everywhere([&] { GdnCp(groups, layout, inf_scale); }, "GDN scale inf must be finite"));
}

TEST(GdnDecodeCpErrors, CacheOfAnotherShapeFailsAndChangesNothing) {
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  GdnDecodeCp layer(groups, GdnCpConfig{}, value_heads(), key_heads());
  attn::GdnCache cache = layer.make_cache(kB, kGK, 2 * kGV, DType::kFloat32);  // V twice the problem's
  const test::GdnDecodeProblem p(kB, 1, key_heads(), value_heads(), kGK, kGV, DType::kFloat32, 3);
  EXPECT_TRUE(fails_everywhere([&] { layer.decode(cache, p.q, p.k, p.v, p.g, p.beta); }, "decode v_new"));
  EXPECT_EQ(cache.length(), 0);
}

TEST(GdnDecodeCpErrors, RanksThatDisagreeOnTheLengthFailEverywhereAndChangeNothing) {
  if (world().size() == 1) GTEST_SKIP() << "one rank cannot disagree with itself";
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  GdnDecodeCp layer(groups, GdnCpConfig{}, value_heads(), key_heads());
  attn::GdnCache cache = layer.make_cache(kB, kGK, kGV, DType::kFloat32);
  const test::GdnDecodeProblem p(kB, 1, key_heads(), value_heads(), kGK, kGV, DType::kFloat32, 5);
  const Tensor state = test::random_tensor(cache.state().shape(), DType::kFloat32, 6);
  cache.set_state(state, world().rank() == 0 ? 7 : 8);  // rank 0 is a token behind
  const std::int64_t length = cache.length();
  EXPECT_TRUE(fails_everywhere([&] { layer.decode(cache, p.q, p.k, p.v, p.g, p.beta); }, "disagree on cache_length"));
  EXPECT_EQ(cache.length(), length);
  EXPECT_EQ(to_double(cache.state()), to_double(state));
}

}  // namespace
}  // namespace seqpar
