// The MHA / GQA key-value cache of inference on one device, and the decode kernel that attends new query tokens to
// it. No communication (the sequence-sharded cache of a context-parallel group is parallel/decode_cp.h).
// Math: docs/design.md, "MHA decode kernel" (mha_forward of attention/mha.h on the cache's rows, causal on global
// positions) and "What lives across decode steps" (the cache's memory: mha_kv_cache_bytes).
//
// Layout: K and V are [B, capacity, Hkv, D] row-major; batch row b's stored tokens are the first length() slots of
// its block. Every stored row carries its token's global position (strictly increasing; a shard of a
// context-parallel cache stores any increasing subset).
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
  Device device;                  // where K and V live (default: the host; a CUDA device in a CUDA build)
};

// The bytes of one layer's cache (M_KV with L = 1, T = capacity; docs/design.md, "What lives across decode steps").
// Returns: 2 * B * capacity * Hkv * D * dtype_size(dtype).
// Sync: host-only.
std::int64_t mha_kv_cache_bytes(const KvCacheSpec& spec);

// One layer's K and V cache on spec.device (the host by default). Memory: allocated once at construction, ledger
// category persistent_cache; appends never allocate.
class MhaKvCache {
 public:
  // Allocates K and V (ledger category persistent_cache) on spec.device.
  // Errors: batch, kv_heads, head_dim < 1, capacity < 0, a non-floating dtype, or an allocation failure
  //   ("out of memory: ..."; a CUDA device in a build without CUDA: Tensor::empty's error).
  // Sync: host-synchronous.
  explicit MhaKvCache(const KvCacheSpec& spec);

  // Accessors: the spec, token slots per batch row, stored tokens per batch row.
  // Sync: host-only.
  const KvCacheSpec& spec() const { return spec_; }
  std::int64_t capacity() const { return spec_.capacity; }
  std::int64_t length() const { return positions_.length(); }
  // Global positions of the stored tokens, [length()], strictly increasing.
  // Sync: host-only.
  const std::vector<std::int64_t>& positions() const { return positions_.positions(); }

  // The stored rows of batch row b.
  // Returns: [1, length(), Hkv, D], contiguous views into the cache (on its device).
  // Errors: b outside [0, B).
  // Sync: host-only, no copy.
  TensorView k_rows(std::int64_t b) const;
  TensorView v_rows(std::int64_t b) const;

  // Appends n tokens.
  // Args: k_new, v_new [B, n, Hkv, D], any floating dtype (converted to the cache's; on the cache's device, or of
  //   the cache's dtype on the host); positions [n], strictly increasing and above the last stored position
  //   (empty: the n positions after the last stored one, from 0 for an empty cache); stream: orders the copies
  //   (a device cache: a stream of its device).
  // Errors (raised before anything is written; the cache stays as it was): shapes, dtypes, positions, or
  //   length() + n over the capacity ("... past the capacity ...").
  // Sync: host-synchronous.
  void append(const TensorView& k_new, const TensorView& v_new, std::span<const std::int64_t> positions = {},
              Stream stream = Stream::cpu());

  // Forgets every stored token (length 0); the memory stays allocated.
  // Sync: host-only.
  void clear() { positions_.clear(); }

 private:
  // The checks of append alone (no work).
  void check_append(const TensorView& k_new, const TensorView& v_new, std::span<const std::int64_t> positions) const;

  KvCacheSpec spec_;
  Tensor k_, v_;
  TokenPositions positions_;
};

// Decode: n new queries attend causally to every stored token (key j visible to query i iff positions()[j] <=
// q_pos[i]); their own keys must already be appended for a query to see itself. One mha_forward call per batch
// row on the cache's contiguous rows (attention/mha.h: its precision, threads and errors).
// Args: q [B, n, Hq, D] the cache's dtype and device, Hq a multiple of Hkv; q_pos [n] global positions, non-decreasing;
//   out [B, n, Hq, D] any floating dtype; lse [B, Hq, n] the accumulator dtype (accumulator_dtype(dtype)) or
//   fp64, natural log; scale <= 0: 1 / sqrt(D).
// Returns: out and lse; a query with no visible stored key gets lse = -inf and out = 0 (a shard of a parallel
//   cache that holds nothing it may see).
// Errors (raised before anything is written): shapes against the cache (B, D, Hq % Hkv), dtype, q_pos size or
//   order; those of mha_forward.
// Devices: a cache on a CUDA device runs mha_forward on CUDA tensors (attention/cuda/mha_cuda.h: the call lowered
//   into rectangles, cuDNN SDPA graphs or the exact cuBLAS fallback); q, out, lse and `stream` on its device.
// Sync: host-synchronous; `stream` is an ordering token on the CPU. No communication.
void mha_decode(const MhaKvCache& cache, const TensorView& q, std::span<const std::int64_t> q_pos,
                const TensorView& out, const TensorView& lse, double scale = 0.0, Stream stream = Stream::cpu());

}  // namespace seqpar::attn
