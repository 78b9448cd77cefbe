// dyncp_bench: runs the plans of an `sp_plan --dynamic-cp --json` file (docs/benchmarks.md, "Dynamic CP"): one
// training step of MHA forward and backward over every micro-batch of a plan, each on its group's grid of a
// CpGridSet built once, the plans interleaved round by round so that their ratios see the same machine load.
//
//   mpirun -np 2 dyncp_bench --plan plan.json --run mixed,"static 2" --rounds 3 --json out.json
//
// The problem (heads, head dim, mask, dtype) is the plan's sp_bench problem flags. A step's time is the slowest
// rank's (barrier, time, barrier); the step's inputs (random, seeded) are cut into the micro-batches' local pieces
// before the clock starts.
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cxxopts.hpp>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "benchmarks/bench_common.h"
#include "benchmarks/sp_bench_options.h"
#include "benchmarks/sp_bench_workload.h"
#include "parallel/dynamic_cp.h"
#include "parallel/usp.h"
#include "runtime/comm_factory.h"
#include "runtime/cp_grid_set.h"
#include "runtime/error.h"
#include "runtime/mpi_comm.h"
#include "runtime/tensor_ops.h"
#include "runtime/timer.h"

namespace seqpar::bench {
namespace {

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return str_cat(a, " ", b, " ", c);
}

struct PlanToRun {
  std::string name;
  double predicted_s = 0;
  std::vector<DynamicCpMicroBatch> micro_batches;
};

PlanToRun plan_from_json(const nlohmann::json& j) {
  SEQPAR_CHECK(!j.contains("excluded"), "dyncp_bench: plan ", j.value("name", "?"),
               " is excluded: ", j.value("excluded", ""));
  PlanToRun p;
  p.name = j.at("name").get<std::string>();
  p.predicted_s = j.at("step_s").get<double>();
  for (const auto& m : j.at("micro_batches")) {
    DynamicCpMicroBatch mb;
    mb.degree = m.at("degree").get<int>();
    mb.group = m.at("group").get<int>();
    for (const auto& d : m.at("docs")) mb.doc_ids.push_back(d.get<std::int64_t>());
    p.micro_batches.push_back(std::move(mb));
  }
  return p;
}

// One micro-batch of this rank, its inputs cut before timing.
struct LocalMicroBatch {
  int index = 0;
  SequenceLayout layout;
  Tensor q, k, v, dout;
};

int dyncp_bench_main(int argc, char** argv) {
  const WorldPlace place = mpi_world_place();
  cxxopts::Options spec("dyncp_bench", "runs the plans of an sp_plan --dynamic-cp JSON file, interleaved");
  // clang-format off
  spec.add_options()
    ("plan", "sp_plan --dynamic-cp --json FILE", cxxopts::value<std::string>())
    ("run", "plans to run, comma-separated: dynamic, mixed, \"static D\"", cxxopts::value<std::string>()->default_value("mixed,static 2"))
    ("rounds", "rounds (each runs every plan once, in order)", cxxopts::value<int>()->default_value("3"))
    ("warmup", "untimed rounds first", cxxopts::value<int>()->default_value("0"))
    ("threads", "OpenMP threads per rank", cxxopts::value<int>()->default_value("1"))
    ("json", "write the results to FILE (rank 0)", cxxopts::value<std::string>())
    ("help", "print this help");
  // clang-format on
  cxxopts::ParseResult r;
  try {
    r = spec.parse(argc, argv);
  } catch (const std::exception& e) {
    SEQPAR_THROW("dyncp_bench: bad command line: ", e.what(), " (see --help)");
  }
  if (r.count("help")) {
    if (place.rank == 0) std::printf("%s\n", spec.help().c_str());
    return 0;
  }
  SEQPAR_CHECK(r.count("plan"), "dyncp_bench: --plan FILE is required");
  const std::string plan_path = r["plan"].as<std::string>();
  std::ifstream in(plan_path);
  SEQPAR_CHECK(in.good(), "dyncp_bench: cannot read ", plan_path);
  nlohmann::json pj;
  in >> pj;
  SEQPAR_CHECK(pj["input"]["world_size"].get<int>() == place.size, "dyncp_bench: the plan is for ",
               pj["input"]["world_size"].get<int>(), " ranks, this run has ", place.size);
  const std::vector<std::int64_t> doc_lens = pj["input"]["doc_lens"].get<std::vector<std::int64_t>>();
  const std::string layout_name_text = pj["input"]["layout"].get<std::string>();
  const RingImpl impl = parse_ring_impl(pj["input"]["impl"].get<std::string>());
  // The problem: sp_bench's parse of the plan's flags with the whole row as one document list.
  std::vector<std::string> args = {"sp_bench"};
  for (const auto& f : pj["input"]["problem_flags"]) args.push_back(f.get<std::string>());
  std::string lens_text;
  for (std::int64_t l : doc_lens) lens_text += (lens_text.empty() ? "" : ",") + std::to_string(l);
  args.insert(args.end(), {"--doc-lens", lens_text});
  std::vector<char*> av;
  for (std::string& a : args) av.push_back(a.data());
  const std::optional<SpBenchOptions> parsed = parse_sp_bench_options(static_cast<int>(av.size()), av.data(), 1, 1);
  SEQPAR_CHECK(parsed && parsed->attn == "mha", "dyncp_bench: runs MHA plans only");
  const SpBenchOptions& o = *parsed;
  const int threads = r["threads"].as<int>();
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#endif

  std::vector<PlanToRun> plans;
  for (const std::string& name : split_commas(r["run"].as<std::string>())) {
    bool found = false;
    if (pj["dynamic"].value("name", "") == name || name == "dynamic") {
      plans.push_back(plan_from_json(pj["dynamic"]));
      plans.back().name = name;
      found = true;
    } else if (name == "mixed") {
      plans.push_back(plan_from_json(pj["mixed"]));
      found = true;
    } else {
      for (const auto& s : pj["statics"]) {
        if (s.value("name", "") == name) {
          plans.push_back(plan_from_json(s));
          found = true;
        }
      }
    }
    SEQPAR_CHECK(found, "dyncp_bench: no plan '", name, "' in ", plan_path, " (dynamic, mixed, static D)");
  }
  std::vector<int> degrees;
  for (const PlanToRun& p : plans)
    for (const DynamicCpMicroBatch& m : p.micro_batches) degrees.push_back(m.degree);
  std::sort(degrees.begin(), degrees.end());
  degrees.erase(std::unique(degrees.begin(), degrees.end()), degrees.end());

  auto world = make_world_communicator("mpi");
  const CpGridSet grids(*world, degrees);
  const std::string load_before = load_average();

  // The step's inputs: counter-based random values of the whole row (the same whatever the plan), cut per rank.
  const std::int64_t T = o.seq, hq = o.heads, hkv = o.kv_heads, D = o.head_dim;
  std::vector<DynamicCpSchedule> scheds;
  std::vector<std::vector<LocalMicroBatch>> locals(plans.size());
  for (std::size_t p = 0; p < plans.size(); ++p) {
    scheds.emplace_back(*world, grids, doc_lens, plans[p].micro_batches);
    const DynamicCpSchedule& s = scheds.back();
    for (int m : s.local()) {
      LocalMicroBatch lm{m, s.layout(m, parse_layout(layout_name_text)), {}, {}, {}, {}};
      const CpGroups groups = CpGroups::from(s.grid(m));
      const std::vector<std::int64_t> rows = s.step_tokens(m);
      const std::vector<std::int64_t> tok = lm.layout.token_index(groups.cp_rank());
      std::vector<std::int64_t> positions(tok.size(), -1);
      for (std::size_t i = 0; i < tok.size(); ++i)
        if (tok[i] >= 0) positions[i] = rows[static_cast<std::size_t>(tok[i])];
      auto piece = [&](std::int64_t heads, std::uint64_t id) {
        Tensor t = Tensor::empty({1, lm.layout.local_len(), heads, D}, o.dtype, MemCategory::kWorkspace);
        fill_random_shard(t.view(), o.seed, id, T, positions);
        return t;
      };
      lm.q = piece(hq, 101);
      lm.k = piece(hkv, 102);
      lm.v = piece(hkv, 103);
      lm.dout = piece(hq, 104);
      locals[p].push_back(std::move(lm));
    }
  }
  MhaCpConfig cfg;
  cfg.impl = impl;
  cfg.causal = o.causal;
  auto run_plan = [&](std::size_t p) {
    barrier(*world, 24 * 3600.0);
    const double t0 = wall_seconds();
    for (LocalMicroBatch& lm : locals[p]) {
      const CpGroups groups = CpGroups::from(scheds[p].grid(lm.index));
      MhaCp attn(groups, lm.layout, cfg);
      MhaCpOutput out = attn.forward(lm.q.view(), lm.k.view(), lm.v.view());
      MhaCpGrads g = attn.backward(std::move(out.ctx), lm.dout.view());
    }
    const double busy = wall_seconds() - t0;
    barrier(*world, 24 * 3600.0);
    return std::make_pair(wall_seconds() - t0, busy);
  };
  for (int w = 0; w < r["warmup"].as<int>(); ++w)
    for (std::size_t p = 0; p < plans.size(); ++p) run_plan(p);
  const int rounds = r["rounds"].as<int>();
  std::vector<std::vector<double>> step(plans.size()), busy(plans.size());
  for (int round = 0; round < rounds; ++round) {
    for (std::size_t p = 0; p < plans.size(); ++p) {
      const auto [s, b] = run_plan(p);
      double bb = b;
      world->all_reduce(TensorView(&bb, DType::kFloat64, {1}), ReduceOp::kMax)->wait();
      step[p].push_back(s);
      busy[p].push_back(bb);
      if (place.rank == 0) {
        std::fprintf(stderr, "dyncp_bench: round %d %s %.3f s (load %s)\n", round + 1, plans[p].name.c_str(), s,
                     load_average().c_str());
      }
    }
  }
  const std::string load_after = load_average();
  if (place.rank == 0) {
    std::printf(
        "# dyncp_bench: %s, %d ranks, %zu documents, %lld tokens, MHA hq %lld hkv %lld D %lld %s %s, %s %s, "
        "threads %d, %d rounds\n# load average before %s, after %s; commit %s, %s\n",
        plan_path.c_str(), place.size, doc_lens.size(), static_cast<long long>(T), static_cast<long long>(hq),
        static_cast<long long>(hkv), static_cast<long long>(D), dtype_name(o.dtype), o.causal ? "causal" : "full",
        layout_name_text.c_str(), ring_impl_name(impl), threads, rounds, load_before.c_str(), load_after.c_str(),
        git_commit(), utc_now_iso8601().c_str());
    std::printf("#  plan              predicted(s)   step per round (s)");
    std::printf("\n");
    for (std::size_t p = 0; p < plans.size(); ++p) {
      std::string per;
      for (double s : step[p]) per += str_cat(" ", s);
      std::printf("   %-16s %12.3f  %s\n", plans[p].name.c_str(), plans[p].predicted_s, per.c_str());
    }
    if (plans.size() >= 2) {
      std::string ratios;
      for (int round = 0; round < rounds; ++round) ratios += str_cat(" ", step[1][round] / step[0][round]);
      std::printf("# %s / %s per round:%s (predicted %.4f)\n", plans[1].name.c_str(), plans[0].name.c_str(),
                  ratios.c_str(), plans[1].predicted_s / plans[0].predicted_s);
    }
  }
  if (r.count("json") && place.rank == 0) {
    nlohmann::json j = {{"plan_file", plan_path},       {"world_size", place.size}, {"threads", threads},
                        {"load_before", load_before},   {"load_after", load_after}, {"commit", git_commit()},
                        {"date_utc", utc_now_iso8601()}};
    for (std::size_t p = 0; p < plans.size(); ++p) {
      j["plans"].push_back({{"name", plans[p].name},
                            {"predicted_s", plans[p].predicted_s},
                            {"step_s", step[p]},
                            {"slowest_rank_busy_s", busy[p]}});
    }
    write_file_atomic(r["json"].as<std::string>(), [&](std::ostream& os) { os << j.dump(2) << "\n"; });
  }
  barrier(*world, 24 * 3600.0);
  return 0;
}

}  // namespace
}  // namespace seqpar::bench

int main(int argc, char** argv) { return seqpar::run_mpi_main(argc, argv, seqpar::bench::dyncp_bench_main); }
