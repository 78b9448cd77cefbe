// The GDN inference cache on one device and its decode steps: the recurrent state and the short-conv tail. No
// communication (head-sharded decode over a context-parallel group: parallel/decode_cp.h).
// Math: docs/design.md, "GDN decode" (gdn_forward from the cached state with chunk_size 1, one step of the
// recurrence per token; the conv step with the tail as initial_conv_state) and "What lives across decode steps"
// (gdn_cache_bytes, constant in the context length).
#pragma once

#include <cstdint>

#include "gdn.h"
#include "../runtime/device.h"
#include "../runtime/tensor.h"

namespace seqpar::attn {

// The shape of one layer's GDN cache.
struct GdnCacheSpec {
  std::int64_t batch = 1;               // B
  std::int64_t value_heads = 1;         // Hv (the heads this cache holds)
  std::int64_t key_dim = 1;             // K
  std::int64_t value_dim = 1;           // V
  DType state_dtype = DType::kFloat32;  // fp32, or fp64 (the accumulator dtype of the inputs)
  std::int64_t conv_channels = 0;       // C of the short conv; 0: no conv tail
  std::int64_t conv_width = 1;          // W >= 1 (the tail holds W-1 inputs)
  DType conv_dtype = DType::kFloat32;   // dtype of the conv inputs x
};

// The bytes of one layer's cache, M_GDN (docs/design.md, "What lives across decode steps").
// Returns: B Hv K V bytes(state_dtype) + B (W-1) C bytes(conv_dtype).
// Sync: host-only.
std::int64_t gdn_cache_bytes(const GdnCacheSpec& spec);

// The recurrent state [B, Hv, K, V] of the state dtype (fp32, fp64 for fp64 inputs) and the conv tail
// [B, W-1, C] of x's dtype. Memory: allocated once at construction, ledger category persistent_cache.
class GdnCache {
 public:
  // Allocates the state and the tail (ledger category persistent_cache), both zero (the empty prefix).
  // Errors: sizes < 1 (conv_channels < 0), a state dtype other than fp32 / fp64, a non-floating conv dtype.
  // Sync: host-synchronous.
  explicit GdnCache(const GdnCacheSpec& spec);

  // Accessors: the spec; length(): tokens absorbed by the state (set_state's length plus every gdn_decode step
  // since); state() [B, Hv, K, V]; conv_state() [B, W-1, C] (views into the cache).
  // Sync: host-only.
  const GdnCacheSpec& spec() const { return spec_; }
  std::int64_t length() const { return length_; }
  TensorView state() const { return state_.view(); }
  TensorView conv_state() const { return conv_state_.view(); }

  // Replaces the state (e.g. with a prefill's final_state) after `length` tokens.
  // Args: state [B, Hv, K, V], any floating dtype (converted); length >= 0.
  // Errors (cache untouched): shape, dtype, length < 0.
  // Sync: host-synchronous.
  void set_state(const TensorView& state, std::int64_t length);

  // Replaces the tail (e.g. with a prefill's final_conv_state).
  // Args: tail [B, W-1, C].
  // Errors (cache untouched): shape, dtype.
  // Sync: host-synchronous.
  void set_conv_state(const TensorView& tail);

 private:
  friend void gdn_decode(GdnCache&, const GdnForwardArgs&, const TensorView&, Stream);
  GdnCacheSpec spec_;
  Tensor state_, conv_state_;
  std::int64_t length_ = 0;
};

// n tokens through the recurrence from the cached state (docs/design.md, "GDN decode"); the cache's state
// becomes S after the n tokens and length() grows by n.
// Args: args.q, k [B, n, Hk, K], v [B, n, Hv, V], g, beta [B, n, Hv] with the cache's B, Hv, K, V and a state
//   dtype equal to accumulator_dtype(q); use_qk_l2norm and scale as in gdn_forward; args.initial_state and
//   args.chunk_size left at their defaults (the cache supplies the state, the step runs token by token);
//   out [B, n, Hv, V] any floating dtype.
// Errors (raised before the cache is written; a refused step leaves the state, the tail and length() as they
//   were): gdn_forward's, and shapes against the cache.
// Sync: host-synchronous. No communication.
void gdn_decode(GdnCache& cache, const GdnForwardArgs& args, const TensorView& out, Stream stream = Stream::cpu());

// n inputs through the short conv with the cached tail as initial_conv_state; the tail becomes the last W-1
// inputs.
// Args: x [B, n, C] the cache's conv dtype and C; weight [C, W] with the cache's W; args.initial_conv_state
//   empty (the cache supplies it); out [B, n, C].
// Errors (cache untouched): short_conv_forward's, and shapes against the cache.
// Sync: host-synchronous. No communication.
void short_conv_decode(GdnCache& cache, const ShortConvArgs& args, const TensorView& out,
                       Stream stream = Stream::cpu());

}  // namespace seqpar::attn
