#include "benchmarks/sp_bench_memory.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "benchmarks/sp_bench_workload.h"
#include "runtime/error.h"
#include "runtime/mpi_comm.h"
#include "runtime/cp_grid.h"

namespace seqpar::bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kGiB = 1024.0 * kMiB;

double sum_of(const std::vector<std::pair<std::string, double>>& lines) {
  double s = 0;
  for (const auto& [name, bytes] : lines) s += bytes;
  return s;
}

// "KEY: N kB" of /proc/meminfo in bytes; -1 when absent.
double meminfo_bytes(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  std::string name, unit;
  double value = 0;
  while (in >> name >> value) {
    std::getline(in, unit);
    if (name == key + ":") return value * 1024.0;
  }
  return -1;
}

// A number in a cgroup file; -1 when absent or "max".
double cgroup_value(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return -1;
  try {
    return std::stod(text);
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

std::string bytes_str(double b) {
  char buf[32];
  if (b >= 1024 * kGiB) {
    std::snprintf(buf, sizeof buf, "%.2f TiB", b / (1024 * kGiB));
  } else if (b >= kGiB) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / kGiB);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / kMiB);
  }
  return buf;
}

double loaded_input_bytes(const SpBenchOptions& o, const std::vector<TensorSpec>& specs, double fallback) {
  double b = 0;
  for (const TensorSpec& s : specs) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(std::filesystem::path(o.inputs_dir) / (s.name + ".npy"), ec);
    if (ec) return fallback;
    b += static_cast<double>(size);
  }
  return b;
}

double MemoryEstimate::ledger_bytes() const { return sum_of(ledger); }
double MemoryEstimate::total_bytes() const { return sum_of(ledger) + sum_of(host) + kProcessBaselineBytes; }

MemoryEstimate estimate_memory(const SpBenchOptions& o, int world_rank) {
  const WorkloadKind& kind = find_workload_kind(o.attn);
  SEQPAR_CHECK(kind.estimate_memory != nullptr, "sp_bench: attention kind ", kind.name, " has no memory estimate");
  const WorkloadMemory w = kind.estimate_memory(o);
  // The ledger's total peak is the larger of the two phases' (the inputs live through both).
  const PhaseMemory& p = w.forward.total() >= w.backward.total() ? w.forward : w.backward;
  MemoryEstimate e;
  e.ledger = {{"inputs", w.inputs},
              {"saved activations", p.saved},
              {"outputs", p.outputs},
              {"workspace", p.workspace},
              {"comm buffers", p.comm}};
  e.phases = {{"fwd", w.inputs + w.forward.total()}, {"bwd", w.inputs + w.backward.total()}};
  // DSA's selection arrays are [B, S_local, topk] whatever S: a --topk far above --seq is the size to cut.
  if (o.attn == "dsa") e.size_flags = str_cat("--seq, --batch or --topk ", o.topk);

  const bool sp_root = cp_coords_of(o.grid, world_rank).cp_rank == 0;
  const double reference = w.full_inputs + w.full_outputs + w.reference_scratch;
  if (!o.inputs_dir.empty())
    e.host.emplace_back("loaded inputs (--inputs, every rank)",
                        loaded_input_bytes(o, kind.input_specs(o), w.full_inputs));
  if (o.check || !o.dump_dir.empty()) e.host.emplace_back("gathered outputs (--check/--dump)", w.full_outputs);
  if (o.dump_inputs && world_rank == 0) e.host.emplace_back("dumped inputs (--dump-inputs, rank 0)", w.full_inputs);
  if (o.efficiency || o.gdn_compare_token) {
    e.host.emplace_back(o.efficiency ? "single-rank reference (--efficiency, every rank)"
                                     : "single-rank reference (--gdn-compare-token)",
                        reference);
  } else if (o.check && sp_root) {
    e.host.emplace_back("single-rank reference (--check, SP root)", reference);
  }
  return e;
}

double available_memory_bytes(double test_override) {
  if (test_override > 0) return test_override;
  double avail = meminfo_bytes("MemAvailable");
  const double limit = cgroup_value("/sys/fs/cgroup/memory.max"), used = cgroup_value("/sys/fs/cgroup/memory.current");
  if (limit > 0 && used >= 0) avail = avail < 0 ? limit - used : std::min(avail, limit - used);
  return avail;
}

std::string describe_memory_estimate(const MemoryEstimate& e) {
  std::string s = str_cat("# memory estimate per rank (largest, world rank 0): ", bytes_str(e.total_bytes()), "\n");
  std::string ledger;
  for (const auto& [name, bytes] : e.ledger) ledger += str_cat(ledger.empty() ? "" : ", ", name, " ", bytes_str(bytes));
  s += str_cat("#   ledger peak ", bytes_str(e.ledger_bytes()), ": ", ledger, "\n");
  for (const auto& [name, bytes] : e.host) s += str_cat("#   host arrays: ", name, " ", bytes_str(bytes), "\n");
  s += str_cat("#   process allowance (MPI, libraries) ", bytes_str(kProcessBaselineBytes), "\n");
  return s;
}

std::string describe_memory_dry_run(const MemoryEstimate& e, const MemoryVerdict& v) {
  return str_cat(describe_memory_estimate(e), "# node: ",
                 !v.compared ? "not compared (nccl backend, --device cuda, or no MemAvailable)"
                             : str_cat(v.text, v.fits ? ": fits" : ": does NOT fit"),
                 "\n");
}

void check_memory_fits(const MemoryVerdict& v, const MemoryEstimate& mine) {
  if (v.fits) return;
  const std::pair<std::string, double>* largest = nullptr;
  for (const auto* lines : {&mine.ledger, &mine.host}) {
    for (const auto& line : *lines) {
      if (largest == nullptr || line.second > largest->second) largest = &line;
    }
  }
  const std::string part = largest == nullptr ? std::string()
                                              : str_cat("the largest part per rank: ", largest->first, " ",
                                                        bytes_str(largest->second), "; ");
  SEQPAR_THROW("memory estimate: ", v.text, "; reduce ", mine.size_flags, ", or use more ranks or nodes (", part,
               "--dry-run prints the estimate by category)");
}

nlohmann::json memory_estimate_json(const MemoryEstimate& e) {
  nlohmann::json mem = {{"ledger_peak_bytes", e.ledger_bytes()}, {"total_bytes", e.total_bytes()}};
  for (const auto& [name, bytes] : e.ledger) mem["ledger"][name] = bytes;
  for (const auto& [name, bytes] : e.host) mem["host"][name] = bytes;
  for (const auto& [name, bytes] : e.phases) mem["phase_peak_bytes"][name] = bytes;
  return mem;
}

MemoryVerdict compare_with_node_memory(const SpBenchOptions& o, const MemoryEstimate& e) {
  MemoryVerdict v;
  if (o.backend != "mpi" || o.device.is_cuda()) return v;  // the tensors live on the devices
  MPI_Comm node = MPI_COMM_NULL;
  SEQPAR_CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  double mine[2] = {e.total_bytes(), 1}, need[2] = {0, 0};
  double avail = available_memory_bytes(o.test_mem_available_mib * kMiB), node_avail = 0;
  const int rc_sum = MPI_Allreduce(mine, need, 2, MPI_DOUBLE, MPI_SUM, node);
  const int rc_min = MPI_Allreduce(&avail, &node_avail, 1, MPI_DOUBLE, MPI_MIN, node);
  MPI_Comm_free(&node);
  SEQPAR_CHECK(rc_sum == MPI_SUCCESS && rc_min == MPI_SUCCESS, "sp_bench: the memory check's node reductions failed");
  // The node that falls shortest, with its figures on every rank (only one of its ranks contributes them).
  int rank = 0;
  SEQPAR_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  struct {
    double ratio;
    int rank;
  } mine_ratio{node_avail > 0 ? need[0] / node_avail : 0.0, rank}, worst{};
  SEQPAR_CHECK_MPI(MPI_Allreduce(&mine_ratio, &worst, 1, MPI_DOUBLE_INT, MPI_MAXLOC, MPI_COMM_WORLD));
  double figures[3] = {0, 0, 0}, shared[3] = {0, 0, 0};
  if (rank == worst.rank) {
    figures[0] = need[0];
    figures[1] = node_avail;
    figures[2] = need[1];
  }
  SEQPAR_CHECK_MPI(MPI_Allreduce(figures, shared, 3, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
  if (shared[1] <= 0) return v;  // no node could read its available memory
  v.compared = true;
  v.fits = shared[0] <= shared[1];
  v.text = str_cat("the ", static_cast<int>(shared[2]), " rank(s) on world rank ", worst.rank, "'s node need ",
                   bytes_str(shared[0]), " of the ", bytes_str(shared[1]), " available (",
                   o.test_mem_available_mib > 0 ? "--test-mem-available-mib" : "MemAvailable", ")");
  return v;
}

}  // namespace seqpar::bench
