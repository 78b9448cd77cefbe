// Sequence layouts: which tokens each rank of a (ring x Ulysses) group holds, for one row of S tokens or one packed
// row of documents (docs/design.md sections 6 and 15).
//
// Slot space. A layout places the T = seq_len() real tokens of a row into a padded sequence of padded_len() slots;
// every SP rank holds local_len() = padded_len() / num_ranks() of them. Positions (positions(), ring_shard_positions())
// are increasing SLOT positions in [0, padded_len()); a padding slot carries no token (token_index() = -1). Document
// d (tokens [cu_seqlens[d], cu_seqlens[d+1])) occupies the slots [slot_cu[d], slot_cu[d+1]) (slot_cu_seqlens()),
// its real tokens the first len_d of them, in order: inside a document a slot difference is a token distance, so
// causal masks, sliding windows and ALiBi read slot positions as they read token positions, and the document's
// slot bounds restrict the keys (doc_bounds). Slots after slot_cu[N] belong to no document (trailing padding).
// When the row needs no padding (an unpacked S that divides as the kind needs), slots are tokens and padded_len()
// = S: every layout of S tokens that was valid before padding existed is unchanged.
//
// Kinds. The row is first cut into ring_size ring shards, then each ring shard (its slots in increasing order) is
// cut into ulysses_size contiguous pieces; the SP rank of (ring_rank, ulysses_rank) is ring_rank * ulysses_size +
// ulysses_rank (runtime/sp_grid.h), so pieces in SP-rank order are the ring shards in ring order, each split in
// Ulysses order. With P = ring_size, U = ulysses_size:
//   contiguous: slots = tokens, padded at the end to a multiple of P U; ring shard r = [r L, (r+1) L), L = padded/P.
//   stripe:     slots = tokens, padded at the end to a multiple of P U; ring shard r = {t : t mod P == r}.
//   zigzag:     per document (TransformerEngine's THD scheme; Brandon et al. 2023 "Striped Attention" /
//               ring-flash-attention for one document): document d is padded at its end to a multiple of 2P slots and
//               cut into 2P chunks; ring shard r takes chunks r and 2P-1-r of every document, in document order
//               (causal work per document is equal on every rank). A ring of one (P = 1) pads no document (its two
//               chunks are adjacent: any length). Then P e trailing slots, e = (-sum_d padded_d / P) mod U, give every
//               ring shard e padding slots at its end so that it divides into U pieces.
//   balanced:   slots = tokens, padded at the end. The row is cut into chunks [k c, (k+1) c) of c tokens, c =
//               ceil(T / (32 P)) rounded up to a multiple of 64 (the CPU kernels' tile) when it is 32 or more (the
//               last chunk shorter; a chunk may hold the end of one document and the start of the next), and whole
//               chunks are assigned to ring ranks, largest causal work first (whole-tile chunks: counted in the
//               kernels' (query tile, key tile) pairs), each
//               to the rank with least work among the ranks whose token count stays within c of the smallest; so the
//               ring ranks' token counts differ by at most one chunk and their causal attention FLOPs are close
//               (flop_imbalance()). Then a local search evens out every ring step, not only the totals: swaps of
//               equal-length chunks between ranks that lower sum_s max_r work(r, s) (see step_work()), at most 4
//               passes over the chunk pairs (balanced_chunk_owners). Ring shard r = its chunks' slots, then its share
//               of the trailing padding (the shards are padded to the largest, rounded up to a multiple of U).
// flop_imbalance() = max / mean over ring ranks of the causal attention work of their tokens, sum over held tokens of
// (offset in document + 1) (what a ring rank's queries compute under a causal mask; 1 when there is no work).
// step_imbalance() = sum over ring steps s of max_r work(r, s) / sum over s of mean_r work(r, s), work(r, s) = the
// kernel tile pairs ring rank r computes at ring step s (step_work()): a ring step ends when its slowest rank does.
//
// Memory: a layout holds every ring shard's slots (padded_len int64 in all), built once by the constructor and shared
// by copies; a row too large to hold fails there with std::bad_alloc.
// Errors (raised identically on every rank, before any communication): sizes < 1; seq_len < 1; cu_seqlens that do not
// start at 0, have fewer than 2 entries, hold a negative value, decrease, or end at a total T < 1 (each naming the
// index, the value and the rule).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "cp_common.h"
#include "../runtime/comm.h"
#include "../runtime/tensor.h"

namespace seqpar {

enum class LayoutKind : std::uint8_t { kContiguous, kZigzag, kStripe, kBalanced };
const char* layout_name(LayoutKind kind);  // "contiguous", "zigzag", "stripe", "balanced"
LayoutKind parse_layout(std::string_view name);

// Per local row: the key-slot bounds [lo, hi) of the row's document (the slots of its real tokens); a padding row
// has lo == hi (no key visible). Spans of these go to attn::MhaForwardArgs::q_doc_lo / q_doc_hi.
struct DocBounds {
  std::vector<std::int64_t> lo, hi;
};

class SequenceLayout {
 public:
  // One unpacked row of `seq_len` >= 1 tokens (a single document), padded as the kind needs (see above).
  SequenceLayout(LayoutKind kind, std::int64_t seq_len, int ring_size, int ulysses_size = 1);
  // One packed row: cu_seqlens int64 [N+1] (cu_seqlens[0] = 0, non-decreasing, last = T >= 1; zero-length
  // documents allowed), documents placed and padded as the kind needs.
  static SequenceLayout packed(LayoutKind kind, std::span<const std::int64_t> cu_seqlens, int ring_size,
                               int ulysses_size = 1);
  // The layout of `seq_len` tokens over the groups' ring_size x ulysses_size ranks; zigzag by default (every CP
  // layer defaults to it, so that a hybrid model shards its activations once and hands this one layout to every
  // layer).
  static SequenceLayout for_groups(const CpGroups& groups, std::int64_t seq_len, LayoutKind kind = LayoutKind::kZigzag);
  // packed() over the groups' sizes.
  static SequenceLayout packed_for_groups(const CpGroups& groups, std::span<const std::int64_t> cu_seqlens,
                                          LayoutKind kind = LayoutKind::kZigzag);

  LayoutKind kind() const { return kind_; }
  std::int64_t seq_len() const;  // T: real tokens of the row
  int ring_size() const { return ring_size_; }
  int ulysses_size() const { return ulysses_size_; }
  int num_ranks() const { return ring_size_ * ulysses_size_; }
  std::int64_t padded_len() const;                                       // slots of the row (>= seq_len())
  std::int64_t local_len() const { return padded_len() / num_ranks(); }  // slots per SP rank
  std::int64_t ring_shard_len() const { return padded_len() / ring_size_; }
  bool has_padding() const { return padded_len() != seq_len(); }

  bool is_packed() const;  // built by packed()
  std::int64_t num_docs() const;
  // Token space, [N+1] (unpacked: {0, S}).
  std::span<const std::int64_t> cu_seqlens() const;
  // Slot space, [N+1]: document d's padded slots are [slot_cu_seqlens()[d], slot_cu_seqlens()[d+1]), its real tokens
  // the first cu_seqlens()[d+1] - cu_seqlens()[d] of them.
  std::span<const std::int64_t> slot_cu_seqlens() const;
  // max / mean per-ring-rank causal attention work (see above); >= 1.
  double flop_imbalance() const;
  // The causal attention work (sum over held tokens of offset in document + 1) of each ring rank.
  const std::vector<std::int64_t>& ring_work() const;
  // Ring rank r's queries against the keys of ring shard (r - s) mod P, the block it holds at ring step s
  // (parallel/ring_pass.h), counted in the CPU kernels' (query tile, key tile) pairs: both shards cut into 64-row
  // tiles of local rows, a pair counted when some query row sees some key row (same document, key slot <= query
  // slot; causal). [P * P], row-major [r * P + s]. Every kind; built by the constructor in O(P padded_len).
  const std::vector<std::int64_t>& step_work() const;
  // sum_s max_r step_work / sum_s mean_r step_work (>= flop-like imbalance of the tile totals; 1 when no work).
  double step_imbalance() const;
  // The balanced kind's chunk length c (0 for the other kinds).
  std::int64_t chunk_len() const;

  // Increasing slot positions of ring shard `ring_rank` (what a rank holds after the Ulysses all-to-all).
  std::vector<std::int64_t> ring_shard_positions(int ring_rank) const;
  // Increasing slot positions held by SP rank `sp_rank` = ring_rank * ulysses_size + ulysses_rank.
  std::vector<std::int64_t> positions(int sp_rank) const;

  // Per slot: the token in [0, T) or -1 (padding); the document in [0, N) or -1 (padding). Errors: slot outside
  // [0, padded_len()).
  std::int64_t token_of_slot(std::int64_t slot) const;
  std::int64_t doc_of_slot(std::int64_t slot) const;
  // Per row of SP rank `sp_rank` (rows at positions(sp_rank)): token index or -1, document or -1, the document's
  // key-slot bounds, and the RoPE position (offset inside its document; 0 for padding).
  std::vector<std::int64_t> token_index(int sp_rank) const;
  std::vector<std::int64_t> doc_index(int sp_rank) const;
  DocBounds doc_bounds(int sp_rank) const;
  std::vector<std::int64_t> rope_positions(int sp_rank) const;
  // The same for any increasing slots (e.g. ring_shard_positions(r)).
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

// Synthetic document mixes for benchmarks and tests: document lengths summing to exactly `total` tokens (>= 1), drawn
// from a splitmix64 stream seeded by `seed` (the same lengths on every platform). Names:
//   "longtail": lengths log-uniform in [64, 16384] (many short documents, most tokens in a few long ones; the last
//               document is cut to what remains of the total);
//   "short":    lengths log-uniform in [1, 256] (the last one cut likewise).
// Errors: an unknown name (listing the names), total < 1.
std::vector<std::int64_t> synthetic_doc_lens(std::string_view dist, std::int64_t total, std::uint64_t seed);
// The balanced kind's chunk length for a row of seq_len tokens on ring_size ring ranks: c = ceil(seq_len / (32
// ring_size)), rounded up to a multiple of 64 when c >= 32. Errors: seq_len or ring_size < 1.
std::int64_t balanced_chunk_len(std::int64_t seq_len, int ring_size);
// The balanced kind's assignment: the ring rank of each chunk [k c, (k+1) c) of the row (c = balanced_chunk_len,
// the last chunk shorter), by the greedy largest-work-first pass and then, when `refine`, the per-step local search
// (see balanced above). Deterministic. Cost O(T + n^2 P^2) for n = ceil(T / c) <= 32 P + 1 chunks. Errors: those of
// cu_seqlens (see above), ring_size < 1.
std::vector<int> balanced_chunk_owners(std::span<const std::int64_t> cu_seqlens, int ring_size, bool refine = true);
// cu_seqlens [N+1] of document lengths (each >= 0): 0, then the running sums. Errors: a negative length.
std::vector<std::int64_t> cu_seqlens_of(std::span<const std::int64_t> doc_lens);

// Adds the layout's fields (kind, seq_len, padded_len, ring_size, ulysses_size, and for a packed row the document
// count and the cu_seqlens digest) to a call's fingerprint (AgreementCheck): ranks that disagree on cu_seqlens get
// the named agreement error.
void add_layout_fields(Fingerprint& fp, const SequenceLayout& layout);

// Local copies by slot along the sequence dimension (dim 1) of [B, S, ...] tensors; no communication. Host or device
// tensors (runtime/tensor_ops.h gather_rows / scatter_rows on `stream`, whose errors they raise). shard: local[b, i,
// ...] = full[b, positions[i], ...]. unshard: full[b, positions[i], ...] = local[b, i, ...].
void shard_sequence(const TensorView& full, const std::vector<std::int64_t>& positions, const TensorView& local,
                    Stream stream = Stream::cpu());
void unshard_sequence(const TensorView& local, const std::vector<std::int64_t>& positions, const TensorView& full,
                      Stream stream = Stream::cpu());
// Same for [B, H, S] tensors (lse), along dim 2.
void shard_sequence_bhs(const TensorView& full, const std::vector<std::int64_t>& positions, const TensorView& local,
                        Stream stream = Stream::cpu());
void unshard_sequence_bhs(const TensorView& local, const std::vector<std::int64_t>& positions, const TensorView& full,
                          Stream stream = Stream::cpu());

// Between the user's token-space tensor and one SP rank's padded local tensor, along seq_dim (1 for [B, S, ...], 2
// for [B, H, S] lse); no communication. full has seq_len() rows, local local_len() rows; B = 1 for a packed layout.
// shard: local row i = full row token_index(sp_rank)[i], or zeros for a padding row (any dtype).
// unshard: full row token_index(sp_rank)[i] = local row i for every real row; padding rows are dropped.
// Errors: seq_dim not 1 or 2, row counts, B != 1 with a packed layout (check_sequence_tensor), then those of
// gather_rows / scatter_rows.
void shard_sequence(const SequenceLayout& layout, int sp_rank, const TensorView& full, const TensorView& local,
                    int seq_dim = 1, Stream stream = Stream::cpu());
// The copies behind them, by token index along seq_dim: gather: local row i = full row tokens[i], zeros where
// tokens[i] < 0; scatter: full row tokens[i] = local row i where tokens[i] >= 0. Errors: those of gather_rows /
// scatter_rows.
void gather_token_rows(const TensorView& full, int seq_dim, std::span<const std::int64_t> tokens,
                       const TensorView& local, Stream stream = Stream::cpu());
void scatter_token_rows(const TensorView& local, int seq_dim, std::span<const std::int64_t> tokens,
                        const TensorView& full, Stream stream = Stream::cpu());
void unshard_sequence(const SequenceLayout& layout, int sp_rank, const TensorView& local, const TensorView& full,
                      int seq_dim = 1, Stream stream = Stream::cpu());
// Error naming `what` and `name` unless t has `len` rows along seq_dim and, for a packed layout, batch 1 (the check a
// CP layer runs on its local tensors, with len = local_len(), before any message).
void check_sequence_tensor(const SequenceLayout& layout, const TensorView& t, std::int64_t len, int seq_dim,
                           const char* what, const char* name);

// Collective over `comm` (size layout.num_ranks(), rank = SP rank): root's full [B, T, ...] tensor (the user's
// tokens; B = 1 when packed) is cut by the layout and every rank receives its [B, local_len, ...] piece, padding rows
// zero. `full` is read on root only. Buffers on the tensors' device, packing on `stream`. Errors (every rank, before
// any message): communicator size, local's shape (check_sequence_tensor).
void scatter_sequence(Communicator& comm, const SequenceLayout& layout, const TensorView& full, const TensorView& local,
                      int root = 0, Stream stream = Stream::cpu());
// Collective: every rank's local piece is gathered into the full [B, T, ...] tensor on every rank (padding rows
// dropped). seq_dim = 1 for [B, T, ...] tensors, 2 for [B, H, T] (lse).
void gather_sequence(Communicator& comm, const SequenceLayout& layout, const TensorView& local, const TensorView& full,
                     int seq_dim = 1, Stream stream = Stream::cpu());
// Collective: every rank's local piece is gathered into the full tensor on `root` only (the inverse of
// scatter_sequence; the other ranks send their piece and receive nothing). `full` is written on root only: the
// other ranks may pass an empty view. Root receives every piece in one buffer of num_ranks times the local
// bytes (ledger category comm_buffer); the others allocate nothing. seq_dim as for gather_sequence.
// Errors: communicator size != layout ranks, seq_dim not 1 or 2, local's shape, root outside the communicator (on
// every rank, before any message); then the shape and dtype errors of the copies on root.
void gather_sequence_to_root(Communicator& comm, const SequenceLayout& layout, const TensorView& local,
                             const TensorView& full, int root = 0, int seq_dim = 1, Stream stream = Stream::cpu());

// The accessors every CP layer that owns its layout shares (DSA, GDN): this rank's positions, the counters and the
// unique id its contexts carry. Built by the layer's constructor after check_layout_matches.
class CpLayerBase {
 public:
  const SequenceLayout& layout() const { return layout_; }
  // This rank's slot positions (layout().positions(sp_rank)), increasing.
  const std::vector<std::int64_t>& positions() const { return positions_; }
  const CpCounters& counters() const { return counters_; }
  void reset_counters() { counters_.reset(); }
  // The agreement checks of forward and backward (over the SP group): how often each ran or was cached.
  const AgreementCheck& forward_agreement() const { return forward_agreement_; }
  const AgreementCheck& backward_agreement() const { return backward_agreement_; }

 protected:
  // Checks that `layout` matches the groups (check_layout_matches, naming `layer`). Every layer takes padded and
  // packed rows.
  CpLayerBase(const CpGroups& groups, const SequenceLayout& layout, const char* layer);
  // A fingerprint of `call` with the layout's fields (add_layout_fields), for the layer to add its own to.
  Fingerprint fingerprint(std::string_view call) const;
  // Runs `check` over the SP group with `fp` (AgreementCheck::run).
  void agree(AgreementCheck& check, const Fingerprint& fp) { check.run(groups_.sp, fp, groups_.stream); }

  CpGroups groups_;
  SequenceLayout layout_;
  std::vector<std::int64_t> positions_;
  LayerId id_;
  CpCounters counters_;
  AgreementCheck forward_agreement_, backward_agreement_;
};

}  // namespace seqpar
