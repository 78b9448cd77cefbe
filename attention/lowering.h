// Lowering of one attention block (local queries against one block of keys) into a few rectangles, each with a mask
// of the kind cuDNN's SDPA graphs take (top-left or bottom-right causal diagonal, optional left bound), whose union is
// exactly seqpar's position mask. Device-neutral host code. Math and guarantees: docs/design.md, "Lowering to masked
// rectangles".
// Input: the query and key slot positions of the block (non-decreasing, as attn::MhaForwardArgs q_pos / k_pos) and the
// MaskSpec (causal, window, per-query document bounds doc_lo / doc_hi).
// Output: disjoint rectangles (index ranges into q_pos / k_pos) with their masks; every row sees at least one key;
// lowered_calls groups rectangles with one mask into ragged calls.
// Errors: the kernels' (decreasing positions, doc_lo / doc_hi sizes, window without causal).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "mha.h"

namespace seqpar::attn {

enum class DiagonalAlignment : std::uint8_t { kTopLeft, kBottomRight };

// The mask of one rectangle (the SDPA graph's mask parameters).
struct SdpaMask {
  bool causal = false;  // right bound 0 on the diagonal
  DiagonalAlignment align = DiagonalAlignment::kTopLeft;
  std::int64_t left_bound = 0;  // > 0: sliding window on the diagonal; 0: none
  bool operator==(const SdpaMask&) const = default;
};

struct LoweredRect {
  std::int64_t q_begin = 0, q_end = 0;  // query rows (indices into q_pos)
  std::int64_t k_begin = 0, k_end = 0;  // key rows (indices into k_pos)
  SdpaMask mask;
  std::int64_t sq() const { return q_end - q_begin; }
  std::int64_t sk() const { return k_end - k_begin; }
};

// One library call: rectangles with one mask and disjoint query rows (one segment: dense; several: ragged).
struct LoweredCall {
  SdpaMask mask;
  std::vector<LoweredRect> segments;
};

// The visibility rule of a rectangle's mask (the CPU model of cuDNN's): local (i, j), 0 <= i < sq, 0 <= j < sk.
inline bool sdpa_mask_visible(const SdpaMask& m, std::int64_t sq, std::int64_t sk, std::int64_t i, std::int64_t j) {
  const std::int64_t e = m.align == DiagonalAlignment::kBottomRight ? sk - sq : 0;
  if (m.causal && j > i + e) return false;
  if (m.left_bound > 0 && j <= i + e - m.left_bound) return false;
  return true;
}

// The rectangles of one block (see above), in document order, then query run, then key run. Errors: those of the
// kernels' mask checks (positions non-decreasing, doc bounds of q_pos.size() entries or none, window needs causal).
std::vector<LoweredRect> lower_attention_block(std::span<const std::int64_t> q_pos, std::span<const std::int64_t> k_pos,
                                               const MaskSpec& mask);
// The rectangles grouped into calls: same mask, disjoint query rows; in order of first appearance.
std::vector<LoweredCall> lowered_calls(const std::vector<LoweredRect>& rects);

// "causal bottom-right left=8" and the like, for logs and test names.
std::string sdpa_mask_str(const SdpaMask& m);

// Why every rectangle of a call goes to the exact fallback instead of an SDPA graph because of its variants, or ""
// when it has none: soft-capping (cuDNN's score_mod replaces the built-in masks the rectangles carry), ALiBi (cuDNN's
// slopes are its own, on local indices), sinks (joined once per row after every rectangle is merged), dropout
// (seqpar's Philox counter, not cuDNN's stream). Names every variant present. The CUDA path's routing
// (attention/cuda/mha_cuda.h); host-only.
std::string sdpa_variant_fallback_reason(const MhaForwardArgs& args);

// ---- lowered execution on the CPU (a test mode) -----------------------------------------------------------------
// The calls a device backend will make, run by the CPU kernel: every rectangle of lower_attention_block is copied out
// as its own sub-block (query rows, key rows), run by mha_forward / mha_backward with the rectangle's mask written in
// the kernel's terms (local positions: query i at i + e, or at i + sk for a left bound without causal, key j at j;
// causal and window = left bound, shifted likewise; ALiBi and dropout read the rectangle's global positions and
// q_tokens through MhaForwardArgs::mod_q_pos / mod_k_pos, as the device's fallback does), and the results are put back: forward blocks merged with
// lse_merge (out in the accumulator dtype, lse in fp64, sinks applied once after the last block), backward
// gradients added into dq / dk / dv of the accumulator dtype (index_add_rows). Same inputs, outputs and errors as
// mha_forward / mha_backward; the results agree with them to rounding (fp64: ~1e-15 relative).
// Extra memory: one sub-block's copies (q, k, v, out, dout rows and their results) at a time, plus the merge state
// (out in the accumulator dtype and lse in fp64, [B, Sq, Hq, D] and [B, Hq, Sq]).
void mha_forward_lowered(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse,
                         Stream stream = Stream::cpu());
void mha_backward_lowered(const MhaBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                          bool accumulate, Stream stream = Stream::cpu());

// SEQPAR_LOWERED_ATTENTION = 1 (read once; default 0): mha_forward and mha_backward run every call through the
// lowered path above, the variants included (soft-capping, ALiBi, sinks, dropout). Every ring / all-gather /
// Ulysses / USP step then executes the rectangles a device backend receives. Errors: a value other than 0 or 1.
bool lowered_attention_enabled();
// Rectangles run by the lowered path in this process so far (tests check that the mode was taken).
std::int64_t lowered_rects_executed();

namespace detail {
// Whether mha_forward / mha_backward hand this call to the lowered path (mode on, not inside a lowered call).
bool route_to_lowered(const MhaForwardArgs& args);
}  // namespace detail

}  // namespace seqpar::attn
