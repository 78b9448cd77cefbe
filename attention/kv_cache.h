// The MHA / GQA key-value cache of inference on one device, and the decode kernel that attends new query tokens to
// it. No communication (the sequence-sharded cache of a context-parallel group is parallel/decode_cp.h).
//
// What lives across decode steps (docs/design.md section 16): a causal decoder never changes the keys and values of
// a past token, and a past query is never asked again, so each attention layer keeps K and V of every token seen
// and no Q. Prefill writes the prompt's rows; each decode step appends the rows of its n new tokens (n > 1 for
// speculative drafts) and attends their queries, causally, to everything stored:
//   a_ij = scale * q_i . k_j  for stored keys j with k_pos[j] <= q_pos[i],
//   lse_i = log sum_j exp(a_ij),  o_i = sum_j exp(a_ij - lse_i) v_j          (attention/mha.h, the same kernel).
// Memory: one layer holds K and V of [B, capacity, Hkv, D]; L layers of capacity T hold
//   M_KV = 2 L B Hkv T D bytes_per_element
// (2: K and V). The capacity is allocated once, at construction (a static cache: appends never allocate), from the
// memory ledger in category persistent_cache; mha_kv_cache_bytes(spec) is that formula for L = 1 and the ledger's
// persistent_cache grows by exactly that much per cache object.
//
// Positions: every stored row carries the global position of its token (strictly increasing along the cache). A
// cache of a whole sequence stores 0, 1, 2, ...; a shard of a context-parallel cache stores the positions its rank
// owns (any increasing subset), so that the causal mask stays one on global positions.
// Layout: K and V are [B, capacity, Hkv, D] row-major, batch row b's stored tokens the first length() slots of its
// block; positions are host metadata (length() int64, not in the ledger).
// Synchronisation: host-synchronous (the stream argument is an ordering token on the CPU), like attention/mha.h.
// Errors: Error naming the tensor and the rule, raised before anything is written (a refused append or decode leaves
// the cache as it was).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "token_cache.h"
#include "../runtime/device.h"
#include "../runtime/tensor.h"

namespace seqpar::attn {

// The shape of one layer's cache.
struct KvCacheSpec {
  std::int64_t batch = 1;         // B
  std::int64_t capacity = 0;      // token slots per batch row (>= 0)
  std::int64_t kv_heads = 1;      // Hkv
  std::int64_t head_dim = 1;      // D
  DType dtype = DType::kFloat32;  // storage dtype of K and V (fp32, bf16, fp16, fp64)
};

// 2 * B * capacity * Hkv * D * dtype_size(dtype): the bytes of one layer's cache (M_KV with L = 1, T = capacity).
std::int64_t mha_kv_cache_bytes(const KvCacheSpec& spec);

class MhaKvCache {
 public:
  // Allocates K and V (ledger category persistent_cache) on the host. Errors: batch, kv_heads, head_dim < 1,
  // capacity < 0, a non-floating dtype, or an allocation failure ("out of memory: ...").
  explicit MhaKvCache(const KvCacheSpec& spec);

  const KvCacheSpec& spec() const { return spec_; }
  std::int64_t capacity() const { return spec_.capacity; }
  std::int64_t length() const { return positions_.length(); }
  // Global positions of the stored tokens, [length()], strictly increasing.
  const std::vector<std::int64_t>& positions() const { return positions_.positions(); }
  // The stored rows of batch row b: [1, length(), Hkv, D] (contiguous views into the cache).
  TensorView k_rows(std::int64_t b) const;
  TensorView v_rows(std::int64_t b) const;

  // Appends n tokens: k_new, v_new [B, n, Hkv, D] (any floating dtype, converted to the cache's) at `positions`
  // ([n], strictly increasing and above the last stored position; empty: the n positions after the last stored
  // one, from 0 for an empty cache). Errors (nothing written): shapes, dtypes, positions, or length() + n over the
  // capacity ("... past the capacity ...").
  void append(const TensorView& k_new, const TensorView& v_new, std::span<const std::int64_t> positions = {});
  // The checks of append alone (no work).
  void check_append(const TensorView& k_new, const TensorView& v_new,
                    std::span<const std::int64_t> positions = {}) const;
  // Forgets every stored token (length 0); the memory stays allocated.
  void clear() { positions_.clear(); }

 private:
  KvCacheSpec spec_;
  Tensor k_, v_;
  TokenPositions positions_;
};

// Decode: the n new queries q [B, n, Hq, D] (the cache's dtype, Hq a multiple of Hkv) at global positions q_pos
// ([n], non-decreasing) attend causally to every stored token (key j visible to query i iff positions()[j] <=
// q_pos[i]); their own keys must already be appended for a query to see itself. out [B, n, Hq, D] any floating dtype;
// lse [B, Hq, n] of the accumulator dtype (accumulator_dtype(dtype)) or fp64, natural log; a query with no visible
// stored key gets lse = -inf and out = 0 (a shard of a parallel cache that holds nothing it may see). scale <= 0:
// 1 / sqrt(D). One mha_forward call per batch row on the cache's contiguous rows (attention/mha.h: its precision,
// threads and errors). Errors: shapes against the cache (B, D, Hq % Hkv), dtype, q_pos size or order.
void mha_decode(const MhaKvCache& cache, const TensorView& q, std::span<const std::int64_t> q_pos,
                const TensorView& out, const TensorView& lse, float scale = 0.0f, Stream stream = Stream::cpu());
// The checks of mha_decode alone (no work).
void check_mha_decode(const MhaKvCache& cache, const TensorView& q, std::span<const std::int64_t> q_pos,
                      const TensorView& out, const TensorView& lse, float scale = 0.0f, Stream stream = Stream::cpu());

}  // namespace seqpar::attn
