// DSA (DeepSeek sparse attention) under context parallelism: selection over the CP group (ring or all-gather of the
// index keys), attention over Ulysses x ring with the latent ring, and the indexer loss out of backward().
// Math and schedules: docs/design.md, "DSA under context parallelism"; loss: "DSA indexer loss"; packed rows: "DSA
// on packed rows"; precision: "DSA precision".
//
// topk_indices hold SLOT positions (layout().tokens_of_slots maps them to tokens), -1 padded. Every scratch array
// and travelling accumulator has the kernels' accumulator dtype (fp64 for fp64 inputs, else fp32).
// Counters (CpCounters): attention_pairs, ring / SP bytes, Ulysses bytes (a2a_*), exposed wait and kernel time, and
// message_rounds: the rounds of both rings (docs/design.md, "DSA under context parallelism").
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include "../attention/dsa.h"
#include "cp_common.h"
#include "layout.h"
#include "ring_pass.h"

namespace seqpar {

// The configuration of DsaCp (the same on every rank).
struct DsaCpConfig {
  DsaSelectMode select = DsaSelectMode::kRing;
  std::int64_t topk = attn::kDsaTopK;
  std::int64_t dim_v = attn::kDsaHeadDimV;
  double scale = 0.0;  // <= 0: 1 / sqrt(Dqk)
  // > 0: the indexer's candidates of query t are the keys with 0 <= t - k_pos < window (attn::DsaIndexerArgs::window);
  // the selection then moves only the index-key rows a rank's queries can see (WindowPlan, parallel/ring_pass.h).
  std::int64_t window = 0;
};

// What DsaCp::forward returns.
struct DsaCpOutput {
  Tensor out;           // [B, S_local, H, Dv], dtype of q
  Tensor lse;           // [B, H, S_local] accumulator_dtype of q (fp64 for fp64 inputs, else fp32)
  Tensor topk_indices;  // [B, S_local, topk] int64 global SLOT positions (layout()), ascending, -1 padded
  CpContext ctx;        // what the backward needs; hand it to backward() of the object that made it
};

// What DsaCp::backward returns.
struct DsaCpGrads {
  Tensor dq;        // [B, S_local, H, Dqk]
  Tensor dc;        // [B, S_local, Dqk]
  Tensor dq_idx;    // [B, S_local, Hi, Di]
  Tensor dk_idx;    // [B, S_local, Di]
  Tensor dw;        // [B, S_local, Hi]
  double loss = 0;  // indexer KL loss summed over the whole sequence (the same on every rank)
};

// Rewrites topk_indices in place from slot positions of `layout` to token indices of the user's row
// (SequenceLayout::token_of_slot; selected slots always hold tokens); -1 stays -1.
// Args: topk_indices [..., k] int64 host tensor, e.g. DsaCpOutput::topk_indices.
// Errors: a non-int64 or non-host tensor.
// Sync: host-synchronous, no communication.
void dsa_topk_slots_to_tokens(const SequenceLayout& layout, const TensorView& topk_indices);

// Runs `allocate`, the allocations of a top-k selection's buffers (a topk entry per query row); one that fails (out of
// memory, a size beyond int64) is rethrown naming topk and the keys it selects among, then the allocator's message
// (a huge topk failed naming only the bytes). DsaCp and DsaDecodeCp call it before their first message.
// Errors: allocate's, reworded. Sync: allocate's.
void allocate_naming_topk(const char* who, std::int64_t topk, std::int64_t keys, const std::function<void()>& allocate);

// One DSA layer under context parallelism on this rank's groups (docs/design.md, "DSA under context parallelism").
class DsaCp : public CpLayerBase {
 public:
  // A layer over `groups` with `layout`'s positions.
  // Errors: the layout not built for the groups; topk < 1, dim_v < 1.
  // Sync: host-only, no communication.
  DsaCp(const CpGroups& groups, const SequenceLayout& layout, const DsaCpConfig& config);

  // Selection, latent attention; the context owns the saved tensors (saved_activation).
  // Args: q [B, S_local, H, Dqk], c [B, S_local, Dqk], q_idx [B, S_local, Hi, Di], k_idx [B, S_local, Di],
  //   w [B, S_local, Hi], all one dtype, at positions(); S_local = layout().local_len() (padded_len /
  //   (ulysses_size * ring_size)); B = 1 for a packed layout. Padding rows (token_index -1) should be zero
  //   (shard_sequence makes them so); they select nothing whatever they hold.
  // Returns: DsaCpOutput; topk_indices hold SLOT positions, -1 padded.
  // Errors (before any communication, identical on every rank): heads not divisible by ulysses_size, shapes /
  //   dtypes, topk < 1, dim_v outside [1, Dqk]; ranks that disagree on inputs, configuration or layout
  //   (AgreementCheck, parallel/cp_common.h).
  // Sync: collective over the groups' Ulysses, ring and CP communicators; host-synchronous; kernels run on
  //   groups.stream.
  DsaCpOutput forward(const TensorView& q, const TensorView& c, const TensorView& q_idx, const TensorView& k_idx,
                      const TensorView& w);
  // Backward with the context of a forward of this object (consumed and freed), and the indexer loss.
  // Args: dout [B, S_local, H, Dv]; loss_grad_scale multiplies the indexer loss gradient (the caller's loss weight).
  // Returns: DsaCpGrads, with the indexer loss summed over the whole sequence.
  // Errors (before any communication, identical on every rank): shapes / dtypes; a context that is empty, used or
  //   another object's; ranks that disagree.
  // Sync: collective over the groups' Ulysses, ring and CP communicators; host-synchronous.
  DsaCpGrads backward(CpContext&& ctx, const TensorView& dout, double loss_grad_scale = 1.0);

  // layout(), positions(), counters(), reset_counters(): CpLayerBase.

 private:
  struct Saved;
  void validate_forward(const TensorView& q, const TensorView& c, const TensorView& q_idx, const TensorView& k_idx,
                        const TensorView& w) const;
  void select_topk(Saved& saved, const TensorView& q_idx, const TensorView& k_idx, const TensorView& w,
                   const DeviceAlloc& alloc);
  void attend_latent(Saved& saved, const DeviceAlloc& alloc);
  void indexer_backward(const Saved& saved, const TensorView& probs, double loss_grad_scale, const DeviceAlloc& alloc,
                        DsaCpGrads& g);

  DsaCpConfig config_;
  std::vector<std::vector<std::int64_t>> cp_positions_;    // every CP rank's positions
  std::vector<std::vector<std::int64_t>> ring_positions_;  // every ring rank's ring shard
  std::optional<WindowPlan> select_plan_;                  // ring selection with a window (over the CP group)
  DocBounds doc_, ring_doc_;  // packed or padded rows: document bounds of positions() and of the ring shard; else empty
};

}  // namespace seqpar
