#include "benchmarks/sp_bench_options.h"

#include <algorithm>
#include <cstdlib>
#include <cxxopts.hpp>
#include <map>
#include <vector>

#include "benchmarks/sp_bench_workload.h"
#include "runtime/comm_factory.h"
#include "runtime/error.h"

namespace seqpar::bench {
namespace {
constexpr int kMaxThreads = 1024;  // per rank; far above any node today, and it keeps OpenMP from failing obscurely

template <typename T>
T get_checked(const cxxopts::ParseResult& r, const char* flag) {
  try {
    return r[flag].as<T>();
  } catch (const cxxopts::exceptions::exception& e) {
    SEQPAR_THROW("--", flag, ": ", e.what());
  }
}

// Runs a library parser and prefixes its error with the flag and the value.
template <typename Fn>
auto parse_flag(const char* flag, const std::string& value, Fn&& fn) {
  try {
    return fn(value);
  } catch (const Error& e) {
    SEQPAR_THROW("--", flag, " ", value, ": ", e.message());
  }
}

void check_min(std::int64_t value, std::int64_t min, const char* flag) {
  SEQPAR_CHECK(value >= min, "--", flag, " ", value, ": must be >= ", min);
}

}  // namespace

std::optional<SpBenchOptions> parse_sp_bench_options(int argc, char** argv, int world_size, int world_rank) {
  cxxopts::Options spec("sp_bench",
                        "sequence-parallel attention benchmark: mpirun -np N sp_bench [options]\n"
                        "  N must equal dp-size * ulysses-size * ring-size.");
  std::string attn_help = "attention kind:", model_help = "preset of real shapes (explicit flags override it):";
  for (const WorkloadKind& k : workload_kinds()) {
    attn_help += str_cat("\n  ", k.name, ": ", k.description);
    for (const ModelPreset& p : k.presets) model_help += str_cat("\n  ", p.name, " (", k.name, "): ", p.note);
  }
  // clang-format off
  spec.add_options("problem")
    ("attn", attn_help, cxxopts::value<std::string>()->default_value("mha"))
    ("model", model_help, cxxopts::value<std::string>())
    ("batch", "batch size per data-parallel replica", cxxopts::value<std::int64_t>()->default_value("1"))
    ("seq", "global sequence length (K = 1024, M = 1024^2 suffixes)", cxxopts::value<std::string>()->default_value("4K"))
    ("heads", "query heads (GDN: value heads)", cxxopts::value<std::int64_t>()->default_value("8"))
    ("kv-heads", "key/value heads (GQA; GDN: key heads of q and k); must divide --heads; 0: --heads",
     cxxopts::value<std::int64_t>()->default_value("0"))
    ("head-dim", "head dimension", cxxopts::value<std::int64_t>()->default_value("64"))
    ("causal", "causal mask (presets turn it on; --causal=false turns it off)",
     cxxopts::value<bool>()->default_value("false")->implicit_value("true"))
    ("window", "sliding window in tokens (0: none; needs --causal)", cxxopts::value<std::int64_t>()->default_value("0"))
    ("topk", "DSA: selected keys per query", cxxopts::value<std::int64_t>()->default_value("2048"))
    ("dim-v", "value width (0: --head-dim); DSA: Dv, the first Dv columns of the latent; GDN: V",
     cxxopts::value<std::int64_t>()->default_value("0"))
    ("indexer-heads", "DSA: indexer heads Hi", cxxopts::value<std::int64_t>()->default_value("64"))
    ("indexer-dim", "DSA: indexer head dim Di", cxxopts::value<std::int64_t>()->default_value("128"))
    ("chunk-size", "GDN: chunk length", cxxopts::value<std::int64_t>()->default_value("64"))
    ("conv-width", "GDN: width W of the short causal depthwise conv (with SiLU) on q, k and v before the "
                   "recurrence (0: none)", cxxopts::value<std::int64_t>()->default_value("0"))
    ("dtype", "storage dtype: fp32 | bf16 | fp16 | fp64", cxxopts::value<std::string>()->default_value("fp32"))
    ("seed", "seed of the random inputs", cxxopts::value<std::uint64_t>()->default_value("1234"));
  spec.add_options("parallel")
    ("backend", "communicator backend: mpi | nccl (nccl needs one CUDA device per rank)",
     cxxopts::value<std::string>()->default_value("mpi"))
    ("ulysses-size", "Ulysses (all-to-all) degree Pu", cxxopts::value<int>()->default_value("1"))
    ("ring-size", "ring degree Pr", cxxopts::value<int>()->default_value("1"))
    ("dp-size", "data-parallel replicas", cxxopts::value<int>()->default_value("1"))
    ("placement", "ulysses_inner | ring_inner", cxxopts::value<std::string>()->default_value("ulysses_inner"))
    ("layout", "contiguous | zigzag | stripe", cxxopts::value<std::string>()->default_value("zigzag"))
    ("impl", "ring implementation: p2p | allgather", cxxopts::value<std::string>()->default_value("p2p"))
    ("gdn-mode", "GDN state passing: chain | scan (default scan, as in GdnCpConfig)",
     cxxopts::value<std::string>()->default_value("scan"))
    ("dsa-select", "DSA top-k selection over the SP group: ring (index keys circulate) | allgather (gathered "
                   "once)", cxxopts::value<std::string>()->default_value("ring"));
  spec.add_options("run")
    ("warmup", "untimed iterations", cxxopts::value<int>()->default_value("2"))
    ("iters", "timed iterations (the median is reported)", cxxopts::value<int>()->default_value("5"))
    ("threads", "OpenMP threads per rank (default: OMP_NUM_THREADS, else 1)", cxxopts::value<int>())
    ("check", "compare every output and gradient with the single-rank reference; non-zero exit when over tolerance")
    ("check-against", "what --check compares with (implies --check): 1-rank (the single-rank kernel, then the fp64 "
                      "reference where that fails) | reference (the fp64 reference, for sizes that fit)",
     cxxopts::value<std::string>()->default_value("1-rank"))
    ("gdn-compare-token", "GDN: also time the single-rank chunked kernel on the whole problem against the "
                          "token-by-token recurrence (the same kernel with chunk size 1), on rank 0")
    ("efficiency", "also time the whole problem on one rank, alone and with every rank busy: efficiency = "
                   "T1 / (ranks x T)")
    ("json", "write the results as JSON to FILE (rank 0)", cxxopts::value<std::string>())
    ("inputs", "read the full inputs from DIR/<name>.npy (fp32 or fp64, C order)", cxxopts::value<std::string>())
    ("dump", "write the full outputs and gradients to DIR/<name>.npy (rank 0)", cxxopts::value<std::string>())
    ("dump-inputs", "with --dump: also write the full inputs to DIR/<name>.npy (fp32, fp64 for --dtype fp64), the "
                    "files --inputs DIR reads")
    ("dry-run", "print the memory estimate per rank (by category) and whether the node can hold it, then exit 0")
    ("quiet", "no progress lines")
    ("help", "print this help")
    ("version", "print the version and exit");
  // Test hooks, not in --help (see SpBenchOptions).
  spec.add_options("test")
    ("test-corrupt", "", cxxopts::value<std::string>())
    ("test-fail-write-after", "", cxxopts::value<std::int64_t>())
    ("test-logit-scale", "", cxxopts::value<double>())
    ("test-mem-available-mib", "", cxxopts::value<double>());
  // clang-format on

  const std::optional<cxxopts::ParseResult> parsed =
      parse_command_line(spec, argc, argv, world_rank, {"problem", "parallel", "run"});
  if (!parsed) return std::nullopt;
  const cxxopts::ParseResult& r = *parsed;

  SpBenchOptions o;
  o.attn = find_workload_kind(get_checked<std::string>(r, "attn")).name;
  if (r.count("model")) {
    o.model = get_checked<std::string>(r, "model");
    const ModelPreset* preset = nullptr;
    std::string preset_kind, names;
    for (const WorkloadKind& k : workload_kinds()) {
      for (const ModelPreset& p : k.presets) {
        names += (names.empty() ? "" : ", ") + p.name;
        if (o.model != p.name) continue;
        preset = &p;
        preset_kind = k.name;
      }
    }
    SEQPAR_CHECK(preset != nullptr, "--model ", o.model, ": unknown preset (expected one of ", names, ")");
    if (!r.count("attn")) o.attn = preset_kind;
    SEQPAR_CHECK(o.attn == preset_kind, "--model ", o.model, " is a ", preset_kind,
                 " preset; it cannot be combined with --attn ", o.attn);
    if (preset->heads > 0) o.heads = preset->heads;
    if (preset->kv_heads > 0) o.kv_heads = preset->kv_heads;
    if (preset->head_dim > 0) o.head_dim = preset->head_dim;
    if (preset->topk > 0) o.topk = preset->topk;
    if (preset->chunk_size > 0) o.chunk_size = preset->chunk_size;
    if (preset->dim_v > 0) o.dim_v = preset->dim_v;
    if (preset->indexer_heads > 0) o.indexer_heads = preset->indexer_heads;
    if (preset->indexer_dim > 0) o.indexer_dim = preset->indexer_dim;
    if (preset->conv_width > 0) o.conv_width = preset->conv_width;
    o.causal = true;
  }
  // Without a preset every flag (or its default) applies; with one, only the flags given explicitly.
  auto given = [&](const char* flag) { return o.model.empty() || r.count(flag) > 0; };
  if (given("heads")) o.heads = get_checked<std::int64_t>(r, "heads");
  if (given("kv-heads")) o.kv_heads = get_checked<std::int64_t>(r, "kv-heads");
  if (given("head-dim")) o.head_dim = get_checked<std::int64_t>(r, "head-dim");
  if (given("causal")) o.causal = get_checked<bool>(r, "causal");
  if (given("topk")) o.topk = get_checked<std::int64_t>(r, "topk");
  if (given("chunk-size")) o.chunk_size = get_checked<std::int64_t>(r, "chunk-size");
  if (given("dim-v")) o.dim_v = get_checked<std::int64_t>(r, "dim-v");
  if (given("indexer-heads")) o.indexer_heads = get_checked<std::int64_t>(r, "indexer-heads");
  if (given("indexer-dim")) o.indexer_dim = get_checked<std::int64_t>(r, "indexer-dim");
  if (given("conv-width")) o.conv_width = get_checked<std::int64_t>(r, "conv-width");

  o.batch = get_checked<std::int64_t>(r, "batch");
  o.seq = parse_size(get_checked<std::string>(r, "seq"), "seq");
  o.window = get_checked<std::int64_t>(r, "window");
  const std::string dtype = get_checked<std::string>(r, "dtype");
  o.dtype = parse_flag("dtype", dtype, [](const std::string& v) { return parse_dtype(v); });
  SEQPAR_CHECK(is_floating(o.dtype), "--dtype ", dtype, ": must be fp32, bf16, fp16 or fp64");
  o.seed = get_checked<std::uint64_t>(r, "seed");
  o.grid.ulysses_size = get_checked<int>(r, "ulysses-size");
  o.grid.ring_size = get_checked<int>(r, "ring-size");
  o.grid.dp_size = get_checked<int>(r, "dp-size");
  o.grid.placement = parse_flag("placement", get_checked<std::string>(r, "placement"),
                                [](const std::string& v) { return parse_placement(v); });
  o.layout =
      parse_flag("layout", get_checked<std::string>(r, "layout"), [](const std::string& v) { return parse_layout(v); });
  o.impl =
      parse_flag("impl", get_checked<std::string>(r, "impl"), [](const std::string& v) { return parse_ring_impl(v); });
  o.gdn_mode = get_checked<std::string>(r, "gdn-mode");
  o.backend = get_checked<std::string>(r, "backend");
  o.dsa_select = get_checked<std::string>(r, "dsa-select");
  o.warmup = get_checked<int>(r, "warmup");
  o.iters = get_checked<int>(r, "iters");
  if (r.count("threads")) {
    o.threads = get_checked<int>(r, "threads");
  } else {
    const char* omp = std::getenv("OMP_NUM_THREADS");
    o.threads = 1;
    if (omp != nullptr && *omp != '\0') {
      try {
        o.threads = std::stoi(omp);
      } catch (const std::exception&) {
        SEQPAR_THROW("OMP_NUM_THREADS=", omp, ": not an integer (or pass --threads)");
      }
      SEQPAR_CHECK(o.threads >= 1 && o.threads <= kMaxThreads, "OMP_NUM_THREADS=", omp, " must be in [1, ", kMaxThreads,
                   "] (or pass --threads)");
    }
  }
  o.check = r.count("check") > 0 || r.count("check-against") > 0;
  o.check_against = get_checked<std::string>(r, "check-against");
  SEQPAR_CHECK(o.check_against == "1-rank" || o.check_against == "reference", "--check-against '", o.check_against,
               "' is not one of 1-rank, reference");
  o.efficiency = r.count("efficiency") > 0;
  o.gdn_compare_token = r.count("gdn-compare-token") > 0;
  o.quiet = r.count("quiet") > 0;
  o.dump_inputs = r.count("dump-inputs") > 0;
  o.dry_run = r.count("dry-run") > 0;
  if (r.count("json")) o.json_path = get_checked<std::string>(r, "json");
  if (r.count("inputs")) o.inputs_dir = get_checked<std::string>(r, "inputs");
  if (r.count("dump")) o.dump_dir = get_checked<std::string>(r, "dump");
  if (r.count("test-corrupt")) o.test_corrupt = get_checked<std::string>(r, "test-corrupt");
  if (r.count("test-fail-write-after")) o.test_fail_write_after = get_checked<std::int64_t>(r, "test-fail-write-after");
  if (r.count("test-logit-scale")) o.test_logit_scale = get_checked<double>(r, "test-logit-scale");
  if (r.count("test-mem-available-mib")) {
    o.test_mem_available_mib = get_checked<double>(r, "test-mem-available-mib");
    SEQPAR_CHECK(o.test_mem_available_mib > 0, "--test-mem-available-mib ", o.test_mem_available_mib, ": must be > 0");
  }
  for (const char* flag : {"json", "inputs", "dump"}) {
    SEQPAR_CHECK(!r.count(flag) || !get_checked<std::string>(r, flag).empty(), "--", flag, " needs a non-empty path");
  }

  if (o.kv_heads == 0) o.kv_heads = o.heads;  // --kv-heads 0 (the default): as many as --heads

  // ---- rules ----
  SEQPAR_CHECK(!o.dump_inputs || !o.dump_dir.empty(), "--dump-inputs needs --dump DIR (the directory it writes to)");
  check_min(o.batch, 1, "batch");
  check_min(o.seq, 1, "seq");
  check_min(o.heads, 1, "heads");
  check_min(o.kv_heads, 1, "kv-heads");
  check_min(o.head_dim, 1, "head-dim");
  check_min(o.window, 0, "window");
  check_min(o.topk, 1, "topk");
  check_min(o.chunk_size, 1, "chunk-size");
  check_min(o.conv_width, 0, "conv-width");
  check_min(o.warmup, 0, "warmup");
  check_min(o.iters, 1, "iters");
  check_min(o.threads, 1, "threads");
  SEQPAR_CHECK(o.threads <= kMaxThreads, "--threads ", o.threads, " must be <= ", kMaxThreads);
  check_min(o.grid.ulysses_size, 1, "ulysses-size");
  check_min(o.grid.ring_size, 1, "ring-size");
  check_min(o.grid.dp_size, 1, "dp-size");
  check_communicator_backend(o.backend);
  SEQPAR_CHECK(o.gdn_mode == "chain" || o.gdn_mode == "scan", "--gdn-mode ", o.gdn_mode,
               ": unknown mode (expected chain or scan)");
  SEQPAR_CHECK(o.dsa_select == "ring" || o.dsa_select == "allgather", "--dsa-select ", o.dsa_select,
               ": unknown selection mode (expected ring or allgather)");
  // A kind's own flag (--dim-v: DSA and GDN) given with a kind that does not own it.
  std::map<std::string, std::vector<std::string>> owners;
  for (const WorkloadKind& k : workload_kinds()) {
    for (const std::string& flag : k.own_flags) owners[flag].push_back(k.name);
  }
  for (const auto& [flag, kinds] : owners) {
    if (!r.count(flag) || std::find(kinds.begin(), kinds.end(), o.attn) != kinds.end()) continue;
    std::string need;
    for (std::size_t i = 0; i < kinds.size(); ++i) need += (i == 0 ? "" : " or ") + kinds[i];
    SEQPAR_THROW("--", flag, " needs --attn ", need, " (--attn ", o.attn, ")");
  }
  const std::int64_t grid_ranks = static_cast<std::int64_t>(o.grid.dp_size) * o.grid.ulysses_size * o.grid.ring_size;
  SEQPAR_CHECK(grid_ranks == world_size, "--dp-size ", o.grid.dp_size, " x --ulysses-size ", o.grid.ulysses_size,
               " x --ring-size ", o.grid.ring_size, " = ", grid_ranks, " must equal the number of MPI ranks (",
               world_size, ")");
  const WorkloadKind& kind = find_workload_kind(o.attn);
  if (kind.validate) kind.validate(o);
  // After the kind's rules: DSA implies --causal (its window limits the indexer's candidates), GDN refuses a window.
  SEQPAR_CHECK(o.window == 0 || o.causal, "--window ", o.window, ": a sliding window needs --causal");
  // Layout divisibility (the same rule the library applies, raised here before any communication).
  SequenceLayout(o.layout, o.seq, o.grid.ring_size, o.grid.ulysses_size);
  return o;
}

std::string describe_shapes(const SpBenchOptions& o) { return find_workload_kind(o.attn).describe_shapes(o); }

}  // namespace seqpar::bench
