// agreement_bench: what the ranks' agreement check of the CP layers costs per call (parallel/cp_common.h
// AgreementCheck), next to one USP forward of a small layer for scale. Cases, each timed over --calls calls and
// reported as the median over --reps repetitions of the slowest rank's mean time per call:
//   cached     the hot path (SEQPAR_AGREEMENT_CHECK=changes, the call repeats the last agreed one): the fingerprint
//              is written and hashed, no message
//   first      the first call of a configuration (a fresh check object each call): fingerprint + one all-reduce of
//              three int64
//   always     SEQPAR_AGREEMENT_CHECK=always on a repeated call: the same as first
//   mismatch   rank 0 passes another k: all-reduce + all-gather of the fields + the message (the failure path)
//   usp fwd    one MhaCp forward (ring over every rank, zigzag, causal, fp32) of B=1, --seq tokens, --heads
//              heads of --head-dim, with the layer's own check as configured by SEQPAR_AGREEMENT_CHECK
//
//   mpirun -np 2 agreement_bench --seq 4K
#include <cstdio>
#include <string>
#include <vector>

#include "benchmarks/bench_common.h"
#include "parallel/usp.h"
#include "runtime/mpi_comm.h"
#include "runtime/cp_grid.h"
#include "runtime/version.h"

namespace seqpar::bench {
namespace {

// The fingerprint of a USP forward (parallel/usp.cc) with k of shape `k_shape`.
Fingerprint usp_fingerprint(const SequenceLayout& layout, const Shape& q_shape, const Shape& k_shape) {
  const TensorView q(nullptr, DType::kFloat32, q_shape), k(nullptr, DType::kFloat32, k_shape);
  return mha_forward_fingerprint("USP forward", MhaCpConfig{}, layout, q, k, k);
}

// Median over `reps` of the slowest rank's mean seconds per call of `calls` calls of `fn`.
double time_per_call(Communicator& world, int reps, int calls, const std::function<void()>& fn) {
  std::vector<double> per_rep;
  for (int r = 0; r < reps; ++r) {
    barrier(world);
    const double t0 = now_s();
    for (int i = 0; i < calls; ++i) fn();
    std::vector<double> t = {(now_s() - t0) / calls};
    all_reduce(world, t, ReduceOp::kMax);
    per_rep.push_back(t[0]);
  }
  return median(per_rep);
}

int agreement_bench_main(int argc, char** argv) {
  const WorldPlace place = mpi_world_place();
  cxxopts::Options spec("agreement_bench",
                        "cost per call of the CP layers' agreement check: mpirun -np N agreement_bench");
  // clang-format off
  spec.add_options()
    ("seq", "tokens of the USP forward (K, M suffixes)", cxxopts::value<std::string>()->default_value("4K"))
    ("heads", "heads (q and kv)", cxxopts::value<std::int64_t>()->default_value("8"))
    ("head-dim", "head dimension", cxxopts::value<std::int64_t>()->default_value("64"))
    ("calls", "calls per repetition of the check cases", cxxopts::value<int>()->default_value("1000"))
    ("reps", "repetitions (the median is reported)", cxxopts::value<int>()->default_value("5"))
    ("help", "print this help")
    ("version", "print the version and exit");
  // clang-format on
  const std::optional<cxxopts::ParseResult> parsed = parse_command_line(spec, argc, argv, place.rank);
  if (!parsed) return 0;
  const cxxopts::ParseResult& r = *parsed;
  const std::int64_t seq = parse_size(r["seq"].as<std::string>(), "seq"), heads = r["heads"].as<std::int64_t>(),
                     head_dim = r["head-dim"].as<std::int64_t>();
  const int calls = r["calls"].as<int>(), reps = r["reps"].as<int>();
  SEQPAR_CHECK(calls >= 1 && reps >= 1, "--calls ", calls, " and --reps ", reps, " must be >= 1");

  auto world = MpiCommunicator::world();
  CpGrid grid(*world, {1, 1, place.size});
  const CpGroups groups = CpGroups::from(grid);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, seq);
  const Shape q_shape = {1, layout.local_len(), heads, head_dim};
  const Fingerprint agreed = usp_fingerprint(layout, q_shape, q_shape);
  const Fingerprint odd = usp_fingerprint(layout, q_shape, {1, layout.local_len(), heads / 2, head_dim * 2});

  std::vector<std::pair<std::string, double>> rows;
  AgreementCheck cached(AgreementMode::kChanges), always(AgreementMode::kAlways);
  cached.run(groups.cp, agreed);  // the first call agrees; every timed call hits the cache
  rows.emplace_back("cached", time_per_call(*world, reps, calls,
                                            [&] { cached.run(groups.cp, usp_fingerprint(layout, q_shape, q_shape)); }));
  rows.emplace_back("first", time_per_call(*world, reps, calls, [&] {
                      AgreementCheck(AgreementMode::kChanges).run(groups.cp, usp_fingerprint(layout, q_shape, q_shape));
                    }));
  rows.emplace_back("always", time_per_call(*world, reps, calls,
                                            [&] { always.run(groups.cp, usp_fingerprint(layout, q_shape, q_shape)); }));
  if (place.size > 1) {
    rows.emplace_back("mismatch", time_per_call(*world, reps, calls, [&] {
                        try {
                          AgreementCheck(AgreementMode::kChanges).run(groups.cp, place.rank == 0 ? odd : agreed);
                        } catch (const Error&) {
                        }
                      }));
  }
  MhaCp usp(groups, layout, MhaCpConfig{});
  Tensor q = Tensor::zeros(q_shape, DType::kFloat32, MemCategory::kSavedActivation);
  usp.forward(q.view(), q.view(), q.view());  // warm-up
  rows.emplace_back("usp fwd", time_per_call(*world, reps, 1, [&] { usp.forward(q.view(), q.view(), q.view()); }));

  if (place.rank == 0) {
    std::printf("# seqpar agreement_bench %s\n", version());
    std::printf("# agreement_bench: ranks %d, SEQPAR_AGREEMENT_CHECK=%s (the layer's mode, used by 'usp fwd')\n",
                place.size, agreement_mode_name(agreement_mode()));
    std::printf("# USP forward: B=1 S=%lld H=%lld D=%lld fp32 causal zigzag, ring of %d; fingerprint %zu bytes\n",
                static_cast<long long>(seq), static_cast<long long>(heads), static_cast<long long>(head_dim),
                place.size, agreed.text().size());
    std::printf("#%11s %14s\n", "case", "us/call");
    for (const auto& [name, s] : rows) std::printf("%12s %14.2f\n", name.c_str(), s * 1e6);
  }
  return 0;
}

}  // namespace
}  // namespace seqpar::bench

int main(int argc, char** argv) { return seqpar::run_mpi_main(argc, argv, seqpar::bench::agreement_bench_main); }
