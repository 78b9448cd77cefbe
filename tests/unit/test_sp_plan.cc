// sp_plan's model on one process: the ring's event simulation against its closed forms, the slowest rank deciding
// (layout imbalance), the exclusions with sp_bench's own reasons, the memory verdict, the profile's JSON round trip.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "benchmarks/flop_models.h"
#include "benchmarks/sp_bench_memory.h"
#include "benchmarks/sp_plan.h"
#include "parallel/layout.h"
#include "runtime/dtype.h"
#include "runtime/error.h"

namespace seqpar::bench::plan {
namespace {

// A profile with flat curves: every kernel at `flops_per_s`, both links at `latency_s` and `bandwidth`.
DeviceProfile flat_profile(double flops_per_s, double latency_s, double bandwidth) {
  DeviceProfile p;
  p.name = "flat";
  p.note = "test";
  for (const char* k : {"mha_fwd", "mha_bwd", "gdn_fwd", "gdn_bwd", "dsa_fwd", "dsa_bwd"}) {
    p.kernels[k].points = {{1.0, flops_per_s}};
    p.kernels[k].source = "test";
  }
  p.intra = {latency_s, bandwidth, "test"};
  p.inter = {latency_s * 10, bandwidth / 10, "test"};
  return p;
}

PlanInput input(std::vector<std::string> flags, int world, double mem = 0) {
  PlanInput in;
  in.problem_flags = std::move(flags);
  in.world_size = world;
  in.devices_per_node = world;
  in.memory_per_device = mem;
  return in;
}

const PlanRow& row_named(const std::vector<PlanRow>& rows, const std::string& name) {
  for (const PlanRow& r : rows)
    if (r.config.name() == name) return r;
  ADD_FAILURE() << "no configuration " << name;
  return rows.front();
}

TEST(SpPlanRing, ComputeBoundIsPStepsOfCompute) {
  for (int P : {1, 2, 4, 8}) {
    const double c = 1e-3, t = 1e-6;
    std::vector<double> exposed;
    const std::vector<double> finish =
        simulate_ring(std::vector<std::vector<double>>(P, std::vector<double>(P, c)), t, &exposed);
    for (int r = 0; r < P; ++r) {
      EXPECT_NEAR(finish[r], P * c, 1e-15) << "rank " << r << " of " << P;
      EXPECT_EQ(exposed[r], 0.0) << "rank " << r << " of " << P;
    }
    EXPECT_NEAR(ring_forward_closed_form(P, c, t), P * c, 1e-15);
  }
}

TEST(SpPlanRing, TransferBoundExposesTheClosedForm) {
  for (int P : {2, 3, 8}) {
    const double c = 1e-6, t = 1e-3;
    std::vector<double> exposed;
    const std::vector<double> finish =
        simulate_ring(std::vector<std::vector<double>>(P, std::vector<double>(P, c)), t, &exposed);
    for (int r = 0; r < P; ++r) {
      EXPECT_NEAR(finish[r], c + (P - 1) * t, 1e-12) << "rank " << r << " of " << P;
      EXPECT_NEAR(exposed[r], (P - 1) * (t - c), 1e-12) << "rank " << r << " of " << P;  // waits: t - c per step
    }
  }
}

TEST(SpPlanRing, SlowestRankDecides) {
  // Rank 1 computes twice as long at every step: everyone waits for its blocks, the ring runs at its pace.
  const int P = 4;
  const double c = 1e-3;
  std::vector<std::vector<double>> compute(P, std::vector<double>(P, c));
  for (double& x : compute[1]) x = 2 * c;
  const std::vector<double> finish = simulate_ring(compute, 1e-9, nullptr);
  EXPECT_NEAR(*std::max_element(finish.begin(), finish.end()), P * 2 * c, 1e-9);
}

// A ring whose transfers do not overlap the kernels (DeviceProfile::ring_transfer_overlaps_compute false): every
// step pays its compute and then its transfer, P c + (P - 1) t, whichever is larger.
TEST(SpPlanRing, WithoutOverlapComputeThenTransfer) {
  for (int P : {1, 2, 5, 8}) {
    for (const auto& [c, t] : {std::pair{1e-3, 1e-6}, std::pair{1e-6, 1e-3}, std::pair{2e-3, 2e-3}}) {
      std::vector<double> exposed;
      const std::vector<double> finish =
          simulate_ring(std::vector<std::vector<double>>(P, std::vector<double>(P, c)), t, &exposed, false);
      for (int r = 0; r < P; ++r) {
        EXPECT_NEAR(finish[r], P * c + (P - 1) * t, 1e-12) << "rank " << r << " of " << P;
        EXPECT_NEAR(exposed[r], (P - 1) * t, 1e-12) << "rank " << r << " of " << P;
      }
      EXPECT_NEAR(ring_forward_closed_form(P, c, t, false), P * c + (P - 1) * t, 1e-15);
    }
  }
  // A slow rank delays its successor's blocks by its extra compute: rank 1 at 2 c finishes at P 2 c + (P - 1) t.
  const int P = 4;
  const double c = 1e-3, t = 1e-4;
  std::vector<std::vector<double>> compute(P, std::vector<double>(P, c));
  for (double& x : compute[1]) x = 2 * c;
  const std::vector<double> finish = simulate_ring(compute, t, nullptr, false);
  EXPECT_NEAR(*std::max_element(finish.begin(), finish.end()), P * 2 * c + (P - 1) * t, 1e-12);
}

// The all-gather's time (allgather_seconds) against its closed forms: one node, P - 1 intra hops; across nodes the
// blocks leave each node through the NICs of the group's members there (the smaller of the intra bandwidth and
// members x the per-rank inter bandwidth); one member per node, one NIC.
TEST(SpPlanCollective, AllGatherSpreadsOverTheNodesNics) {
  DeviceProfile p = flat_profile(1e12, 2e-6, 400e9);  // intra 2 us + 400 GB/s, inter 20 us + 40 GB/s
  const double b = 32e6;
  EXPECT_NEAR(allgather_seconds(b, 8, 8, 8, p), 7 * (2e-6 + b / 400e9), 1e-15);
  EXPECT_NEAR(allgather_seconds(b, 64, 8, 8, p), 63 * (20e-6 + b / 320e9), 1e-15);  // 8 NICs of 40 GB/s
  EXPECT_NEAR(allgather_seconds(b, 16, 16, 32, p), 15 * (2e-6 + b / 400e9), 1e-15);
  EXPECT_NEAR(allgather_seconds(b, 64, 16, 16, p), 63 * (20e-6 + b / 400e9), 1e-15);  // NVLink the narrower
  EXPECT_NEAR(allgather_seconds(b, 8, 1, 8, p), 7 * (20e-6 + b / 40e9), 1e-15);       // a ring across nodes
  p.ranks_per_nic = 2;  // two ranks share a NIC: 20 GB/s each
  EXPECT_NEAR(allgather_seconds(b, 64, 8, 8, p), 63 * (20e-6 + b / 160e9), 1e-15);
  EXPECT_EQ(allgather_seconds(b, 1, 8, 8, p), 0.0);
}

// The ring's merge pass (DeviceProfile::ring_merge_pass): each of the P - 1 later steps adds the bytes of its merge
// at the memory bandwidth to the kernel's time. Compute-bound with a fast link: forward P c + (P - 1) m_fwd,
// backward likewise with m_bwd, against the closed forms of the bytes.
TEST(SpPlanRing, MergePassAddsItsBytesAtMemoryBandwidth) {
  DeviceProfile p = flat_profile(1e9, 1e-9, 1e15);
  p.memory_bandwidth_bps = 2e9;
  const int P = 4;
  const std::int64_t S = 2048, H = 4, Hkv = 2, D = 32;
  PlanInput in = input({"--attn", "mha", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--seq", "2K"}, P);
  in.only_configs = {"u1xr4 zigzag p2p"};
  const PlanRow base = plan(in, p).front();
  p.ring_merge_pass = true;
  const PlanRow merged = plan(in, p).front();
  ASSERT_TRUE(base.excluded.empty() && merged.excluded.empty()) << base.excluded << merged.excluded;
  const SpBenchOptions o = config_options(in, base.config);
  const double e = static_cast<double>(dtype_size(o.dtype)),
               a = static_cast<double>(dtype_size(accumulator_dtype(o.dtype)));
  const double rows = static_cast<double>(S) / P;
  const double m_fwd = rows * H * (D * (e + 2 * a) + 3 * a) / 2e9, m_bwd = rows * (H + 2 * Hkv) * D * 3 * a / 2e9;
  EXPECT_NEAR(merged.prediction.forward_s - base.prediction.forward_s, (P - 1) * m_fwd, 1e-9);
  EXPECT_NEAR(merged.prediction.backward_s - base.prediction.backward_s, (P - 1) * m_bwd, 1e-9);
  // The all-gather merges nothing per step; its passes are over the whole sequence's K and V (E elements): the
  // reorder after each gather (4 e E), and in the backward dK, dV zeroed (2 e E), per kernel call (zigzag: two, one
  // per half of the local queries) the call's dK, dV added (2 x 3 e E) and its fp32 GQA accumulator (4 query heads
  // on 2 key heads) zeroed and converted (2 (8 + e) E), and the reorder before the reduce-scatter (4 e E).
  in.only_configs = {"u1xr4 zigzag allgather"};
  p.ring_merge_pass = false;
  const Prediction ag = plan(in, p).front().prediction;
  p.ring_merge_pass = true;
  const Prediction ag_passes = plan(in, p).front().prediction;
  const double E = static_cast<double>(S) * Hkv * D;
  EXPECT_NEAR(ag_passes.forward_s - ag.forward_s, 4 * e * E / 2e9, 1e-9);
  EXPECT_NEAR(ag_passes.backward_s - ag.backward_s, (10 * e * E + 2 * (6 * e * E + 2 * (8 + e) * E)) / 2e9, 1e-9);
}

// The "ring" block of a profile: read and written back; a merge pass needs the memory bandwidth; the flags are
// booleans; the block names its source.
TEST(SpPlanProfile, RingBlock) {
  DeviceProfile p = flat_profile(2e9, 3e-6, 4e9);
  p.memory_bandwidth_bps = 3e12;
  p.device_source = "test";
  p.ring_transfer_overlaps_compute = false;
  p.ring_merge_pass = true;
  p.ring_source = "test";
  const DeviceProfile q = profile_from_json(profile_json(p), "round trip");
  EXPECT_FALSE(q.ring_transfer_overlaps_compute);
  EXPECT_TRUE(q.ring_merge_pass);
  const auto refused = [](const nlohmann::json& j, const std::string& what) {
    try {
      profile_from_json(j, "p");
      ADD_FAILURE() << "accepted: " << j.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  nlohmann::json j = profile_json(p);
  j.erase("device");
  refused(j, "ring.merge_pass is true but device.memory_bandwidth_bytes_per_s is 0");
  j = profile_json(p);
  j["ring"]["merge_pass"] = 1;
  refused(j, "ring.merge_pass must be true or false");
  j = profile_json(p);
  j["ring"].erase("source");
  refused(j, "p: ring");
  // Absent: the ideal ring.
  j = profile_json(p);
  j.erase("ring");
  const DeviceProfile d = profile_from_json(j, "no ring");
  EXPECT_TRUE(d.ring_transfer_overlaps_compute);
  EXPECT_FALSE(d.ring_merge_pass);
}

TEST(SpPlan, ZigzagBeatsContiguousUnderCausalMask) {
  // Compute-bound (fast links): contiguous's last ring rank does about 2P - 1 times the first's work.
  const DeviceProfile prof = flat_profile(1e9, 1e-9, 1e15);
  const auto rows = plan(
      input({"--attn", "mha", "--heads", "4", "--kv-heads", "4", "--head-dim", "32", "--seq", "2K", "--causal"}, 4),
      prof);
  const PlanRow& zz = row_named(rows, "u1xr4 zigzag p2p");
  const PlanRow& ct = row_named(rows, "u1xr4 contiguous p2p");
  ASSERT_TRUE(zz.excluded.empty()) << zz.excluded;
  ASSERT_TRUE(ct.excluded.empty()) << ct.excluded;
  EXPECT_LT(zz.prediction.step_s, ct.prediction.step_s);
  EXPECT_GT(ct.prediction.imbalance_s, 0.5 * ct.prediction.compute_s * 0.5);
  // Zigzag balances the causal work to one tile row per rank: little imbalance.
  EXPECT_LT(zz.prediction.imbalance_s, 0.1 * zz.prediction.compute_s);
  // The same total work: compute of the slowest rank times P bounds the whole problem's time from above.
  const double total = 4.0 * 4 * 32 * (2048.0 * 2049 / 2) * 3.5 / 1e9;  // forward + backward, one rank's rate
  EXPECT_GE(ct.prediction.compute_s * 4, total * 0.999);
}

TEST(SpPlan, ExclusionsNameTheRule) {
  const DeviceProfile prof = flat_profile(1e9, 1e-6, 1e9);
  // 6 heads over 4 ranks: Ulysses 4 cannot split them (sp_bench's own message); GDN refuses the stripe layout.
  const auto mha =
      plan(input({"--attn", "mha", "--heads", "6", "--kv-heads", "6", "--seq", "1K", "--causal"}, 4), prof);
  const PlanRow& u4 = row_named(mha, "u4xr1 zigzag p2p");
  EXPECT_NE(u4.excluded.find("--heads 6 must be divisible by --ulysses-size 4"), std::string::npos) << u4.excluded;
  EXPECT_TRUE(row_named(mha, "u2xr2 zigzag p2p").excluded.empty()) << row_named(mha, "u2xr2 zigzag p2p").excluded;
  const auto gdn =
      plan(input({"--attn", "gdn", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--seq", "1K"}, 2), prof);
  const PlanRow& stripe = row_named(gdn, "u1xr2 stripe scan");
  EXPECT_NE(stripe.excluded.find("stripe"), std::string::npos) << stripe.excluded;
  // The reason is sp_bench's, verbatim: parse the same flags as sp_bench would.
  PlanInput in = input({"--attn", "mha", "--heads", "6", "--kv-heads", "6", "--seq", "1K", "--causal"}, 4);
  try {
    config_options(in, u4.config);
    ADD_FAILURE() << "u4 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(u4.excluded, std::string(e.what()));
  }
}

// The table says when the first choice ties (within 0.5 %) with others, naming them and not a slower one; a GPU
// profile (its note starts "GPU profile") adds the note that the command runs on the CPU without --device cuda.
TEST(SpPlan, TableNamesTiesAndTheGpuProfileNote) {
  std::vector<PlanRow> rows(3);
  const double steps[] = {1.0, 1.004, 1.1};
  for (int i = 0; i < 3; ++i) {
    rows[i].config.ulysses_size = 1 << i;
    rows[i].config.ring_size = 4 >> i;
    rows[i].config.layout = "zigzag";
    rows[i].config.impl = "p2p";
    rows[i].prediction.step_s = steps[i];
    rows[i].command = "mpirun -np 4 sp_bench";
  }
  DeviceProfile prof = flat_profile(1e9, 1e-6, 1e9);
  const PlanInput in = input({"--attn", "mha"}, 4);
  std::string t = plan_table(in, prof, rows);
  EXPECT_NE(t.find("ties (within 0.5 % of its predicted step) with 1 other configuration(s): " + rows[1].config.name() +
                   "\n"),
            std::string::npos)
      << t;
  EXPECT_EQ(t.find("--device cuda"), std::string::npos) << t;
  rows[1].prediction.step_s = 1.006;  // beyond 0.5 %: no tie
  prof.note = "GPU profile from public figures";
  t = plan_table(in, prof, rows);
  EXPECT_EQ(t.find("ties"), std::string::npos) << t;
  EXPECT_NE(t.find("unless --device cuda is added"), std::string::npos) << t;
}

// A ring of one places the tokens alike under every layout kind (slots in order, padded to a multiple of Pu), so
// the plan lists one layout there, and the flags it prints leave --layout to sp_bench's default.
TEST(SpPlan, RingOfOneHasOneLayoutAndNoLayoutFlag) {
  const std::vector<std::int64_t> cu = {0, 5, 5, 70, 197};
  for (const int pu : {1, 2, 4}) {
    const SequenceLayout ref(LayoutKind::kZigzag, 197, 1, pu),
        packed_ref = SequenceLayout::packed(LayoutKind::kZigzag, cu, 1, pu);
    for (const LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kStripe, LayoutKind::kBalanced}) {
      const SequenceLayout l(kind, 197, 1, pu), packed = SequenceLayout::packed(kind, cu, 1, pu);
      for (int r = 0; r < pu; ++r) {
        EXPECT_EQ(l.token_index(r), ref.token_index(r)) << layout_name(kind) << " pu " << pu << " rank " << r;
        EXPECT_EQ(packed.token_index(r), packed_ref.token_index(r)) << layout_name(kind) << " packed, pu " << pu;
      }
    }
  }
  const DeviceProfile prof = flat_profile(1e9, 1e-6, 1e9);
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--attn", "mha", "--heads", "4", "--kv-heads", "4", "--seq", "1K", "--causal"},
        std::vector<std::string>{"--attn", "gdn", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--seq",
                                 "1K"}}) {
    int ring_of_one = 0;
    for (const PlanRow& row : plan(input(flags, 4), prof)) {
      const std::vector<std::string> f = row.config.flags();
      const bool has_layout = std::find(f.begin(), f.end(), "--layout") != f.end();
      EXPECT_EQ(has_layout, row.config.ring_size > 1) << row.config.name() << ": " << row.command;
      if (row.config.ring_size > 1) continue;
      ++ring_of_one;
      EXPECT_EQ(row.config.layout, "zigzag") << row.config.name();
      EXPECT_EQ(row.command.find("--layout"), std::string::npos) << row.command;
      EXPECT_TRUE(row.excluded.empty()) << row.config.name() << ": " << row.excluded;
    }
    EXPECT_EQ(ring_of_one, flags[1] == "mha" ? 1 : 2) << flags[1];  // MHA: p2p; GDN: chain and scan
  }
}

// Rings beyond kPlanMaxRing (the balanced kind beyond kPlanMaxBalancedRing) are excluded by name before any layout is
// built (a world of 65536 ranks would otherwise allocate a 2^32-entry per-step table per configuration).
TEST(SpPlan, RingsBeyondTheLimitAreExcludedByName) {
  const DeviceProfile prof = flat_profile(1e9, 1e-6, 1e9);
  const std::vector<std::string> flags = {"--attn", "mha",   "--heads", "8",       "--kv-heads",
                                          "8",      "--seq", "1M",      "--causal"};
  const std::vector<PlanRow> rows = plan(input(flags, 65536), prof);
  for (const PlanRow& row : rows) {
    if (row.config.ring_size > kPlanMaxRing) {
      const std::string want =
          row.config.layout == "balanced"
              ? str_cat("ring_size ", row.config.ring_size, " exceeds the ", kPlanMaxBalancedRing,
                        " ring ranks sp_plan plans the balanced layout for (its step refinement costs O(ring_size^4))")
              : str_cat("ring_size ", row.config.ring_size, " exceeds the ", kPlanMaxRing,
                        " ring ranks sp_plan plans for (a layout's per-step work table has ring_size^2 entries)");
      EXPECT_EQ(row.excluded, want) << row.config.name();
    } else {
      EXPECT_FALSE(row.excluded.empty()) << row.config.name() << ": 8 heads cannot split over Ulysses "
                                         << row.config.ulysses_size;
    }
  }
  std::vector<std::string> shorter = flags;
  shorter[7] = "64K";
  const std::vector<PlanRow> balanced = plan(input(shorter, 2 * kPlanMaxBalancedRing), prof);
  const PlanRow& over = row_named(balanced, str_cat("u1xr", 2 * kPlanMaxBalancedRing, " balanced p2p"));
  EXPECT_NE(over.excluded.find(str_cat("ring_size ", 2 * kPlanMaxBalancedRing, " exceeds the ", kPlanMaxBalancedRing,
                                       " ring ranks sp_plan plans the balanced layout for")),
            std::string::npos)
      << over.excluded;
  EXPECT_TRUE(row_named(balanced, str_cat("u2xr", kPlanMaxBalancedRing, " balanced p2p")).excluded.empty());
  EXPECT_TRUE(row_named(balanced, str_cat("u1xr", 2 * kPlanMaxBalancedRing, " zigzag p2p")).excluded.empty());
}

// memory_verdict estimates one rank per class (rank 0, the other SP roots, the rest): its sum over a node equals the
// sum of every rank's own estimate, with --check making the SP roots differ.
TEST(SpPlan, MemoryVerdictSumsEveryRanksEstimate) {
  PlanInput in = input({"--attn", "gdn", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--seq", "2K",
                        "--check", "--dp-size", "2"},
                       8);
  PlanConfig c;
  c.ring_size = 2;
  c.ulysses_size = 2;
  c.impl.clear();
  c.gdn_mode = "scan";
  const SpBenchOptions o = config_options(in, c);
  double need = 0, largest = 0;
  for (int r = 0; r < in.world_size; ++r) {
    need += estimate_memory(o, r).total_bytes();
    largest = std::max(largest, estimate_memory(o, r).total_bytes());
  }
  ASSERT_GT(largest, estimate_memory(o, 1).total_bytes());  // the classes differ (else this test shows nothing)
  in.memory_per_device = need / in.devices_per_node * 1.0001;
  double per_rank = 0;
  EXPECT_EQ(memory_verdict(o, in, &per_rank), "");
  EXPECT_EQ(per_rank, largest);
  in.memory_per_device = need / in.devices_per_node * 0.9999;
  EXPECT_EQ(memory_verdict(o, in, nullptr).rfind("does not fit in memory", 0), 0u);
}

TEST(SpPlan, MemoryExclusionUsesSpBenchEstimate) {
  const DeviceProfile prof = flat_profile(1e9, 1e-6, 1e9);
  const std::vector<std::string> flags = {"--attn", "mha",   "--heads", "8",       "--head-dim",
                                          "64",     "--seq", "64K",     "--causal"};
  // The per-rank estimate of sp_bench for u1 x r2 zigzag p2p, then a memory just above and just below it.
  PlanInput in = input(flags, 2);
  PlanConfig c;
  c.ring_size = 2;
  const SpBenchOptions o = config_options(in, c);
  const double per_rank = std::max(estimate_memory(o, 0).total_bytes(), estimate_memory(o, 1).total_bytes());
  in.memory_per_device = per_rank * 1.01;
  EXPECT_EQ(memory_verdict(o, in, nullptr), "");
  in.memory_per_device = per_rank * 0.99;
  const std::string v = memory_verdict(o, in, nullptr);
  EXPECT_EQ(v.rfind("does not fit in memory", 0), 0u) << v;
  const auto rows = plan(in, prof);
  EXPECT_EQ(row_named(rows, "u1xr2 zigzag p2p").excluded.rfind("does not fit in memory", 0), 0u);
  // All-gather holds the whole K / V: it needs more than p2p, so it does not fit either.
  EXPECT_FALSE(row_named(rows, "u1xr2 zigzag allgather").excluded.empty());
  // Valid ones come first, ranked by predicted time.
  bool seen_excluded = false;
  double last = 0;
  for (const PlanRow& r : rows) {
    if (!r.excluded.empty()) {
      seen_excluded = true;
      continue;
    }
    EXPECT_FALSE(seen_excluded) << r.config.name() << " after an excluded one";
    EXPECT_GE(r.prediction.step_s, last);
    last = r.prediction.step_s;
  }
}

TEST(SpPlan, ProfileJsonRoundTrip) {
  DeviceProfile p = flat_profile(2e9, 3e-6, 4e9);
  p.kernels["mha_fwd"].points = {{1e6, 1e9}, {1e8, 3e9}};
  p.ranks_per_nic = 2;
  const DeviceProfile q = profile_from_json(profile_json(p), "round trip");
  EXPECT_EQ(q.kernels.at("mha_fwd").points, p.kernels.at("mha_fwd").points);
  EXPECT_EQ(q.intra.latency_s, 3e-6);
  EXPECT_EQ(q.inter.bandwidth_bps, 4e8);
  EXPECT_EQ(q.ranks_per_nic, 2);
  // Log-linear interpolation: halfway in log(flops) between the points is halfway in rate.
  EXPECT_NEAR(q.kernels.at("mha_fwd").rate(1e7), 2e9, 1e-3);
  EXPECT_EQ(q.kernels.at("mha_fwd").rate(1.0), 1e9);
  nlohmann::json bad = profile_json(p);
  bad["links"]["intra"]["bandwidth_bytes_per_s"] = 0;
  try {
    profile_from_json(bad, "bad profile");
    ADD_FAILURE() << "a zero bandwidth was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad profile: links.intra"), std::string::npos) << e.what();
  }
}

// A flat profile with every block's source given, as JSON: what loading accepts.
nlohmann::json sourced_profile_json() {
  DeviceProfile p = flat_profile(2e9, 3e-6, 4e9);
  p.intra.source = p.inter.source = "test";
  p.memory_bytes = 80e9;
  p.memory_bandwidth_bps = 3e12;
  p.device_source = "test";
  return profile_json(p);
}

// Loading refuses a block of numbers that does not say where they come from, naming the block.
TEST(SpPlanProfile, EveryBlockNamesItsSource) {
  const nlohmann::json good = sourced_profile_json();
  EXPECT_NO_THROW(profile_from_json(good, "good"));
  const auto expect_refused = [](const nlohmann::json& j, const std::string& block) {
    try {
      profile_from_json(j, "p");
      ADD_FAILURE() << "accepted without a source: " << block;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("p: " + block), std::string::npos) << e.what();
    }
  };
  for (const std::string block : {"kernels.mha_fwd", "links.intra", "links.inter", "device", "factors"}) {
    const auto dot = block.find('.');
    nlohmann::json missing = good, empty = good, bad_entry = good, assumed = good;
    const auto at = [&](nlohmann::json& root) -> nlohmann::json& {
      return dot == std::string::npos ? root[block] : root[block.substr(0, dot)][block.substr(dot + 1)];
    };
    at(missing).erase("source");
    expect_refused(missing, block);
    at(empty)["source"] = "";
    expect_refused(empty, block);
    at(bad_entry)["source"] = nlohmann::json::array({{{"what", "peak"}}});  // neither url nor assumption
    expect_refused(bad_entry, block);
    at(assumed)["source"] = nlohmann::json::array({{{"what", "peak"}, {"assumption", "why"}}});
    EXPECT_NO_THROW(profile_from_json(assumed, "p")) << block;
  }
}

// The optional scalar fields of a profile are numbers of their range: a wrong type names the field (nlohmann's bare
// "type must be number" named neither), and a factor of zero or below, a negative decode overhead or cores per node,
// or a fractional ranks_per_nic are refused (they were taken and predicted times at or below zero, or truncated).
TEST(SpPlanProfile, ScalarFieldsTypedAndInRange) {
  const nlohmann::json good = sourced_profile_json();
  EXPECT_NO_THROW(profile_from_json(good, "good"));
  const auto refused = [](const nlohmann::json& j, const std::string& what) {
    try {
      profile_from_json(j, "p");
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  nlohmann::json j = good;
  j["gdn_map_factor"] = -1.0;
  refused(j, "gdn_map_factor -1 and gdn_sweep_factor 1 must be > 0");
  j = good;
  j["gdn_sweep_factor"] = 0;
  refused(j, "gdn_map_factor 1 and gdn_sweep_factor 0 must be > 0");
  j = good;
  j["gdn_work_ahead"] = {{"forward_ahead", -0.5}, {"source", "test"}};
  refused(j, "gdn_work_ahead: forward_ahead -0.5 and backward_ahead 0 must be >= 0");
  j["gdn_work_ahead"] = {{"forward_ahead", 0.8}, {"backward_rest", 0}, {"source", "test"}};
  refused(j, "gdn_work_ahead: forward_rest 1 and backward_rest 0 must be > 0");
  j["gdn_work_ahead"] = {{"forward_ahead", 0.8}};
  refused(j, "gdn_work_ahead");  // no source
  j["gdn_work_ahead"] = {{"forward_ahead", 0.8}, {"forward_rest", 0.4}, {"source", "test"}};
  EXPECT_EQ(profile_from_json(j, "p").gdn_work_ahead.fwd_rest, 0.4);
  EXPECT_EQ(profile_from_json(profile_json(profile_from_json(j, "p")), "p").gdn_work_ahead.fwd_ahead, 0.8);
  j = good;
  j["cores_per_node"] = -4;
  refused(j, "cores_per_node -4 must be >= 0");
  j = good;
  j["cores_per_node"] = "many";
  refused(j, "p: field \"cores_per_node\" must be a number (is \"many\")");
  j = good;
  j["device"]["decode_overhead_s"] = -1e-3;
  refused(j, "device.decode_overhead_s -0.001 must be >= 0");
  j = good;
  j["device"]["memory_bandwidth_bytes_per_s"] = "fast";
  refused(j, "p: device: field \"memory_bandwidth_bytes_per_s\" must be a number");
  j = good;
  j["links"]["ranks_per_nic"] = 1.5;
  refused(j, "links.ranks_per_nic 1.5 must be an integer >= 1");
  j = good;
  j["links"]["ranks_per_nic"] = "2";
  refused(j, "p: links: field \"ranks_per_nic\" must be a number");
  j = good;
  j["links"]["intra"]["p2p_bandwidth_bytes_per_s"] = "80e9";
  refused(j, "p: links.intra: field \"p2p_bandwidth_bytes_per_s\" must be a number (is \"80e9\")");
  j = good;
  j["kernels"]["mha_fwd"]["points"] = {{1e9, 1e-300}};  // flops / rate overflows to inf
  refused(j, "the rate flops_per_s must be finite and >= 1");
  j = good;
  j["name"] = 5;
  refused(j, "p: field \"name\" must be a string");
  refused(nlohmann::json::array({1}), "p: must be a JSON object (is array)");
  // In range: taken as given.
  j = good;
  j["links"]["ranks_per_nic"] = 4;
  j["device"]["decode_overhead_s"] = 2e-6;
  const DeviceProfile q = profile_from_json(j, "p");
  EXPECT_EQ(q.ranks_per_nic, 4);
  EXPECT_EQ(q.decode_overhead_s, 2e-6);
}

// The GPU profiles in benchmarks/profiles load (so every block names its source), carry the curves the published
// comparisons use, and their figures are the datasheets' orders of magnitude.
TEST(SpPlanProfile, ShippedGpuProfilesLoad) {
  int n = 0;
  for (const auto& f : std::filesystem::directory_iterator(SEQPAR_PROFILES_DIR)) {
    if (f.path().extension() != ".json") continue;
    ++n;
    SCOPED_TRACE(f.path().string());
    const DeviceProfile p = load_profile(f.path().string());
    for (const char* k : {"mha_fwd", "mha_bwd", "gemm", "gdn_fwd", "gdn_bwd", "dsa_fwd", "dsa_bwd"}) {
      ASSERT_TRUE(p.kernels.count(k)) << k;
      EXPECT_FALSE(p.kernels.at(k).source.empty()) << k;
      for (const auto& [x, y] : p.kernels.at(k).points) EXPECT_TRUE(y > 1e14 && y < 5e15) << k << " " << y;
    }
    EXPECT_GT(p.memory_bytes, 64e9);
    EXPECT_GT(p.memory_bandwidth_bps, 3e12);
    EXPECT_GE(p.intra.bandwidth_bps, 400e9);  // NVLink 4 or 5 per direction
    EXPECT_EQ(p.inter.bandwidth_bps, 50e9);   // 400 Gb/s per NIC
    EXPECT_FALSE(p.shared_node.present());    // each GPU has its own memory: no shared-node slowdown
  }
  EXPECT_GE(n, 3) << "benchmarks/profiles should hold the H100, H200 and GB200 profiles";
}

// A decode step: the slowest shard's attention plus the all-gather of the partial results (P - 1 hops of
// B n Hq (D + 2) accumulator bytes), against the closed form; the bytes are MhaDecodeCp::decode_bytes_per_step's.
TEST(SpPlanDecode, StepIsShardPlusMerge) {
  const double rate = 1e9, lat = 2e-6, bw = 1e9;
  DeviceProfile p = flat_profile(rate, lat, bw);
  const int P = 2;
  PlanInput in = input({"--attn", "mha", "--heads", "8", "--kv-heads", "8", "--head-dim", "64", "--context", "4096",
                        "--decode-steps", "16"},
                       P);
  in.mode = "decode";
  const std::vector<PlanRow> rows = plan(in, p);
  const PlanRow& inter = row_named(rows, "u1xr2 zigzag cache-interleave");
  const PlanRow& contig = row_named(rows, "u1xr2 zigzag cache-contiguous");
  ASSERT_TRUE(inter.excluded.empty()) << inter.excluded;
  ASSERT_TRUE(contig.excluded.empty()) << contig.excluded;
  // Interleave 1 at the middle step (length 4096 + 8): 2052 tokens a rank, plus the step's own token.
  const double block = 1.0 * 1 * 8 * (64 + 2) * 4;  // B n Hq (D + 2) fp32
  const double attn = 4.0 * 8 * 64 * (2052 + 1) / rate;
  EXPECT_NEAR(inter.prediction.step_s, attn + (P - 1) * (lat + block / bw), 1e-12);
  EXPECT_EQ(inter.prediction.bytes_sent_forward, (P - 1) * block);
  // Contiguous blocks of ceil((4096 + 16) / 2) = 2056: rank 0's is full at the middle step; it decides.
  EXPECT_NEAR(contig.prediction.step_s, 4.0 * 8 * 64 * (2056 + 1) / rate + (P - 1) * (lat + block / bw), 1e-12);
  EXPECT_NEAR(contig.prediction.imbalance_s, 4.0 * 8 * 64 * (2056 - 2052) / rate, 1e-12);  // ranks 2056, 2048
  // One rank: the whole cache, no merge.
  PlanInput one = in;
  one.world_size = one.devices_per_node = 1;
  const PlanRow& solo = row_named(plan(one, p), "u1xr1 zigzag cache-interleave");
  EXPECT_NEAR(solo.prediction.step_s, 4.0 * 8 * 64 * (4104 + 1) / rate, 1e-12);
  EXPECT_EQ(solo.prediction.bytes_sent_forward, 0.0);
  // Memory-bound: the fixed cost plus the shard's K and V (2 x 8 heads x 64 x 4 bytes a token) at the bandwidth.
  p.memory_bandwidth_bps = 1e8;
  p.decode_overhead_s = 1e-3;
  const PlanRow& mem = row_named(plan(in, p), "u1xr2 zigzag cache-interleave");
  EXPECT_NEAR(mem.prediction.step_s, 1e-3 + 2.0 * 8 * 64 * 4 * (2052 + 1) / 1e8 + (P - 1) * (lat + block / bw), 1e-12);
}

// A causal packed row costs the tile pairs the CPU kernels compute (64 x 64, masked or not), not its visible pairs:
// tile pairs x the visible pairs per tile pair of one causal row of the padded length x 4 H D. Documents of whole
// tiles, counted by hand: a document of m tiles has m (m + 1) / 2 tile pairs.
TEST(SpPlanPacked, ComputeIsExecutedTilePairs) {
  const double rate = 1e9;
  DeviceProfile p = flat_profile(rate, 0.0, 1e30);
  p.mha_tile_pairs = true;
  const double per_pair = 4.0 * 8 * 64;  // 4 H D
  // The causal row of n tiles of 64: its n (n + 1) / 2 tile pairs hold len (len + 1) / 2 visible pairs.
  const auto pairs_per_tile = [](double len) {
    const double n = len / 64;
    return len * (len + 1) / (n * (n + 1));
  };
  // One rank, documents 1024, 512, 256, 128, 64, 64: 136 + 36 + 10 + 3 + 1 + 1 = 187 tile pairs of a 2048-slot row.
  PlanInput one = input({"--attn", "mha", "--heads", "8", "--kv-heads", "8", "--head-dim", "64", "--doc-lens",
                         "1024,512,256,128,64,64", "--causal"},
                        1);
  one.only_configs = {"u1xr1 zigzag p2p"};
  const Prediction a = plan(one, p).front().prediction;
  const double tiles_s = 187 * pairs_per_tile(2048) * per_pair / rate;
  EXPECT_NEAR(a.forward_s, tiles_s, 1e-12);
  EXPECT_NEAR(a.backward_s, 2.5 * tiles_s, 1e-12);
  // 6 % more than the visible pairs, sum of L (L + 1) / 2 = 701440.
  EXPECT_NEAR(a.forward_s / (701440 * per_pair / rate), 187 * pairs_per_tile(2048) / 701440, 1e-12);
  EXPECT_GT(a.forward_s, 1.05 * 701440 * per_pair / rate);
  // The flag travels in the profile's JSON; anything but a boolean is refused, naming the field.
  EXPECT_TRUE(profile_from_json(profile_json(p), "round trip").mha_tile_pairs);
  nlohmann::json bad = profile_json(p);
  bad["mha_tile_pairs"] = 1;
  try {
    profile_from_json(bad, "bad profile");
    ADD_FAILURE() << "mha_tile_pairs 1 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad profile: mha_tile_pairs must be true or false"), std::string::npos)
        << e.what();
  }
  // A profile without mha_tile_pairs: the visible pairs.
  DeviceProfile visible = p;
  visible.mha_tile_pairs = false;
  EXPECT_NEAR(plan(one, visible).front().prediction.forward_s, 701440 * per_pair / rate, 1e-12);
  // Unpacked: the row's tiles are those of the reference row, so its visible pairs.
  PlanInput plain =
      input({"--attn", "mha", "--heads", "8", "--kv-heads", "8", "--head-dim", "64", "--seq", "2K", "--causal"}, 1);
  plain.only_configs = {"u1xr1 zigzag p2p"};
  EXPECT_NEAR(plan(plain, p).front().prediction.forward_s, 2048.0 * 2049 / 2 * per_pair / rate, 1e-12);
  // Two ranks, contiguous, documents 1024, 512, 256 (1792 slots): rank 0 holds document 0's first 896 tokens (14
  // tiles: 105 pairs at step 0, none at step 1); rank 1 the last 128 (2 tiles: 3 pairs, and 2 x 14 against rank 0's
  // at step 1), then 512 (36) and 256 (10): 77 pairs. Rank 0 decides: 105 tile pairs.
  PlanInput two = input({"--attn", "mha", "--heads", "8", "--kv-heads", "8", "--head-dim", "64", "--doc-lens",
                         "1024,512,256", "--causal"},
                        2);
  two.only_configs = {"u1xr2 contiguous p2p"};
  const Prediction b = plan(two, p).front().prediction;
  const double rank0_s = 105 * pairs_per_tile(1792) * per_pair / rate;
  EXPECT_NEAR(b.forward_s, rank0_s, 1e-9);
  // Forward and backward (2.5 x): rank 0's 105 against the mean of 105 and 77.
  EXPECT_NEAR(b.imbalance_s, 3.5 * (105 - (105 + 77) / 2.0) * pairs_per_tile(1792) * per_pair / rate, 1e-9);
}

// GDN's chain runs head by head (GdnCp): at 2 ranks, contiguous, rank 1 starts head h when rank 0 has finished it
// and its state has arrived, so a phase takes half the work, plus one head of the first half, plus one head's state
// message (the forward; the backward the same from the other end).
TEST(SpPlanGdn, ChainPipelinesOverValueHeads) {
  const double rate = 1e9, lat = 3e-6, bw = 1e9;
  const DeviceProfile p = flat_profile(rate, lat, bw);
  const std::int64_t H = 4, K = 32, V = 32, S = 1024;
  PlanInput in = input({"--attn", "gdn", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--dim-v", "32",
                        "--seq", "1K", "--conv-width", "0"},
                       2);
  in.only_configs = {"u1xr2 contiguous chain"};
  const PlanRow r = plan(in, p).front();
  ASSERT_TRUE(r.excluded.empty()) << r.excluded;
  const SpBenchOptions o = config_options(in, r.config);
  const double F = gdn_forward_flops(GdnFlopShape{1, S, H, K, V, o.chunk_size, 0, 0}) / rate;
  const double msg = lat + 1.0 * K * V * 4 / bw;  // one head's fp32 state
  EXPECT_NEAR(r.prediction.forward_s, F / 2 + F / 2 / H + msg, 1e-12);
  EXPECT_NEAR(r.prediction.backward_s, 2.5 * (F / 2 + F / 2 / H) + msg, 1e-12);
  EXPECT_EQ(r.prediction.bytes_sent_forward, 1.0 * H * K * V * 4);
  // One value head: no pipeline, the two halves one after the other.
  PlanInput one = in;
  one.problem_flags = {"--attn",  "gdn", "--heads", "1",  "--kv-heads",   "1", "--head-dim", "32",
                       "--dim-v", "32",  "--seq",   "1K", "--conv-width", "0"};
  const PlanRow r1 = plan(one, p).front();
  const double F1 = F / H;
  EXPECT_NEAR(r1.prediction.forward_s, F1 + lat + 1.0 * K * V * 4 / bw, 1e-12);
}

// GdnCp's work ahead: a rank waiting for head h's state computes the state-independent part of its waiting windows
// (each costs ahead x the window, at most kGdnAheadMaxWindows of them held), and a window done ahead then costs rest x
// the window. With ahead 1/4, rest 3/4, H = 4 and a free link, worked by hand (window W = one value head of a rank's
// half, F the whole forward): contiguous, the second rank is bound by the first's states, one a period W, and fills
// each period's idle W / 4 with the next window's ahead, so only the last window's rest follows the last state:
// F / 2 + r W. Zigzag at 2 ranks holds segments of S/4 (rank 0), S/2 (rank 1), S/4 (rank 0): rank 1 waits one
// quarter-segment head (W / 2), works two of its windows ahead, never waits again, and rank 0's last head waits W / 2
// and pays its rest: F / 2 + r W / 2. Without work ahead both are F / 2 + W (the model before: equal). The backward
// is the same with 2.5 F, the segments in reverse.
TEST(SpPlanGdn, WorkAheadShortensTheZigzagChain) {
  DeviceProfile p = flat_profile(1e9, 0.0, 1e18);
  const std::int64_t H = 4, K = 32, V = 32, S = 1024;
  PlanInput in = input({"--attn", "gdn", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--dim-v", "32",
                        "--seq", "1K", "--conv-width", "0"},
                       2);
  in.only_configs = {"u1xr2 contiguous chain", "u1xr2 zigzag chain", "u1xr2 zigzag scan"};
  const SpBenchOptions o = config_options(in, plan(in, p).front().config);
  const double F = gdn_forward_flops(GdnFlopShape{1, S, H, K, V, o.chunk_size, 0, 0}) / 1e9;
  const double W = F / 2 / H, Wb = 2.5 * W;
  const double tol = 1e-9 * F;
  {
    const std::vector<PlanRow> rows = plan(in, p);
    for (const char* name : {"u1xr2 contiguous chain", "u1xr2 zigzag chain"}) {
      const PlanRow& r = row_named(rows, name);
      EXPECT_NEAR(r.prediction.forward_s, F / 2 + W, tol) << name;
      EXPECT_NEAR(r.prediction.backward_s, 2.5 * F / 2 + Wb, tol) << name;
    }
  }
  p.gdn_work_ahead.fwd_ahead = p.gdn_work_ahead.bwd_ahead = 0.25;
  p.gdn_work_ahead.fwd_rest = p.gdn_work_ahead.bwd_rest = 0.75;
  p.gdn_work_ahead.source = "test";
  const std::vector<PlanRow> rows = plan(in, p);
  const PlanRow &contiguous = row_named(rows, "u1xr2 contiguous chain"), &zigzag = row_named(rows, "u1xr2 zigzag chain");
  EXPECT_NEAR(contiguous.prediction.forward_s, F / 2 + 0.75 * W, tol);
  EXPECT_NEAR(contiguous.prediction.backward_s, 2.5 * F / 2 + 0.75 * Wb, tol);
  EXPECT_NEAR(zigzag.prediction.forward_s, F / 2 + 0.75 * W / 2, tol);
  EXPECT_NEAR(zigzag.prediction.backward_s, 2.5 * F / 2 + 0.75 * Wb / 2, tol);
  // At 2 ranks the scan runs the same pipeline (no map; its direct segment and the shift wait as the chain does).
  EXPECT_NEAR(row_named(rows, "u1xr2 zigzag scan").prediction.step_s, zigzag.prediction.step_s, tol);
  EXPECT_LT(zigzag.prediction.step_s, contiguous.prediction.step_s);
}

// A work ahead that costs more than it saves (ahead 1/2 + rest 3/4 > 1, as the CPU forward's 0.84 + 0.40): contiguous
// at 2 ranks, 4 value heads, a free link, the second rank's forward by hand. In run order it works windows 0 and 1
// ahead in its first wait (W), then has W / 4 after each window to work the next one halfway, so the last runs half
// ahead: F / 2 + (1/2 x 3/4 + 1/2) W = F / 2 + 7/8 W. Last window first (kPlanGdnAheadLastFirst): windows 3 and 0 in
// the first wait, so the last runs with its work ahead done: F / 2 + 3/4 W.
TEST(SpPlanGdn, WorkAheadOrderDecidesTheLastWindow) {
  DeviceProfile p = flat_profile(1e9, 0.0, 1e18);
  p.gdn_work_ahead.fwd_ahead = 0.5;
  p.gdn_work_ahead.fwd_rest = 0.75;
  p.gdn_work_ahead.source = "test";
  PlanInput in = input({"--attn", "gdn", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--dim-v", "32",
                        "--seq", "1K", "--conv-width", "0"},
                       2);
  in.only_configs = {"u1xr2 contiguous chain"};
  const PlanRow r = plan(in, p).front();
  const SpBenchOptions o = config_options(in, r.config);
  const double F = gdn_forward_flops(GdnFlopShape{1, 1024, 4, 32, 32, o.chunk_size, 0, 0}) / 1e9, W = F / 2 / 4;
  EXPECT_NEAR(r.prediction.forward_s, F / 2 + (kPlanGdnAheadLastFirst ? 0.75 : 0.875) * W, 1e-9 * F);
}

// At 2 ranks the scan computes no map (GdnScanPlan: segment 0 runs, the others run from the states they receive), so
// the map factors change nothing; at 4 ranks, contiguous, the middle segments' maps are on the critical path when
// they dominate, and the forward grows by the factor's change times one segment's gdn_map_flops at the forward's
// rate, the backward by the sweep factor's change times one segment's forward.
TEST(SpPlanGdn, ScanMapsFromTheirFlops) {
  DeviceProfile p = flat_profile(1e9, 1e-6, 1e10);
  const std::vector<std::string> flags = {"--attn",  "gdn", "--heads", "4",  "--kv-heads",   "2", "--head-dim", "32",
                                          "--dim-v", "32",  "--seq",   "1K", "--conv-width", "0"};
  PlanInput two = input(flags, 2);
  two.only_configs = {"u1xr2 zigzag scan"};
  p.gdn_map_factor = p.gdn_sweep_factor = 1.0;
  const double base = plan(two, p).front().prediction.step_s;
  p.gdn_map_factor = p.gdn_sweep_factor = 50.0;
  EXPECT_EQ(plan(two, p).front().prediction.step_s, base);

  PlanInput four = input(flags, 4);
  four.only_configs = {"u1xr4 contiguous scan"};
  const SpBenchOptions o = config_options(four, plan(four, p).front().config);
  const GdnFlopShape seg{1, 256, 4, 32, 32, o.chunk_size, 0, 0};
  const double map_s = gdn_map_flops(seg) / 1e9, fwd_s = gdn_forward_flops(seg) / 1e9;
  EXPECT_NEAR(gdn_map_flops(seg), 256.0 * 4 * (4 * o.chunk_size * 32 + 2 * o.chunk_size * 32 + 4 * 32 * 64), 1e-3);
  p.gdn_map_factor = p.gdn_sweep_factor = 20.0;
  const Prediction a = plan(four, p).front().prediction;
  p.gdn_map_factor = p.gdn_sweep_factor = 30.0;
  const Prediction b = plan(four, p).front().prediction;
  EXPECT_NEAR(b.forward_s - a.forward_s, 10.0 * map_s, 1e-9);
  EXPECT_NEAR(b.backward_s - a.backward_s, 10.0 * fwd_s, 1e-9);
}

// A model: layers x (attention + linear layers), the linear layers at the gemm curve on each rank's tokens
// (forward F, backward 2 F per token), tensor parallelism splitting both.
TEST(SpPlanModel, LayersTimesAttentionPlusLinear) {
  DeviceProfile p = flat_profile(1e12, 1e-6, 1e10);
  p.kernels["gemm"].points = {{1.0, 2e12}};
  p.kernels["gemm"].source = "test";
  PlanInput in =
      input({"--attn", "mha", "--heads", "8", "--kv-heads", "8", "--head-dim", "64", "--seq", "2K", "--causal"}, 2);
  const PlanRow base = row_named(plan(in, p), "u1xr2 zigzag p2p");
  PlanInput model = in;
  model.layers = 3;
  model.linear_flops_per_token = 1e9;
  const PlanRow r = row_named(plan(model, p), "u1xr2 zigzag p2p");
  const double linear = 3 * 1e9 * 1024 / 2e12;  // forward + backward of 1024 tokens a rank
  EXPECT_NEAR(r.prediction.step_s, 3 * (base.prediction.step_s + linear), 1e-9);
  EXPECT_NEAR(r.prediction.linear_s, 3 * linear, 1e-12);
  // --tp 2 halves the heads (the attention's FLOPs, compute-bound here) and the linear FLOPs.
  model.tp = 2;
  const PlanRow t = row_named(plan(model, p), "u1xr2 zigzag p2p");
  EXPECT_NEAR(t.prediction.linear_s, 3 * linear / 2, 1e-12);
  EXPECT_LT(t.prediction.compute_s, r.prediction.compute_s * 0.51);
}

// The profile's "shared_node" block: factors >= 1 per kernel curve of the profile, an integer cores_busy, a source;
// anything else is refused naming the field, and the block survives the JSON round trip.
TEST(SpPlanProfile, SharedNodeTypedAndInRange) {
  const nlohmann::json good = sourced_profile_json();
  nlohmann::json j = good;
  j["shared_node"] = {{"slowdown", {{"mha_fwd", 1.25}, {"dsa_bwd", 1.0}}}, {"cores_busy", 2}, {"source", "test"}};
  const DeviceProfile q = profile_from_json(j, "p");
  EXPECT_EQ(q.shared_node.slowdown.at("mha_fwd"), 1.25);
  EXPECT_EQ(q.shared_node.cores_busy, 2);
  const DeviceProfile r = profile_from_json(profile_json(q), "round trip");
  EXPECT_EQ(r.shared_node.slowdown, q.shared_node.slowdown);
  EXPECT_EQ(r.shared_node.cores_busy, 2);
  EXPECT_EQ(r.shared_node.source, "test");
  EXPECT_FALSE(profile_from_json(good, "p").shared_node.present());
  EXPECT_FALSE(profile_json(profile_from_json(good, "p")).contains("shared_node"));
  const auto refused = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& what) {
    nlohmann::json b = j;
    edit(b["shared_node"]);
    try {
      profile_from_json(b, "p");
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused([](nlohmann::json& n) { n["slowdown"]["mha_fwd"] = 0.9; },
          "p: shared_node: slowdown.mha_fwd 0.9 must be in [1, 100]");
  refused([](nlohmann::json& n) { n["slowdown"]["mha_fwd"] = 250; }, "slowdown.mha_fwd 250 must be in [1, 100]");
  refused([](nlohmann::json& n) { n["slowdown"]["mha_fwd"] = "1.2"; }, "slowdown.mha_fwd must be a number");
  refused([](nlohmann::json& n) { n["slowdown"]["attn_fwd"] = 1.2; },
          "slowdown.attn_fwd: no kernel curve \"attn_fwd\"");
  refused([](nlohmann::json& n) { n["slowdown"] = nlohmann::json::object(); }, "non-empty object \"slowdown\"");
  refused([](nlohmann::json& n) { n["slowdown"] = 1.2; }, "non-empty object \"slowdown\"");
  refused([](nlohmann::json& n) { n["cores_busy"] = 1.5; }, "cores_busy 1.5 must be an integer >= 1");
  refused([](nlohmann::json& n) { n["cores_busy"] = 0; }, "cores_busy 0 must be an integer >= 1");
  refused([](nlohmann::json& n) { n.erase("cores_busy"); }, "p: shared_node: field \"cores_busy\" must be a number");
  refused([](nlohmann::json& n) { n.erase("source"); }, "p: shared_node: no \"source\"");
}

// --calibrate's shared-node slowdown: each copy's time over the run alone of the same pair, at each length; the median
// of all those samples (not the mean: one noisy pair moves the mean), at least 1. Three pairs of 2 lengths and 2
// copies; pair 1 ran on a slower machine (alone and busy both twice as long: its ratios are against its own run
// alone), pair 2 has one copy 3 times slower. Samples: pair 0 1.2 1.3 1.3 1.2, pair 1 1.2 1.25 1.3 1.2, pair 2
// 3 3 1.1 1.1; sorted, the 6th and 7th of 12 are 1.2 and 1.25: median 1.225 (the mean is 18.15 / 12 = 1.5125).
TEST(SpPlanCalibrate, SharedNodeSlowdownIsTheMedianOfInterleavedPairs) {
  const std::vector<std::vector<double>> alone = {{10, 20}, {20, 40}, {10, 20}};
  const std::vector<std::vector<std::vector<double>>> busy = {
      {{12, 26}, {13, 24}}, {{24, 50}, {26, 48}}, {{30, 60}, {11, 22}}};
  const SharedNodeSamples s = shared_node_slowdown(alone, busy);
  EXPECT_EQ(s.samples, 12);
  EXPECT_NEAR(s.median, 1.225, 1e-12);
  EXPECT_NEAR(s.slowdown, 1.225, 1e-12);
  ASSERT_EQ(s.pair_medians.size(), 3u);
  EXPECT_NEAR(s.pair_medians[0], 1.25, 1e-12);   // 1.2 1.2 1.3 1.3
  EXPECT_NEAR(s.pair_medians[1], 1.225, 1e-12);  // 1.2 1.2 1.25 1.3
  EXPECT_NEAR(s.pair_medians[2], 2.05, 1e-12);   // 1.1 1.1 3 3
  // An odd count: the middle sample. Below 1 (noise: the other cores cannot speed a kernel up) the factor is 1, the
  // median kept for the source.
  const SharedNodeSamples low = shared_node_slowdown({{10, 10, 10}}, {{{9, 8, 12}}});
  EXPECT_NEAR(low.median, 0.9, 1e-12);
  EXPECT_EQ(low.slowdown, 1.0);
  // A length without a time (0) alone or busy gives no sample; a pair without any sample has median 0.
  const SharedNodeSamples gaps = shared_node_slowdown({{0, 10}, {10}}, {{{5, 15}}, {{0}}});
  EXPECT_EQ(gaps.samples, 1);
  EXPECT_NEAR(gaps.slowdown, 1.5, 1e-12);
  EXPECT_EQ(gaps.pair_medians, (std::vector<double>{1.5, 0.0}));
  const auto refused = [](const std::vector<std::vector<double>>& a,
                          const std::vector<std::vector<std::vector<double>>>& b, const std::string& what) {
    try {
      shared_node_slowdown(a, b);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused({{10, 20}}, {{{12}}}, "pair 0 copy 0 has 1 lengths and the run alone 2");
  refused({{10}, {10}}, {{{12}}}, "2 runs alone and 1 busy runs");
  refused({{0}}, {{{12}}}, "no length has a time > 0 both alone and busy (1 pairs)");
}

// The shared-node slowdown multiplies a kernel's time where the plan puts more than one rank on a node, and nowhere
// else. Flat curves (rate R) and a free link (no latency): MHA Ulysses u2xr1 on one node of 2 ranks computes half the
// heads, forward s_f F / 2 / R and backward s_b 2.5 F / 2 / R (F = 4 H D S (S + 1) / 2, causal visible pairs); the
// same on 2 nodes of 1 rank each: F / 2 / R, as without the block. 2 threads a rank on cores_busy 2: also x 2.
// Kinds not listed keep cores_per_node. GDN's and DSA's phases (every term a kernel's, the link free) scale by the
// factor of their kind.
TEST(SpPlanSharedNode, SlowsKernelsOnlyWhereRanksShareANode) {
  const double R = 1e9, sf = 1.5, sb = 1.25;
  DeviceProfile flat = flat_profile(R, 0.0, 1e30);
  DeviceProfile busy = flat;
  busy.shared_node.slowdown = {{"mha_fwd", sf}, {"mha_bwd", sb}, {"gdn_fwd", sf},
                               {"gdn_bwd", sf}, {"dsa_fwd", sb}, {"dsa_bwd", sb}};
  busy.shared_node.cores_busy = 2;
  busy.shared_node.source = "test";
  const double S = 2048, F = 4.0 * 8 * 64 * S * (S + 1) / 2;
  PlanInput one_node =
      input({"--attn", "mha", "--heads", "8", "--kv-heads", "8", "--head-dim", "64", "--seq", "2K", "--causal"}, 2);
  one_node.only_configs = {"u2xr1 zigzag p2p"};
  PlanInput two_nodes = one_node;
  two_nodes.nodes = 2;
  two_nodes.devices_per_node = 1;
  const Prediction shared = plan(one_node, busy).front().prediction;
  EXPECT_NEAR(shared.forward_s, sf * F / 2 / R, 1e-9);
  EXPECT_NEAR(shared.backward_s, sb * 2.5 * F / 2 / R, 1e-9);
  const Prediction apart = plan(two_nodes, busy).front().prediction;
  EXPECT_NEAR(apart.forward_s, F / 2 / R, 1e-9);
  EXPECT_NEAR(apart.backward_s, 2.5 * F / 2 / R, 1e-9);
  EXPECT_EQ(plan(one_node, flat).front().prediction.step_s, plan(two_nodes, flat).front().prediction.step_s);
  // 2 ranks x 2 threads on the 2 cores of the measurement: the factor x 2.
  PlanInput threads = one_node;
  threads.threads = 2;
  EXPECT_NEAR(plan(threads, busy).front().prediction.forward_s, 2 * sf * F / 2 / R, 1e-9);
  // A kind the block does not list keeps cores_per_node (here 1 core: 2 ranks x 1 thread, x 2).
  DeviceProfile partial = busy;
  partial.cores_per_node = 1;
  partial.shared_node.slowdown.erase("mha_bwd");
  const Prediction p = plan(one_node, partial).front().prediction;
  EXPECT_NEAR(p.forward_s, sf * F / 2 / R, 1e-9);
  EXPECT_NEAR(p.backward_s, 2 * 2.5 * F / 2 / R, 1e-9);
  EXPECT_EQ(kernel_slowdown(one_node, partial, "mha_bwd"), 2.0);
  EXPECT_EQ(kernel_slowdown(one_node, partial, "mha_fwd"), sf);
  EXPECT_EQ(kernel_slowdown(two_nodes, partial, "mha_fwd"), 1.0);
  // GDN (chain at 2 ranks) and DSA (select-ring at 2 ranks): each phase x its kind's factor on one node.
  for (const auto& [flags, config, f_fwd, f_bwd] :
       std::vector<std::tuple<std::vector<std::string>, std::string, double, double>>{
           {{"--attn", "gdn", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--dim-v", "32", "--seq", "1K",
             "--conv-width", "0"},
            "u1xr2 contiguous chain",
            sf,
            sf},
           {{"--attn", "dsa", "--heads", "4", "--head-dim", "32", "--dim-v", "32", "--indexer-heads", "2",
             "--indexer-dim", "16", "--topk", "64", "--seq", "1K"},
            "u1xr2 zigzag select-ring",
            sb,
            sb}}) {
    PlanInput a = input(flags, 2);
    a.only_configs = {config};
    PlanInput b = a;
    b.nodes = 2;
    b.devices_per_node = 1;
    const PlanRow ra = plan(a, busy).front(), rb = plan(b, busy).front();
    ASSERT_TRUE(ra.excluded.empty()) << config << ": " << ra.excluded;
    ASSERT_TRUE(rb.excluded.empty()) << config << ": " << rb.excluded;
    EXPECT_NEAR(ra.prediction.forward_s / rb.prediction.forward_s, f_fwd, 1e-9) << config;
    EXPECT_NEAR(ra.prediction.backward_s / rb.prediction.backward_s, f_bwd, 1e-9) << config;
    EXPECT_EQ(plan(b, flat).front().prediction.step_s, rb.prediction.step_s) << config;
  }
}

}  // namespace
}  // namespace seqpar::bench::plan
