#include "benchmarks/sp_bench_report.h"

#include <algorithm>
#include <cstdio>
#include <span>

#include "benchmarks/sp_bench_workload.h"
#include "runtime/memory.h"
#include "runtime/version.h"

namespace seqpar::bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

double tflops_total(const PhaseResult& p) { return p.flops / (p.time_ms * 1e-3) / 1e12; }

bool has_rounds(const RunReport& r) { return r.phases.front().message_rounds >= 0; }

}  // namespace

namespace {

// Max / mean over ring ranks of the non-causal attention work: each real token of a shard attends to its whole
// document (the causal form is SequenceLayout::flop_imbalance).
double full_flop_imbalance(const SequenceLayout& layout) {
  const std::span<const std::int64_t> cu = layout.cu_seqlens();
  double max_work = 0, sum_work = 0;
  for (int r = 0; r < layout.ring_size(); ++r) {
    double work = 0;
    for (std::int64_t slot : layout.ring_shard_positions(r)) {
      const std::int64_t d = layout.doc_of_slot(slot);
      if (d >= 0) work += static_cast<double>(cu[d + 1] - cu[d]);
    }
    max_work = std::max(max_work, work);
    sum_work += work;
  }
  return sum_work > 0 ? max_work / (sum_work / layout.ring_size()) : 1.0;
}

// The mask of the run: GDN and DSA are causal whatever --causal says.
bool causal_mask(const SpBenchOptions& o) { return o.causal || o.attn != "mha"; }

}  // namespace

std::string describe_packing(const SpBenchOptions& o) {
  if (!o.packed() && sp_bench_padded_len(o) == o.seq) return "";  // nothing to say, and no layout built
  const SequenceLayout layout = sp_bench_layout(o);
  const bool causal = causal_mask(o);
  return str_cat("# packing: ", layout.num_docs(), " document(s)",
                 o.doc_dist.empty() ? std::string() : str_cat(" (--doc-dist ", o.doc_dist, ", seed ", o.seed, ")"),
                 ", partition ", layout_name(layout.kind()), " over ", layout.ring_size(), " ring rank(s)",
                 layout.chunk_len() > 0 ? str_cat(", chunks of ", layout.chunk_len()) : std::string(), ": padded_len ",
                 layout.padded_len(), " (", layout.padded_len() - layout.seq_len(), " padding), ",
                 causal ? "causal" : "non-causal", " FLOP imbalance ",
                 fmt("%.4f", causal ? layout.flop_imbalance() : full_flop_imbalance(layout)),
                 " (max / mean per ring rank), ", causal ? "causal" : "non-causal", " per-step imbalance ",
                 fmt("%.4f", step_imbalance_for_mask(layout, causal)),
                 " (sum over ring steps of max / mean tile pairs)");
}

namespace {

void print_header(const SpBenchOptions& o, const RunReport& r) {
  std::printf("# seqpar sp_bench %s\n", version());
  std::printf("# backend %s, world %d, grid %s, threads/rank %d\n", r.backend, r.world_size, r.grid.c_str(), o.threads);
  std::printf("# host %s (%d ranks on it, %d cores), commit %s, date %s\n", r.node.host.c_str(), r.node.ranks_per_node,
              r.node.cores_per_node, git_commit(), r.date_utc.c_str());
  const std::string warning = oversubscription_warning(r.node, o.threads);
  if (!warning.empty()) std::printf("# warning: %s\n", warning.c_str());
  const std::string transport = single_copy_note(r.node);
  if (!transport.empty()) std::printf("# note: %s\n", transport.c_str());
  // The ring impl only where it means something (a kind that owns --impl; GDN's mode and DSA's selection are in the
  // shapes line).
  const std::vector<std::string>& own = find_workload_kind(o.attn).own_flags;
  const std::string impl = std::find(own.begin(), own.end(), "impl") != own.end()
                               ? str_cat(", impl ", ring_impl_name(o.impl))
                               : std::string();
  std::printf("# attn %s%s, layout %s%s, dtype %s\n", o.attn.c_str(),
              o.model.empty() ? "" : str_cat(" (model ", o.model, ")").c_str(), layout_name(o.layout), impl.c_str(),
              dtype_name(o.dtype));
  std::printf("# shapes %s\n", describe_shapes(o).c_str());
  const std::string packing = describe_packing(o);
  if (!packing.empty()) std::printf("%s\n", packing.c_str());
  std::printf(
      "# FLOPs per step (all replicas): fwd %.4g, bwd %.4g; warmup %d, iters %d (median; JSON: min, max, each); inputs "
      "%s\n",
      r.phases[0].flops, r.phases[1].flops, o.warmup, o.iters,
      o.inputs_dir.empty() ? str_cat("random (seed ", o.seed, ")").c_str() : o.inputs_dir.c_str());
  std::printf("%s#\n", describe_memory_estimate(r.memory).c_str());
}

void print_phases(const SpBenchOptions& o, const RunReport& r) {
  std::string h1 = "#    phase      time   TFLOP/s   TFLOP/s   exposed        sent";
  std::string h2 = "#                (ms)     /rank     total   comm(%)  (MiB/rank)";
  const char* cat_short[] = {"model", "saved", "cache", "work", "comm", "total"};
  for (const char* c : cat_short) {
    h1 += str_cat(std::string(9 - std::string(c).size(), ' '), c);
    h2 += "    (MiB)";
  }
  if (o.efficiency) {
    h1 += "    T1 alone   effic.    T1 busy   effic.";
    h2 += "        (ms)   (alone)       (ms)   (busy)";
  }
  if (has_rounds(r)) {
    h1 += "   rounds";
    h2 += "      (-)";
  }
  std::printf("%s\n%s\n", h1.c_str(), h2.c_str());
  for (const PhaseResult& p : r.phases) {
    std::string row = std::string(std::max<int>(0, 10 - static_cast<int>(p.name.size())), ' ') + p.name;
    row += fmt("%10.2f", p.time_ms);
    row += fmt("%10.4f", tflops_total(p) / r.world_size);
    row += fmt("%10.4f", tflops_total(p));
    row += fmt("%10.1f", 100.0 * p.exposed_frac);
    row += fmt("%12.2f", p.bytes_sent / kMiB);
    for (double m : p.mem_mib) row += fmt("%9.2f", m);
    if (o.efficiency) {
      row += fmt("%12.2f", p.single_rank_ms);
      row += fmt("%9.3f", p.efficiency);
      row += fmt("%11.2f", p.single_rank_busy_ms);
      row += fmt("%9.3f", p.efficiency_busy);
    }
    if (has_rounds(r)) row += fmt("%9.0f", p.message_rounds);
    std::printf("%s\n", row.c_str());
  }
}

// The rules: sp_bench_check.h.
void print_check(const CheckReport& check) {
  if (check.against == "reference") {
    std::printf(
        "#\n# check against the fp64 reference (attention/reference; --check-against reference): ok when fp64_err "
        "<= atol + rtol * max|fp64| or the rounding floor (16-bit MHA dq, dk; docs/benchmarks.md) (rule reference);\n# "
        "tensors without an fp64 counterpart against the "
        "single-rank kernel: ok when max_abs_err <= atol + rtol * max|ref| (rule 1-rank)\n");
  } else {
    std::printf(
        "#\n# check against the single-rank reference (--check-against 1-rank): ok when max_abs_err <= atol + rtol "
        "* max|ref| (rule 1-rank);\n# where not, and the fp64 reference is computed: ok when fp64_err <= max(%g x "
        "1rank_fp64_err, atol + rtol * max|fp64|, the rounding floor) (rule fp64)\n",
        kFp64ErrorFactor);
  }
  std::printf(
      "#        tensor  max_abs_err  max_rel_err     max|ref|       atol       rtol     fp64_err "
      "1rank_fp64_err      rule  result\n");
  for (const CheckResult& c : check.tensors) {
    const std::string fp64 = c.fp64_err >= 0 ? fmt("%12.3e", c.fp64_err) + fmt(" %14.3e", c.one_rank_fp64_err)
                                             : std::string(12 - 1, ' ') + "-" + std::string(15 - 1, ' ') + "-";
    std::printf("%15s %12.3e %12.3e %12.3e %10.1e %10.1e %s %9s  %s\n", c.name.c_str(), c.max_abs, c.max_rel(),
                c.max_ref, c.atol, c.rtol, fp64.c_str(), c.rule, c.ok ? "ok" : "FAIL");
  }
  if (!check.fp64_note.empty()) std::printf("# %s\n", check.fp64_note.c_str());
  std::printf("# check %s\n", check.passed ? "passed" : "FAILED");
}

void print_variants(const SpBenchOptions& o, const std::vector<VariantTiming>& variants) {
  std::printf(
      "#\n# single-rank kernel on the whole problem (world rank 0 alone, %d threads; median of %d after %d "
      "warmup)\n",
      o.threads, o.iters, o.warmup);
  std::printf("#                     variant   fwd (ms)   bwd (ms) fwd+bwd (ms)  vs first\n");
  const double base = variants.front().fwd_ms + variants.front().bwd_ms;
  for (const VariantTiming& v : variants) {
    std::printf("%29s %10.2f %10.2f %12.2f %8.2fx\n", v.name.c_str(), v.fwd_ms, v.bwd_ms, v.fwd_ms + v.bwd_ms,
                (v.fwd_ms + v.bwd_ms) / base);
  }
}

nlohmann::json phase_json(const SpBenchOptions& o, const RunReport& r, const PhaseResult& p) {
  nlohmann::json pj = {{"phase", p.name},
                       {"time_ms", p.time_ms},
                       {"time_min_ms", p.min_ms},
                       {"time_median_ms", p.time_ms},
                       {"time_max_ms", p.max_ms},
                       {"time_iters_ms", p.iter_ms},
                       {"flops", p.flops},
                       {"tflops_per_rank", tflops_total(p) / r.world_size},
                       {"tflops_total", tflops_total(p)},
                       {"exposed_comm_pct", 100.0 * p.exposed_frac},
                       {"bytes_sent_per_rank", p.bytes_sent},
                       {"executed_flops_max_rank", p.executed_flops}};
  nlohmann::json mj;
  for (int c = 0; c < kNumMemCategories; ++c) mj[mem_category_name(static_cast<MemCategory>(c))] = p.mem_mib[c];
  mj["total"] = p.mem_mib[kNumMemCategories];
  pj["mem_peak_mib"] = mj;
  if (has_rounds(r)) pj["message_rounds"] = p.message_rounds;
  if (o.efficiency) {
    pj["single_rank_ms"] = p.single_rank_ms;
    pj["efficiency"] = p.efficiency;
    pj["single_rank_busy_ms"] = p.single_rank_busy_ms;
    pj["efficiency_busy"] = p.efficiency_busy;
  }
  return pj;
}

nlohmann::json check_json(const CheckResult& c) {
  nlohmann::json j = {{"tensor", c.name},
                      {"max_abs_err", c.max_abs},
                      {"max_rel_err", c.max_rel()},
                      {"max_abs_ref", c.max_ref},
                      {"atol", c.atol},
                      {"rtol", c.rtol},
                      {"rule", c.rule},
                      {"ok", c.ok}};
  if (c.fp64_err >= 0) {
    j["fp64_err"] = c.fp64_err;
    j["one_rank_fp64_err"] = c.one_rank_fp64_err;
    j["max_abs_fp64"] = c.max_fp64;
  }
  return j;
}

}  // namespace

void print_report(const SpBenchOptions& o, const RunReport& r) {
  print_header(o, r);
  print_phases(o, r);
  if (r.gemm_tflops > 0) {
    std::printf("# reference: cuBLAS bf16 GEMM %lld^3 (fp32 accumulation) on world rank 0's device after the "
                "iterations: %.1f TFLOP/s; per rank, fwd %.3f and bwd %.3f of it\n",
                static_cast<long long>(r.gemm_n), r.gemm_tflops,
                tflops_total(r.phases[0]) / r.world_size / r.gemm_tflops,
                tflops_total(r.phases[1]) / r.world_size / r.gemm_tflops);
  }
  if (r.check != nullptr) print_check(*r.check);
  if (!r.variants.empty()) print_variants(o, r.variants);
  std::fflush(stdout);
}

nlohmann::json report_json(const SpBenchOptions& o, const RunReport& r) {
  nlohmann::json j;
  j["version"] = version();
  // Where and when (docs/benchmarks.md, "sp_bench JSON").
  j["git_commit"] = git_commit();
  j["host"] = r.node.host;
  j["date_utc"] = r.date_utc;
  j["ranks_per_node"] = r.node.ranks_per_node;
  j["cores_per_node"] = r.node.cores_per_node;
  j["backend"] = r.backend;
  j["world_size"] = r.world_size;
  if (r.gemm_tflops > 0) {
    j["gemm_reference"] = {{"n", r.gemm_n},
                           {"tflops", r.gemm_tflops},
                           {"fwd_ratio_gemm", tflops_total(r.phases[0]) / r.world_size / r.gemm_tflops},
                           {"bwd_ratio_gemm", tflops_total(r.phases[1]) / r.world_size / r.gemm_tflops}};
  }
  j["grid"] = {{"dp_size", o.grid.dp_size},
               {"ulysses_size", o.grid.ulysses_size},
               {"ring_size", o.grid.ring_size},
               {"placement", placement_name(o.grid.placement)}};
  j["attn"] = o.attn;
  j["model"] = o.model;
  j["layout"] = layout_name(o.layout);
  {
    const SequenceLayout layout = sp_bench_layout(o);
    j["packing"] = {{"documents", layout.num_docs()},
                    {"packed", o.packed()},
                    {"doc_dist", o.doc_dist},
                    {"cu_seqlens", std::vector<std::int64_t>(layout.cu_seqlens().begin(), layout.cu_seqlens().end())},
                    {"partition", layout_name(layout.kind())},
                    {"chunk_len", layout.chunk_len()},
                    {"padded_len", layout.padded_len()},
                    {"mask", causal_mask(o) ? "causal" : "non-causal"},
                    {"flop_imbalance", causal_mask(o) ? layout.flop_imbalance() : full_flop_imbalance(layout)},
                    {"ring_work", layout.ring_work()},
                    {"step_imbalance", step_imbalance_for_mask(layout, causal_mask(o))},
                    {"step_work", layout.step_work()}};
  }
  j["impl"] = ring_impl_name(o.impl);
  j["dtype"] = dtype_name(o.dtype);
  j["threads_per_rank"] = o.threads;
  j["shape"] = {{"batch", o.batch},       {"seq", o.seq},       {"heads", o.heads},  {"kv_heads", o.kv_heads},
                {"head_dim", o.head_dim}, {"causal", o.causal}, {"window", o.window}};
  const WorkloadKind& kind = find_workload_kind(o.attn);
  if (kind.add_json) kind.add_json(o, j);
  j["warmup"] = o.warmup;
  j["iters"] = o.iters;
  j["memory_estimate"] = memory_estimate_json(r.memory);
  j["phases"] = nlohmann::json::array();
  for (const PhaseResult& p : r.phases) j["phases"].push_back(phase_json(o, r, p));
  if (!r.variants.empty()) {
    j["variants"] = nlohmann::json::array();
    for (const VariantTiming& v : r.variants) {
      j["variants"].push_back({{"name", v.name}, {"fwd_ms", v.fwd_ms}, {"bwd_ms", v.bwd_ms}});
    }
  }
  if (r.check != nullptr) {
    j["check"] = nlohmann::json::array();
    for (const CheckResult& c : r.check->tensors) j["check"].push_back(check_json(c));
    j["check_passed"] = r.check->passed;
    j["check_against"] = r.check->against;
  }
  return j;
}

}  // namespace seqpar::bench
