#include "benchmarks/sp_bench_options.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cxxopts.hpp>
#include <limits>

#include "runtime/error.h"

namespace seqpar::bench {
namespace {
constexpr int kMaxThreads = 1024;  // per rank; far above any node today, and it keeps OpenMP from failing obscurely

AttnKind parse_attn(const std::string& name) {
  if (name == "mha") return AttnKind::kMha;
  if (name == "dsa") return AttnKind::kDsa;
  if (name == "gdn") return AttnKind::kGdn;
  SEQPAR_THROW("--attn ", name, ": unknown attention kind (expected mha, dsa or gdn)");
}

// Real shapes of the presets. Flags given explicitly override them.
struct Preset {
  const char* name;
  AttnKind attn;
  std::int64_t heads, kv_heads, head_dim, topk, chunk_size;
  std::int64_t dim_v, indexer_heads, indexer_dim;  // DSA only (0: not part of the preset)
  const char* note;
};
constexpr Preset kPresets[] = {
    {"llama3-8b", AttnKind::kMha, 32, 8, 128, 0, 0, 0, 0, 0,
     "MHA/GQA: 32 query heads, 8 kv heads, head dim 128, causal"},
    {"deepseek-v3.2", AttnKind::kDsa, 128, 1, 576, 2048, 0, 512, 64, 128,
     "DSA: 128 heads, latent 576 (value 512), indexer 64 heads x 128, top-k 2048, causal"},
    {"qwen3-next", AttnKind::kGdn, 32, 32, 128, 0, 64, 0, 0, 0,
     "GDN: 32 heads (value heads; key heads shared by pairs), K = V = 128, chunk 64, causal"},
};

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

const char* attn_kind_name(AttnKind kind) {
  switch (kind) {
    case AttnKind::kMha: return "mha";
    case AttnKind::kDsa: return "dsa";
    case AttnKind::kGdn: return "gdn";
  }
  return "?";
}

std::int64_t parse_size(const std::string& text, const char* flag) {
  SEQPAR_CHECK(!text.empty(), "--", flag, ": empty value (expected an integer, optionally with a K or M suffix)");
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string suffix = text.substr(digits);
  std::int64_t mult = 1;
  if (suffix == "k" || suffix == "K") {
    mult = 1024;
  } else if (suffix == "m" || suffix == "M") {
    mult = 1024 * 1024;
  } else {
    SEQPAR_CHECK(suffix.empty(), "--", flag, " ", text,
                 ": not a size (expected a non-negative integer, optionally with a K or M suffix: 4096, 8K, 1M)");
  }
  SEQPAR_CHECK(digits > 0 && digits <= 12, "--", flag, " ", text,
               ": not a size (expected a non-negative integer, optionally with a K or M suffix: 4096, 8K, 1M)");
  return std::stoll(text.substr(0, digits)) * mult;
}

std::optional<SpBenchOptions> parse_sp_bench_options(int argc, char** argv, int world_size, int world_rank) {
  cxxopts::Options spec("sp_bench",
                        "sequence-parallel attention benchmark: mpirun -np N sp_bench [options]\n"
                        "  N must equal dp-size * ulysses-size * ring-size.");
  // clang-format off
  spec.add_options("problem")
    ("attn", "attention kind: mha | dsa | gdn", cxxopts::value<std::string>()->default_value("mha"))
    ("model", "preset of real shapes: llama3-8b (mha) | deepseek-v3.2 (dsa) | qwen3-next (gdn); explicit flags "
              "override it", cxxopts::value<std::string>())
    ("batch", "batch size per data-parallel replica", cxxopts::value<std::int64_t>()->default_value("1"))
    ("seq", "global sequence length (K = 1024, M = 1024^2 suffixes)", cxxopts::value<std::string>()->default_value("4K"))
    ("heads", "query heads", cxxopts::value<std::int64_t>()->default_value("8"))
    ("kv-heads", "key/value heads (GQA; must divide --heads)", cxxopts::value<std::int64_t>()->default_value("8"))
    ("head-dim", "head dimension", cxxopts::value<std::int64_t>()->default_value("64"))
    ("causal", "causal mask (presets turn it on; --causal=false turns it off)",
     cxxopts::value<bool>()->default_value("false")->implicit_value("true"))
    ("window", "sliding window in tokens (0: none; needs --causal)", cxxopts::value<std::int64_t>()->default_value("0"))
    ("topk", "DSA: selected keys per query", cxxopts::value<std::int64_t>()->default_value("2048"))
    ("dim-v", "DSA: value width Dv, the first Dv columns of the latent (0: --head-dim)",
     cxxopts::value<std::int64_t>()->default_value("0"))
    ("indexer-heads", "DSA: indexer heads Hi", cxxopts::value<std::int64_t>()->default_value("64"))
    ("indexer-dim", "DSA: indexer head dim Di", cxxopts::value<std::int64_t>()->default_value("128"))
    ("chunk-size", "GDN: chunk length", cxxopts::value<std::int64_t>()->default_value("64"))
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
    ("gdn-mode", "GDN state passing: chain | scan", cxxopts::value<std::string>()->default_value("chain"))
    ("dsa-select", "DSA top-k selection over the SP group: ring (index keys circulate) | allgather (gathered "
                   "once)", cxxopts::value<std::string>()->default_value("ring"));
  spec.add_options("run")
    ("warmup", "untimed iterations", cxxopts::value<int>()->default_value("2"))
    ("iters", "timed iterations (the median is reported)", cxxopts::value<int>()->default_value("5"))
    ("threads", "OpenMP threads per rank (default: OMP_NUM_THREADS, else 1)", cxxopts::value<int>())
    ("check", "compare every output and gradient with the single-rank reference; non-zero exit when over tolerance")
    ("gdn-compare-token", "GDN: also time the single-rank chunked kernel on the whole problem against the "
                          "token-by-token recurrence (the same kernel with chunk size 1), on rank 0")
    ("efficiency", "also time the whole problem on one rank, alone and with every rank busy: efficiency = "
                   "T1 / (ranks x T)")
    ("json", "write the results as JSON to FILE (rank 0)", cxxopts::value<std::string>())
    ("inputs", "read the full inputs from DIR/<name>.npy (fp32 or fp64, C order)", cxxopts::value<std::string>())
    ("dump", "write the full outputs and gradients to DIR/<name>.npy (rank 0)", cxxopts::value<std::string>())
    ("quiet", "no progress lines")
    ("help", "print this help");
  // clang-format on

  cxxopts::ParseResult r;
  try {
    r = spec.parse(argc, argv);
  } catch (const cxxopts::exceptions::exception& e) {
    SEQPAR_THROW("bad command line: ", e.what(), " (see --help)");
  }
  if (r.count("help")) {
    if (world_rank == 0) std::fputs(spec.help({"problem", "parallel", "run"}).c_str(), stdout);
    return std::nullopt;
  }
  SEQPAR_CHECK(r.unmatched().empty(), "unexpected argument '", r.unmatched().front(),
               "' (every option is a --flag; see --help)");

  SpBenchOptions o;
  o.attn = parse_attn(get_checked<std::string>(r, "attn"));
  if (r.count("model")) {
    o.model = get_checked<std::string>(r, "model");
    const Preset* preset = nullptr;
    for (const Preset& p : kPresets) {
      if (o.model == p.name) preset = &p;
    }
    SEQPAR_CHECK(preset != nullptr, "--model ", o.model,
                 ": unknown preset (expected llama3-8b, deepseek-v3.2 or qwen3-next)");
    if (!r.count("attn")) o.attn = preset->attn;
    SEQPAR_CHECK(o.attn == preset->attn, "--model ", o.model, " is a ", attn_kind_name(preset->attn),
                 " preset; it cannot be combined with --attn ", attn_kind_name(o.attn));
    o.heads = preset->heads;
    o.kv_heads = preset->kv_heads;
    o.head_dim = preset->head_dim;
    if (preset->topk > 0) o.topk = preset->topk;
    if (preset->chunk_size > 0) o.chunk_size = preset->chunk_size;
    if (preset->dim_v > 0) o.dim_v = preset->dim_v;
    if (preset->indexer_heads > 0) o.indexer_heads = preset->indexer_heads;
    if (preset->indexer_dim > 0) o.indexer_dim = preset->indexer_dim;
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
  o.check = r.count("check") > 0;
  o.efficiency = r.count("efficiency") > 0;
  o.gdn_compare_token = r.count("gdn-compare-token") > 0;
  o.quiet = r.count("quiet") > 0;
  if (r.count("json")) o.json_path = get_checked<std::string>(r, "json");
  if (r.count("inputs")) o.inputs_dir = get_checked<std::string>(r, "inputs");
  if (r.count("dump")) o.dump_dir = get_checked<std::string>(r, "dump");
  for (const char* flag : {"json", "inputs", "dump"}) {
    SEQPAR_CHECK(!r.count(flag) || !get_checked<std::string>(r, flag).empty(), "--", flag, " needs a non-empty path");
  }

  // ---- rules ----
  check_min(o.batch, 1, "batch");
  check_min(o.seq, 1, "seq");
  check_min(o.heads, 1, "heads");
  check_min(o.kv_heads, 1, "kv-heads");
  check_min(o.head_dim, 1, "head-dim");
  check_min(o.window, 0, "window");
  check_min(o.topk, 1, "topk");
  check_min(o.chunk_size, 1, "chunk-size");
  check_min(o.warmup, 0, "warmup");
  check_min(o.iters, 1, "iters");
  check_min(o.threads, 1, "threads");
  SEQPAR_CHECK(o.threads <= kMaxThreads, "--threads ", o.threads, " must be <= ", kMaxThreads);
  check_min(o.grid.ulysses_size, 1, "ulysses-size");
  check_min(o.grid.ring_size, 1, "ring-size");
  check_min(o.grid.dp_size, 1, "dp-size");
  SEQPAR_CHECK(o.backend == "mpi" || o.backend == "nccl", "--backend ", o.backend,
               ": unknown communicator backend (expected mpi or nccl)");
  SEQPAR_CHECK(o.gdn_mode == "chain" || o.gdn_mode == "scan", "--gdn-mode ", o.gdn_mode,
               ": unknown mode (expected chain or scan)");
  SEQPAR_CHECK(o.dsa_select == "ring" || o.dsa_select == "allgather", "--dsa-select ", o.dsa_select,
               ": unknown selection mode (expected ring or allgather)");
  SEQPAR_CHECK(!o.gdn_compare_token || o.attn == AttnKind::kGdn, "--gdn-compare-token needs --attn gdn (--attn ",
               attn_kind_name(o.attn), ")");
  SEQPAR_CHECK(o.window == 0 || o.causal, "--window ", o.window, ": a sliding window needs --causal");
  const std::int64_t grid_ranks = static_cast<std::int64_t>(o.grid.dp_size) * o.grid.ulysses_size * o.grid.ring_size;
  SEQPAR_CHECK(grid_ranks == world_size, "--dp-size ", o.grid.dp_size, " x --ulysses-size ", o.grid.ulysses_size,
               " x --ring-size ", o.grid.ring_size, " = ", grid_ranks, " must equal the number of MPI ranks (",
               world_size, ")");
  if (o.attn == AttnKind::kMha) {
    SEQPAR_CHECK(o.heads % o.kv_heads == 0, "--heads ", o.heads, " must be a multiple of --kv-heads ", o.kv_heads,
                 " (GQA)");
    const int pu = o.grid.ulysses_size;
    SEQPAR_CHECK(o.heads % pu == 0, "--heads ", o.heads, " must be divisible by --ulysses-size ", pu);
    SEQPAR_CHECK(o.kv_heads % pu == 0 || pu % o.kv_heads == 0, "--kv-heads ", o.kv_heads,
                 " must divide or be a multiple of --ulysses-size ", pu, " (--heads ", o.heads, ")");
  }
  if (o.attn == AttnKind::kGdn) {
    SEQPAR_CHECK(o.heads % o.grid.ulysses_size == 0, "--heads ", o.heads, " must be divisible by --ulysses-size ",
                 o.grid.ulysses_size);
    SEQPAR_CHECK(o.layout != LayoutKind::kStripe, "--layout stripe: GDN needs contiguous segments (use contiguous or ",
                 "zigzag)");
    SEQPAR_CHECK(o.window == 0, "--window ", o.window, ": GDN has no attention window");
  }
  if (o.attn == AttnKind::kDsa) {
    // DSA is causal by construction (key j is visible to query t iff j <= t); --causal is implied.
    o.causal = true;
    if (o.dim_v == 0) o.dim_v = o.head_dim;
    check_min(o.dim_v, 1, "dim-v");
    check_min(o.indexer_heads, 1, "indexer-heads");
    check_min(o.indexer_dim, 1, "indexer-dim");
    SEQPAR_CHECK(o.dim_v <= o.head_dim, "--dim-v ", o.dim_v, " must be <= --head-dim ", o.head_dim,
                 " (the value is the first Dv columns of the latent)");
    SEQPAR_CHECK(o.heads % o.grid.ulysses_size == 0, "--heads ", o.heads, " must be divisible by --ulysses-size ",
                 o.grid.ulysses_size);
    SEQPAR_CHECK(o.layout != LayoutKind::kStripe, "--layout stripe: DSA under CP supports contiguous and zigzag");
    SEQPAR_CHECK(o.window == 0, "--window ", o.window, ": DSA selects its keys with the indexer (no window)");
  }
  // Layout divisibility (the same rule the library applies, raised here before any communication).
  SequenceLayout(o.layout, o.seq, o.grid.ring_size, o.grid.ulysses_size);
  return o;
}

std::string describe_shapes(const SpBenchOptions& o) {
  if (o.attn == AttnKind::kGdn) {
    return str_cat("B=", o.batch, " S=", o.seq, " H=", o.heads, " K=V=", o.head_dim, " chunk=", o.chunk_size,
                   " mode=", o.gdn_mode, " (causal recurrence)");
  }
  std::string s = str_cat("B=", o.batch, " S=", o.seq, " Hq=", o.heads);
  if (o.attn == AttnKind::kMha) s += str_cat(" Hkv=", o.kv_heads);
  s += str_cat(o.attn == AttnKind::kDsa ? " Dqk=" : " D=", o.head_dim, " causal=", o.causal ? "yes" : "no");
  if (o.window > 0) s += str_cat(" window=", o.window);
  if (o.attn == AttnKind::kDsa) {
    s += str_cat(" Dv=", o.dim_v, " topk=", o.topk, " indexer Hi=", o.indexer_heads, " Di=", o.indexer_dim,
                 " select=", o.dsa_select);
  }
  if (o.attn == AttnKind::kGdn) s += str_cat(" chunk=", o.chunk_size, " mode=", o.gdn_mode);
  return s;
}

}  // namespace seqpar::bench
