// sp_plan's tile model of an attention call (benchmarks/sp_plan_tiles.h): tile and unit counts against closed forms,
// the H100 profile's fit against the FlashAttention-3 rates it was fitted to, and the zigzag ring's calls, costed
// with 1 x 1 tiles (iterations = visible pairs), against the exact causal pairs of each rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "benchmarks/sp_plan.h"
#include "benchmarks/sp_plan_tiles.h"
#include "runtime/error.h"

namespace seqpar::bench::plan {
namespace {

TilePhase phase(int m, int n, int cm, int cn, bool pack = false) {
  TilePhase p;
  p.block_m = m;
  p.block_n = n;
  p.causal_block_m = cm;
  p.causal_block_n = cn;
  p.unit_flops_per_s = p.causal_unit_flops_per_s = 1e12;
  p.pack_gqa = pack;
  return p;
}

// Without a mask every unit runs every block of the other side: units ceil(L/M) (forward) or ceil(L/N) (backward)
// per head, iterations units x the other count.
TEST(SpPlanTiles, CountsWithoutMaskAreTheGrid) {
  const TilePhase p = phase(128, 176, 128, 128);
  for (const std::int64_t L : {1, 100, 128, 176, 1000, 4096, 5000}) {
    const auto mb = (L + 127) / 128, nb = (L + 175) / 176;
    const TileCount f = tile_count(p, false, {{L, L, false}}, 4, 4);
    EXPECT_EQ(f.units, 4.0 * mb) << L;
    EXPECT_EQ(f.iterations, 4.0 * mb * nb) << L;
    const TileCount b = tile_count(p, true, {{L, L, false}}, 4, 4);
    EXPECT_EQ(b.units, 4.0 * nb) << L;
    EXPECT_EQ(b.iterations, 4.0 * mb * nb) << L;
  }
}

// Causal, L = T blocks: the forward's unit m sees m + 1 key blocks, T (T + 1) / 2 in all; the backward with M half
// of N: key block n is seen from query block 2n on, 2T - 2n blocks, T (T + 1) in all. Bottom-right alignment: with
// k_len = q_len + d every query sees d more keys.
TEST(SpPlanTiles, CausalCountsAreTriangles) {
  const TilePhase p = phase(128, 176, 128, 128), b = phase(80, 128, 64, 128);
  for (const std::int64_t T : {1, 2, 5, 64}) {
    EXPECT_EQ(tile_count(p, false, {{T * 128, T * 128, true}}, 1, 1).iterations, T * (T + 1) / 2.0) << T;
    EXPECT_EQ(tile_count(b, true, {{T * 128, T * 128, true}}, 1, 1).iterations, T * (T + 1.0)) << T;
    // k_len = q_len + 128: every forward unit sees one more key block.
    EXPECT_EQ(tile_count(p, false, {{T * 128, (T + 1) * 128, true}}, 1, 1).iterations, T * (T + 1) / 2.0 + T) << T;
  }
  // A query block that sees no key (k_len < q_len) costs no iteration, only its unit.
  const TileCount c = tile_count(p, false, {{256, 100, true}}, 1, 1);
  EXPECT_EQ(c.units, 2.0);
  EXPECT_EQ(c.iterations, 1.0);  // the second block's last query sees keys 0..99; the first block's none
}

// 1 x 1 tiles: iterations are the visible (query, key) pairs: L (L + 1) / 2 causal, q k without a mask, and packed
// GQA changes nothing but the units (g heads per unit).
TEST(SpPlanTiles, UnitTilesCountPairs) {
  const TilePhase one = phase(1, 1, 1, 1);
  for (const std::int64_t L : {1, 7, 300}) {
    EXPECT_EQ(tile_count(one, false, {{L, L, true}}, 3, 3).iterations, 3.0 * L * (L + 1) / 2) << L;
    EXPECT_EQ(tile_count(one, true, {{L, L, true}}, 3, 3).iterations, 3.0 * L * (L + 1) / 2) << L;
    EXPECT_EQ(tile_count(one, false, {{L, 2 * L, false}}, 3, 3).iterations, 3.0 * L * 2 * L) << L;
  }
  const TilePhase packed = phase(128, 128, 128, 128, true);
  // 8 query heads on 1 key head, 16 tokens: one M block of 128 rows (16 tokens x 8 heads) instead of 8 blocks.
  EXPECT_EQ(tile_count(packed, false, {{16, 16, true}}, 8, 1).units, 1.0);
  EXPECT_EQ(tile_count(phase(128, 128, 128, 128), false, {{16, 16, true}}, 8, 1).units, 8.0);
}

// The seconds: (iterations + overhead x units) x tile FLOPs / rate, never below iterations at the plateau; the
// backward's tile 2.5 times the forward's FLOPs.
TEST(SpPlanTiles, SecondsAreUnitsAtTheRate) {
  AttnTiles t;
  t.present = true;
  t.fwd = phase(128, 128, 128, 128);
  t.bwd = phase(64, 128, 64, 128);
  t.fwd.overhead_blocks = t.bwd.overhead_blocks = 2;
  t.fwd.causal_overhead_blocks = t.bwd.causal_overhead_blocks = 3;
  const double D = 128, tile = 4 * 128 * 128 * D;
  // 1024 x 1024 without a mask: 8 units of 8 iterations.
  EXPECT_NEAR(tile_call_seconds(t, false, {{1024, 1024, false}}, 1, 1, 128, 1e15), (64 + 2 * 8) * tile / 1e12, 1e-15);
  // Causal: 36 iterations, 8 units, overhead 3.
  EXPECT_NEAR(tile_call_seconds(t, false, {{1024, 1024, true}}, 1, 1, 128, 1e15), (36 + 3 * 8) * tile / 1e12, 1e-15);
  // Backward, tile 64 x 128: 8 units (key blocks) x 16 query blocks.
  EXPECT_NEAR(tile_call_seconds(t, true, {{1024, 1024, false}}, 1, 1, 128, 1e15),
              (128 + 2 * 8) * 2.5 * 4 * 64 * 128 * D / 1e12, 1e-15);
  // A plateau below the unit rate decides when the overhead is small against it.
  EXPECT_NEAR(tile_call_seconds(t, false, {{1024, 1024, false}}, 1, 1, 128, 0.5e12), 64 * tile / 0.5e12, 1e-15);
}

// The H100 profile's fit: a call of the FlashAttention-3 paper's benchmark (16K tokens as 16K / L sequences of L,
// 16 heads of 128) costed by the tiles within 5 % of the rate the paper publishes at L, for the forward and backward
// without a mask (the profile's mha_fwd and mha_bwd curves) and the forward with one (292 ... 616 TFLOPS/s, the
// paper's head-dim-128 causal forward chart; the profile's mha_tiles source).
TEST(SpPlanTiles, FitReproducesTheCurve) {
  const DeviceProfile p = load_profile(std::string(SEQPAR_PROFILES_DIR) + "/h100_sxm.json");
  ASSERT_TRUE(p.mha_tiles.present);
  const std::vector<std::int64_t> L = {512, 1024, 2048, 4096, 8192, 16384};
  const std::vector<double> causal_fwd = {292e12, 423e12, 521e12, 579e12, 602e12, 616e12};
  for (std::size_t i = 0; i < L.size(); ++i) {
    const std::vector<TileSeq> full(16384 / L[i], TileSeq{L[i], L[i], false}),
        causal(16384 / L[i], TileSeq{L[i], L[i], true});
    const double fwd_flops = 4.0 * 16384 * L[i] * 2048;
    const double plateau_f = p.kernel("mha_fwd").points.back().second,
                 plateau_b = p.kernel("mha_bwd").points.back().second;
    const double f = fwd_flops / tile_call_seconds(p.mha_tiles, false, full, 16, 16, 128, plateau_f);
    const double b = 2.5 * fwd_flops / tile_call_seconds(p.mha_tiles, true, full, 16, 16, 128, plateau_b);
    const double c =
        (fwd_flops * (L[i] + 1) / (2.0 * L[i])) / tile_call_seconds(p.mha_tiles, false, causal, 16, 16, 128, plateau_f);
    EXPECT_NEAR(f / p.kernel("mha_fwd").points[i].second, 1.0, 0.05) << "forward at " << L[i];
    EXPECT_NEAR(b / p.kernel("mha_bwd").points[i].second, 1.0, 0.05) << "backward at " << L[i];
    EXPECT_NEAR(c / causal_fwd[i], 1.0, 0.05) << "causal forward at " << L[i];
  }
}

// The zigzag ring's calls cover each rank's causal pairs exactly: with 1 x 1 tiles, no overhead and flat links, every
// ring rank's compute is 4 H D x (its pairs) / rate, and zigzag gives every rank (2P - 1) c^2 + c (c + 1) pairs of a
// document of 2 P c tokens (the total L (L + 1) / 2 over P ranks); p2p and all-gather alike, and a ring of one.
TEST(SpPlanTiles, ZigzagCallsCoverTheCausalPairs) {
  DeviceProfile p;
  p.name = "tiles";
  for (const char* k : {"mha_fwd", "mha_bwd"}) p.kernels[k] = {{{1.0, 1e12}}, "test"};
  p.intra = {0, 1e18, "test"};
  p.inter = {0, 1e18, "test"};
  p.mha_tiles.present = true;
  p.mha_tiles.fwd = p.mha_tiles.bwd = phase(1, 1, 1, 1);
  p.mha_tiles.source = "test";
  for (const int P : {1, 2, 4}) {
    const std::vector<std::int64_t> docs = {2 * P * 3, 2 * P * 5, 2 * P * 1};
    double pairs = 0;
    std::string lens;
    for (const std::int64_t n : docs) {
      pairs += n * (n + 1) / 2.0;
      if (!lens.empty()) lens += ',';
      lens += std::to_string(n);
    }
    for (const std::string impl : {"p2p", "allgather"}) {
      if (P == 1 && impl == "allgather") continue;  // a ring of one has one configuration
      PlanInput in;
      in.problem_flags = {"--attn",     "mha", "--heads",  "2",          "--kv-heads", "2",
                          "--head-dim", "8",   "--causal", "--doc-lens", lens};
      in.world_size = in.devices_per_node = P;
      in.only_configs = {"u1xr" + std::to_string(P) + " zigzag " + impl};
      const std::vector<PlanRow> rows = plan(in, p);
      ASSERT_FALSE(rows.empty());
      ASSERT_TRUE(rows.front().excluded.empty()) << rows.front().excluded;
      const Prediction& pr = rows.front().prediction;
      const double fwd = 4.0 * 2 * 8 * pairs / P / 1e12;
      EXPECT_NEAR(pr.compute_s, fwd + 2.5 * fwd, 1e-9 * fwd) << "P " << P << " " << impl;
      EXPECT_NEAR(pr.imbalance_s, 0.0, 1e-9 * fwd) << "P " << P << " " << impl;
    }
  }
}

// The "mha_tiles" block: read and written back; blocks are positive integers; the block names its source.
TEST(SpPlanTiles, ProfileBlock) {
  const DeviceProfile p = load_profile(std::string(SEQPAR_PROFILES_DIR) + "/h100_sxm.json");
  const DeviceProfile q = profile_from_json(profile_json(p), "round trip");
  EXPECT_TRUE(q.mha_tiles.present);
  EXPECT_EQ(q.mha_tiles.fwd.block_n, 176);
  EXPECT_EQ(q.mha_tiles.bwd.causal_block_m, 64);
  EXPECT_EQ(q.mha_tiles.fwd.causal_overhead_blocks, p.mha_tiles.fwd.causal_overhead_blocks);
  EXPECT_TRUE(q.mha_tiles.fwd.pack_gqa);
  nlohmann::json j = profile_json(p);
  j["mha_tiles"]["fwd"]["block_m"] = 0;
  EXPECT_THROW(profile_from_json(j, "bad"), Error);
  // Out of int range: refused naming the value (it used to wrap, 2^32 + 64 read as 64).
  for (const nlohmann::json& v :
       {nlohmann::json(4294967360LL), nlohmann::json(-4294967232LL), nlohmann::json(18446744073709551615ULL)}) {
    j["mha_tiles"]["fwd"]["block_m"] = v;
    try {
      profile_from_json(j, "bad");
      ADD_FAILURE() << "accepted block_m " << v.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("block_m " + v.dump() + " must be an integer in [1, 2^31 - 1]"),
                std::string::npos)
          << e.what();
    }
  }
  j = profile_json(p);
  j["mha_tiles"].erase("source");
  EXPECT_THROW(profile_from_json(j, "bad"), Error);
  // A profile without the block keeps the curves alone.
  j = profile_json(p);
  j.erase("mha_tiles");
  EXPECT_FALSE(profile_from_json(j, "no tiles").mha_tiles.present);
}

// A profile with one flat MHA rate (1 TFLOP/s), links of the given latency (100 and 10 GB/s) and 2 TB/s of memory.
DeviceProfile flat_profile(double latency_s) {
  DeviceProfile p;
  p.name = "flat";
  p.note = "test";
  for (const char* k : {"mha_fwd", "mha_bwd"}) p.kernels[k] = {{{1.0, 1e12}}, "test"};
  p.intra = {latency_s, 1e11, "test"};
  p.inter = {latency_s, 1e10, "test"};
  p.memory_bandwidth_bps = 2e12;
  p.device_source = "test";
  return p;
}

// The "ulysses" block: every input crossing a Ulysses all-to-all (q, k, v; dq, dk, dv) copied before and after it,
// the output (out; dout) after it only, read and written: 2 e (S / (P Pu)) D (3 Hq + 4 max(Hkv, Pu)) bytes per phase
// at the memory bandwidth; no copies without a Ulysses group; read and written back; needs the memory bandwidth.
TEST(SpPlanTiles, UlyssesLayoutPassAddsItsBytes) {
  DeviceProfile p = flat_profile(0);
  const std::int64_t S = 4096, Hq = 8, Hkv = 2, D = 64;
  for (const int pu : {1, 4}) {
    PlanInput in;
    in.problem_flags = {"--attn",     "mha", "--heads", "8",  "--kv-heads", "2",
                        "--head-dim", "64",  "--seq",   "4K", "--dtype",    "bf16"};
    in.world_size = in.devices_per_node = pu;
    in.only_configs = {"u" + std::to_string(pu) + "xr1 zigzag p2p"};
    p.ulysses_layout_pass = false;
    const Prediction base = plan(in, p).front().prediction;
    p.ulysses_layout_pass = true;
    p.ulysses_source = "test";
    const Prediction copies = plan(in, p).front().prediction;
    // q, k, v twice (into and out of the all-to-all's layout), out once (after its all-to-all), each read and written
    const double kv = 2.0 * 2 * (S / pu) * D * std::max<std::int64_t>(Hkv, pu), q = 2.0 * 2 * (S / pu) * D * Hq;
    const double bytes = pu > 1 ? 2 * q + 2 * (2 * kv) + q : 0.0;
    EXPECT_NEAR(copies.forward_s - base.forward_s, bytes / 2e12, 1e-12) << "Pu " << pu;
    EXPECT_NEAR(copies.backward_s - base.backward_s, bytes / 2e12, 1e-12) << "Pu " << pu;
  }
  const DeviceProfile q = profile_from_json(profile_json(p), "round trip");
  EXPECT_TRUE(q.ulysses_layout_pass);
  nlohmann::json j = profile_json(p);
  j["device"]["memory_bandwidth_bytes_per_s"] = 0;
  EXPECT_THROW(profile_from_json(j, "no bandwidth"), Error);
  j = profile_json(p);
  j["ulysses"]["layout_pass"] = "yes";
  EXPECT_THROW(profile_from_json(j, "not a flag"), Error);
}

// links.intra's p2p bandwidth: a ring inside one node sends its blocks at it (forward, without overlap: P c + (P - 1)
// (latency + block / p2p)), the all-gather and a ring across nodes do not use it; read and written back; >= 0.
TEST(SpPlanTiles, IntraP2pBandwidthTimesTheRingInsideANode) {
  DeviceProfile p;
  p.name = "flat";
  p.note = "test";
  for (const char* k : {"mha_fwd", "mha_bwd"}) p.kernels[k] = {{{1.0, 1e12}}, "test"};
  p.intra = {1e-6, 1e11, "test"};
  p.inter = {1e-6, 1e10, "test"};
  p.ring_transfer_overlaps_compute = false;
  p.ring_source = "test";
  const int P = 4;
  PlanInput in;
  in.problem_flags = {"--attn",     "mha", "--heads", "4",  "--kv-heads", "2",
                      "--head-dim", "64",  "--seq",   "8K", "--dtype",    "bf16"};
  in.world_size = in.devices_per_node = P;
  in.only_configs = {"u1xr4 zigzag p2p", "u1xr4 zigzag allgather"};
  const std::vector<PlanRow> base = plan(in, p);
  p.intra_p2p_bandwidth_bps = 2e10;
  const std::vector<PlanRow> slow = plan(in, p);
  const double block = 8192.0 / P * 2 * 64 * 2 * 2;  // K and V of a ring shard: S / P rows, 2 key heads of 64, bf16
  for (std::size_t i = 0; i < base.size(); ++i) {
    ASSERT_EQ(base[i].config.name(), slow[i].config.name());
    const double moved = slow[i].prediction.forward_s - base[i].prediction.forward_s;
    if (base[i].config.impl == "p2p")
      EXPECT_NEAR(moved, (P - 1) * (block / 2e10 - block / 1e11), 1e-12) << base[i].config.name();
    else
      EXPECT_EQ(moved, 0.0) << base[i].config.name();
  }
  in.devices_per_node = 1;  // every hop across nodes: the inter link, the p2p bandwidth unused
  in.nodes = P;
  in.only_configs = {"u1xr4 zigzag p2p"};
  p.intra_p2p_bandwidth_bps = 0;
  const double across = plan(in, p).front().prediction.forward_s;
  p.intra_p2p_bandwidth_bps = 2e10;
  EXPECT_EQ(plan(in, p).front().prediction.forward_s, across);
  EXPECT_EQ(profile_from_json(profile_json(p), "round trip").intra_p2p_bandwidth_bps, 2e10);
  nlohmann::json j = profile_json(p);
  j["links"]["intra"]["p2p_bandwidth_bytes_per_s"] = -1;
  EXPECT_THROW(profile_from_json(j, "negative"), Error);
}

// The passes around a FlashAttention-3 varlen call, tensor by tensor (e storage bytes, Q query rows, K key rows):
// forward, q gathered (read, write), k and v gathered, out zero-filled then scattered (read, write), the fp32 lse
// filled then scattered; backward, q, out, dout, k, v and the lse gathered, dq, dk, dv zero-filled and scattered.
// Empty sequences count nothing. The half reads: a read and a write of the halved rows.
TEST(SpPlanTiles, UnpadPadBytesTensorByTensor) {
  const double e = 2, D = 64, Hq = 8, Hkv = 2;
  const std::vector<TileSeq> seqs = {{100, 300, true}, {50, 50, false}, {0, 40, false}};
  const double Q = 150, K = 350;
  const double q = e * Q * Hq * D, kv = e * K * Hkv * D, lse = 4 * Q * Hq;
  const double fwd = 2 * q + 2 * (2 * kv) + (q + 2 * q) + (lse + 2 * lse);
  const double bwd = 3 * (2 * q) + 2 * (2 * kv) + 2 * lse + (q + 2 * q) + 2 * (kv + 2 * kv);
  EXPECT_DOUBLE_EQ(unpad_pad_bytes(false, seqs, 8, 2, 64, e), fwd);
  EXPECT_DOUBLE_EQ(unpad_pad_bytes(true, seqs, 8, 2, 64, e), bwd);
  // Half reads: the first sequence's 100 queries are half its keys, a {60, 30} call's 30 keys half its queries.
  const std::vector<TileSeq> steps = {{100, 200, false}, {60, 30, false}, {70, 70, false}};
  const double hq = e * 100 * Hq * D, hkv = e * 30 * Hkv * D;
  EXPECT_DOUBLE_EQ(half_read_bytes(false, steps, 8, 2, 64, e), 2 * hq + 2 * (2 * hkv));
  EXPECT_DOUBLE_EQ(half_read_bytes(true, steps, 8, 2, 64, e), 3 * (2 * hq) + 2 * (2 * hkv));
}

// The "fa3_calls" block in a plan: Ulysses (a ring of one, pu 4: one call of the whole row, Hq / pu query heads and
// max(Hkv, pu) / pu key heads) and the zigzag all-gather (P 4: each rank's two halves, c = S / 2P queries each, on
// (j + 1) c keys for chunks j = r and 2P - 1 - r: (2P + 1) c keys in all, the same on every rank, plus each half's
// query read and output collect, and its backward's dk, dv zero-filled at the whole row) gain exactly their calls'
// bytes at the memory bandwidth; read and written back; needs the memory bandwidth.
TEST(SpPlanTiles, Fa3UnpadPadPassAddsItsBytes) {
  DeviceProfile p = flat_profile(0);
  const double bw = 2e12;
  PlanInput in;
  in.problem_flags = {"--attn", "mha",   "--heads", "8",       "--kv-heads", "2",       "--head-dim",
                      "64",     "--seq", "8K",      "--dtype", "bf16",       "--causal"};
  in.world_size = in.devices_per_node = 4;
  in.only_configs = {"u4xr1 zigzag p2p", "u1xr4 zigzag allgather"};
  const std::vector<PlanRow> base = plan(in, p);
  p.fa3_unpad_pad_pass = true;
  p.fa3_calls_source = "test";
  const std::vector<PlanRow> with = plan(in, p);
  ASSERT_EQ(base.size(), 2u);
  for (const PlanRow& b : base) {
    const auto w =
        std::find_if(with.begin(), with.end(), [&](const PlanRow& x) { return x.config.name() == b.config.name(); });
    ASSERT_NE(w, with.end());
    std::vector<TileSeq> calls;
    int hq = 8, hkv = 2;
    if (b.config.ulysses_size == 4) {
      calls = {{8192, 8192, true}};
      hq = 2;
      hkv = 1;
    } else {
      const std::int64_t c = 8192 / 8;
      calls = {{c, c, true}, {c, 8 * c, true}};  // rank 0: chunks 0 and 7 (the same key total on every rank)
    }
    // The all-gather's halves also read their queries out of the local ones and collect their output back: forward
    // q in and out back (4 e per element of the 2c rows x Hq x D), backward q, dout in and dq back (6 e).
    const double halves = b.config.ulysses_size == 4 ? 0.0 : 2.0 * (8192 / 8) * 8 * 64;  // 2c rows x Hq x D
    // and its backward zero-fills dk, dv at all 8192 gathered rows per half, not the half's c and 8c key rows.
    const double zero_fill = b.config.ulysses_size == 4 ? 0.0 : 2.0 * 2 * 2 * 64 * (2 * 8192 - 9 * 1024);
    EXPECT_NEAR(w->prediction.forward_s - b.prediction.forward_s,
                (unpad_pad_bytes(false, calls, hq, hkv, 64, 2) + 4 * 2 * halves) / bw, 1e-12)
        << b.config.name();
    EXPECT_NEAR(w->prediction.backward_s - b.prediction.backward_s,
                (unpad_pad_bytes(true, calls, hq, hkv, 64, 2) + 6 * 2 * halves + zero_fill) / bw, 1e-12)
        << b.config.name();
  }
  const DeviceProfile q = profile_from_json(profile_json(p), "round trip");
  EXPECT_TRUE(q.fa3_unpad_pad_pass);
  nlohmann::json j = profile_json(p);
  j["device"]["memory_bandwidth_bytes_per_s"] = 0;
  EXPECT_THROW(profile_from_json(j, "no bandwidth"), Error);
  j = profile_json(p);
  j["fa3_calls"]["unpad_pad_pass"] = 1;
  EXPECT_THROW(profile_from_json(j, "not a flag"), Error);
  j = profile_json(p);
  j["fa3_calls"].erase("source");
  EXPECT_THROW(profile_from_json(j, "no source"), Error);
}

// The H200 and GB200 profiles' tiles reproduce their own mha curves (the paper's benchmark call, as
// FitReproducesTheCurve for the H100: within 5 % at every point, forward and backward), and the causal forward at
// the H100's published causal rates times the profile's curve ratio (1 for the H200, Blackwell's peak ratio for the
// GB200); both carry the Ulysses copies and the H100's NCCL send/receive rate inside a node; the FlashAttention-3
// passes are on for the H200 (the baselines' Hopper backend) and off for the GB200 (TransformerEngine's).
TEST(SpPlanTiles, H200AndGb200CarryTheSettings) {
  const DeviceProfile h100 = load_profile(std::string(SEQPAR_PROFILES_DIR) + "/h100_sxm.json");
  const std::vector<std::int64_t> L = {512, 1024, 2048, 4096, 8192, 16384};
  const std::vector<double> causal_fwd = {292e12, 423e12, 521e12, 579e12, 602e12, 616e12};
  for (const char* name : {"h200.json", "gb200_nvl72.json"}) {
    const DeviceProfile p = load_profile(std::string(SEQPAR_PROFILES_DIR) + "/" + name);
    ASSERT_TRUE(p.mha_tiles.present) << name;
    EXPECT_TRUE(p.ulysses_layout_pass) << name;
    EXPECT_EQ(p.intra_p2p_bandwidth_bps, h100.intra_p2p_bandwidth_bps) << name;
    EXPECT_EQ(p.fa3_unpad_pad_pass, std::string(name) == "h200.json") << name;
    EXPECT_FALSE(p.fa3_calls_source.empty()) << name;
    const double ratio = p.kernel("mha_fwd").points.back().second / h100.kernel("mha_fwd").points.back().second;
    const double plateau_f = p.kernel("mha_fwd").points.back().second,
                 plateau_b = p.kernel("mha_bwd").points.back().second;
    for (std::size_t i = 0; i < L.size(); ++i) {
      const std::vector<TileSeq> full(16384 / L[i], TileSeq{L[i], L[i], false}),
          causal(16384 / L[i], TileSeq{L[i], L[i], true});
      const double fwd_flops = 4.0 * 16384 * L[i] * 2048;
      const double f = fwd_flops / tile_call_seconds(p.mha_tiles, false, full, 16, 16, 128, plateau_f);
      const double b = 2.5 * fwd_flops / tile_call_seconds(p.mha_tiles, true, full, 16, 16, 128, plateau_b);
      const double c = (fwd_flops * (L[i] + 1) / (2.0 * L[i])) /
                       tile_call_seconds(p.mha_tiles, false, causal, 16, 16, 128, plateau_f);
      EXPECT_NEAR(f / p.kernel("mha_fwd").points[i].second, 1.0, 0.05) << name << " forward at " << L[i];
      EXPECT_NEAR(b / p.kernel("mha_bwd").points[i].second, 1.0, 0.05) << name << " backward at " << L[i];
      EXPECT_NEAR(c / (ratio * causal_fwd[i]), 1.0, 0.05) << name << " causal forward at " << L[i];
    }
  }
}

// ring.storage_dtype_gradients: the ring p2p's travelling dK/dV block is the K/V block's size (bf16), not twice it
// (fp32): without overlap the backward pays P - 1 blocks in the steps and one on the way home, so it moves by P x
// (the K/V block) / the link; with the merge pass on, the running out (forward: read and written, P - 1 steps) and
// dq, dk, dv (backward: three passes) move from 4 to 2 bytes an element. A ring of 4 across 4 nodes, no mask (every
// rank alike); read and written back.
TEST(SpPlanTiles, StorageDtypeGradientsHalveTheGradientBlock) {
  DeviceProfile p = flat_profile(1e-6);
  p.ring_transfer_overlaps_compute = false;
  p.ring_source = "test";
  const int P = 4;
  const double S = 8192, Hq = 4, Hkv = 2, D = 64, e = 2, a = 4;
  PlanInput in;
  in.problem_flags = {"--attn",     "mha", "--heads", "4",  "--kv-heads", "2",
                      "--head-dim", "64",  "--seq",   "8K", "--dtype",    "bf16"};
  in.world_size = in.nodes = P;
  in.devices_per_node = 1;
  in.only_configs = {"u1xr4 zigzag p2p"};
  const double block = S / P * Hkv * D * 2 * e;  // K and V of a ring shard
  for (const bool merge : {false, true}) {
    p.ring_merge_pass = merge;
    p.ring_storage_dtype_gradients = false;
    const Prediction fp32 = plan(in, p).front().prediction;
    p.ring_storage_dtype_gradients = true;
    const Prediction bf16 = plan(in, p).front().prediction;
    const double rows = S / P;
    const double fwd = merge ? (P - 1) * rows * Hq * D * 2 * (a - e) / 2e12 : 0.0;
    const double bwd = P * block / 1e10 + (merge ? (P - 1) * rows * (Hq + 2 * Hkv) * D * 3 * (a - e) / 2e12 : 0.0);
    EXPECT_NEAR(fp32.forward_s - bf16.forward_s, fwd, 1e-12) << "merge " << merge;
    EXPECT_NEAR(fp32.backward_s - bf16.backward_s, bwd, 1e-12) << "merge " << merge;
  }
  EXPECT_TRUE(profile_from_json(profile_json(p), "round trip").ring_storage_dtype_gradients);
  nlohmann::json j = profile_json(p);
  j["ring"]["storage_dtype_gradients"] = "yes";
  EXPECT_THROW(profile_from_json(j, "not a flag"), Error);
}

// ring.copy_passes: the ring function's copies (ring_copy_pass_bytes), bf16 with bf16 gradients (e = a = 2, the lse
// 4): the forward adds, at step 0 only, rows (4 e Hkv D + Hq (D (e + 3 a) + 2 l)) (K and V concatenated, out zeroed,
// the lse cloned, step 0's output folded in); the backward rows D (8 e Hkv + 2 a Hq + 4 a Hkv) at step 0 (K and V
// copied, dq, dk, dv copied, dk, dv concatenated) and rows 4 e Hkv D at each of the P - 1 later steps; at the memory
// bandwidth, not overlapped (a ring of 4 across 4 nodes, no mask: every rank alike). The all-gather pays none; a ring
// of one (Ulysses 2) pays them only with ring_function_at_one, over its S rows of Hq / 2 and Hkv / 2 heads. Read and
// written back; not a flag, or no memory bandwidth: refused.
TEST(SpPlanTiles, RingCopyPassesAddTheirBytes) {
  DeviceProfile p = flat_profile(1e-6);
  p.ring_transfer_overlaps_compute = false;
  p.ring_storage_dtype_gradients = true;
  p.ring_source = "test";
  const double S = 8192, Hq = 4, Hkv = 2, D = 64, e = 2, a = 2, l = 4, bw = 2e12;
  const auto fwd_bytes = [&](double rows, double hq, double hkv) {
    return rows * (4 * e * hkv * D + hq * (D * (e + 3 * a) + 2 * l));
  };
  const auto bwd_bytes = [&](double rows, double hq, double hkv, int P) {
    return rows * D * (8 * e * hkv + 2 * a * hq + 4 * a * hkv) + (P - 1) * rows * 4 * e * hkv * D;
  };
  PlanInput in;
  in.problem_flags = {"--attn",     "mha", "--heads", "4",  "--kv-heads", "2",
                      "--head-dim", "64",  "--seq",   "8K", "--dtype",    "bf16"};
  in.world_size = in.nodes = 4;
  in.devices_per_node = 1;
  for (const std::string impl : {"p2p", "allgather"}) {
    in.only_configs = {"u1xr4 zigzag " + impl};
    p.ring_copy_passes = false;
    const Prediction off = plan(in, p).front().prediction;
    p.ring_copy_passes = true;
    const Prediction on = plan(in, p).front().prediction;
    const bool p2p = impl == "p2p";
    EXPECT_NEAR(on.forward_s - off.forward_s, p2p ? fwd_bytes(S / 4, Hq, Hkv) / bw : 0.0, 1e-12) << impl;
    EXPECT_NEAR(on.backward_s - off.backward_s, p2p ? bwd_bytes(S / 4, Hq, Hkv, 4) / bw : 0.0, 1e-12) << impl;
  }
  in.world_size = in.devices_per_node = 2;
  in.nodes = 1;
  in.only_configs = {"u2xr1 zigzag p2p"};
  p.ring_copy_passes = false;
  const Prediction ulysses = plan(in, p).front().prediction;
  p.ring_copy_passes = true;
  EXPECT_EQ(plan(in, p).front().prediction.forward_s, ulysses.forward_s);
  in.ring_function_at_one = true;
  const Prediction usp = plan(in, p).front().prediction;
  EXPECT_NEAR(usp.forward_s - ulysses.forward_s, fwd_bytes(S, Hq / 2, Hkv / 2) / bw, 1e-12);
  EXPECT_NEAR(usp.backward_s - ulysses.backward_s, bwd_bytes(S, Hq / 2, Hkv / 2, 1) / bw, 1e-12);
  EXPECT_TRUE(profile_from_json(profile_json(p), "round trip").ring_copy_passes);
  nlohmann::json j = profile_json(p);
  j["ring"]["copy_passes"] = "yes";
  EXPECT_THROW(profile_from_json(j, "not a flag"), Error);
  j = profile_json(p);
  j["device"]["memory_bandwidth_bytes_per_s"] = 0;
  EXPECT_THROW(profile_from_json(j, "no bandwidth"), Error);
}

}  // namespace
}  // namespace seqpar::bench::plan
