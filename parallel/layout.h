// Sequence layouts: which tokens each rank of a (ring x Ulysses) group holds, for one row of S tokens or one packed
// row of documents.
// Math: docs/design.md, "Sequence layouts" (slot space, the contiguous, stripe and zigzag kinds, the SP-rank order),
// "Packed rows and padding", "The balanced partitioner" (chunks, the greedy assignment, the step-balancing local
// search, flop_imbalance and step_imbalance).
//
// Positions are increasing SLOT positions in [0, padded_len()); a padding slot carries no token (token_index() =
// -1). Inside a document a slot difference is a token distance. Without padding, slots are tokens.
// Memory: a layout holds every ring shard's slots (padded_len int64), built once and shared by copies.
// The cu_seqlens rules (raised identically on every rank, before any communication, naming the index, value and
// rule): at least 2 entries, starting at 0, no negative value, non-decreasing, ending at T >= 1.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "../runtime/comm.h"
#include "../runtime/tensor.h"
#include "cp_common.h"

namespace seqpar {

// How slots are dealt to ranks (docs/design.md, "Sequence layouts").
enum class LayoutKind : std::uint8_t { kContiguous, kZigzag, kStripe, kBalanced };

// Names ("contiguous", "zigzag", "stripe", "balanced") and their parser.
// Errors: the parser, for another name.
// Sync: host-only.
const char* layout_name(LayoutKind kind);
LayoutKind parse_layout(std::string_view name);

// Per local row: the key-slot bounds [lo, hi) of the row's document (the slots of its real tokens); a padding row
// has lo == hi (no key visible). Spans of these go to attn::MhaForwardArgs::q_doc_lo / q_doc_hi.
struct DocBounds {
  std::vector<std::int64_t> lo, hi;
};

// Which slots each rank of a (ring x Ulysses) group holds; immutable, copies share the data. Every member is
// host-only and communication-free.
class SequenceLayout {
 public:
  // One unpacked row of `seq_len` tokens (a single document), padded as the kind needs (docs/design.md,
  // "Sequence layouts").
  // Errors: sizes < 1, seq_len < 1.
  SequenceLayout(LayoutKind kind, std::int64_t seq_len, int ring_size, int ulysses_size = 1);

  // One packed row, documents placed and padded as the kind needs (docs/design.md, "Packed rows and padding").
  // Args: cu_seqlens int64 [N+1] (cu_seqlens[0] = 0, non-decreasing, last = T >= 1; zero-length documents allowed).
  // Errors: sizes < 1; the cu_seqlens rules (file comment).
  static SequenceLayout packed(LayoutKind kind, std::span<const std::int64_t> cu_seqlens, int ring_size,
                               int ulysses_size = 1);

  // The layout of `seq_len` tokens over the groups' ring_size x ulysses_size ranks, and packed() over the groups'
  // sizes; zigzag by default (every CP layer defaults to it, so that a hybrid model shards its activations once
  // and hands this one layout to every layer).
  // Errors: as the constructor / packed().
  static SequenceLayout for_groups(const CpGroups& groups, std::int64_t seq_len, LayoutKind kind = LayoutKind::kZigzag);
  static SequenceLayout packed_for_groups(const CpGroups& groups, std::span<const std::int64_t> cu_seqlens,
                                          LayoutKind kind = LayoutKind::kZigzag);

  // Sizes: seq_len() = T, real tokens of the row; padded_len() = slots of the row (>= seq_len()); local_len() =
  // slots per CP rank; ring_shard_len() = slots per ring shard; is_packed(): built by packed().
  LayoutKind kind() const { return kind_; }
  std::int64_t seq_len() const;
  int ring_size() const { return ring_size_; }
  int ulysses_size() const { return ulysses_size_; }
  int num_ranks() const { return ring_size_ * ulysses_size_; }
  std::int64_t padded_len() const;
  std::int64_t local_len() const { return padded_len() / num_ranks(); }
  std::int64_t ring_shard_len() const { return padded_len() / ring_size_; }
  bool has_padding() const { return padded_len() != seq_len(); }
  bool is_packed() const;
  std::int64_t num_docs() const;

  // Document bounds: cu_seqlens() in token space, [N+1] (unpacked: {0, S}); slot_cu_seqlens() in slot space, [N+1]:
  // document d's padded slots are [slot_cu_seqlens()[d], slot_cu_seqlens()[d+1]), its real tokens the first
  // cu_seqlens()[d+1] - cu_seqlens()[d] of them.
  std::span<const std::int64_t> cu_seqlens() const;
  std::span<const std::int64_t> slot_cu_seqlens() const;

  // Balance (docs/design.md, "The balanced partitioner"): flop_imbalance() = max / mean per-ring-rank causal
  // attention work, >= 1; ring_work(): that work (sum over held tokens of offset in document + 1) of each ring rank;
  // step_imbalance() = sum_s max_r step_work / sum_s mean_r step_work (>= flop-like imbalance of the tile totals;
  // 1 when no work); chunk_len(): the balanced kind's chunk length c (0 for the other kinds).
  double flop_imbalance() const;
  const std::vector<std::int64_t>& ring_work() const;
  // Ring rank r's queries against the keys of ring shard (r - s) mod P, the block it holds at ring step s
  // (parallel/ring_pass.h), counted in the CPU kernels' (query tile, key tile) pairs: both shards cut into 64-row
  // tiles of local rows, a pair counted when some query row sees some key row (same document, key slot <= query
  // slot; causal). Every kind; built by the constructor in O(P padded_len).
  // Returns: [P * P], row-major [r * P + s].
  const std::vector<std::int64_t>& step_work() const;
  double step_imbalance() const;
  std::int64_t chunk_len() const;

  // Increasing slot positions of ring shard `ring_rank` (what a rank holds after the Ulysses all-to-all), and of
  // CP rank `cp_rank` = ring_rank * ulysses_size + ulysses_rank.
  std::vector<std::int64_t> ring_shard_positions(int ring_rank) const;
  std::vector<std::int64_t> positions(int cp_rank) const;

  // Per slot: the token in [0, T) or -1 (padding); the document in [0, N) or -1 (padding).
  // Errors: slot outside [0, padded_len()).
  std::int64_t token_of_slot(std::int64_t slot) const;
  std::int64_t doc_of_slot(std::int64_t slot) const;

  // Per row of CP rank `cp_rank` (rows at positions(cp_rank)), or of any increasing slots (the *_of_slots forms,
  // e.g. ring_shard_positions(r)): token index or -1, document or -1, the document's key-slot bounds, and the RoPE
  // position (offset inside its document; 0 for padding).
  std::vector<std::int64_t> token_index(int cp_rank) const;
  std::vector<std::int64_t> doc_index(int cp_rank) const;
  DocBounds doc_bounds(int cp_rank) const;
  std::vector<std::int64_t> rope_positions(int cp_rank) const;
  std::vector<std::int64_t> tokens_of_slots(std::span<const std::int64_t> slots) const;
  DocBounds doc_bounds_of_slots(std::span<const std::int64_t> slots) const;
  std::vector<std::int64_t> rope_positions_of_slots(std::span<const std::int64_t> slots) const;

  // A 64-bit digest of cu_seqlens (FNV-1a), for agreement checks.
  std::uint64_t cu_seqlens_digest() const;

 private:
  struct Data;
  SequenceLayout(LayoutKind kind, std::vector<std::int64_t> cu_seqlens, bool packed, int ring_size, int ulysses_size);

  LayoutKind kind_;
  int ring_size_;
  int ulysses_size_;
  std::shared_ptr<const Data> data_;  // immutable, shared by copies
};

// Synthetic document mixes for benchmarks and tests, drawn from a splitmix64 stream seeded by `seed` (the same
// lengths on every platform).
// Args: dist: "longtail": lengths log-uniform in [64, 16384] (many short documents, most tokens in a few long
//   ones; the last document is cut to what remains of the total); "short": lengths log-uniform in [1, 256] (the
//   last one cut likewise). total >= 1.
// Returns: document lengths summing to exactly `total` tokens.
// Errors: an unknown name (listing the names), total < 1.
// Sync: host-only.
std::vector<std::int64_t> synthetic_doc_lens(std::string_view dist, std::int64_t total, std::uint64_t seed);

// The balanced kind's chunk length for a row of seq_len tokens on ring_size ring ranks (docs/design.md, "The
// balanced partitioner").
// Returns: c = ceil(seq_len / (32 ring_size)), rounded up to a multiple of 64 when c >= 32.
// Errors: seq_len or ring_size < 1.
// Sync: host-only.
std::int64_t balanced_chunk_len(std::int64_t seq_len, int ring_size);

// The balanced kind's assignment, by the greedy largest-work-first pass and then, when `refine`, the per-step
// local search (docs/design.md, "The balanced partitioner"). Deterministic. Cost O(T + n^2 P^2) for
// n = ceil(T / c) <= 32 P + 1 chunks.
// Returns: the ring rank of each chunk [k c, (k+1) c) of the row (c = balanced_chunk_len, the last chunk shorter).
// Errors: the cu_seqlens rules (the file comment), ring_size < 1.
// Sync: host-only.
std::vector<int> balanced_chunk_owners(std::span<const std::int64_t> cu_seqlens, int ring_size, bool refine = true);

// SequenceLayout::step_imbalance() for a mask: causal (that value: a query row sees the keys of its document up to its
// own slot) or not (it sees its whole document), sum_s max_r / sum_s mean_r of the 64-row tile pairs of ring rank r's
// queries against the shard it holds at ring step s (1 when no work).
// Cost: O(P padded_len) when not causal. Sync: host-only.
double step_imbalance_for_mask(const SequenceLayout& layout, bool causal);

// cu_seqlens of document lengths.
// Args: doc_lens, each >= 0.
// Returns: [N+1]: 0, then the running sums.
// Errors: a negative length.
// Sync: host-only.
std::vector<std::int64_t> cu_seqlens_of(std::span<const std::int64_t> doc_lens);

// Adds the layout's fields (kind, seq_len, padded_len, ring_size, ulysses_size, and for a packed row the document
// count and the cu_seqlens digest) to a call's fingerprint (AgreementCheck): ranks that disagree on cu_seqlens get
// the named agreement error.
// Sync: host-only.
void add_layout_fields(Fingerprint& fp, const SequenceLayout& layout);

// Local copies by slot along the sequence dimension (dim 1) of [B, S, ...] tensors, host or device; the _bhs forms
// for [B, H, S] tensors (lse), along dim 2.
// Returns: shard: local[b, i, ...] = full[b, positions[i], ...]; unshard: full[b, positions[i], ...] =
//   local[b, i, ...].
// Errors: those of gather_rows / scatter_rows (runtime/tensor_ops.h).
// Sync: gather_rows / scatter_rows on `stream`; no communication.
void shard_sequence(const TensorView& full, const std::vector<std::int64_t>& positions, const TensorView& local,
                    Stream stream = Stream::cpu());
void unshard_sequence(const TensorView& local, const std::vector<std::int64_t>& positions, const TensorView& full,
                      Stream stream = Stream::cpu());
void shard_sequence_bhs(const TensorView& full, const std::vector<std::int64_t>& positions, const TensorView& local,
                        Stream stream = Stream::cpu());
void unshard_sequence_bhs(const TensorView& local, const std::vector<std::int64_t>& positions, const TensorView& full,
                          Stream stream = Stream::cpu());

// Between the user's token-space tensor and one CP rank's padded local tensor (shard; unshard below).
// Args: seq_dim: 1 for [B, S, ...], 2 for [B, H, S] lse; full has seq_len() rows, local local_len() rows; B = 1
//   for a packed layout; any dtype.
// Returns: shard: local row i = full row token_index(cp_rank)[i], or zeros for a padding row; unshard: full row
//   token_index(cp_rank)[i] = local row i for every real row; padding rows are dropped.
// Errors: seq_dim not 1 or 2, row counts, B != 1 with a packed layout (check_sequence_tensor), then those of
//   gather_rows / scatter_rows.
// Sync: on `stream`; no communication.
void shard_sequence(const SequenceLayout& layout, int cp_rank, const TensorView& full, const TensorView& local,
                    int seq_dim = 1, Stream stream = Stream::cpu());
// The copies behind them, by token index along seq_dim.
// Returns: gather: local row i = full row tokens[i], zeros where tokens[i] < 0; scatter: full row tokens[i] =
//   local row i where tokens[i] >= 0.
// Errors: those of gather_rows / scatter_rows.
// Sync: on `stream`; no communication.
void gather_token_rows(const TensorView& full, int seq_dim, std::span<const std::int64_t> tokens,
                       const TensorView& local, Stream stream = Stream::cpu());
void scatter_token_rows(const TensorView& local, int seq_dim, std::span<const std::int64_t> tokens,
                        const TensorView& full, Stream stream = Stream::cpu());
// The inverse of the layout form of shard_sequence above (Args, Returns, Errors, Sync there).
void unshard_sequence(const SequenceLayout& layout, int cp_rank, const TensorView& local, const TensorView& full,
                      int seq_dim = 1, Stream stream = Stream::cpu());

// The check a CP layer runs on its local tensors, with len = local_len(), before any message.
// Errors: naming `what` and `name`, unless t has `len` rows along seq_dim and, for a packed layout, batch 1.
// Sync: host-only.
void check_sequence_tensor(const SequenceLayout& layout, const TensorView& t, std::int64_t len, int seq_dim,
                           const char* what, const char* name);

// Root's full tensor is cut by the layout and every rank receives its piece, padding rows zero.
// Args: comm: size layout.num_ranks(), rank = CP rank; full [B, T, ...] (the user's tokens; B = 1 when packed),
//   read on root only; local [B, local_len, ...].
// Errors (every rank, before any message): the ranks' agreement check (as the CP layers', docs/design.md,
//   "Agreement of the ranks": layout, root, local's dtype / shape / device, root's full against root's local);
//   communicator size, local's shape (check_sequence_tensor).
// Sync: collective over `comm` (one 24-byte all-reduce for the agreement check unless SEQPAR_AGREEMENT_CHECK=off,
//   then the data); buffers on the tensors' device, packing on `stream`.
void scatter_sequence(Communicator& comm, const SequenceLayout& layout, const TensorView& full, const TensorView& local,
                      int root = 0, Stream stream = Stream::cpu());
// Every rank's local piece is gathered into the full [B, T, ...] tensor on every rank (padding rows dropped).
// Args: seq_dim = 1 for [B, T, ...] tensors, 2 for [B, H, T] (lse).
// Errors (every rank, before any message): the agreement check (as scatter_sequence; layout, seq_dim, local's and
//   full's dtype / shape / device); communicator size != layout ranks, seq_dim not 1 or 2, local's shape; then the
//   shape and dtype errors of the copies.
// Sync: collective over `comm` (the agreement check as scatter_sequence, then the data).
void gather_sequence(Communicator& comm, const SequenceLayout& layout, const TensorView& local, const TensorView& full,
                     int seq_dim = 1, Stream stream = Stream::cpu());
// Every rank's local piece is gathered into the full tensor on `root` only (the inverse of scatter_sequence; the
// other ranks send their piece and receive nothing). Root receives every piece in one buffer of num_ranks times
// the local bytes (ledger category comm_buffer); the others allocate nothing.
// Args: full: written on root only (the other ranks may pass an empty view); seq_dim as for gather_sequence.
// Errors (every rank, before any message): the agreement check (as scatter_sequence; layout, seq_dim, root, local's
//   dtype / shape / device, root's full against root's local); communicator size != layout ranks, seq_dim not 1 or
//   2, local's shape, root outside the communicator; then the shape and dtype errors of the copies on root.
// Sync: collective over `comm`.
void gather_sequence_to_root(Communicator& comm, const SequenceLayout& layout, const TensorView& local,
                             const TensorView& full, int root = 0, int seq_dim = 1, Stream stream = Stream::cpu());

// The accessors every CP layer that owns its layout shares (DSA, GDN): this rank's positions, the counters and the
// unique id its contexts carry. Built by the layer's constructor after check_layout_matches.
class CpLayerBase {
 public:
  // Accessors: the layout; this rank's slot positions (layout().positions(cp_rank)), increasing; the counters
  // (CpCounters) and reset_counters().
  // Sync: host-only.
  const SequenceLayout& layout() const { return layout_; }
  const std::vector<std::int64_t>& positions() const { return positions_; }
  const CpCounters& counters() const { return counters_; }
  void reset_counters() { counters_.reset(); }

  // The agreement checks of forward and backward (over the CP group): how often each ran or was cached.
  // Sync: host-only.
  const AgreementCheck& forward_agreement() const { return forward_agreement_; }
  const AgreementCheck& backward_agreement() const { return backward_agreement_; }

 protected:
  // Checks that `layout` matches the groups (check_layout_matches, naming `layer`). Every layer takes padded and
  // packed rows.
  CpLayerBase(const CpGroups& groups, const SequenceLayout& layout, const char* layer);
  // A fingerprint of `call` with the layout's fields (add_layout_fields), for the layer to add its own to.
  Fingerprint fingerprint(std::string_view call) const;
  // Runs `check` over the CP group with `fp` (AgreementCheck::run).
  void agree(AgreementCheck& check, const Fingerprint& fp) { check.run(groups_.cp, fp, groups_.stream); }

  CpGroups groups_;
  SequenceLayout layout_;
  std::vector<std::int64_t> positions_;
  LayerId id_;
  CpCounters counters_;
  AgreementCheck forward_agreement_, backward_agreement_;
};

}  // namespace seqpar
