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
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
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

constexpr int kMaxThreadsPerRank = 1024;  // as sp_bench's --threads

struct PlanToRun {
  std::string name;
  double predicted_s = 0;
  std::vector<DynamicCpMicroBatch> micro_batches;
};

// An integer field of a plan (a JSON number with a fractional part, a string or a missing key is an Error naming
// the plan and the field, not a silent truncation).
std::int64_t plan_int(const nlohmann::json& j, const char* key, const std::string& plan) {
  SEQPAR_CHECK(j.contains(key), "dyncp_bench: plan ", plan, ": a micro-batch has no '", key, "'");
  const nlohmann::json& v = j.at(key);
  SEQPAR_CHECK(v.is_number_integer(), "dyncp_bench: plan ", plan, ": '", key, "' = ", v.dump(), " must be an integer");
  return v.get<std::int64_t>();
}

// `doc_lens`: the plan file's documents (input.doc_lens); a micro-batch's own doc_lens, when present, must be theirs.
PlanToRun plan_from_json(const nlohmann::json& j, const std::vector<std::int64_t>& doc_lens) {
  SEQPAR_CHECK(!j.contains("excluded"), "dyncp_bench: plan ", j.value("name", "?"),
               " is excluded: ", j.value("excluded", ""));
  PlanToRun p;
  p.name = j.at("name").get<std::string>();
  p.predicted_s = j.at("step_s").get<double>();
  for (const auto& m : j.at("micro_batches")) {
    DynamicCpMicroBatch mb;
    const std::int64_t degree = plan_int(m, "degree", p.name), group = plan_int(m, "group", p.name);
    SEQPAR_CHECK(degree >= 1 && degree <= std::numeric_limits<int>::max() && group >= 0 &&
                     group <= std::numeric_limits<int>::max(),
                 "dyncp_bench: plan ", p.name, ": micro-batch ", p.micro_batches.size(), " has degree ", degree,
                 " and group ", group, " (degree must be >= 1, group >= 0)");
    mb.degree = static_cast<int>(degree);
    mb.group = static_cast<int>(group);
    for (const auto& d : m.at("docs")) {
      SEQPAR_CHECK(d.is_number_integer(), "dyncp_bench: plan ", p.name, ": micro-batch ", p.micro_batches.size(),
                   " names document ", d.dump(), ", not an integer index");
      mb.doc_ids.push_back(d.get<std::int64_t>());
    }
    SEQPAR_CHECK(!mb.doc_ids.empty(), "dyncp_bench: plan ", p.name, ": micro-batch ", p.micro_batches.size(),
                 " has no documents (a micro-batch runs a packed row of at least one)");
    if (m.contains("doc_lens")) {
      const std::vector<std::int64_t> lens = m.at("doc_lens").get<std::vector<std::int64_t>>();
      SEQPAR_CHECK(lens.size() == mb.doc_ids.size(), "dyncp_bench: plan ", p.name, ": micro-batch ",
                   p.micro_batches.size(), " has ", mb.doc_ids.size(), " docs but ", lens.size(), " doc_lens");
      for (std::size_t i = 0; i < lens.size(); ++i) {
        const std::int64_t id = mb.doc_ids[i];
        SEQPAR_CHECK(id < 0 || id >= static_cast<std::int64_t>(doc_lens.size()) ||
                         lens[i] == doc_lens[static_cast<std::size_t>(id)],
                     "dyncp_bench: plan ", p.name, ": micro-batch ", p.micro_batches.size(), " gives document ", id,
                     " length ", lens[i], ", but input.doc_lens says ", doc_lens[static_cast<std::size_t>(id)],
                     " (an edited plan file: plan again with sp_plan --dynamic-cp)");
      }
    }
    p.micro_batches.push_back(std::move(mb));
  }
  return p;
}

// The plan's sp_bench problem flags that dyncp_bench runs: MHA with --heads, --kv-heads, --head-dim, --causal,
// --dtype and --seed. Anything else that changes the attention (a window, score modifiers, dropout, RoPE) is refused
// rather than silently left out of the timed step, and so is any flag of how sp_bench runs (a grid flag is refused
// when the flags are parsed).
void check_problem_runs(const SpBenchOptions& o) {
  std::vector<std::string> unsupported;
  if (o.window != 0) unsupported.push_back(str_cat("--window ", o.window));
  if (o.softcap != 0) unsupported.push_back(str_cat("--softcap ", o.softcap));
  if (o.alibi) unsupported.push_back("--alibi");
  if (o.sinks) unsupported.push_back("--sinks");
  if (o.dropout != 0) unsupported.push_back(str_cat("--dropout ", o.dropout));
  if (o.rope) unsupported.push_back("--rope");
  if (o.batch != 1) unsupported.push_back(str_cat("--batch ", o.batch));
  // sp_bench's other flags (what a run checks, writes, reads, times or where it runs: --check, --json, --dump,
  // --inputs, --iters, --device, --layout, ...) have no effect here: dyncp_bench has its own --json, --warmup and
  // --threads, the plan's layout and impl, random inputs and no check.
  static const std::set<std::string> kTaken = {"attn",  "model",   "heads",        "kv-heads", "head-dim", "causal",
                                               "dtype", "seed",    "doc-lens",     "window",   "softcap",  "alibi",
                                               "sinks", "dropout", "dropout-seed", "batch"};
  for (const std::string& f : o.given_flags)
    if (kTaken.count(f) == 0 && f.rfind("rope", 0) != 0) unsupported.push_back("--" + f);
  std::string text;
  for (const std::string& u : unsupported) text += str_cat(text.empty() ? "" : ", ", u);
  SEQPAR_CHECK(unsupported.empty(), "dyncp_bench: the plan's problem flags set ", text,
               ", which dyncp_bench does not run (it times MHA with --heads, --kv-heads, --head-dim, --causal, "
               "--dtype and --seed only, writes only its own --json and neither checks nor dumps); plan without them");
}

// One micro-batch of this rank, its inputs cut before timing.
struct LocalMicroBatch {
  int index = 0;
  SequenceLayout layout;
  Tensor q, k, v, dout;
};

int dyncp_bench_run(int argc, char** argv) {
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
  const std::optional<cxxopts::ParseResult> parsed_args = parse_command_line(spec, argc, argv, place.rank);
  if (!parsed_args) return 0;
  const cxxopts::ParseResult& r = *parsed_args;
  SEQPAR_CHECK(r.count("plan"), "dyncp_bench: --plan FILE is required");
  const std::string plan_path = r["plan"].as<std::string>();
  const int rounds = r["rounds"].as<int>(), warmup = r["warmup"].as<int>(), threads = r["threads"].as<int>();
  SEQPAR_CHECK(rounds >= 1, "dyncp_bench: --rounds ", rounds, " must be >= 1");
  SEQPAR_CHECK(warmup >= 0, "dyncp_bench: --warmup ", warmup, " must be >= 0");
  SEQPAR_CHECK(threads >= 1 && threads <= kMaxThreadsPerRank, "dyncp_bench: --threads ", threads, " must be in [1, ",
               kMaxThreadsPerRank, "]");
  std::ifstream in(plan_path);
  SEQPAR_CHECK(in.good(), "dyncp_bench: cannot read ", plan_path);
  nlohmann::json pj;
  try {
    in >> pj;
  } catch (const nlohmann::json::exception& e) {
    SEQPAR_THROW("dyncp_bench: ", plan_path, " is not an sp_plan --dynamic-cp JSON file: ", e.what());
  }
  // The first collective: ranks started with other flags or another plan (mpirun's MPMD form) stop here, each
  // naming what differs, before the grids are built or any plan runs (a rank with more --rounds would wait forever).
  check_ranks_agree(options_fingerprint_start("dyncp_bench")
                        .add_text("--run", r["run"].as<std::string>())
                        .add_int("--rounds", rounds)
                        .add_int("--warmup", warmup)
                        .add_int("--threads", threads)
                        .add_text("--plan (FNV-1a digest of its JSON)",
                                  str_cat(Fingerprint("plan").add_text("json", pj.dump()).digest())));
  const std::vector<std::int64_t> doc_lens = pj["input"]["doc_lens"].get<std::vector<std::int64_t>>();
  // The plan's schedule (groups, start order, predicted times) is of its world: another world would run a schedule
  // that was never planned, or fail later at a group that does not exist.
  const nlohmann::json& planned_world = pj["input"]["world_size"];
  SEQPAR_CHECK(planned_world.is_number_integer() && planned_world.get<std::int64_t>() == place.size, "dyncp_bench: ",
               plan_path, " was planned for input.world_size ", planned_world.dump(), ", but this job has ", place.size,
               " ranks (plan again with sp_plan --dynamic-cp --world ", place.size, ")");
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
  const std::optional<SpBenchOptions> parsed =
      parse_sp_bench_options(static_cast<int>(av.size()), av.data(), 1, 1,
                             "in the plan's problem flags: a plan's problem holds no grid; dyncp_bench runs each "
                             "micro-batch on a ring of its degree (sp_plan --dynamic-cp writes the flags without one)");
  SEQPAR_CHECK(parsed && parsed->attn == "mha", "dyncp_bench: runs MHA plans only");
  const SpBenchOptions& o = *parsed;
  check_problem_runs(o);
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#endif

  std::vector<PlanToRun> plans;
  for (const std::string& name : split_commas(r["run"].as<std::string>())) {
    bool found = false;
    if (pj["dynamic"].value("name", "") == name || name == "dynamic") {
      plans.push_back(plan_from_json(pj["dynamic"], doc_lens));
      plans.back().name = name;
      found = true;
    } else if (name == "mixed") {
      plans.push_back(plan_from_json(pj["mixed"], doc_lens));
      found = true;
    } else {
      for (const auto& s : pj["statics"]) {
        if (s.value("name", "") == name) {
          plans.push_back(plan_from_json(s, doc_lens));
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
  if (r.count("json")) check_output_paths(*world, r["json"].as<std::string>());  // before the plans run, not after
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
  for (int w = 0; w < warmup; ++w)
    for (std::size_t p = 0; p < plans.size(); ++p) run_plan(p);
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
      std::printf("   %-16s %12.6g  %s\n", plans[p].name.c_str(), plans[p].predicted_s, per.c_str());
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

// A plan file with a field of the wrong type or a missing one stops every rank naming it (the same file on every
// rank, agreed before the fields are read).
int dyncp_bench_main(int argc, char** argv) {
  try {
    return dyncp_bench_run(argc, argv);
  } catch (const nlohmann::json::exception& e) {
    SEQPAR_THROW("dyncp_bench: the --plan file is not an sp_plan --dynamic-cp JSON file: ", e.what());
  }
}

}  // namespace
}  // namespace seqpar::bench

int main(int argc, char** argv) { return seqpar::run_mpi_main(argc, argv, seqpar::bench::dyncp_bench_main); }
