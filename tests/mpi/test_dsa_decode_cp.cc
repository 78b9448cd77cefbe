// DSA inference under CP (parallel/dsa_decode_cp.h) against the single-rank training forward over the whole
// sequence: N decode steps of n tokens after a T-token prefill under CP return rows T..T+Nn-1 of it, topk_indices
// exactly (those of attn::dsa_indexer_topk over all T + Nn keys, on every rank), out and lse against the fp64
// reference attention over that selection (B = 2, contiguous and interleave 1 and 16 caches, zigzag, contiguous and
// stripe prefills, ring and all-gather selection, a window, USP grids). The prefill's out, lse and topk_indices are
// the same rows in the compute layout. The ledger's persistent_cache per rank is B (Di + Dqk) bytes per owned slot
// (about T / P); a step sends the documented select and merge bytes (CpCounters); bad input fails on every rank with
// one message and leaves every cache unchanged. Tolerances: test::decode_atol / decode_rtol.
#include <gtest/gtest.h>

#include "parallel/dsa_decode_cp.h"
#include "runtime/cp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/decode_problem.h"
#include "tests/util/mpi_test.h"

namespace seqpar {
namespace {

using test::all_close, test::fails_everywhere, test::persistent_bytes, test::rows_of, test::to_double, test::world;

constexpr std::int64_t kB = 2, kH = 4, kDqk = 24, kDv = 16, kHi = 2, kDi = 8, kTopk = 9, kPrompt = 96, kSteps = 4;

struct DsaCase {
  CacheShardKind shard;
  std::int64_t interleave;
  LayoutKind layout;  // of the prompt's forward
  std::int64_t n;     // tokens per step
  DType dtype = DType::kFloat32;
  bool usp = false;  // Ulysses 2 x ring P/2 for the prefill when the world size is even
  std::int64_t window = 0;
  DsaSelectMode select = DsaSelectMode::kRing;
};
std::string case_name(const DsaCase& c) {
  return str_cat(cache_shard_name(c.shard), c.shard == CacheShardKind::kInterleave ? str_cat(c.interleave) : "", "_",
                 layout_name(c.layout), "_n", c.n, "_", dtype_name(c.dtype), c.usp ? "_usp" : "",
                 c.window > 0 ? str_cat("_window", c.window) : "", "_", dsa_select_mode_name(c.select));
}

DsaDecodeConfig config_of(const DsaCase& c) {
  DsaDecodeConfig cfg;
  cfg.shard = c.shard;
  cfg.interleave = c.interleave;
  cfg.topk = kTopk;
  cfg.dim_v = kDv;
  cfg.window = c.window;
  cfg.prefill_select = c.select;
  return cfg;
}

// Rows [0, layout.seq_len()) of `full` ([B, S, ...]), this CP rank's part under `layout`.
Tensor local_rows(const TensorView& full, const SequenceLayout& layout, int cp_rank) {
  Tensor prompt = rows_of(full, 0, layout.seq_len());
  Shape shape = full.shape();
  shape[1] = layout.local_len();
  Tensor t = Tensor::empty(shape, full.dtype(), MemCategory::kWorkspace);
  shard_sequence(prompt, layout.positions(cp_rank), t);
  return t;
}

class DsaDecodeCpTest : public ::testing::TestWithParam<DsaCase> {};

TEST_P(DsaDecodeCpTest, StepsEqualRowsOfTheTrainingForward) {
  const DsaCase c = GetParam();
  const CpGrid grid(world(), c.usp ? test::small_grid_config() : test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  const int P = groups.cp.size(), me = groups.cp_rank();
  const test::DecodeSchedule sched{kPrompt, kSteps, c.n};
  const test::DsaDecodeProblem p(kB, sched.total(), kH, kDqk, kDv, kHi, kDi, kTopk, c.window, c.dtype, 23);
  EXPECT_TRUE(p.ref_topk_matches) << "the kernels' fp64 selection differs from the fp64 reference's";
  DsaDecodeCp layer(groups, config_of(c));

  const std::int64_t before = persistent_bytes();
  ShardedDsaCache cache = layer.make_cache(kB, sched.total(), kDi, kDqk, c.dtype);
  const std::int64_t slots = cache.sharding().local_capacity(me);
  const std::int64_t slot_bytes = kB * (kDi + kDqk) * static_cast<std::int64_t>(dtype_size(c.dtype));
  EXPECT_EQ(persistent_bytes() - before, slot_bytes * slots);
  // About capacity / P slots per rank: at most one interleave block (or one contiguous rounding) away.
  const std::int64_t spread = c.shard == CacheShardKind::kInterleave ? c.interleave : P;
  EXPECT_LE(std::abs(slots * P - sched.total()), spread * P) << "slots " << slots;

  const SequenceLayout layout = SequenceLayout::for_groups(groups, sched.prompt, c.layout);
  const auto local = [&](const TensorView& full) { return local_rows(full, layout, me); };
  const DsaPrefillOutput pre =
      layer.prefill(cache, layout, local(p.q), local(p.c), local(p.q_idx), local(p.k_idx), local(p.w));
  EXPECT_EQ(cache.length(), sched.prompt);
  EXPECT_EQ(cache.local().positions(), cache.sharding().owned(me, 0, sched.prompt));
  EXPECT_EQ(to_double(pre.topk_indices), to_double(local(p.topk_indices))) << "prefill topk_indices";
  EXPECT_TRUE(all_close(to_double(pre.out), to_double(local(p.ref_out)), test::decode_atol(c.dtype),
                        test::decode_rtol(c.dtype), "prefill out"));
  Tensor lse_rows = rows_of(p.ref_lse, 0, sched.prompt, 2);
  Tensor want_lse = Tensor::empty({kB, kH, layout.local_len()}, DType::kFloat64, MemCategory::kWorkspace);
  shard_sequence_bhs(lse_rows, layout.positions(me), want_lse);
  EXPECT_TRUE(all_close(to_double(pre.lse), to_double(want_lse), test::decode_atol(c.dtype), test::decode_rtol(c.dtype),
                        "prefill lse"));

  layer.reset_counters();
  for (std::int64_t step = 0; step < sched.steps; ++step) {
    const std::int64_t t0 = sched.first(step), t1 = t0 + c.n;
    const auto rows = [&](const TensorView& t) { return rows_of(t, t0, t1); };
    const DsaDecodeOutput o = layer.decode(cache, rows(p.q), rows(p.c), rows(p.q_idx), rows(p.k_idx), rows(p.w));
    EXPECT_EQ(to_double(o.topk_indices), to_double(rows(p.topk_indices))) << "topk_indices of step " << step;
    test::expect_step_close(o.out, o.lse, p.ref_out, p.ref_lse, t0, t1, c.dtype, str_cat("step ", step));
  }
  EXPECT_EQ(cache.length(), sched.total());
  EXPECT_EQ(cache.num_steps(), sched.steps);
  EXPECT_EQ(cache.local().positions(), cache.sharding().owned(me, 0, sched.total()));
  // Per step: (P - 1) B n k (8 + a) candidate bytes and (P - 1) B n H (Dv + 2) a merge bytes, each way.
  const std::int64_t a = static_cast<std::int64_t>(dtype_size(accumulator_dtype(c.dtype)));
  const std::int64_t per_step = (P - 1) * kB * c.n * (kTopk * (8 + a) + kH * (kDv + 2) * a);
  EXPECT_EQ(layer.decode_bytes_per_step(kB, c.n, kH, c.dtype), per_step);
  EXPECT_EQ(layer.select_bytes_per_step(kB, c.n, c.dtype), (P - 1) * kB * c.n * kTopk * (8 + a));
  EXPECT_EQ(layer.counters().bytes_sent, sched.steps * per_step);
  EXPECT_EQ(layer.counters().bytes_received, sched.steps * per_step);
  EXPECT_EQ(persistent_bytes() - before, slot_bytes * slots);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DsaDecodeCpTest,
    ::testing::Values(DsaCase{CacheShardKind::kContiguous, 1, LayoutKind::kZigzag, 1},
                      DsaCase{CacheShardKind::kInterleave, 1, LayoutKind::kContiguous, 1},
                      DsaCase{CacheShardKind::kInterleave, 16, LayoutKind::kZigzag, 3},
                      DsaCase{CacheShardKind::kInterleave, 1, LayoutKind::kStripe, 2, DType::kFloat64, false, 20},
                      DsaCase{CacheShardKind::kInterleave, 16, LayoutKind::kContiguous, 1, DType::kFloat64, false, 0,
                              DsaSelectMode::kAllGather},
                      DsaCase{CacheShardKind::kInterleave, 1, LayoutKind::kZigzag, 2, DType::kFloat32, true},
                      DsaCase{CacheShardKind::kContiguous, 1, LayoutKind::kContiguous, 1, DType::kFloat64, true, 30}),
    test::CaseName());

// fill (no prompt attention) stores the same rows as prefill: the steps after it are the same.
TEST(DsaDecodeCpFill, StepsAfterAFillEqualTheTrainingForward) {
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  const DsaCase c{CacheShardKind::kInterleave, 16, LayoutKind::kZigzag, 1};
  const test::DsaDecodeProblem p(kB, kPrompt + 2, kH, kDqk, kDv, kHi, kDi, kTopk, 0, c.dtype, 29);
  DsaDecodeCp layer(groups, config_of(c));
  ShardedDsaCache cache = layer.make_cache(kB, kPrompt + 2, kDi, kDqk, c.dtype);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, kPrompt, c.layout);
  layer.fill(cache, layout, local_rows(p.k_idx, layout, groups.cp_rank()), local_rows(p.c, layout, groups.cp_rank()));
  EXPECT_EQ(cache.length(), kPrompt);
  for (std::int64_t t = kPrompt; t < kPrompt + 2; ++t) {
    const auto rows = [&](const TensorView& x) { return rows_of(x, t, t + 1); };
    const DsaDecodeOutput o = layer.decode(cache, rows(p.q), rows(p.c), rows(p.q_idx), rows(p.k_idx), rows(p.w));
    EXPECT_EQ(to_double(o.topk_indices), to_double(rows(p.topk_indices))) << "topk_indices at " << t;
    EXPECT_TRUE(all_close(to_double(o.out), to_double(rows(p.ref_out)), test::decode_atol(c.dtype),
                          test::decode_rtol(c.dtype), str_cat("out at ", t)));
  }
}

// A decode cache holds one request per batch row: a prompt layout packing several documents is refused on every rank
// before any data moves, by prefill and by fill.
TEST(DsaDecodeCpErrors, PackedPromptFailsEverywhereAndChangesNothing) {
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  const DsaCase c{CacheShardKind::kInterleave, 16, LayoutKind::kZigzag, 1};
  DsaDecodeCp layer(groups, config_of(c));
  ShardedDsaCache cache = layer.make_cache(1, 64, kDi, kDqk, DType::kFloat32);
  const SequenceLayout two = SequenceLayout::packed_for_groups(groups, std::vector<std::int64_t>{0, 20, 48});
  const std::int64_t s = two.local_len();
  const Tensor q = test::random_tensor({1, s, kH, kDqk}, DType::kFloat32, 3);
  const Tensor cl = test::random_tensor({1, s, kDqk}, DType::kFloat32, 4);
  const Tensor q_idx = test::random_tensor({1, s, kHi, kDi}, DType::kFloat32, 5);
  const Tensor k_idx = test::random_tensor({1, s, kDi}, DType::kFloat32, 6);
  const Tensor w = test::random_tensor({1, s, kHi}, DType::kFloat32, 7);
  const char* rule = "the layout packs 2 documents into one row";
  EXPECT_TRUE(fails_everywhere([&] { layer.prefill(cache, two, q, cl, q_idx, k_idx, w); }, str_cat("prefill: ", rule)));
  EXPECT_TRUE(fails_everywhere([&] { layer.fill(cache, two, k_idx, cl); }, str_cat("fill: ", rule)));
  EXPECT_EQ(cache.length(), 0);
}

// The cache per rank grows as T / P: twice the context, twice the bytes (up to one interleave block per rank).
TEST(DsaDecodeCpMemory, CacheBytesPerRankGrowAsTOverP) {
  const CpGrid grid(world(), test::small_grid_config());
  const CpGroups groups = CpGroups::from(grid);
  const int P = groups.cp.size();
  DsaDecodeCp layer(groups, DsaDecodeConfig{});
  for (const std::int64_t T : {1024, 4096}) {
    const std::int64_t before = persistent_bytes();
    ShardedDsaCache cache = layer.make_cache(1, T, 128, 576, DType::kBFloat16);
    const double per_rank = static_cast<double>(persistent_bytes() - before);
    const double formula = 1.0 * 1 * T * (128 + 576) * 2 / P;  // M / P for L = 1, B = 1, bf16
    EXPECT_NEAR(per_rank / formula, 1.0, P * 1.0 / T) << "T " << T;
    EXPECT_EQ(attn::dsa_cache_bytes(cache.spec()), static_cast<std::int64_t>(formula * P));
  }
}

struct Bad {
  test::DsaDecodeProblem p{kB, kPrompt + 4, kH, kDqk, kDv, kHi, kDi, kTopk, 0, DType::kFloat32, 9};
  CpGrid grid{world(), test::ring_over_world()};
  CpGroups groups = CpGroups::from(grid);
  SequenceLayout layout{LayoutKind::kZigzag, kPrompt, groups.ring.size()};
  Tensor local(const TensorView& full) const { return local_rows(full, layout, groups.cp_rank()); }
  void prefill(DsaDecodeCp& layer, ShardedDsaCache& cache) const {
    layer.prefill(cache, layout, local(p.q), local(p.c), local(p.q_idx), local(p.k_idx), local(p.w));
  }
  DsaDecodeOutput step(DsaDecodeCp& layer, ShardedDsaCache& cache, std::int64_t n) const {
    const auto rows = [&](const TensorView& x) { return rows_of(x, kPrompt, kPrompt + n); };
    return layer.decode(cache, rows(p.q), rows(p.c), rows(p.q_idx), rows(p.k_idx), rows(p.w));
  }
  DsaDecodeConfig config() const { return config_of({CacheShardKind::kInterleave, 1, LayoutKind::kZigzag, 1}); }
};

TEST(DsaDecodeCpErrors, PastTheCapacityFailsEverywhereAndChangesNothing) {
  Bad b;
  DsaDecodeCp layer(b.groups, b.config());
  ShardedDsaCache cache = layer.make_cache(kB, kPrompt + 1, kDi, kDqk, DType::kFloat32);
  b.prefill(layer, cache);
  const std::vector<std::int64_t> held = cache.local().positions();
  const std::vector<double> c_before = to_double(cache.local().c_rows(1));
  EXPECT_TRUE(fails_everywhere(
      [&] { b.step(layer, cache, 2); },
      "2 new tokens after 96 would run past the cache capacity 97: make the cache with a capacity of at least 98"));
  EXPECT_EQ(cache.length(), kPrompt);
  EXPECT_EQ(cache.num_steps(), 0);
  EXPECT_EQ(cache.local().positions(), held);
  EXPECT_EQ(to_double(cache.local().c_rows(1)), c_before);
  b.step(layer, cache, 1);  // the one token that fits still works
  EXPECT_EQ(cache.length(), kPrompt + 1);
}

// A topk no buffer can hold (2^46 entries per query row) fails on every rank naming topk and the cache's capacity,
// before any message and before the cache is written (it named only the bytes).
TEST(DsaDecodeCpErrors, HugeTopkFailsNamingTopkAndChangesNothing) {
  Bad b;
  DsaDecodeCp layer(b.groups, b.config());
  ShardedDsaCache cache = layer.make_cache(kB, kPrompt + 1, kDi, kDqk, DType::kFloat32);
  b.prefill(layer, cache);
  DsaDecodeConfig huge_cfg = b.config();
  huge_cfg.topk = std::int64_t{1} << 46;
  DsaDecodeCp huge(b.groups, huge_cfg);
  EXPECT_TRUE(fails_everywhere([&] { b.step(huge, cache, 1); },
                               str_cat("DsaDecodeCp::decode: topk 70368744177664: the top-k selection's buffers (topk "
                                       "entries per query row) cannot be made; a query selects among at most ",
                                       kPrompt + 1, " keys, a larger topk adds only -1 padding (out of memory")));
  EXPECT_EQ(cache.length(), kPrompt);
  EXPECT_EQ(cache.num_steps(), 0);
}

TEST(DsaDecodeCpErrors, CacheOfAnotherShardingOrShapeFailsEverywhere) {
  Bad b;
  DsaDecodeConfig contiguous = b.config();
  contiguous.shard = CacheShardKind::kContiguous;
  DsaDecodeCp layer(b.groups, b.config()), other(b.groups, contiguous);
  ShardedDsaCache cache = other.make_cache(kB, kPrompt + 4, kDi, kDqk, DType::kFloat32);
  EXPECT_TRUE(fails_everywhere([&] { b.prefill(layer, cache); }, "the cache is sharded contiguous over"));
  EXPECT_EQ(cache.length(), 0);
  ShardedDsaCache wide = layer.make_cache(kB, kPrompt + 4, 2 * kDi, kDqk, DType::kFloat32);
  EXPECT_TRUE(fails_everywhere([&] { b.prefill(layer, wide); }, "prefill k_idx (the cache's [B, S_local, Di])"));
  EXPECT_EQ(wide.length(), 0);
  EXPECT_EQ(wide.local().length(), 0);
  ShardedDsaCache good = layer.make_cache(kB, kPrompt + 4, kDi, kDqk, DType::kFloat32);
  b.prefill(layer, good);
  const std::int64_t local = good.local().length();
  const Tensor q_idx = test::random_tensor({kB, 1, kHi, 2 * kDi}, DType::kFloat32, 5);
  const auto rows = [&](const TensorView& x) { return rows_of(x, kPrompt, kPrompt + 1); };
  EXPECT_TRUE(
      fails_everywhere([&] { layer.decode(good, rows(b.p.q), rows(b.p.c), q_idx, rows(b.p.k_idx), rows(b.p.w)); },
                       "decode q_idx_new (the cache's [B, n, Hi, Di])"));
  EXPECT_EQ(good.length(), kPrompt);
  EXPECT_EQ(good.local().length(), local);
}

TEST(DsaDecodeCpErrors, RanksThatDisagreeOnTheLengthFailEverywhereAndChangeNothing) {
  if (world().size() == 1) GTEST_SKIP() << "one rank cannot disagree with itself";
  Bad b;
  DsaDecodeCp layer(b.groups, b.config());
  ShardedDsaCache fresh = layer.make_cache(kB, kPrompt + 4, kDi, kDqk, DType::kFloat32);
  ShardedDsaCache filled = layer.make_cache(kB, kPrompt + 4, kDi, kDqk, DType::kFloat32);
  b.prefill(layer, filled);
  ShardedDsaCache& mine = world().rank() == 0 ? fresh : filled;
  const std::int64_t length = mine.length(), local = mine.local().length();
  EXPECT_TRUE(fails_everywhere([&] { b.step(layer, mine, 1); }, "disagree on cache_length"));
  EXPECT_EQ(mine.length(), length);
  EXPECT_EQ(mine.local().length(), local);
}

}  // namespace
}  // namespace seqpar
