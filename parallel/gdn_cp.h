// GDN (gated delta rule) and its short causal conv under context parallelism: the state passes between the
// segments of a layout by chain or scan, value heads split over the Ulysses group, the conv's halo point to point.
// Math and schedules: docs/design.md, "GDN chain and scan" (message rounds of each mode), "GDN segments", "Short conv
// halo", "Grouped value heads" (key heads replicated when Hk < ulysses_size), "GDN on packed rows".
//
// Layouts: contiguous, zigzag or balanced (stripe is refused); packed layouts take B = 1 and [N, Hv, K, V] states.
// States, transitions and their gradients travel in fp32 (fp64 for fp64 inputs). final_state and dinitial_state
// are returned in full on every rank.
// Counters (CpCounters): message_rounds, state-passing bytes, Ulysses bytes (a2a_*), exposed wait and kernel time.
// Errors of the forward and backward calls are raised before any communication, identical on every rank.
// Work ahead: a rank waiting for a state (forward) or a state gradient (backward) from another rank computes,
// meanwhile, the part of the windows that will wait which needs no such state (attn::GdnAhead: per chunk T, W, U and
// the decay scores forward, the chunk start states backward), in the order those windows run, a few chunks per step
// between tests of the pending receive. It posts no message and waits for none, and every message is posted and
// waited for in the order it is without it, so the schedule's message order (and so its freedom from deadlock) is
// unchanged; results are bitwise those without it. SEQPAR_GDN_WORK_AHEAD=0 turns it off (for comparisons).
// Deferred saved copies (forward, ulysses_size 1, host tensors): the kernels read the caller's q, k, v, g, beta, and
// the copies the backward needs are made block by block as idle work (before the work ahead) and, what is left,
// after the rank's last message is posted and before its sends are waited for (testing them between blocks): off the
// critical path of a rank that waits (the first wait of the chain's next rank) and of one that is waited for (the
// tail, while the next rank runs its last head). Local work only, like the work ahead: the message order, and so the
// freedom from deadlock, is unchanged, and so are the results. SEQPAR_GDN_DEFER_COPIES=0 copies them first (for
// comparisons).
// Last window ahead first (forward): the work ahead starts with the last window that waits (what is left of it after
// its state arrives is the rank's tail), then the others in run order; a split window costs about a fifth more than
// one run whole, so the windows between run whole at the sender's pace (docs/design.md, "GDN chain and scan": "The
// last window ahead first"). Only the order of local work changes: messages, freedom from deadlock and results are as
// without it. SEQPAR_GDN_AHEAD_LAST_FIRST=0 keeps the run order (for comparisons).
// Lean backward (host tensors): at ulysses_size 1 the kernels read the caller's dout (no copy); the gradients are not
// zero-filled when no row is padding (every row is written by a window); with grouped value heads (Hv > Hk) the sums
// of dq, dk over the value heads of each key head are made key head by key head, each once its value heads have run on
// every row of the rank, while a message is pending (before the work ahead), the rest after the chain or the scan.
// Local work only: the message order, and so the freedom from deadlock, is unchanged, and each sum adds the same terms
// in the same order (value-head order, in the state dtype), so results are bitwise the same.
// SEQPAR_GDN_LEAN_BACKWARD=0 copies, zero-fills and sums after the chain (for comparisons).
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

// The work ahead's bounds per call and rank: at most this many windows computed ahead and not yet used, their
// buffers (attn::gdn_ahead_bytes) under this many bytes unless a single window needs more.
inline constexpr std::int64_t kGdnAheadMaxWindows = 4;
inline constexpr std::int64_t kGdnAheadBudgetBytes = std::int64_t{256} << 20;

// The tag offset of GdnCp's message `index` (>= 0; a chain message's segment x value heads + head, a scan round's
// round x value heads + head): index mod kGdnTagSpan, in [0, kGdnTagSpan). Each message kind adds it to its own base.
// The index is 64-bit: segments x heads can pass 2^31 on long packed rows of short documents.
inline constexpr std::int64_t kGdnTagSpan = 4000;
inline int gdn_tag_offset(std::int64_t index) { return static_cast<int>(index % kGdnTagSpan); }

// The configuration of GdnCp (the same on every rank).
struct GdnCpConfig {
  GdnCpMode mode = GdnCpMode::kScan;
  bool use_qk_l2norm = true;
  double scale = 0.0;  // <= 0: 1 / sqrt(K)
  std::int64_t chunk_size = attn::kGdnDefaultChunkSize;
  // Compute the state-independent part of the windows that wait while a message is pending (the file comment; off
  // also when SEQPAR_GDN_WORK_AHEAD=0). Results are bitwise the same either way.
  bool work_ahead = true;
  // Forward at ulysses_size 1 on host tensors: the kernels read the caller's inputs and the copies saved for the
  // backward are made in idle time (the file comment; off also when SEQPAR_GDN_DEFER_COPIES=0). Results are bitwise
  // the same either way.
  bool defer_copies = true;
  // Forward: the work ahead starts with the last window that waits (the file comment; off also when
  // SEQPAR_GDN_AHEAD_LAST_FIRST=0). Results are bitwise the same either way.
  bool ahead_last_first = true;
  // Backward on host tensors: dout read in place at ulysses_size 1, no zero fill without padding rows, the key-head
  // sums of dq, dk in idle time (the file comment; off also when SEQPAR_GDN_LEAN_BACKWARD=0). Results are bitwise the
  // same either way.
  bool lean_backward = true;
  // Keep copies of q, k, v, g, beta in the context (true), or none: the caller keeps the forward's tensors (or
  // recomputes them exactly) and hands them back to backward (false; as flash-attention's and TransformerEngine's
  // backward functions take q, k, v again, and as the PyTorch module does with autograd's saved tensors). At
  // ulysses_size > 1 the context holds the exchanged heads layout either way. Results are bitwise the same either way.
  bool save_inputs = true;
};

// The forward's inputs, handed back to GdnCp::backward when GdnCpConfig::save_inputs is false.
struct GdnCpInputs {
  TensorView q, k, v, g, beta;
};

// One run of consecutive tokens held by one rank in consecutive rows.
struct Segment {
  std::int64_t start = 0;  // first token (global index)
  std::int64_t length = 0;
  int owner = 0;                  // rank in the group
  std::int64_t local_offset = 0;  // row of the owner's local tensor where the segment starts
};
// The segments of all ranks in global order (docs/design.md, "GDN segments").
// Args: tokens_per_rank[r]: the token of each row of rank r's shard, increasing over its tokens; -1 marks a
//   padding row, which belongs to no segment and ends a run.
// Returns: the segments, sorted by start.
// Sync: host-only, no communication.
std::vector<Segment> segments_in_global_order(const std::vector<std::vector<std::int64_t>>& tokens_per_rank);

// The part of a segment inside one document: rows [offset, offset + length) of the segment, tokens of document
// `doc`; starts_doc / ends_doc: the piece holds the document's first / last token. A segment's state runs through
// its pieces except at a document start, where it restarts from that document's initial state.
struct SegmentPiece {
  std::int64_t offset = 0, length = 0, doc = 0;
  bool starts_doc = false, ends_doc = false;
};
// The pieces of `seg` in order (docs/design.md, "GDN on packed rows").
// Args: cu_seqlens [N+1], already validated ({0, S} for one document).
// Returns: the pieces, in row order.
// Sync: host-only, no communication.
std::vector<SegmentPiece> segment_pieces(const Segment& seg, const std::vector<std::int64_t>& cu_seqlens);

// Which maps the scan computes, which messages it sends, and which segments run early; a function of the segments'
// pieces and the direction only, the same on every rank (docs/design.md, "GDN chain and scan": "What the scan skips").
// Round r (1..rounds) composes segment i's map with the one of segment i - dir 2^(r-1).
struct GdnScanPlan {
  int rounds = 0;
  std::vector<std::vector<char>> need;   // [r][i]: the scanned map of segment i after round r is used
  std::vector<std::vector<char>> known;  // [r][i]: ... has M = 0 (its U is segment i's true end state / dS_start)
  std::vector<char> direct;              // segment i runs in round 1 from the received state instead of its map
  std::vector<int> ready;                // the first stage (0: phase 1, r: round r) at which known[r][i]
  // Round r composes segment i's map with the one it receives (and so receives one).
  bool composes(int r, int i) const { return need[r][i] && !known[r - 1][i]; }
  // The shift passes segment i's end state (dS_start, backward) to segment i + dir.
  bool shifts(int i, int dir) const { return need[rounds][i] && !direct[i + dir]; }
  // Phase 1 computes segment i's map (gdn_transition forward; the dS sweep backward).
  bool computes_map(int i) const { return need[0][i] && !known[0][i] && !direct[i]; }
};
// The plan in direction dir (+1 forward, -1 backward) for segments with these pieces (segment_pieces).
// Sync: host-only, no communication.
GdnScanPlan gdn_scan_plan(const std::vector<std::vector<SegmentPiece>>& pieces, int dir);

// What GdnCp::forward returns.
struct GdnCpOutput {
  Tensor out;          // [B, S_local, Hv, V], dtype of q
  Tensor final_state;  // [B, Hv, K, V] ([N, Hv, K, V] packed) state dtype, identical on every rank
  CpContext ctx;       // what the backward needs; hand it to backward() of the object that made it
};

// What GdnCp::backward returns.
struct GdnCpGrads {
  Tensor dq, dk;          // local [B, S_local, Hk, K], dtype of q (summed over the value heads of each key head)
  Tensor dv, dg, dbeta;   // local [B, S_local, Hv, V] / [B, S_local, Hv], dtype of q
  Tensor dinitial_state;  // [B, Hv, K, V] ([N, Hv, K, V] packed) state dtype, same on every rank
};

// GDN under context parallelism on this rank's groups (docs/design.md, "GDN chain and scan").
class GdnCp : public CpLayerBase {
 public:
  // A layer over `groups` with `layout`'s positions (contiguous, zigzag or balanced).
  // Errors: layout not built for the groups, stripe layout, chunk_size < 1, non-finite scale.
  // Sync: host-only, no communication.
  GdnCp(const CpGroups& groups, const SequenceLayout& layout, const GdnCpConfig& config);

  // Forward; the state passes between segments by config.mode; the context owns the saved tensors (without copies
  // of the inputs when config.save_inputs is false: backward then takes them back).
  // Args: q, k [B, S_local, Hk, K], v [B, S_local, Hv, V], g, beta [B, S_local, Hv] at positions() (S_local =
  //   layout().local_len(); padding rows are ignored); initial_state: empty or the full [B, Hv, K, V]
  //   ([N, Hv, K, V] for a packed layout of N documents, B = 1) in the state dtype, the same on every rank.
  // Returns: GdnCpOutput; final_state in full on every rank. States travel in fp32 (fp64 for fp64 inputs).
  // Errors: B > 1 with a packed layout, state shapes, head counts (Hv % Hk, Hv % ulysses_size, Hk vs
  //   ulysses_size), shape / dtype mismatches; ranks that disagree (AgreementCheck).
  // Sync: collective over the Ulysses and ring groups; host-synchronous; kernels run on groups.stream.
  GdnCpOutput forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                      const TensorView& beta, const TensorView& initial_state = {});

  // Backward with the context of a forward of this object (consumed and freed).
  // Args: dout [B, S_local, Hv, V]; dfinal_state: empty or the full [B, Hv, K, V] ([N, Hv, K, V] packed), the same
  //   on every rank; inputs: with save_inputs false, the forward's q, k, v, g, beta with the forward's values (the
  //   same tensors unchanged, or an exact recomputation as activation checkpointing makes; values are not
  //   checked), else none.
  // Returns: GdnCpGrads; dinitial_state in full on every rank.
  // Errors: shape / dtype mismatches; a context that is empty, used or another object's; inputs missing (save_inputs
  //   false), given (save_inputs true) or shaped unlike the forward's; ranks that disagree.
  // Sync: collective over the Ulysses and ring groups; host-synchronous; kernels run on groups.stream.
  GdnCpGrads backward(CpContext&& ctx, const TensorView& dout, const TensorView& dfinal_state = {},
                      const GdnCpInputs& inputs = {});

  // layout(), positions(), counters(), reset_counters(): CpLayerBase.

  // Seconds this rank spent in each part of its last forward or backward call (also logged at debug level):
  // maps: segment maps (forward: gdn_transition; backward: the dS sweep of a carrying segment); local: the kernels
  // that produce outputs and gradients; combine: composing and applying maps; wait: blocked on state messages;
  // copies: moving rows between layouts (the Ulysses exchange, head-major copies, a segment's rows in and out);
  // total: the whole call. last_phase_seconds() is wall time; last_phase_cpu_seconds() the process's CPU time in
  // the same parts (its wait is 0: a wait's CPU time depends on how the communicator polls; it is in total).
  // ahead: the part of local spent on work ahead (attn::GdnAhead) while a message was pending.
  struct PhaseSeconds {
    double maps = 0, local = 0, combine = 0, wait = 0, copies = 0, total = 0, ahead = 0;
  };
  const PhaseSeconds& last_phase_seconds() const { return phases_; }
  const PhaseSeconds& last_phase_cpu_seconds() const { return cpu_phases_; }

 private:
  struct Saved;
  struct ForwardPass;
  using ScanPlan = GdnScanPlan;
  struct ScanHooks;
  class AheadQueue;
  struct BackwardPass;
  AheadQueue forward_ahead_queue(ForwardPass& f);
  AheadQueue backward_ahead_queue(BackwardPass& bp);
  attn::GdnWindow waiting_window(std::size_t j, std::int64_t h, bool backward) const;
  void add_scan_waits(const ScanPlan& p, int dir, std::int64_t heads, AheadQueue& q, bool backward) const;
  void run_scan(const ScanPlan& p, int dir, const Saved& s, const DeviceAlloc& alloc, const ScanHooks& hooks);
  std::shared_ptr<Saved> validate_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                          const TensorView& g, const TensorView& beta,
                                          const TensorView& initial_state) const;
  Tensor run_pieces(ForwardPass& f, std::size_t j, std::int64_t h, bool known, bool continuing);
  void forward_chain(ForwardPass& f);
  void log_phases(const char* what) const;  // last_phase_seconds() and last_phase_cpu_seconds() at debug level
  void forward_scan(ForwardPass& f);
  // Segment i continues the document of the segment before it (its first token starts no document): only then does a
  // state pass between the two.
  bool continues(int i) const { return !pieces_[i].front().starts_doc; }
  struct BackwardPass;
  struct PieceBackward;
  PieceBackward piece_backward(BackwardPass& bp, std::size_t j, const SegmentPiece& p, std::int64_t h);
  Tensor run_piece(BackwardPass& bp, std::size_t j, const SegmentPiece& p, std::int64_t h, const TensorView& ds_end);
  Tensor run_pieces_backward(BackwardPass& bp, std::size_t j, std::int64_t h, bool known, bool waiting,
                             const TensorView& ds_end_in);
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
  std::shared_ptr<const ScanPlan> plan_fwd_, plan_bwd_;  // the scan's plan in each direction
  PhaseSeconds phases_, cpu_phases_;
  bool work_ahead_ = true;    // SEQPAR_GDN_WORK_AHEAD
  bool defer_copies_ = true;  // SEQPAR_GDN_DEFER_COPIES
  bool ahead_last_first_ = true;  // SEQPAR_GDN_AHEAD_LAST_FIRST
  bool lean_backward_ = true;  // SEQPAR_GDN_LEAN_BACKWARD
};

// The configuration of ShortConvCp.
struct ShortConvCpConfig {
  bool use_silu = true;  // out = silu(conv(x)) (false: conv(x))
};

// What ShortConvCp::forward returns.
struct ShortConvCpOutput {
  Tensor out;     // [B, S_local, C], x's dtype
  CpContext ctx;  // what the backward needs; hand it to backward() of the object that made it
};

// What ShortConvCp::backward returns.
struct ShortConvCpGrads {
  Tensor dx;       // [B, S_local, C], x's dtype
  Tensor dweight;  // [C, W], weight's dtype, summed over the group (the same on every rank)
};

// The short causal depthwise conv (attention/gdn.h short_conv_*) on a sharded sequence, over groups.cp (rank r
// holds layout.positions(r)); docs/design.md, "Short conv halo". Padding rows get out 0 and dx 0; with a packed
// layout (B = 1) no output reads an input of another document.
class ShortConvCp {
 public:
  // A layer over groups.cp with `layout`'s positions.
  // Errors: layout not built for the groups.
  // Sync: host-only, no communication.
  ShortConvCp(const CpGroups& groups, const SequenceLayout& layout, const ShortConvCpConfig& config = {});

  // Forward; receives the halo point to point.
  // Args: x [B, S_local, C], weight [C, W] (same on every rank).
  // Returns: ShortConvCpOutput.
  // Errors: as GdnCp's (B > 1 with a packed layout included).
  // Sync: collective over the CP group; host-synchronous; kernels run on groups.stream.
  ShortConvCpOutput forward(const TensorView& x, const TensorView& weight);

  // Backward with the context of a forward of this object (consumed and freed); the first form returns dx and
  // dweight, the second writes dweight into the caller's `dweight` and returns dx.
  // Args: dout like the output; dweight [C, W], weight's dtype.
  // Returns: dx; dweight summed over the group (the same on every rank).
  // Errors: as GdnCp's; a context that is empty, used or another object's.
  // Sync: collective over the CP group (halo gradient point to point, dweight all-reduced); host-synchronous.
  ShortConvCpGrads backward(CpContext&& ctx, const TensorView& dout);
  Tensor backward(CpContext&& ctx, const TensorView& dout, const TensorView& dweight);

  // Bytes of halo this rank has sent in forward calls since construction.
  // Sync: host-only.
  std::int64_t halo_bytes_sent() const { return halo_bytes_sent_; }

  // The agreement checks of forward and backward (over the CP group): how often each ran or was cached.
  // Sync: host-only.
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
  std::vector<std::vector<std::int64_t>> tokens_;  // per CP rank: the token of each row (-1: padding)
  std::vector<std::int64_t> cu_seqlens_;           // document bounds ({0, seq_len} for an unpacked layout)
  std::vector<Segment> segments_;
  std::shared_ptr<HaloPlan> plan_;  // a function of (layout, W) only: cached, not state between calls
  std::int64_t halo_bytes_sent_ = 0;
  AgreementCheck forward_agreement_, backward_agreement_;
};

}  // namespace seqpar
