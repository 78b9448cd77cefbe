// GDN (gated delta rule) and its short causal conv under context parallelism (docs/design.md section 10).
//
// The sequence is sharded by a SequenceLayout (contiguous, zigzag or balanced; stripe would make every token its own
// segment and is refused). A rank's positions form one or more segments (maximal runs of consecutive positions);
// zigzag gives two per rank, and the segments in global order visit every rank twice. Each step of the recurrence
// is affine in the state, so a segment is one map S_end = M S_start + U:
//   chain: each segment waits for its start state from the segment before it in global order, runs, and sends its
//          end state on; backward passes d(state) the other way. N - 1 sequential message rounds for N segments.
//   scan:  every segment computes (M, U) from a zero start at once; a Kogge-Stone inclusive scan of the maps in
//          global segment order (ceil(log2 N) rounds of point-to-point messages) plus one shift round gives each
//          segment its start state; then every segment runs with it. Backward: the local part L of dS_start from
//          a cheap reverse sweep, the reverse scan of the maps (M^T, L), one shift round, then the full backward.
// States, transitions and their gradients stay fp32 (fp64 for fp64 inputs) on the wire; with fp64 inputs every
// kernel, composition and sum here runs in fp64.
//
// Heads: q and k have Hk key heads, v, g, beta, the states and out Hv value heads (Hv a multiple of Hk; value head h
// reads key head h / (Hv / Hk), attention/gdn.h).
// Under USP, value heads are independent: an all-to-all over the Ulysses group turns [B, S/(Pu Pr), Hv, *] into
// [B, S/Pr, Hv/Pu, *] (the ring shard), the chain or scan runs over the ring group, and the inverse all-to-all
// restores the layout. q and k follow their value heads: split the same way when Pu divides Hk, else (Hk < Pu,
// Pu % Hk == 0) each key head is replicated to the Pu / Hk ranks whose value heads read it and the replicas' dq, dk
// are summed in fp32 (fp64 for fp64) on the way back (UlyssesExchange, parallel/ulysses.h). final_state and
// d(initial_state) are returned in full ([B, Hv, K, V]) on every rank.
//
// Packed rows and padding (docs/design.md section 15.4): with a packed layout (SequenceLayout::packed, B = 1) every
// document runs from its own initial state and nothing crosses a document start; initial_state, final_state and
// their gradients are [N, Hv, K, V] (zero-length documents pass their state and its gradient through). Segments are
// runs of consecutive tokens (token_index), cut into pieces at document starts (segment_pieces): a piece that starts
// a document runs from its initial state (in the scan, M = 0), so states pass between segments only inside a
// document (the chain's rounds count those links). Padding rows (any length on any grid) are skipped: their outputs
// and gradients are 0 and their inputs are never read. The conv halo stops at a document start. Scan and shift rounds
// send one packed message per peer.
//
// Short conv halo: a segment's first W-1 outputs need the W-1 inputs before it in global order; they are received
// point to point from whichever ranks hold them (several when the segments before are shorter than W-1), and the
// halo's gradient goes back the same way and is added to the owners' dx. dweight is summed over the group.
//
// Counters (CpCounters): message_rounds, ring bytes of the state passing (bytes_*), Ulysses bytes (a2a_*), exposed
// ring wait time, Ulysses exchange time (a2a_s) and kernel time.
// Synchronisation: every public call is collective over the groups' communicators (GDN: Ulysses and ring; short
// conv: SP) and host-synchronous; kernels run on groups.stream. The objects keep no state between calls: a forward's
// context owns the saved tensors (saved_activation) until the backward consumes it.
// Errors (before any communication, identical on every rank): the layout not built for the groups, stripe layout,
// B > 1 with a packed layout, initial_state / dfinal_state not [N, Hv, K, V] for N documents,
// Hv not a multiple of Hk, Hv not divisible by ulysses_size, Hk neither divisible by ulysses_size nor dividing it,
// shape / dtype mismatches; a context that is empty, already used or made by
// another object; ranks of the SP group that disagree on the inputs' shapes and dtypes (initial_state given or not
// included), mode, chunk_size, use_qk_l2norm, scale or the layout (short conv: x, weight, use_silu; backward: the
// saved shapes, dout, dfinal_state / dweight) (AgreementCheck, parallel/cp_common.h: one all-reduce over the SP
// group on the first call of each configuration, before any data moves).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string_view>
#include <vector>

#include "../attention/gdn.h"
#include "cp_common.h"
#include "layout.h"

namespace seqpar {

struct GdnCpConfig {
  GdnCpMode mode = GdnCpMode::kScan;
  bool use_qk_l2norm = true;
  float scale = 0.0f;  // <= 0: 1 / sqrt(K)
  std::int64_t chunk_size = attn::kGdnDefaultChunkSize;
};

// One run of consecutive tokens held by one rank in consecutive rows.
struct Segment {
  std::int64_t start = 0;  // first token (global index)
  std::int64_t length = 0;
  int owner = 0;                  // rank in the group
  std::int64_t local_offset = 0;  // row of the owner's local tensor where the segment starts
};
// The segments of all ranks (tokens_per_rank[r] = the token of each row of rank r's shard, increasing over its
// tokens; -1 marks a padding row, which belongs to no segment and ends a run), in global order.
std::vector<Segment> segments_in_global_order(const std::vector<std::vector<std::int64_t>>& tokens_per_rank);

// The part of a segment inside one document: rows [offset, offset + length) of the segment, tokens of document
// `doc`; starts_doc / ends_doc: the piece holds the document's first / last token. A segment's state runs through
// its pieces except at a document start, where it restarts from that document's initial state.
struct SegmentPiece {
  std::int64_t offset = 0, length = 0, doc = 0;
  bool starts_doc = false, ends_doc = false;
};
// The pieces of `seg` in order, for documents with bounds cu_seqlens ([N+1], validated; {0, S} for one document).
std::vector<SegmentPiece> segment_pieces(const Segment& seg, const std::vector<std::int64_t>& cu_seqlens);

struct GdnCpOutput {
  Tensor out;          // [B, S_local, Hv, V], dtype of q
  Tensor final_state;  // [B, Hv, K, V] ([N, Hv, K, V] packed) state dtype, identical on every rank
  CpContext ctx;       // what the backward needs; hand it to backward() of the object that made it
};

struct GdnCpGrads {
  Tensor dq, dk;          // local [B, S_local, Hk, K], dtype of q (summed over the value heads of each key head)
  Tensor dv, dg, dbeta;   // local [B, S_local, Hv, V] / [B, S_local, Hv], dtype of q
  Tensor dinitial_state;  // [B, Hv, K, V] ([N, Hv, K, V] packed) state dtype, same on every rank
};

class GdnContextParallel : public CpLayerBase {
 public:
  GdnContextParallel(const CpGroups& groups, const SequenceLayout& layout, const GdnCpConfig& config);

  // q, k [B, S_local, Hk, K], v [B, S_local, Hv, V], g, beta [B, S_local, Hv] at positions() (S_local =
  // layout().local_len(); padding rows are ignored); initial_state: empty or the full [B, Hv, K, V] ([N, Hv, K, V]
  // for a packed layout of N documents, B = 1) in the state dtype, the same on every rank.
  GdnCpOutput forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                      const TensorView& beta, const TensorView& initial_state = {});
  // The context of a forward of this object (consumed and freed); dout [B, S_local, Hv, V]; dfinal_state: empty or
  // the full [B, Hv, K, V] ([N, Hv, K, V] packed), the same on every rank.
  GdnCpGrads backward(CpContext&& ctx, const TensorView& dout, const TensorView& dfinal_state = {});

  // layout(), positions(), counters(), reset_counters(): CpLayerBase.

 private:
  struct Saved;
  struct ForwardPass;
  std::shared_ptr<Saved> validate_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                          const TensorView& g, const TensorView& beta,
                                          const TensorView& initial_state) const;
  Tensor run_pieces(ForwardPass& f, std::size_t j, bool known, bool continuing);
  void forward_chain(ForwardPass& f);
  void forward_scan(ForwardPass& f);
  // Segment i continues the document of the segment before it (its first token starts no document): only then does a
  // state pass between the two.
  bool continues(int i) const { return !pieces_[i].front().starts_doc; }
  struct BackwardPass;
  struct PieceBackward;
  PieceBackward piece_backward(BackwardPass& bp, std::size_t j, const SegmentPiece& p);
  Tensor run_piece(BackwardPass& bp, std::size_t j, const SegmentPiece& p, const TensorView& ds_end);
  Tensor run_pieces_backward(BackwardPass& bp, std::size_t j, bool known, bool waiting, const TensorView& ds_end_in);
  void backward_chain(BackwardPass& bp);
  void backward_scan(BackwardPass& bp);
  // Segment i passes a state gradient back from the segment after it (its last token ends no document).
  bool continued(int i) const { return !pieces_[i].back().ends_doc; }
  GdnCpConfig config_;
  std::vector<Segment> segments_;                  // ring-level segments (of the ring shards), global order
  std::vector<std::vector<SegmentPiece>> pieces_;  // per segment
  std::vector<std::int64_t> cu_seqlens_;           // document bounds ({0, seq_len} for an unpacked layout)
  std::int64_t ring_shard_rows_ = 0;               // rows of this rank's ring shard (padding included)
  std::int64_t chain_links_ = 0;                   // segments that continue the document of the one before
  std::vector<int> mine_;                          // indices into segments_ of this rank's segments, in global order
  std::map<int, std::size_t> slot_;                // global segment index -> index in mine_
};

struct ShortConvCpConfig {
  bool use_silu = true;  // out = silu(conv(x)) (false: conv(x))
};

struct ShortConvCpOutput {
  Tensor out;     // [B, S_local, C], x's dtype
  CpContext ctx;  // what the backward needs; hand it to backward() of the object that made it
};

// The short causal depthwise conv (attention/gdn.h short_conv_*) on a sharded sequence, over groups.sp (rank r
// holds layout.positions(r)). Padding rows get out 0 and dx 0; with a packed layout (B = 1) no output reads an input
// of another document. Errors: as GdnContextParallel's (B > 1 with a packed layout included).
class ShortConvContextParallel {
 public:
  ShortConvContextParallel(const CpGroups& groups, const SequenceLayout& layout, const ShortConvCpConfig& config = {});

  // x [B, S_local, C], weight [C, W] (same on every rank).
  ShortConvCpOutput forward(const TensorView& x, const TensorView& weight);
  // The context of a forward of this object (consumed and freed). Returns dx (local, x's dtype); dweight [C, W]
  // (summed over the group, weight's dtype) into `dweight`.
  Tensor backward(CpContext&& ctx, const TensorView& dout, const TensorView& dweight);

  std::int64_t halo_bytes_sent() const { return halo_bytes_sent_; }
  // The agreement checks of forward and backward (over the SP group): how often each ran or was cached.
  const AgreementCheck& forward_agreement() const { return forward_agreement_; }
  const AgreementCheck& backward_agreement() const { return backward_agreement_; }

 private:
  struct HaloPlan;
  struct Saved;
  const HaloPlan& plan_for(std::int64_t width);

  CpGroups groups_;
  SequenceLayout layout_;
  ShortConvCpConfig config_;
  LayerId id_;
  std::vector<std::vector<std::int64_t>> tokens_;  // per SP rank: the token of each row (-1: padding)
  std::vector<std::int64_t> cu_seqlens_;           // document bounds ({0, seq_len} for an unpacked layout)
  std::vector<Segment> segments_;
  std::shared_ptr<HaloPlan> plan_;  // a function of (layout, W) only: cached, not state between calls
  std::int64_t halo_bytes_sent_ = 0;
  AgreementCheck forward_agreement_, backward_agreement_;
};

}  // namespace seqpar
