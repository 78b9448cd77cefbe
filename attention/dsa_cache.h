// The DSA (DeepSeek sparse attention) cache of inference on one device, and the decode step that selects and
// attends over it. No communication (the sequence-sharded cache of a context-parallel group is
// parallel/dsa_decode_cp.h).
//
// What lives across decode steps (docs/design.md section 16): a DSA layer reads, for every past token j, its indexer
// key k_idx_j [Di] (one head, shared by the Hi indexer heads) and its latent c_j [Dqk] (absorbed MLA: one latent
// shared by all H query heads, the value being its first Dv columns). No query is kept. Memory of L layers of
// capacity T:
//   M = L B T (Di + Dqk) bytes_per_element
// allocated once, at construction (appends never allocate), from the memory ledger in category persistent_cache;
// dsa_cache_bytes(spec) is that formula for L = 1 and the ledger grows by exactly that much per cache object.
//
// Positions: every stored row carries the global position of its token (strictly increasing, attention/token_cache.h,
// like MhaKvCache): 0, 1, 2, ... for a whole sequence, any increasing subset for a shard of a context-parallel cache.
// Layout: k_idx [B, capacity, Di] and c [B, capacity, Dqk] row-major, batch row b's stored tokens the first length()
// slots of its block.
//
// Decode (attention/dsa.h, the training kernels on the cache's rows; no second kernel): n >= 1 new queries at
// positions q_pos, whose own k_idx and c were appended first (so that drafts see each other causally):
//   I_tj = sum_i w_ti relu(q_idx_ti . k_idx_j)   for stored j with pos_j <= q_pos[t] (and q_pos[t] - pos_j < window
//                                                when window > 0),
//   J_t  = the k stored keys with the largest I_tj (larger score first, then smaller position: the training tie
//          rule), topk_indices = J_t ascending, -1 padded,
//   out_ht = sum_{j in J_t} softmax_j(scale q_ht . c_j) c_j[:Dv],  lse_ht = log sum_{j in J_t} exp(scale q_ht . c_j).
// The decode is dsa_topk_init + dsa_indexer_topk_block + dsa_topk_finalize + dsa_attention_forward, one call each per
// batch row (a partly filled [B, capacity, ...] buffer is contiguous per row only), so it returns exactly the rows of
// the training forward over the whole sequence: topk_indices bitwise, out and lse to the kernels' rounding.
// The two halves are public for a sharded cache (parallel/dsa_decode_cp.h): dsa_decode_select scores this cache's
// rows into a running top-k state, and dsa_decode_attend attends to the selected positions this cache holds.
// Synchronisation: host-synchronous (the stream is an ordering token on the CPU).
// Errors: Error naming the tensor and the rule, raised before anything is written (a refused append or decode leaves
// the cache as it was; a decode never writes the cache).
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

// B * capacity * (Di + Dqk) * dtype_size(dtype): the bytes of one layer's cache (M with L = 1, T = capacity).
std::int64_t dsa_cache_bytes(const DsaCacheSpec& spec);

class DsaCache {
 public:
  // Allocates k_idx and c (ledger category persistent_cache) on the host. Errors: batch, index_dim, latent_dim < 1,
  // capacity < 0, a non-floating dtype, or an allocation failure ("out of memory: ...").
  explicit DsaCache(const DsaCacheSpec& spec);

  const DsaCacheSpec& spec() const { return spec_; }
  std::int64_t capacity() const { return spec_.capacity; }
  std::int64_t length() const { return positions_.length(); }
  // Global positions of the stored tokens, [length()], strictly increasing.
  const std::vector<std::int64_t>& positions() const { return positions_.positions(); }
  // The stored rows of batch row b: k_idx [1, length(), Di], c [1, length(), Dqk] (contiguous views into the cache).
  TensorView k_idx_rows(std::int64_t b) const;
  TensorView c_rows(std::int64_t b) const;

  // Appends n tokens: k_idx_new [B, n, Di], c_new [B, n, Dqk] (any floating dtype, converted to the cache's) at
  // `positions` ([n], strictly increasing and above the last stored position; empty: the n positions after the last
  // stored one). Errors (nothing written): shapes, dtypes, positions, or length() + n over the capacity.
  void append(const TensorView& k_idx_new, const TensorView& c_new, std::span<const std::int64_t> positions = {});
  // The checks of append alone (no work).
  void check_append(const TensorView& k_idx_new, const TensorView& c_new,
                    std::span<const std::int64_t> positions = {}) const;
  // Forgets every stored token (length 0); the memory stays allocated.
  void clear() { positions_.clear(); }

 private:
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
  float scale = 0.0f;                   // <= 0: 1 / sqrt(Dqk)
};

// The decode step: topk_indices [B, n, k] int64 (k = its dim 2; global positions, ascending, -1 padded),
// out [B, n, H, Dv] any floating dtype, lse [B, H, n] of the accumulator dtype (accumulator_dtype(dtype)) or fp64
// (natural log; -inf and out 0 for a query with nothing selected). Errors: shapes and dtypes against the cache,
// q_pos size, a window < 0, the kernels' own checks.
void dsa_decode(const DsaCache& cache, const DsaDecodeArgs& args, const TensorView& topk_indices, const TensorView& out,
                const TensorView& lse, Stream stream = Stream::cpu());
// The checks of dsa_decode alone (no work; topk_indices is not read).
void check_dsa_decode(const DsaCache& cache, const DsaDecodeArgs& args, const TensorView& topk_indices,
                      const TensorView& out, const TensorView& lse, Stream stream = Stream::cpu());

// The first half, for a sharded cache: scores every stored key visible to each query (args.q is not read) and merges
// them into `state` (scores [B, n, k] of the accumulator dtype, positions [B, n, k] int64; dsa_topk_init first).
// Errors: as dsa_decode, and the state's shapes.
void dsa_decode_select(const DsaCache& cache, const DsaDecodeArgs& args, const DsaTopkState& state,
                       Stream stream = Stream::cpu());
// The second half: out [B, n, H, Dv] and lse [B, H, n] (as dsa_decode) over the selected positions of topk_indices
// that this cache stores (others are simply not here: a shard attends to its own rows). args.q_idx, args.w are not
// read. Errors: as dsa_attention_forward on the cache's rows.
void dsa_decode_attend(const DsaCache& cache, const DsaDecodeArgs& args, const TensorView& topk_indices,
                       const TensorView& out, const TensorView& lse, Stream stream = Stream::cpu());

}  // namespace seqpar::attn
