// Sequence layouts: which global token positions each rank of a (ring x Ulysses) group holds.
//
// The sequence [0, S) is first cut into ring_size ring shards by the layout kind, then each ring shard (its
// positions in increasing order) is cut into ulysses_size contiguous pieces (docs/design.md section 6):
//   contiguous: ring shard r = [r*S/P, (r+1)*S/P)
//   zigzag:     2P chunks of S/(2P); ring shard r = chunk r followed by chunk 2P-1-r (causal work is equal on every
//               rank; Brandon et al. 2023 "Striped Attention" / ring-flash-attention's zigzag)
//   stripe:     ring shard r = {t : t mod P == r}
// The SP rank of (ring_rank, ulysses_rank) is ring_rank * ulysses_size + ulysses_rank (runtime/sp_grid.h), so
// pieces in SP-rank order are the ring shards in ring order, each split in Ulysses order.
//
// Errors (raised identically on every rank, before any communication): seq_len not divisible as the layout
// needs (S % (P*U) for contiguous and stripe; S % (2P) and (S/P) % U for zigzag, where a ring of one, P = 1, takes
// any S % U == 0, odd lengths included), sizes < 1. Sequences are never padded.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "parallel/cp_common.h"
#include "runtime/comm.h"
#include "runtime/tensor.h"

namespace seqpar {

enum class LayoutKind : std::uint8_t { kContiguous, kZigzag, kStripe };
const char* layout_name(LayoutKind kind);  // "contiguous", "zigzag", "stripe"
LayoutKind parse_layout(std::string_view name);

class SequenceLayout {
 public:
  SequenceLayout(LayoutKind kind, std::int64_t seq_len, int ring_size, int ulysses_size = 1);
  // The layout of `seq_len` tokens over the groups' ring_size x ulysses_size ranks; zigzag by default (every CP
  // layer defaults to it, so that a hybrid model shards its activations once and hands this one layout to every
  // layer).
  static SequenceLayout for_groups(const CpGroups& groups, std::int64_t seq_len, LayoutKind kind = LayoutKind::kZigzag);

  LayoutKind kind() const { return kind_; }
  std::int64_t seq_len() const { return seq_len_; }
  int ring_size() const { return ring_size_; }
  int ulysses_size() const { return ulysses_size_; }
  int num_ranks() const { return ring_size_ * ulysses_size_; }
  std::int64_t local_len() const { return seq_len_ / num_ranks(); }  // tokens per SP rank
  std::int64_t ring_shard_len() const { return seq_len_ / ring_size_; }

  // Increasing global positions of ring shard `ring_rank` (what a rank holds after the Ulysses all-to-all).
  std::vector<std::int64_t> ring_shard_positions(int ring_rank) const;
  // Increasing global positions held by SP rank `sp_rank` = ring_rank * ulysses_size + ulysses_rank.
  std::vector<std::int64_t> positions(int sp_rank) const;

 private:
  LayoutKind kind_;
  std::int64_t seq_len_;
  int ring_size_;
  int ulysses_size_;
};

// Adds the layout's fields (kind, seq_len, ring_size, ulysses_size) to a call's fingerprint (AgreementCheck).
void add_layout_fields(Fingerprint& fp, const SequenceLayout& layout);

// Local copies along the sequence dimension (dim 1) of [B, S, ...] tensors; no communication. Host or device tensors
// (runtime/tensor_ops.h gather_rows / scatter_rows on `stream`, whose errors they raise).
// shard: local[b, i, ...] = full[b, positions[i], ...]. unshard: full[b, positions[i], ...] = local[b, i, ...].
void shard_sequence(const TensorView& full, const std::vector<std::int64_t>& positions, const TensorView& local,
                    Stream stream = Stream::cpu());
void unshard_sequence(const TensorView& local, const std::vector<std::int64_t>& positions, const TensorView& full,
                      Stream stream = Stream::cpu());
// Same for [B, H, S] tensors (lse), along dim 2.
void shard_sequence_bhs(const TensorView& full, const std::vector<std::int64_t>& positions, const TensorView& local,
                        Stream stream = Stream::cpu());
void unshard_sequence_bhs(const TensorView& local, const std::vector<std::int64_t>& positions, const TensorView& full,
                          Stream stream = Stream::cpu());

// Collective over `comm` (size layout.num_ranks(), rank = SP rank): root's full [B, S, ...] tensor is cut by the
// layout and every rank receives its [B, local_len, ...] piece. `full` is read on root only. Buffers on the tensors'
// device, packing on `stream`.
void scatter_sequence(Communicator& comm, const SequenceLayout& layout, const TensorView& full, const TensorView& local,
                      int root = 0, Stream stream = Stream::cpu());
// Collective: every rank's local piece is gathered into the full [B, S, ...] tensor on every rank.
// seq_dim = 1 for [B, S, ...] tensors, 2 for [B, H, S] (lse).
void gather_sequence(Communicator& comm, const SequenceLayout& layout, const TensorView& local, const TensorView& full,
                     int seq_dim = 1, Stream stream = Stream::cpu());
// Collective: every rank's local piece is gathered into the full tensor on `root` only (the inverse of
// scatter_sequence; the other ranks send their piece and receive nothing). `full` is written on root only: the
// other ranks may pass an empty view. Root receives every piece in one buffer of S/local_len times the local
// bytes (ledger category comm_buffer); the others allocate nothing. seq_dim as for gather_sequence.
// Errors: communicator size != layout ranks, seq_dim not 1 or 2, root outside the communicator (on every rank,
// before any message); then the shape and dtype errors of the copies on root.
void gather_sequence_to_root(Communicator& comm, const SequenceLayout& layout, const TensorView& local,
                             const TensorView& full, int root = 0, int seq_dim = 1, Stream stream = Stream::cpu());

// The accessors every CP layer that owns its layout shares (DSA, GDN): this rank's positions, the counters and the
// unique id its contexts carry. Built by the layer's constructor after check_layout_matches.
class CpLayerBase {
 public:
  const SequenceLayout& layout() const { return layout_; }
  // This rank's global token positions (layout().positions(sp_rank)), increasing.
  const std::vector<std::int64_t>& positions() const { return positions_; }
  const CpCounters& counters() const { return counters_; }
  void reset_counters() { counters_.reset(); }
  // The agreement checks of forward and backward (over the SP group): how often each ran or was cached.
  const AgreementCheck& forward_agreement() const { return forward_agreement_; }
  const AgreementCheck& backward_agreement() const { return backward_agreement_; }

 protected:
  // Checks that `layout` matches the groups (check_layout_matches, naming `layer`).
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
