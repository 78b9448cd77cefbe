// sp_plan against the runtime, at the world's size: its byte predictions equal the counters of the very workloads
// sp_bench runs (built from the same options by the same registry), and its memory verdict is the one sp_bench
// reaches (compare_with_node_memory over MPI, as --dry-run prints it and a run refuses it).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "benchmarks/sp_bench_memory.h"
#include "benchmarks/sp_bench_workload.h"
#include "benchmarks/sp_plan.h"
#include "runtime/error.h"
#include "runtime/mpi_comm.h"
#include "tests/util/mpi_test.h"

namespace seqpar::bench::plan {
namespace {

using test::world;

DeviceProfile flat_profile() {
  DeviceProfile p;
  p.name = "flat";
  for (const char* k : {"mha_fwd", "mha_bwd", "gdn_fwd", "gdn_bwd", "dsa_fwd", "dsa_bwd"})
    p.kernels[k].points = {{1.0, 1e9}};
  p.intra = {1e-6, 1e9, "test"};
  p.inter = p.intra;
  return p;
}

PlanInput input(std::vector<std::string> flags) {
  PlanInput in;
  in.problem_flags = std::move(flags);
  in.world_size = world().size();
  in.devices_per_node = world().size();
  return in;
}

double max_over_ranks(double x) {
  world().all_reduce(TensorView(&x, DType::kFloat64, {1}), ReduceOp::kMax)->wait();
  return x;
}

struct BytesCase {
  std::vector<std::string> flags;
  int ulysses_size;
  std::string layout, impl;
};

// Every valid configuration the planner lists for each problem: one forward and one backward of sp_bench's
// workload, the counters (the most any rank sent) against the predicted bytes. Returns how many were checked.
int check_bytes_of_every_row(const std::vector<std::vector<std::string>>& problems) {
  int checked = 0;
  for (const auto& flags : problems) {
    const PlanInput in = input(flags);
    for (const PlanRow& row : plan(in, flat_profile())) {
      if (!row.excluded.empty()) continue;
      const std::string what = row.config.name() + " of " + row.command;
      const SpBenchOptions o = config_options(in, row.config);
      CpGrid grid(world(), o.grid);
      std::unique_ptr<Workload> wl = find_workload_kind(o.attn).make(o, grid);
      wl->setup(nullptr);
      const PhaseCounters f = wl->forward();
      const PhaseCounters b = wl->backward();
      EXPECT_TRUE(row.prediction.bytes_exact) << what;
      EXPECT_EQ(max_over_ranks(static_cast<double>(f.bytes_sent)), row.prediction.bytes_sent_forward) << what;
      EXPECT_EQ(max_over_ranks(static_cast<double>(b.bytes_sent)), row.prediction.bytes_sent_backward) << what;
      double link_total = 0;
      for (const auto& [cls, bytes] : row.prediction.bytes_per_link) link_total += bytes;
      EXPECT_EQ(link_total, row.prediction.bytes_sent_forward + row.prediction.bytes_sent_backward) << what;
      ++checked;
    }
  }
  return checked;
}

// Every valid MHA configuration the planner lists for a few problems (GQA with replicated KV heads, bf16, a packed
// row with padding, fp64): one forward and one backward of sp_bench's workload, counters against the prediction.
TEST(SpPlanBytes, MhaEqualCounters) {
  const std::vector<std::vector<std::string>> problems = {
      {"--attn", "mha", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--seq", "192", "--causal"},
      {"--attn", "mha", "--heads", "4", "--kv-heads", "1", "--head-dim", "16", "--seq", "128", "--dtype", "bf16"},
      {"--attn", "mha", "--heads", "2", "--kv-heads", "2", "--head-dim", "8", "--doc-lens", "37,100,11", "--causal"},
      {"--attn", "mha", "--heads", "2", "--kv-heads", "2", "--head-dim", "8", "--seq", "64", "--dtype", "fp64"}};
  const int checked = check_bytes_of_every_row(problems);
  // At 1 rank: one configuration per problem; at 2: u1 x r2 and u2 x r1 in several layouts and both impls.
  EXPECT_GE(checked, world().size() == 1 ? 4 : 12);
}

// GDN on unpacked rows: the chain's state messages, the scan's Kogge-Stone rounds and shift, the Ulysses exchange
// (key heads replicated when fewer than Pu, bf16) and the state gathers, against the counters.
TEST(SpPlanBytes, GdnEqualCounters) {
  const std::vector<std::vector<std::string>> problems = {
      {"--attn", "gdn", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--seq", "256"},
      {"--attn", "gdn", "--heads", "4", "--kv-heads", "1", "--head-dim", "16", "--seq", "128", "--dtype", "bf16"}};
  const int checked = check_bytes_of_every_row(problems);
  EXPECT_GE(checked, world().size() == 1 ? 2 : 12);
}

// The planner's fit verdict is sp_bench's: with the node's memory set to devices_per_node x memory_per_device
// (--test-mem-available-mib, as the ctest of sp_bench --dry-run passes it), compare_with_node_memory agrees, and the
// run itself refuses what the planner excludes.
TEST(SpPlanMemory, VerdictIsSpBenchs) {
  const std::vector<std::string> flags = {"--attn", "mha",   "--heads", "8",       "--head-dim",
                                          "64",     "--seq", "32K",     "--causal"};
  PlanInput in = input(flags);
  const std::vector<PlanRow> unlimited = plan(in, flat_profile());
  ASSERT_TRUE(unlimited.front().excluded.empty()) << unlimited.front().excluded;
  const double need = unlimited.front().memory_total;
  for (double factor : {1.02, 0.98}) {
    in.memory_per_device = need * factor;
    const std::vector<PlanRow> rows = plan(in, flat_profile());
    for (const PlanRow& row : rows) {
      if (row.excluded.find("must") != std::string::npos) continue;  // a rule, not memory
      SpBenchOptions o = config_options(in, row.config);
      o.test_mem_available_mib = in.memory_per_device * in.devices_per_node / (1024.0 * 1024.0);
      const MemoryEstimate mine = estimate_memory(o, world().rank());
      const MemoryVerdict v = compare_with_node_memory(o, mine);
      ASSERT_TRUE(v.compared);
      const std::string what = row.config.name() + " at " + std::to_string(factor) + ": " + row.excluded;
      EXPECT_EQ(v.fits, row.excluded.empty()) << what << " | sp_bench: " << v.text;
      if (!v.fits) {
        try {
          check_memory_fits(v, mine);
          ADD_FAILURE() << "sp_bench's check accepted " << what;
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("memory estimate:"), std::string::npos) << e.what();
        }
      }
    }
  }
}

}  // namespace
}  // namespace seqpar::bench::plan
