#include "benchmarks/sp_bench_timing.h"

#include <algorithm>
#include <cstdio>

#include "runtime/error.h"

namespace seqpar::bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr int kMemSlots = kNumMemCategories + 1;  // the categories, then the total

// The per-iteration times of the forward, the backward and their sum, from [fwd_0, bwd_0, fwd_1, ...].
std::vector<std::vector<double>> phase_series(const std::vector<double>& t, int iters) {
  std::vector<std::vector<double>> s(3, std::vector<double>(iters));
  for (int i = 0; i < iters; ++i) {
    s[0][i] = t[2 * i];
    s[1][i] = t[2 * i + 1];
    s[2][i] = s[0][i] + s[1][i];
  }
  return s;
}

// Medians over the iterations of the forward, the backward and their sum.
std::vector<double> phase_medians(const std::vector<double>& t, int iters) {
  std::vector<double> m;
  for (const std::vector<double>& s : phase_series(t, iters)) m.push_back(median(s));
  return m;
}

// Records one phase's counters and memory peaks into `t`.
void record_phase(LocalTimings& t, int phase, const PhaseCounters& c) {
  const MemorySnapshot s = memory_ledger().snapshot();
  double* m = &t.mem[phase * kMemSlots];
  for (int k = 0; k < kNumMemCategories; ++k) m[k] = std::max(m[k], static_cast<double>(s.peak[k]));
  m[kNumMemCategories] = std::max(m[kNumMemCategories], static_cast<double>(s.total_peak));
  t.exposed_s[phase] += c.exposed_comm_s;
  t.bytes[phase] = static_cast<double>(c.bytes_sent);
  t.executed[phase] = c.executed_flops;
  t.rounds[phase] = static_cast<double>(c.message_rounds);
}

}  // namespace

Progress::Progress(bool enabled) : enabled_(enabled), start_(now_s()), last_(start_) {}

void Progress::note(const std::string& what, bool force) {
  if (!enabled_) return;
  const double t = now_s();
  if (t - start_ < 2.0 || (!force && t - last_ < 2.0)) return;
  last_ = t;
  std::fprintf(stderr, "# [sp_bench %7.1f s] %s\n", t - start_, what.c_str());
  std::fflush(stderr);
}

LocalTimings time_iterations(Communicator& world, Workload& wl, const SpBenchOptions& o, const NamedArrays* inputs,
                             Progress& progress) {
  for (int i = 0; i < o.warmup; ++i) {
    progress.note(str_cat("warmup ", i + 1, "/", o.warmup));
    barrier(world);
    wl.forward();
    barrier(world);
    wl.backward();
  }
  const int n = o.iters;
  LocalTimings t;
  t.iters = n;
  t.times.assign(2 * n, 0);
  t.mem.assign(2 * kMemSlots, 0);
  // --efficiency: the whole problem on one rank, same threads, same run, interleaved with the distributed
  // iterations so that a drifting machine load affects both alike. Twice per iteration: on world rank 0 while the
  // other ranks wait ("alone", the definition), and on every rank at once, each on its own copy ("busy"): the
  // second baseline sees the same contention for shared cores, caches and memory bandwidth as the distributed run,
  // which separates the algorithm's overhead from what the machine can give P busy ranks.
  t.alone.assign(2 * n, 0);
  t.busy.assign(2 * n, 0);
  auto time_reference = [&](std::vector<double>& out, int i) {
    double t0 = now_s();
    wl.reference_forward();
    out[2 * i] = now_s() - t0;
    t0 = now_s();
    wl.reference_backward();
    out[2 * i + 1] = now_s() - t0;
  };
  if (o.efficiency) {
    progress.note("efficiency: making the single-rank problem", true);
    wl.reference_setup(inputs);
    t.reference_ready = true;
    if (o.warmup > 0) {
      wl.reference_forward();
      wl.reference_backward();
    }
  }
  for (int i = 0; i < n; ++i) {
    progress.note(str_cat("iteration ", i + 1, "/", n));
    if (o.efficiency) {
      barrier(world);
      if (world.rank() == 0) time_reference(t.alone, i);
      barrier(world, kLongWaitS);
      time_reference(t.busy, i);
      barrier(world, kLongWaitS);
    }
    wl.release_outputs();
    barrier(world);
    memory_ledger().reset_peaks();
    double t0 = now_s();
    PhaseCounters c = wl.forward();
    t.times[2 * i] = now_s() - t0;
    record_phase(t, 0, c);

    barrier(world);
    memory_ledger().reset_peaks();
    t0 = now_s();
    c = wl.backward();
    t.times[2 * i + 1] = now_s() - t0;
    record_phase(t, 1, c);
  }
  return t;
}

std::vector<PhaseResult> reduce_phases(Communicator& world, LocalTimings t, const Workload& wl,
                                       const SpBenchOptions& o) {
  const int n = t.iters;
  double local_sum[2] = {0, 0};
  for (int i = 0; i < n; ++i) {
    local_sum[0] += t.times[2 * i];
    local_sum[1] += t.times[2 * i + 1];
  }
  std::vector<double> exposed_frac = {t.exposed_s[0] / local_sum[0], t.exposed_s[1] / local_sum[1]};
  all_reduce(world, t.times, ReduceOp::kMax);
  all_reduce(world, exposed_frac, ReduceOp::kSum);
  all_reduce(world, t.bytes, ReduceOp::kMax);
  all_reduce(world, t.executed, ReduceOp::kMax);
  all_reduce(world, t.rounds, ReduceOp::kMax);
  all_reduce(world, t.mem, ReduceOp::kMax);

  const double dp = o.grid.dp_size, ranks = world.size();
  const std::vector<std::vector<double>> series = phase_series(t.times, n);
  std::vector<PhaseResult> phases(3);
  const char* names[3] = {"fwd", "bwd", "fwd+bwd"};
  const double flops[2] = {dp * wl.forward_flops(), dp * wl.backward_flops()};
  for (int p = 0; p < 3; ++p) {
    PhaseResult& r = phases[p];
    r.name = names[p];
    for (double x : series[p]) r.iter_ms.push_back(1e3 * x);
    r.time_ms = median(r.iter_ms);
    r.min_ms = *std::min_element(r.iter_ms.begin(), r.iter_ms.end());
    r.max_ms = *std::max_element(r.iter_ms.begin(), r.iter_ms.end());
    if (p < 2) {
      r.flops = flops[p];
      r.exposed_frac = exposed_frac[p] / ranks;
      r.bytes_sent = t.bytes[p];
      r.executed_flops = t.executed[p];
      if (t.rounds[0] >= 0) r.message_rounds = t.rounds[p];
      for (int c = 0; c < kMemSlots; ++c) r.mem_mib.push_back(t.mem[p * kMemSlots + c] / kMiB);
      continue;
    }
    const PhaseResult &f = phases[0], &b = phases[1];
    r.flops = f.flops + b.flops;
    // fwd+bwd exposed share: time-weighted mean of the two phases.
    r.exposed_frac = (f.exposed_frac * f.time_ms + b.exposed_frac * b.time_ms) / (f.time_ms + b.time_ms);
    r.bytes_sent = f.bytes_sent + b.bytes_sent;
    r.executed_flops = f.executed_flops + b.executed_flops;
    if (t.rounds[0] >= 0) r.message_rounds = f.message_rounds + b.message_rounds;
    for (int c = 0; c < kMemSlots; ++c) r.mem_mib.push_back(std::max(f.mem_mib[c], b.mem_mib[c]));
  }

  if (o.efficiency) {
    all_reduce(world, t.alone, ReduceOp::kMax);
    all_reduce(world, t.busy, ReduceOp::kMax);
    const std::vector<double> alone = phase_medians(t.alone, n), busy = phase_medians(t.busy, n);
    const double cp_size = o.grid.ulysses_size * o.grid.ring_size;
    for (int p = 0; p < 3; ++p) {
      phases[p].single_rank_ms = 1e3 * alone[p];
      phases[p].efficiency = alone[p] / (cp_size * phases[p].time_ms * 1e-3);
      phases[p].single_rank_busy_ms = 1e3 * busy[p];
      phases[p].efficiency_busy = busy[p] / (cp_size * phases[p].time_ms * 1e-3);
    }
  }
  return phases;
}

}  // namespace seqpar::bench
