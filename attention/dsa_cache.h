// The DSA (DeepSeek sparse attention) cache of inference on one device, and the decode step that selects and
// attends over it. No communication (the sequence-sharded cache of a context-parallel group is
// parallel/dsa_decode_cp.h).
// Math: docs/design.md, "DSA decode" (the training kernels of attention/dsa.h on the cache's rows) and "What lives
// across decode steps" (the cache's memory: dsa_cache_bytes).
//
// Layout: k_idx [B, capacity, Di] and c [B, capacity, Dqk], row-major; batch row b's stored tokens are the first
// length() slots of its block. Every stored row carries its token's global position (strictly increasing).
// Every function here is host-synchronous and raises its errors before anything is written (a refused append
// leaves the cache as it was; a decode never writes the cache).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dsa.h"
#include "token_cache.h"
#include "../runtime/device.h"
#include "../runtime/tensor.h"

namespace seqpar::attn {

// The shape of one layer's cache.
struct DsaCacheSpec {
  std::int64_t batch = 1;                       // B
  std::int64_t capacity = 0;                    // token slots per batch row (>= 0)
  std::int64_t index_dim = kDsaIndexerHeadDim;  // Di
  std::int64_t latent_dim = kDsaHeadDimQk;      // Dqk
  DType dtype = DType::kFloat32;                // storage dtype of k_idx and c (fp32, bf16, fp16, fp64)
};

// The bytes of one layer's cache (M with L = 1, T = capacity; docs/design.md, "What lives across decode steps").
// Returns: B * capacity * (Di + Dqk) * dtype_size(dtype).
// Sync: host-only.
std::int64_t dsa_cache_bytes(const DsaCacheSpec& spec);

// One layer's k_idx and c cache on the host. Memory: allocated once at construction, ledger category
// persistent_cache; appends never allocate.
class DsaCache {
 public:
  // Allocates k_idx and c (ledger category persistent_cache) on the host.
  // Errors: batch, index_dim, latent_dim < 1, capacity < 0, a non-floating dtype, or an allocation failure
  //   ("out of memory: ...").
  // Sync: host-synchronous.
  explicit DsaCache(const DsaCacheSpec& spec);

  // Accessors: the spec, token slots per batch row, stored tokens per batch row.
  // Sync: host-only.
  const DsaCacheSpec& spec() const { return spec_; }
  std::int64_t capacity() const { return spec_.capacity; }
  std::int64_t length() const { return positions_.length(); }
  // Global positions of the stored tokens, [length()], strictly increasing.
  // Sync: host-only.
  const std::vector<std::int64_t>& positions() const { return positions_.positions(); }

  // The stored rows of batch row b.
  // Returns: k_idx [1, length(), Di], c [1, length(), Dqk] (contiguous views into the cache).
  // Errors: b outside [0, B).
  // Sync: host-only, no copy.
  TensorView k_idx_rows(std::int64_t b) const;
  TensorView c_rows(std::int64_t b) const;

  // Appends n tokens.
  // Args: k_idx_new [B, n, Di], c_new [B, n, Dqk], any floating dtype (converted to the cache's); positions [n],
  //   strictly increasing and above the last stored position (empty: the n positions after the last stored one).
  // Errors (nothing written): shapes, dtypes, positions, or length() + n over the capacity.
  // Sync: host-synchronous.
  void append(const TensorView& k_idx_new, const TensorView& c_new, std::span<const std::int64_t> positions = {});

  // Forgets every stored token (length 0); the memory stays allocated.
  // Sync: host-only.
  void clear() { positions_.clear(); }

 private:
  // The checks of append alone (no work).
  void check_append(const TensorView& k_idx_new, const TensorView& c_new,
                    std::span<const std::int64_t> positions) const;

  DsaCacheSpec spec_;
  Tensor k_idx_, c_;
  TokenPositions positions_;
};

// The new queries of a decode step, the cache's dtype each.
struct DsaDecodeArgs {
  TensorView q;                         // [B, n, H, Dqk]
  TensorView q_idx;                     // [B, n, Hi, Di]
  TensorView w;                         // [B, n, Hi]
  std::span<const std::int64_t> q_pos;  // [n] global positions (a query sees stored keys at positions <= its own)
  std::int64_t window = 0;              // > 0: only keys with q_pos - pos < window are candidates (as in training)
  std::int64_t dim_v = kDsaHeadDimV;    // Dv, 1 <= Dv <= Dqk
  double scale = 0.0;                   // <= 0: 1 / sqrt(Dqk)

  // Every check dsa_decode makes on (cache, this, topk_indices, out, lse, stream), no work (topk_indices is not
  // read). A sharded caller runs it on its shard before anything is sent.
  // Errors: as dsa_decode.
  // Sync: host-only.
  void validate(const DsaCache& cache, const TensorView& topk_indices, const TensorView& out, const TensorView& lse,
                Stream stream = Stream::cpu()) const;
};

// The decode step: selects and attends over the cache (docs/design.md, "DSA decode").
// Args: topk_indices [B, n, k] int64 (k = its dim 2); out [B, n, H, Dv] any floating dtype; lse [B, H, n] of the
//   accumulator dtype (accumulator_dtype(dtype)) or fp64, natural log.
// Returns: topk_indices (global positions, ascending, -1 padded), out, lse; -inf and out 0 for a query with
//   nothing selected.
// Errors: shapes and dtypes against the cache, q_pos size, a window < 0, the kernels' own checks.
// Sync: host-synchronous. No communication.
void dsa_decode(const DsaCache& cache, const DsaDecodeArgs& args, const TensorView& topk_indices, const TensorView& out,
                const TensorView& lse, Stream stream = Stream::cpu());

// The first half of dsa_decode, for a sharded cache: scores every stored key visible to each query and merges
// them into `state`.
// Args: args.q is not read; state: scores [B, n, k] of the accumulator dtype, positions [B, n, k] int64
//   (dsa_topk_init first).
// Errors: as dsa_decode, and the state's shapes.
// Sync: host-synchronous. No communication.
void dsa_decode_select(const DsaCache& cache, const DsaDecodeArgs& args, const DsaTopkState& state,
                       Stream stream = Stream::cpu());
// The second half: attention over the selected positions of topk_indices that this cache stores (others are
// simply not here: a shard attends to its own rows).
// Args: args.q_idx, args.w are not read; out [B, n, H, Dv] and lse [B, H, n] as dsa_decode.
// Errors: as dsa_attention_forward on the cache's rows.
// Sync: host-synchronous. No communication.
void dsa_decode_attend(const DsaCache& cache, const DsaDecodeArgs& args, const TensorView& topk_indices,
                       const TensorView& out, const TensorView& lse, Stream stream = Stream::cpu());

}  // namespace seqpar::attn
