// DSA (DeepSeek sparse attention) inference under context parallelism: a token-sharded indexer-key and latent
// cache, and a decode step whose top-k is global.
// Math and schedules: docs/design.md, "DSA decode" (sharding over the whole CP group and why, the global top-k by
// one all-gather of candidates, the exact merge of the shards' attention, bytes per step), "Decode agreement and
// capacity".
//
// The cache (attn::DsaCache per rank) is sharded by token over the CP group (CacheSharding, parallel/decode_cp.h);
// every rank returns all heads, and topk_indices identical on every rank and bitwise those of one device.
// Memory: caches in persistent_cache; the buffers of a step in workspace / comm_buffer, freed at return.
#pragma once

#include <cstdint>
#include <string_view>

#include "../attention/dsa_cache.h"
#include "cp_common.h"
#include "decode_cp.h"
#include "dsa_cp.h"
#include "layout.h"

namespace seqpar {

// One layer's DSA cache on one CP rank: the local attn::DsaCache of local_capacity(cp_rank) slots holding the rank's
// tokens at their global positions, the sharding over the CP group, the length and step count of the whole cache
// (ShardedCache, parallel/decode_cp.h; rank() is the CP rank).
using ShardedDsaCache = ShardedCache<attn::DsaCache, attn::DsaCacheSpec>;

// The configuration of DsaDecodeCp (the same on every rank).
struct DsaDecodeConfig {
  CacheShardKind shard = CacheShardKind::kInterleave;
  std::int64_t interleave = 1;  // I of the interleaved sharding (>= 1)
  std::int64_t topk = attn::kDsaTopK;
  std::int64_t dim_v = attn::kDsaHeadDimV;
  double scale = 0.0;       // <= 0: 1 / sqrt(Dqk)
  std::int64_t window = 0;  // > 0: the indexer's candidates of query t are the keys with t - pos < window
  DsaSelectMode prefill_select = DsaSelectMode::kRing;  // the prompt's selection (DsaCp)
};

// What decode() returns.
struct DsaDecodeOutput : DecodeOutput {
  // out [B, n, H, Dv] (dtype of q, all heads), lse [B, H, n] accumulator dtype; the same on every rank.
  Tensor topk_indices;  // [B, n, k] int64 global token positions, ascending, -1 padded
};

// What prefill() returns.
struct DsaPrefillOutput : PrefillOutput {
  // out [B, S_local, H, Dv], lse [B, H, S_local]: the prompt's in the compute layout (DsaCp::forward).
  Tensor topk_indices;  // [B, S_local, k] int64 token positions (layout slots mapped to tokens), -1 padded
};

// DSA prefill and decode over a token-sharded cache on groups.cp (docs/design.md, "DSA decode").
class DsaDecodeCp {
 public:
  // A decoder over `groups` with `config`.
  // Errors: interleave < 1, topk < 1, dim_v < 1, window < 0, a non-finite scale.
  // Sync: host-only, no communication.
  DsaDecodeCp(const CpGroups& groups, const DsaDecodeConfig& config);

  // An empty cache of `capacity` tokens sharded by the configuration over the CP group.
  // Returns: this rank's ShardedDsaCache (local slots in persistent_cache).
  // Errors: those of attn::DsaCache's constructor.
  // Sync: host-only, collective-free.
  ShardedDsaCache make_cache(std::int64_t batch, std::int64_t capacity, std::int64_t index_dim, std::int64_t latent_dim,
                             DType dtype) const;

  // The prompt; the cache then holds the T tokens on their owners.
  // Args: q [B, S_local, H, Dqk], c [B, S_local, Dqk], q_idx [B, S_local, Hi, Di], k_idx [B, S_local, Di],
  //   w [B, S_local, Hi] at layout.positions(cp_rank) (layout built for the groups, seq_len T = the prompt
  //   length), one dtype, the cache's. The cache must be empty and hold at least T tokens.
  // Returns: the prompt's out, lse and topk_indices.
  // Errors (before any data moves; a refused call leaves every cache as it was): a cache made with another
  //   sharding, shape or dtype; ranks disagreeing on shapes, dtypes, configuration, sharding, cache length or step
  //   count; then a layout packing several documents (one request per batch row) and the capacity.
  // Sync: collective over groups.cp; host-synchronous.
  DsaPrefillOutput prefill(ShardedDsaCache& cache, const SequenceLayout& layout, const TensorView& q,
                           const TensorView& c, const TensorView& q_idx, const TensorView& k_idx, const TensorView& w);

  // prefill without the prompt's attention and selection: the cache takes k_idx, c re-sharded to their owners (a
  // prompt computed elsewhere, or a benchmark of the decode step alone).
  // Args, Errors, Sync: as prefill (the same shapes and rules).
  void fill(ShardedDsaCache& cache, const SequenceLayout& layout, const TensorView& k_idx, const TensorView& c);

  // One step of n >= 1 new tokens at positions cache.length() .. + n - 1; the top-k is global.
  // Args: q_new [B, n, H, Dqk], c_new [B, n, Dqk], q_idx_new [B, n, Hi, Di], k_idx_new [B, n, Di],
  //   w_new [B, n, Hi], the cache's dtype, identical on every rank.
  // Returns: out, lse and topk_indices of the n queries against every token so far (the new ones included,
  //   causally), identical on every rank; topk_indices bitwise those of one device.
  // Errors (cache unchanged, on every rank; checked before any data moves): a cache made with another sharding,
  //   shape or dtype; ranks disagreeing on shapes, configuration, cache length or step; length + n past the
  //   capacity.
  // Sync: collective over groups.cp; host-synchronous.
  DsaDecodeOutput decode(ShardedDsaCache& cache, const TensorView& q_new, const TensorView& c_new,
                         const TensorView& q_idx_new, const TensorView& k_idx_new, const TensorView& w_new);

  // The bytes of one step of n queries (docs/design.md, "DSA decode"): selection, merge, and their sum.
  // Args: batch B rows, heads H query heads, dtype the inputs'.
  // Returns: bytes per step.
  // Sync: host-only, no communication.
  std::int64_t select_bytes_per_step(std::int64_t batch, std::int64_t n, DType dtype) const;
  std::int64_t merge_bytes_per_step(std::int64_t batch, std::int64_t n, std::int64_t heads, DType dtype) const;
  std::int64_t decode_bytes_per_step(std::int64_t batch, std::int64_t n, std::int64_t heads, DType dtype) const {
    return select_bytes_per_step(batch, n, dtype) + merge_bytes_per_step(batch, n, heads, dtype);
  }

  // Accessors: the configuration; the counters (CpCounters) and reset_counters().
  // Sync: host-only.
  const DsaDecodeConfig& config() const { return config_; }
  const CpCounters& counters() const { return counters_; }
  void reset_counters() { counters_.reset(); }

 private:
  void check_cache(const ShardedDsaCache& cache, const char* call) const;
  // Every check of prefill / fill before any data moves (the agreement check included).
  void check_prompt(const ShardedDsaCache& cache, const SequenceLayout& layout, const char* who, const TensorView& q,
                    const TensorView& q_idx, const TensorView& w, const TensorView& k_idx, const TensorView& c);
  void agree(const ShardedDsaCache& cache, std::string_view call, const SequenceLayout* layout,
             std::initializer_list<std::pair<std::string_view, TensorView>> tensors);
  // Moves the prompt's k_idx, c from the compute layout to their owners and appends them (length = the prompt's).
  void store_prompt(ShardedDsaCache& cache, const SequenceLayout& layout, const TensorView& k_idx, const TensorView& c);
  void check_decode(const ShardedDsaCache& cache, const TensorView& q, const TensorView& c, const TensorView& q_idx,
                    const TensorView& k_idx, const TensorView& w);

  CpGroups groups_;
  DsaDecodeConfig config_;
  CpCounters counters_;
  AgreementCheck agreement_;
};

}  // namespace seqpar
