// The GDN inference cache on one device and its decode steps: the recurrent state and the short-conv tail. No
// communication (head-sharded decode over a context-parallel group: parallel/decode_cp.h).
//
// What lives across decode steps (docs/design.md section 16): a gated delta rule layer keeps no per-token keys or
// values, only its state S [B, Hv, K, V] (the same for any number of tokens seen) and, for its short causal conv of
// width W, the last W-1 inputs [B, W-1, C]. Memory of one layer:
//   M_GDN = B Hv K V bytes(state dtype) + B (W-1) C bytes(conv dtype)       (constant in the context length T)
// allocated once at construction, ledger category persistent_cache (gdn_cache_bytes(spec) is that formula).
//
// Decode step of n >= 1 tokens (attention/gdn.h, the same math; Yang et al., "Gated Delta Networks", ICLR 2025):
// for each token in order, per batch b and value head h (q_t, k_t of key head h / (Hv / Hk), after the optional L2
// normalisation and the scale),
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t.
// It runs attention/gdn.h's gdn_forward from the cached state with chunk_size 1: a chunk of one token is exactly
// one step of the recurrence (A = 0, T = I), token by token, so decode and the chunked prefill are one kernel.
// The short conv step is short_conv_forward with the tail as initial_conv_state: y_t = sum_w weight[c, w]
// xin[t + w, c] over the tail followed by the new inputs, the new tail the last W-1 rows of that sequence.
// Dtypes: inputs any floating dtype; the state has the state dtype (fp32, fp64 for fp64 inputs: accumulator_dtype
// of q), the conv tail the dtype of x. Synchronisation: host-synchronous.
// Errors: Error naming the tensor and the rule, raised before the cache is written (a refused step leaves the
// state, the tail and length() as they were).
#pragma once

#include <cstdint>

#include "gdn.h"
#include "../runtime/device.h"
#include "../runtime/tensor.h"

namespace seqpar::attn {

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

// B Hv K V bytes(state_dtype) + B (W-1) C bytes(conv_dtype): M_GDN of one layer.
std::int64_t gdn_cache_bytes(const GdnCacheSpec& spec);

class GdnCache {
 public:
  // Allocates the state and the tail (ledger category persistent_cache), both zero (the empty prefix).
  // Errors: sizes < 1 (conv_channels < 0), a state dtype other than fp32 / fp64, a non-floating conv dtype.
  explicit GdnCache(const GdnCacheSpec& spec);

  const GdnCacheSpec& spec() const { return spec_; }
  // Tokens absorbed by the state (set_state's length plus every gdn_decode step since).
  std::int64_t length() const { return length_; }
  TensorView state() const { return state_.view(); }            // [B, Hv, K, V]
  TensorView conv_state() const { return conv_state_.view(); }  // [B, W-1, C]

  // Replaces the state with `state` [B, Hv, K, V] (any floating dtype, converted; e.g. a prefill's final_state)
  // after `length` tokens (>= 0). Errors: shape, dtype, length < 0.
  void set_state(const TensorView& state, std::int64_t length);
  // Replaces the tail with `tail` [B, W-1, C] (e.g. a prefill's final_conv_state). Errors: shape, dtype.
  void set_conv_state(const TensorView& tail);

 private:
  friend void gdn_decode(GdnCache&, const GdnForwardArgs&, const TensorView&, Stream);
  GdnCacheSpec spec_;
  Tensor state_, conv_state_;
  std::int64_t length_ = 0;
};

// n tokens through the recurrence from the cached state: args.q, k [B, n, Hk, K], v [B, n, Hv, V], g, beta
// [B, n, Hv] with the cache's B, Hv, K, V and a state dtype equal to accumulator_dtype(q); use_qk_l2norm and scale as
// in gdn_forward; args.initial_state and args.chunk_size must be left at their defaults (the cache supplies the
// state, the step runs token by token). out [B, n, Hv, V] any floating dtype. The cache's state becomes S after the
// n tokens and length() grows by n. Errors (cache untouched): gdn_forward's, and shapes against the cache.
void gdn_decode(GdnCache& cache, const GdnForwardArgs& args, const TensorView& out, Stream stream = Stream::cpu());
// The checks of gdn_decode alone (no work).
void check_gdn_decode(const GdnCache& cache, const GdnForwardArgs& args, const TensorView& out,
                      Stream stream = Stream::cpu());

// n inputs x [B, n, C] (the cache's conv dtype and C) through the short conv with the cached tail: out [B, n, C]
// (args.initial_conv_state must be empty: the cache supplies it); the tail becomes the last W-1 inputs.
// weight [C, W] with the cache's W. Errors (cache untouched): short_conv_forward's, and shapes against the cache.
void short_conv_decode(GdnCache& cache, const ShortConvArgs& args, const TensorView& out,
                       Stream stream = Stream::cpu());

}  // namespace seqpar::attn
