// sp_bench command line: parsing (cxxopts), model presets and validation.
//
// Every check here is local arithmetic on the flags and the world size, so that a bad flag fails on every rank with
// the same message before any communication (validation at the boundary, before any communication).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attention/rope.h"
#include "benchmarks/bench_common.h"
#include "benchmarks/sp_bench_decode.h"
#include "parallel/layout.h"
#include "parallel/ring_attention.h"
#include "runtime/dtype.h"
#include "runtime/cp_grid.h"

namespace seqpar::bench {

struct SpBenchOptions {
  std::string attn = "mha";  // a registered WorkloadKind name (sp_bench_workload.h)
  CpGridConfig grid;
  LayoutKind layout = LayoutKind::kZigzag;
  RingImpl impl = RingImpl::kP2P;
  std::string backend = "mpi";  // communicator backend: mpi | nccl
  Device device;                // --device: cpu, or cuda / cuda:N for --attn mha (check_device_rules)
  std::string gdn_mode = "scan";
  std::string dsa_select = "ring";  // DSA top-k selection over the CP group: ring | allgather
  std::string model;                // preset name, empty when none

  std::int64_t batch = 1;
  std::int64_t seq = 4096;
  // A packed row (docs/design.md, "Packed rows and padding"): the document lengths from --doc-lens, --doc-dist (with --seed) or
  // --inputs DIR/cu_seqlens.npy; empty: one unpacked row. When set, seq is their sum and batch is 1.
  std::vector<std::int64_t> doc_lens;
  std::string doc_dist;  // --doc-dist NAME (parallel/layout.h synthetic_doc_lens), empty when not given
  bool packed() const { return !doc_lens.empty(); }
  std::int64_t heads = 8;     // query heads (DSA: attention heads; GDN: value heads Hv)
  std::int64_t kv_heads = 8;  // MHA kv heads (GQA); GDN key heads Hk (q, k); the flag's 0 means --heads
  std::int64_t head_dim = 64;
  bool causal = false;
  std::int64_t window = 0;
  double softcap = 0;               // MHA: logit soft-capping cap (0: none)
  bool alibi = false;               // MHA: ALiBi biases with the slopes of attn::alibi_slopes(heads)
  bool sinks = false;               // MHA: random learned attention sinks per query head (output dsinks)
  double dropout = 0;               // MHA: drop probability of the attention probabilities (attention/dropout.h)
  std::uint64_t dropout_seed = 0;   // MHA: the dropout generator's seed
  std::int64_t topk = 2048;         // DSA
  std::int64_t dim_v = 0;           // value width: DSA Dv (first Dv latent columns), GDN V; 0: --head-dim
  std::int64_t indexer_heads = 64;  // DSA indexer heads Hi
  std::int64_t indexer_dim = 128;   // DSA indexer head dim Di
  std::int64_t chunk_size = 64;     // GDN
  std::int64_t conv_width = 0;      // GDN: short conv width W on q, k, v before the recurrence; 0: none
  DType dtype = DType::kFloat32;
  // RoPE around the layer (benchmarks/sp_bench_rope.h; MHA and DSA): on with --rope rotate-half | interleaved or a
  // preset that has one. rope_cfg.rotary_dim is --rope-dim (0: the kind's default).
  bool rope = false;
  attn::RopeConfig rope_cfg;

  int warmup = 2;
  int iters = 5;
  int threads = 1;
  std::uint64_t seed = 1234;

  bool check = false;
  // --check-against: "1-rank" (the one-rank kernel, then the fp64 rule where it fails) or "reference" (the fp64
  // references of attention/reference for every tensor they define; sizes that fit only). Implies --check.
  std::string check_against = "1-rank";
  bool efficiency = false;
  bool gdn_compare_token = false;  // GDN: also time the single-rank chunked kernel against chunk_size 1
  std::string json_path;
  std::string inputs_dir;
  std::string dump_dir;
  bool dump_inputs = false;              // --dump also writes the full inputs, as --inputs reads them
  bool quiet = false;                    // no progress lines
  bool dry_run = false;                  // print the memory estimate and exit
  std::vector<std::string> given_flags;  // the flags given on the command line (a kind's rules on explicit flags)
  bool given(const std::string& flag) const {
    return std::find(given_flags.begin(), given_flags.end(), flag) != given_flags.end();
  }

  // Test hooks (hidden from --help; the tests in tests/mpi/CMakeLists.txt use them):
  std::string test_corrupt;                 // --test-corrupt NAME: perturb the gathered tensor NAME before the check
  std::int64_t test_fail_write_after = -1;  // --test-fail-write-after N: every output file fails after N bytes
  double test_logit_scale = 1;              // --test-logit-scale X (MHA): random q times X, logits times X
  double test_mem_available_mib = 0;        // --test-mem-available-mib N: the node's available memory (0: real)

  DecodeOptions decode;  // --mode decode and its flags (benchmarks/sp_bench_decode.h)
};

// Parses argv. Returns std::nullopt after printing the help on rank 0 (--help). Throws Error (same text on every
// rank) for unknown flags, malformed values and any rule violation, including a grid that does not match
// `world_size` (the number of MPI ranks). `no_grid` not empty: argv is a problem without a grid, for a program that
// chooses the grid itself (sp_plan's flags after "--", the problem flags of a dyncp_bench plan; world_size 1), and
// a grid flag given (--ulysses-size, --ring-size, --dp-size) is refused: "--ring-size 3 " + no_grid, which says
// where the flag was and why it has no place there.
std::optional<SpBenchOptions> parse_sp_bench_options(int argc, char** argv, int world_size, int world_rank,
                                                     const std::string& no_grid = {});

// Collective over MPI_COMM_WORLD (check_ranks_agree of bench_common.h over the options' fingerprint): every rank must
// have parsed the same options (mpirun may start ranks with different command lines). Throws Error, the same on
// every rank, naming the first flag that differs and its value on each rank (--mode, --backend and --inputs first).
// --json is not compared (rank 0 alone writes it). sp_bench calls it right after parsing, before any other
// collective: with every flag and the mode and backend agreed, all ranks then run the same sequence of collectives.
void check_options_agree(const SpBenchOptions& o);

// The backend's rules on the agreed options (sp_bench calls it right after check_options_agree, so that ranks started
// with other flags stop at the agreement first): --backend nccl takes device buffers only, so it needs --device cuda.
// Throws Error, the same on every rank, before any other message; --dry-run refuses it too. Host-only, no collective.
void check_backend_rules(const SpBenchOptions& o);

// " (from --model NAME)" when the value of `flag` (without "--") came from the --model preset, else "": for error
// messages that name a value the user did not type.
std::string preset_note(const SpBenchOptions& o, const std::string& flag);

// One-line configuration summary used in the table header (the kind's describe_shapes).
std::string describe_shapes(const SpBenchOptions& o);

// The layout of the run (local arithmetic): packed over cu_seqlens_of(o.doc_lens) when o.packed(), else one row of
// o.seq tokens; --layout over --ring-size x --ulysses-size.
SequenceLayout sp_bench_layout(const SpBenchOptions& o);
// Slots of that layout (padded_len): the rows the distributed step allocates, padding included (o.seq when nothing
// is padded). Local arithmetic.
std::int64_t sp_bench_padded_len(const SpBenchOptions& o);
// The document lengths joined by commas ("" when not packed), as --doc-lens takes them.
std::string doc_lens_text(const SpBenchOptions& o);

}  // namespace seqpar::bench
