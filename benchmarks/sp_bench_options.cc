#include "benchmarks/sp_bench_options.h"

#include <algorithm>
#include <cstdlib>
#include <cxxopts.hpp>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/bench_device.h"
#include "benchmarks/npy.h"
#include "benchmarks/sp_bench_decode.h"
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

// A flag that some kinds list as their own (WorkloadKind::own_flags) means nothing for the others: given with an
// --attn that does not list it, it is an error naming the kinds that take it.
void check_kinds_own_flags(const SpBenchOptions& o) {
  std::vector<std::pair<std::string, std::string>> owners;  // (flag, "--attn a or --attn b")
  for (const WorkloadKind& k : workload_kinds()) {
    for (const std::string& flag : k.own_flags) {
      auto it = std::find_if(owners.begin(), owners.end(), [&](const auto& e) { return e.first == flag; });
      if (it == owners.end()) it = owners.insert(owners.end(), {flag, ""});
      it->second += str_cat(it->second.empty() ? "" : " or ", "--attn ", k.name);
    }
  }
  const std::vector<std::string>& mine = find_workload_kind(o.attn).own_flags;
  for (const auto& [flag, kinds] : owners) {
    SEQPAR_CHECK(!o.given(flag) || std::find(mine.begin(), mine.end(), flag) != mine.end(), "--", flag, " needs ",
                 kinds, " (--attn ", o.attn, ")");
  }
}

// --inputs: each shape flag of the kind is read from its file (its dimension `dim` of <dir>/<tensor>.npy) when it was
// not given; a given one must match the file. The full shapes are checked again when the files are read.
void shapes_from_inputs(const WorkloadKind& kind, SpBenchOptions& o) {
  std::vector<std::pair<std::string, npy::Header>> headers;
  for (const WorkloadKind::InputShapeFlag& f : kind.input_shape_flags) {
    auto it = std::find_if(headers.begin(), headers.end(), [&](const auto& h) { return h.first == f.tensor; });
    const std::string path = (std::filesystem::path(o.inputs_dir) / (f.tensor + ".npy")).string();
    // --mode decode reads no training-only array (DSA's dout, which carries --dim-v): its flag stays as given.
    if (o.decode.mode == "decode" && f.tensor == "dout") continue;
    if (f.optional_file && !std::filesystem::exists(path)) {
      SEQPAR_CHECK(!o.given(f.flag) || o.*f.field == 0, "--", f.flag, " ", o.*f.field, " needs --inputs ", path,
                   ", which does not exist (leave --", f.flag, " out to run without ", f.tensor, ")");
      o.*f.field = 0;
      continue;
    }
    if (it == headers.end()) it = headers.insert(headers.end(), {f.tensor, npy::read_header(path)});
    const Shape& shape = it->second.shape;
    SEQPAR_CHECK(f.dim < static_cast<int>(shape.size()), path, ": shape ", shape_str(shape), " has no dimension ",
                 f.dim, " (--", f.flag, " of --attn ", kind.name, ")");
    if (!o.given(f.flag)) {
      o.*f.field = shape[f.dim];
      continue;
    }
    SEQPAR_CHECK(o.*f.field == shape[f.dim], "--", f.flag, " ", o.*f.field, " does not match --inputs: ", path,
                 " has shape ", shape_str(shape), " (dimension ", f.dim, " is ", shape[f.dim], "); leave --", f.flag,
                 " out to take it from the file");
  }
}

// Packed rows: --doc-lens, --doc-dist or --inputs DIR/cu_seqlens.npy (at most one), then their rules.
void parse_packing(const cxxopts::ParseResult& r, SpBenchOptions& o) {
  const std::filesystem::path cu_file = std::filesystem::path(o.inputs_dir) / "cu_seqlens.npy";
  const bool from_file = !o.inputs_dir.empty() && std::filesystem::exists(cu_file);
  const int sources = static_cast<int>(r.count("doc-lens") > 0) + static_cast<int>(r.count("doc-dist") > 0) +
                      static_cast<int>(r.count("cu-seqlens") > 0) + static_cast<int>(from_file);
  SEQPAR_CHECK(sources <= 1, "--doc-lens, --cu-seqlens, --doc-dist and --inputs DIR/cu_seqlens.npy each describe the ",
               "packed row; give one");
  if (sources == 0) return;
  const char* source = r.count("doc-lens")     ? "--doc-lens"
                       : r.count("cu-seqlens") ? "--cu-seqlens"
                       : r.count("doc-dist")   ? "--doc-dist"
                                               : "cu_seqlens.npy";
  if (r.count("cu-seqlens")) {
    // The offsets 0, l1, l1 + l2, ..., S: checked by the layout's cu_seqlens rules, then taken as --doc-lens.
    const std::string text = get_checked<std::string>(r, "cu-seqlens");
    std::vector<std::int64_t> values;
    for (std::size_t begin = 0; begin <= text.size();) {
      const std::size_t end = std::min(text.find(',', begin), text.size());
      values.push_back(parse_size(text.substr(begin, end - begin), "cu-seqlens"));
      begin = end + 1;
    }
    try {
      (void)SequenceLayout::packed(LayoutKind::kContiguous, values, 1);
    } catch (const Error& e) {
      SEQPAR_THROW("--cu-seqlens ", text, ": ", e.message());
    }
    for (std::size_t i = 1; i < values.size(); ++i) o.doc_lens.push_back(values[i] - values[i - 1]);
  } else if (r.count("doc-lens")) {
    const std::string text = get_checked<std::string>(r, "doc-lens");
    for (std::size_t begin = 0; begin <= text.size();) {
      const std::size_t end = std::min(text.find(',', begin), text.size());
      o.doc_lens.push_back(parse_size(text.substr(begin, end - begin), "doc-lens"));
      begin = end + 1;
    }
  } else if (r.count("doc-dist")) {
    o.doc_dist = get_checked<std::string>(r, "doc-dist");
    o.doc_lens = synthetic_doc_lens(o.doc_dist, o.seq, o.seed);
  } else {
    const npy::HostArray cu = npy::read(cu_file.string());
    SEQPAR_CHECK((cu.dtype == DType::kInt64 || cu.dtype == DType::kInt32) && cu.shape.size() == 1, cu_file.string(),
                 ": cu_seqlens must be a 1-d int32 or int64 array [N+1], got ", dtype_name(cu.dtype), " ",
                 shape_str(cu.shape));
    std::vector<std::int64_t> values(static_cast<std::size_t>(cu.numel()));
    for (std::int64_t i = 0; i < cu.numel(); ++i) {
      values[i] =
          cu.dtype == DType::kInt64 ? cu.view().data_as<std::int64_t>()[i] : cu.view().data_as<std::int32_t>()[i];
    }
    try {
      (void)SequenceLayout::packed(LayoutKind::kContiguous, values, 1);  // the cu_seqlens rules
    } catch (const Error& e) {
      SEQPAR_THROW(cu_file.string(), ": ", e.message());
    }
    for (std::size_t i = 1; i < values.size(); ++i) o.doc_lens.push_back(values[i] - values[i - 1]);
    SEQPAR_CHECK(values.back() == o.seq, cu_file.string(), ": cu_seqlens ends at ", values.back(),
                 " tokens, but the inputs hold S = ", o.seq, " (dimension 1 of q)");
  }
  std::int64_t total = 0;
  for (std::int64_t len : o.doc_lens) total += len;
  SEQPAR_CHECK(total >= 1, source, ": the documents hold ", total, " tokens; a packed row needs at least one");
  SEQPAR_CHECK((!r.count("doc-lens") && !r.count("cu-seqlens")) || !o.given("seq") || o.seq == total, "--seq ", o.seq,
               " does not match ", source, ", whose lengths sum to ", total, "; leave --seq out");
  o.seq = total;
  SEQPAR_CHECK(o.batch == 1, "--batch ", o.batch, ": a packed row (", source, ") takes --batch 1");
}

// The RoPE flags (MHA and DSA; parsed by parse_rope).
void add_rope_flags(cxxopts::Options& spec) {
  // clang-format off
  spec.add_options("problem")
    ("rope", "RoPE around the layer on the layout's global positions: none | rotate-half | interleaved (MHA: q and k; "
             "DSA: the last --rope-dim columns of q and the latent with this pairing, the first of the indexer's q "
             "and k rotate-half, as DeepSeek-V3.2; default none, presets set it)", cxxopts::value<std::string>())
    ("rope-dim", "rotated columns r (partial rotary; MHA default: all of --head-dim, DSA: 64)",
     cxxopts::value<std::int64_t>())
    ("rope-theta", "RoPE base theta (default 10000)", cxxopts::value<double>())
    ("rope-scaling", "RoPE frequency scaling: none | llama3 | yarn", cxxopts::value<std::string>())
    ("rope-factor", "llama3 / yarn scaling factor", cxxopts::value<double>())
    ("rope-original-max-pos", "llama3 / yarn original_max_position_embeddings", cxxopts::value<std::int64_t>());
  // clang-format on
}

// RoPE (sp_bench_rope.h): the preset's configuration, then the --rope* flags given. --rope-factor and
// --rope-original-max-pos set the llama3 and the yarn parameter alike; the others of each scaling stay at the
// model's values (llama3: Llama 3.1's low 1, high 4; yarn: DeepSeek-V3's beta_fast 32, beta_slow 1).
// A kind that does not own the flags is left to the ownership rule (its error names the kinds that apply RoPE).
void parse_rope(const cxxopts::ParseResult& r, const std::optional<attn::RopeConfig>& preset, SpBenchOptions& o) {
  const std::vector<std::string>& own = find_workload_kind(o.attn).own_flags;
  if (std::find(own.begin(), own.end(), "rope") == own.end()) return;
  if (preset) {
    o.rope = true;
    o.rope_cfg = *preset;
  }
  if (r.count("rope")) {
    const std::string v = get_checked<std::string>(r, "rope");
    o.rope = v != "none";
    if (o.rope) {
      o.rope_cfg.pairing = parse_flag("rope", v, [](const std::string& s) { return attn::parse_rope_pairing(s); });
    }
  }
  attn::RopeConfig& c = o.rope_cfg;
  if (r.count("rope-dim")) c.rotary_dim = get_checked<std::int64_t>(r, "rope-dim");
  if (r.count("rope-theta")) c.theta = get_checked<double>(r, "rope-theta");
  if (r.count("rope-scaling")) {
    c.scaling = parse_flag("rope-scaling", get_checked<std::string>(r, "rope-scaling"),
                           [](const std::string& s) { return attn::parse_rope_scaling(s); });
  }
  if (r.count("rope-factor")) c.llama3.factor = c.yarn.factor = get_checked<double>(r, "rope-factor");
  if (r.count("rope-original-max-pos")) {
    c.llama3.original_max_position_embeddings = c.yarn.original_max_position_embeddings =
        get_checked<std::int64_t>(r, "rope-original-max-pos");
  }
  for (const char* flag : {"rope-dim", "rope-theta", "rope-scaling", "rope-factor", "rope-original-max-pos"}) {
    SEQPAR_CHECK(o.rope || !r.count(flag), "--", flag, " needs --rope rotate-half or interleaved");
  }
  if (o.rope) {
    try {
      c.validate();
    } catch (const Error& e) {
      SEQPAR_THROW("RoPE flags (--rope*): ", e.message());
    }
  }
}

}  // namespace

// Every flag of sp_bench, registered in --help's order: the common ones (here), each kind's own (add_mha_flags,
// add_dsa_flags, add_gdn_flags in its sp_bench_<kind>.cc), RoPE's (add_rope_flags) and --mode decode's
// (sp_bench_decode.cc).
void add_sp_bench_flags(cxxopts::Options& spec) {
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
    ("causal", "causal mask; off by default (--attn mha runs non-causal, unlike Python's MhaCp, causal=True), "
               "presets turn it on, --causal=false turns it off",
     cxxopts::value<bool>()->default_value("false")->implicit_value("true"))
    ("window", "sliding window in tokens (0: none; needs --causal)", cxxopts::value<std::int64_t>()->default_value("0"));
  // clang-format on
  add_mha_flags(spec, FlagGroup::kProblem);
  add_dsa_flags(spec, FlagGroup::kProblem);
  add_gdn_flags(spec, FlagGroup::kProblem);
  add_rope_flags(spec);
  // clang-format off
  spec.add_options("problem")
    ("doc-lens", "a packed row of documents with these comma-separated lengths (their sum is --seq, --batch 1; "
                 "zero-length documents allowed)", cxxopts::value<std::string>())
    ("cu-seqlens", "the same packed row as comma-separated offsets 0,l1,l1+l2,...,S (cu_seqlens; taken as "
                   "--doc-lens)", cxxopts::value<std::string>())
    ("doc-dist", "a packed row of --seq tokens in synthetic documents drawn with --seed: longtail (lengths "
                 "log-uniform in 64..16384) | short (log-uniform in 1..256)", cxxopts::value<std::string>())
    ("dtype", "storage dtype: fp32 | bf16 | fp16 | fp64", cxxopts::value<std::string>()->default_value("fp32"))
    ("seed", "seed of the random inputs", cxxopts::value<std::uint64_t>()->default_value("1234"));
  spec.add_options("parallel")
    ("backend", "communicator backend: mpi | nccl (nccl needs --device cuda, one CUDA device per rank)",
     cxxopts::value<std::string>()->default_value("mpi"))
    ("ulysses-size", "Ulysses (all-to-all) degree Pu", cxxopts::value<int>()->default_value("1"))
    ("ring-size", "ring degree Pr", cxxopts::value<int>()->default_value("1"))
    ("dp-size", "data-parallel replicas", cxxopts::value<int>()->default_value("1"))
    ("placement", "ulysses_inner | ring_inner", cxxopts::value<std::string>()->default_value("ulysses_inner"))
    ("layout", "contiguous | zigzag | stripe | balanced (packed rows: whole chunks of documents, equal causal "
               "work per ring rank)", cxxopts::value<std::string>()->default_value("zigzag"));
  // clang-format on
  add_mha_flags(spec, FlagGroup::kParallel);
  add_gdn_flags(spec, FlagGroup::kParallel);
  add_dsa_flags(spec, FlagGroup::kParallel);
  // clang-format off
  spec.add_options("run")
    ("warmup", "untimed iterations", cxxopts::value<int>()->default_value("2"))
    ("iters", "timed iterations (the median is reported)", cxxopts::value<int>()->default_value("5"))
    ("threads", "OpenMP threads per rank (default: OMP_NUM_THREADS, else 1)", cxxopts::value<int>())
    ("device", "cpu | cuda | cuda:N: where each rank's tensors live (cuda: a build with CUDA, --attn mha; dropout, "
               "ALiBi, sinks and soft-capping take the exact cuBLAS fallback; --mode decode without --chunk; with "
               "--backend nccl each rank's own GPU)",
     cxxopts::value<std::string>()->default_value("cpu"))
    ("check", "compare every output and gradient with the single-rank reference; non-zero exit when over tolerance")
    ("check-against", "what --check compares with (implies --check): 1-rank (the single-rank kernel, then the fp64 "
                      "reference where that fails) | reference (the fp64 reference, for sizes that fit)",
     cxxopts::value<std::string>()->default_value("1-rank"));
  // clang-format on
  add_gdn_flags(spec, FlagGroup::kRun);
  // clang-format off
  spec.add_options("run")
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
  add_decode_options(spec);  // --mode decode and its flags (benchmarks/sp_bench_decode.h)
}

namespace {

// --model: the preset's shapes (and RoPE, returned) set on `o` before the flags; a preset of another kind than --attn
// is refused.
std::optional<attn::RopeConfig> apply_model_preset(const cxxopts::ParseResult& r, SpBenchOptions& o) {
  std::optional<attn::RopeConfig> preset_rope;
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
    preset_rope = preset->rope;
    if (preset->softcap > 0) o.softcap = preset->softcap;
    o.sinks = preset->sinks;
    o.causal = true;
  }
  return preset_rope;
}

// The problem's flags: shapes (a preset's unless given), the kinds' own, RoPE, dropout, dtype and seed.
void parse_problem_flags(const cxxopts::ParseResult& r, const std::optional<attn::RopeConfig>& preset_rope,
                         SpBenchOptions& o) {
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
  parse_rope(r, preset_rope, o);
  if (given("softcap")) o.softcap = get_checked<double>(r, "softcap");
  if (given("sinks")) o.sinks = r.count("sinks") > 0;
  o.alibi = r.count("alibi") > 0;

  o.batch = get_checked<std::int64_t>(r, "batch");
  o.seq = parse_size(get_checked<std::string>(r, "seq"), "seq");
  o.window = get_checked<std::int64_t>(r, "window");
  // read as text: cxxopts refuses "nan" before the rule could name it
  o.dropout = parse_flag("dropout", get_checked<std::string>(r, "dropout"), [](const std::string& v) {
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    SEQPAR_CHECK(!v.empty() && end == v.c_str() + v.size(), "not a number");
    return x;
  });
  o.dropout_seed = get_checked<std::uint64_t>(r, "dropout-seed");
  const std::string dtype = get_checked<std::string>(r, "dtype");
  o.dtype = parse_flag("dtype", dtype, [](const std::string& v) { return parse_dtype(v); });
  SEQPAR_CHECK(is_floating(o.dtype), "--dtype ", dtype, ": must be fp32, bf16, fp16 or fp64");
  o.seed = get_checked<std::uint64_t>(r, "seed");
}

// The grid, the run's flags (threads: --threads, else OMP_NUM_THREADS, else 1), --check and the output paths.
// --device cuda (the option's value d, before the device itself is looked up, so that a build or machine without
// CUDA names these rules too): what runs on a CUDA device, refused here (every rank, before any message) otherwise. The
// MHA CP layers and MHA decode (but not its chunk prefill) take device tensors; the DSA and GDN CP layers run their
// kernels on the host; the MHA CUDA path (attention/cuda/mha_cuda.h) runs dropout, ALiBi, sinks and soft-capping on
// its exact fallback, RoPE on the device (attention/rope.h).
void check_device_rules(const std::string& d, const SpBenchOptions& o) {
  if (d == "cpu") return;
  SEQPAR_CHECK(o.attn == "mha", "--device ", d, " with --attn ", o.attn, ": the ", o.attn,
               " CP layers run their kernels on the host only (no CUDA implementation yet); --device cuda takes "
               "--attn mha");
  SEQPAR_CHECK(o.decode.mode != "decode" || o.decode.chunk == 0, "--device ", d,
               " with --mode decode --chunk ", o.decode.chunk,
               ": a persistent-cache prefill (MhaDecodeCp::extend) runs on the host only (no CUDA implementation yet); "
               "drop --chunk");
}

void parse_parallel_and_run_flags(const cxxopts::ParseResult& r, SpBenchOptions& o) {
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
  const bool check_flag = r.count("check") > 0 && r["check"].as<bool>();  // --check=false: no check
  SEQPAR_CHECK(check_flag || r.count("check") == 0 || r.count("check-against") == 0, "--check-against ",
               r["check-against"].as<std::string>(), " implies --check, but --check=false was given");
  o.check = check_flag || r.count("check-against") > 0;
  o.check_against = get_checked<std::string>(r, "check-against");
  SEQPAR_CHECK(o.check_against == "1-rank" || o.check_against == "reference", "--check-against '", o.check_against,
               "' is not one of 1-rank, reference");
  check_device_rules(get_checked<std::string>(r, "device"), o);  // what a device cannot run, in any build
  o.device = bench::parse_bench_device(get_checked<std::string>(r, "device"));
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
}

// The rules on the parsed options: every count in range, the grid against the world (no_grid: no grid flag at all,
// parse_sp_bench_options), then the kind's own.
void check_rules(const WorkloadKind& kind, int world_size, const std::string& no_grid, SpBenchOptions& o) {
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
  check_kinds_own_flags(o);
  if (!no_grid.empty()) {
    const std::pair<const char*, int> grid_flags[] = {
        {"ulysses-size", o.grid.ulysses_size}, {"ring-size", o.grid.ring_size}, {"dp-size", o.grid.dp_size}};
    for (const auto& [flag, value] : grid_flags) {
      SEQPAR_CHECK(std::find(o.given_flags.begin(), o.given_flags.end(), flag) == o.given_flags.end(), "--", flag, " ",
                   value, " ", no_grid);
    }
  }
  const std::int64_t grid_ranks = static_cast<std::int64_t>(o.grid.dp_size) * o.grid.ulysses_size * o.grid.ring_size;
  SEQPAR_CHECK(grid_ranks == world_size, "--dp-size ", o.grid.dp_size, " x --ulysses-size ", o.grid.ulysses_size,
               " x --ring-size ", o.grid.ring_size, " = ", grid_ranks, " must equal the number of MPI ranks (",
               world_size, ")");
  if (kind.validate) kind.validate(o);
  // After the kind's rules: DSA implies --causal (its window limits the indexer's candidates), GDN refuses a window.
  // --mode decode is causal whatever --causal says: its own rules (run_decode_bench) name what it refuses.
  SEQPAR_CHECK(o.window == 0 || o.causal || o.decode.mode == "decode", "--window ", o.window,
               ": a sliding window needs --causal");
}

}  // namespace

std::optional<SpBenchOptions> parse_sp_bench_options(int argc, char** argv, int world_size, int world_rank,
                                                     const std::string& no_grid) {
  cxxopts::Options spec("sp_bench",
                        "sequence-parallel attention benchmark: mpirun -np N sp_bench [options]\n"
                        "  N must equal dp-size * ulysses-size * ring-size.");
  add_sp_bench_flags(spec);
  const std::optional<cxxopts::ParseResult> parsed =
      parse_command_line(spec, argc, argv, world_rank, {"problem", "parallel", "run", "decode"});
  if (!parsed) return std::nullopt;
  const cxxopts::ParseResult& r = *parsed;

  SpBenchOptions o;
  o.decode = parse_decode_options(r);
  for (const cxxopts::KeyValue& kv : r.arguments()) o.given_flags.push_back(kv.key());
  o.attn = find_workload_kind(get_checked<std::string>(r, "attn")).name;
  const std::optional<attn::RopeConfig> preset_rope = apply_model_preset(r, o);
  parse_problem_flags(r, preset_rope, o);
  parse_parallel_and_run_flags(r, o);

  const WorkloadKind& kind = find_workload_kind(o.attn);
  if (!o.inputs_dir.empty()) shapes_from_inputs(kind, o);
  decode_shapes_from_inputs(o);               // --mode decode --inputs: --context and --decode-steps
  if (o.kv_heads == 0) o.kv_heads = o.heads;  // --kv-heads 0 (the default): as many as --heads
  check_min(o.seq, 1, "seq");
  parse_packing(r, o);

  check_rules(kind, world_size, no_grid, o);
  return o;
}

void check_backend_rules(const SpBenchOptions& o) {
  SEQPAR_CHECK(o.backend != "nccl" || !o.device.is_cpu(), "--backend nccl with --device ", o.device.str(),
               ": NCCL communicates device buffers only, so --backend nccl needs --device cuda (or cuda:N, --attn "
               "mha); for host tensors use --backend mpi");
}

void check_options_agree(const SpBenchOptions& o) {
  // --mode, --backend and --inputs first: the error names the first field that differs, and a rank with another mode,
  // backend or input files differs in what follows them too (the shapes --inputs gives, the flags a mode reads).
  const DecodeOptions& d = o.decode;
  const bool decode = d.mode == "decode";
  Fingerprint fp = options_fingerprint_start("sp_bench");
  fp.add_text("--mode", d.mode)
      .add_text("--backend", o.backend)
      .add_text("--inputs", o.inputs_dir.empty() ? "(none)" : o.inputs_dir)
      .add_text("--attn", o.attn)
      .add_text("--model", o.model)
      .add_int("--dp-size", o.grid.dp_size)
      .add_int("--ulysses-size", o.grid.ulysses_size)
      .add_int("--ring-size", o.grid.ring_size)
      .add_text("--placement", placement_name(o.grid.placement))
      .add_text("--layout", layout_name(o.layout))
      .add_text("--impl", ring_impl_name(o.impl))
      .add_text("--gdn-mode", o.gdn_mode)
      .add_text("--dsa-select", o.dsa_select)
      .add_int("--batch", o.batch)
      .add_text("--seq", decode ? "(not read by --mode decode)" : std::to_string(o.seq))
      .add_text("--doc-lens", doc_lens_text(o))
      .add_int("--heads", o.heads)
      .add_int("--kv-heads", o.kv_heads)
      .add_int("--head-dim", o.head_dim)
      .add_flag("--causal", o.causal)
      .add_int("--window", o.window)
      .add_int("--topk", o.topk)
      .add_int("--dim-v", o.dim_v)
      .add_int("--indexer-heads", o.indexer_heads)
      .add_int("--indexer-dim", o.indexer_dim)
      .add_int("--chunk-size", o.chunk_size)
      .add_int("--conv-width", o.conv_width)
      .add_real("--softcap", o.softcap)
      .add_flag("--alibi", o.alibi)
      .add_flag("--sinks", o.sinks)
      .add_real("--dropout", o.dropout)
      .add_text("--dropout-seed", std::to_string(o.dropout_seed))
      .add_text("--rope", o.rope ? attn::rope_pairing_name(o.rope_cfg.pairing) : "none")
      .add_int("--rope-dim", o.rope_cfg.rotary_dim)
      .add_real("--rope-theta", o.rope_cfg.theta)
      .add_text("--rope-scaling", attn::rope_scaling_name(o.rope_cfg.scaling))
      .add_real("--rope-factor",
                o.rope_cfg.scaling == attn::RopeScaling::kYarn ? o.rope_cfg.yarn.factor : o.rope_cfg.llama3.factor)
      .add_int("--rope-original-max-pos", o.rope_cfg.scaling == attn::RopeScaling::kYarn
                                              ? o.rope_cfg.yarn.original_max_position_embeddings
                                              : o.rope_cfg.llama3.original_max_position_embeddings)
      .add_text("--dtype", dtype_name(o.dtype))
      .add_int("--warmup", o.warmup)
      .add_int("--iters", o.iters)
      .add_int("--threads", o.threads)
      .add_text("--seed", std::to_string(o.seed))
      .add_flag("--check", o.check)
      .add_text("--check-against", o.check_against)
      .add_flag("--efficiency", o.efficiency)
      .add_flag("--dump-inputs", o.dump_inputs)
      .add_flag("--dry-run", o.dry_run)
      .add_real("--test-mem-available-mib", o.test_mem_available_mib)
      .add_flag("--gdn-compare-token", o.gdn_compare_token)
      .add_text("--test-corrupt", o.test_corrupt)
      .add_int("--test-fail-write-after", o.test_fail_write_after)
      .add_real("--test-logit-scale", o.test_logit_scale)
      // --mode decode's flags (their defaults under --mode train, which refuses them). --dump is compared in both
      // modes: the ranks gather the outputs (train) or collect the outputs of their steps (decode) only when given.
      .add_int("--context", d.context)
      .add_int("--decode-steps", d.decode_steps)
      .add_int("--new-tokens", d.new_tokens)
      .add_text("--cache-shard", d.cache_shard)
      .add_int("--interleave", d.interleave)
      .add_text("--prefill", d.prefill)
      .add_int("--chunk", d.chunk)
      .add_text("--chunk-mode", d.chunk_mode)
      .add_text("--dump", o.dump_dir.empty() ? "(none)" : o.dump_dir)
      // The library's layers require one mode on every rank (they cannot see a mismatch without paying the check).
      .add_text("SEQPAR_AGREEMENT_CHECK", agreement_mode_name(agreement_mode()));
  check_ranks_agree(fp);
}

std::string preset_note(const SpBenchOptions& o, const std::string& flag) {
  return o.model.empty() || o.given(flag) ? std::string() : str_cat(" (from --model ", o.model, ")");
}

std::string describe_shapes(const SpBenchOptions& o) { return find_workload_kind(o.attn).describe_shapes(o); }

std::string doc_lens_text(const SpBenchOptions& o) {
  std::string s;
  for (std::size_t i = 0; i < o.doc_lens.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(o.doc_lens[i]);
  }
  return s;
}

SequenceLayout sp_bench_layout(const SpBenchOptions& o) {
  if (!o.packed()) return SequenceLayout(o.layout, o.seq, o.grid.ring_size, o.grid.ulysses_size);
  return SequenceLayout::packed(o.layout, cu_seqlens_of(o.doc_lens), o.grid.ring_size, o.grid.ulysses_size);
}

std::int64_t sp_bench_padded_len(const SpBenchOptions& o) {
  // The padding rules of parallel/layout.cc in closed form for the kinds that have one, so that the memory estimate
  // (--dry-run) of a sequence too long for this node builds no layout (a layout holds padded_len int64 positions).
  const std::int64_t P = o.grid.ring_size, U = o.grid.ulysses_size;
  const auto round_up = [](std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; };
  if (o.layout == LayoutKind::kContiguous || o.layout == LayoutKind::kStripe) return round_up(o.seq, P * U);
  if (o.layout == LayoutKind::kZigzag) {
    const std::int64_t unit = P == 1 ? 1 : 2 * P;  // a ring of one pads no document
    std::int64_t docs_end = 0;
    if (o.packed()) {
      for (const std::int64_t len : o.doc_lens) docs_end += round_up(len, unit);
    } else {
      docs_end = round_up(o.seq, unit);
    }
    return docs_end + P * ((U - (docs_end / P) % U) % U);
  }
  return sp_bench_layout(o).padded_len();  // balanced: the chunk assignment decides
}

}  // namespace seqpar::bench
