// DSA (DeepSeek sparse attention) inference under context parallelism: a token-sharded indexer-key and latent cache,
// and a decode step whose top-k is global (docs/design.md section 16.7).
//
// The cache (attn::DsaCache per rank: k_idx [Di] and the latent c [Dqk] of each token it stores) is sharded by token
// over the whole SP group of P = ulysses_size x ring_size ranks (CacheSharding, parallel/decode_cp.h: `contiguous`
// or `interleave I`, token t on SP rank (t / I) mod P); a token's rows are stored on its owner only. Memory per rank
// and layer: B (Di + Dqk) bytes(dtype) per slot, local_capacity(sp_rank) ~ capacity / P slots, i.e. M / P with
// M = L B T (Di + Dqk) bytes.
//   Why the SP group and not the ring only (as MHA under USP, whose Ulysses ranks split the KV heads): DSA has one
//   latent and one indexer key per token, shared by all heads, so a Ulysses split of the query heads would leave
//   every Ulysses rank of a ring rank holding the same token shard (the cache replicated Pu times) and scoring the
//   same keys with the same indexer (the indexer has no heads to split: its Hi heads are summed per key). Sharding
//   the tokens over all P ranks divides the memory and the indexer's O(T) scan by P instead of Pr, at the price of
//   a merge over P ranks of all H heads (the bytes below) instead of Pr ranks of H / Pu heads; the attention work per
//   rank is the same (H heads x ~k / P selected positions, against H / Pu x ~k / Pr). Every rank returns all heads.
//
//   prefill: the prompt's training forward under CP (DsaContextParallel over `layout`, any layout kind, ring or
//     all-gather selection, any grid) gives the prompt's out, lse and topk_indices in the compute layout; then one
//     all_to_all_v over the SP group moves every prompt token's k_idx and c from the rank that computed it to its
//     owner. Bytes sent by a rank: B (Di + Dqk) bytes(dtype) per token it sends to another rank.
//   decode step of n new tokens at positions L..L+n-1 (L = the cache's length; q, c, q_idx, k_idx, w of the new
//     tokens identical on every rank): the owner of each new token appends its k_idx and c; then
//     1. selection: each rank scores the keys of its shard visible to each query (attn::dsa_decode_select: the
//        training indexer, window included) and keeps its local top-k candidates (score of the accumulator dtype a,
//        global position); ONE all-gather over the SP group of every rank's k candidates; every rank merges the P
//        candidate lists in rank order with the training tie rule (attn::dsa_topk_merge: larger score first, then
//        smaller position) into the global topk_indices, identical on every rank and bitwise those of the
//        single-device selection (a key's score does not depend on the shard that holds it, and the order is a
//        strict total order, so the merge of the shards' top-k is the top-k of the union).
//     2. attention: each rank attends every query to the selected positions IT stores (attn::dsa_decode_attend: the
//        training attention on its own rows; a global position is never read through another rank's shard), giving
//        out_r and lse_r (-inf where it holds no selected position), and one all-gather of (out_r, lse hi, lo)
//        merges them exactly in fp64 and rank order, as MHA decode does (parallel/decode_cp.h).
//     Bytes per step and rank (CpCounters::bytes_sent, and bytes_received the same):
//       select_bytes = (P - 1) B n k (8 + bytes(a))          (the candidates: int64 position + score)
//       merge_bytes  = (P - 1) B n H (Dv + 2) bytes(a)       (out_r and lse as hi + lo)
//     plus the ranks' agreement check before them (one 24-byte all-reduce, not counted).
//
// Ranks' agreement: every prefill, fill and decode checks, before any data moves, that the ranks pass the same
// shapes, dtypes, configuration, sharding, cache length and step count (AgreementCheck over the SP group), then the
// capacity. A refused call leaves every cache as it was (the prefill's own forward checks its inputs on every rank
// before its first message too).
// Synchronisation: every public call is collective over groups.sp and host-synchronous. Memory: caches in
// persistent_cache; the buffers of a step in workspace / comm_buffer, freed at return.
#pragma once

#include <cstdint>
#include <string_view>

#include "../attention/dsa_cache.h"
#include "cp_common.h"
#include "decode_cp.h"
#include "dsa_cp.h"
#include "layout.h"

namespace seqpar {

// One layer's DSA cache on one SP rank: the local attn::DsaCache of local_capacity(sp_rank) slots holding the rank's
// tokens at their global positions, the sharding over the SP group, the length and step count of the whole cache
// (ShardedCache, parallel/decode_cp.h; rank() is the SP rank).
using ShardedDsaCache = ShardedCache<attn::DsaCache, attn::DsaCacheSpec>;

struct DsaDecodeConfig {
  CacheShardKind shard = CacheShardKind::kInterleave;
  std::int64_t interleave = 1;  // I of the interleaved sharding (>= 1)
  std::int64_t topk = attn::kDsaTopK;
  std::int64_t dim_v = attn::kDsaHeadDimV;
  float scale = 0.0f;       // <= 0: 1 / sqrt(Dqk)
  std::int64_t window = 0;  // > 0: the indexer's candidates of query t are the keys with t - pos < window
  DsaSelectMode prefill_select = DsaSelectMode::kRing;  // the prompt's selection (DsaContextParallel)
};

struct DsaDecodeOutput : DecodeOutput {
  // out [B, n, H, Dv] (dtype of q, all heads), lse [B, H, n] accumulator dtype; the same on every rank.
  Tensor topk_indices;  // [B, n, k] int64 global token positions, ascending, -1 padded
};

struct DsaPrefillOutput : PrefillOutput {
  // out [B, S_local, H, Dv], lse [B, H, S_local]: the prompt's in the compute layout (DsaContextParallel::forward).
  Tensor topk_indices;  // [B, S_local, k] int64 token positions (layout slots mapped to tokens), -1 padded
};

class DsaDecodeContextParallel {
 public:
  // Errors: interleave < 1, topk < 1, dim_v < 1, window < 0, a non-finite scale.
  DsaDecodeContextParallel(const CpGroups& groups, const DsaDecodeConfig& config);

  // An empty cache of `capacity` tokens sharded by the configuration over the SP group (collective-free).
  ShardedDsaCache make_cache(std::int64_t batch, std::int64_t capacity, std::int64_t index_dim, std::int64_t latent_dim,
                             DType dtype) const;

  // The prompt: q [B, S_local, H, Dqk], c [B, S_local, Dqk], q_idx [B, S_local, Hi, Di], k_idx [B, S_local, Di],
  // w [B, S_local, Hi] at layout.positions(sp_rank) (layout built for the groups, seq_len T = the prompt length), one
  // dtype, the cache's. The cache must be empty and hold at least T tokens. Returns the prompt's out, lse and
  // topk_indices; the cache then holds the T tokens on their owners.
  DsaPrefillOutput prefill(ShardedDsaCache& cache, const SequenceLayout& layout, const TensorView& q,
                           const TensorView& c, const TensorView& q_idx, const TensorView& k_idx, const TensorView& w);
  // prefill without the prompt's attention and selection: the cache takes k_idx, c (the same shapes and rules)
  // re-sharded to their owners (a prompt computed elsewhere, or a benchmark of the decode step alone).
  void fill(ShardedDsaCache& cache, const SequenceLayout& layout, const TensorView& k_idx, const TensorView& c);

  // One step of n >= 1 new tokens at positions cache.length() .. + n - 1: q_new [B, n, H, Dqk], c_new [B, n, Dqk],
  // q_idx_new [B, n, Hi, Di], k_idx_new [B, n, Di], w_new [B, n, Hi], the cache's dtype, identical on every rank.
  // Returns out, lse and topk_indices of the n queries against every token so far (the new ones included, causally),
  // identical on every rank. Errors (cache unchanged, on every rank): a cache made with another sharding, shape or
  // dtype; ranks disagreeing on shapes, configuration, cache length or step; length + n past the capacity.
  DsaDecodeOutput decode(ShardedDsaCache& cache, const TensorView& q_new, const TensorView& c_new,
                         const TensorView& q_idx_new, const TensorView& k_idx_new, const TensorView& w_new);

  // The header comment's bytes of one step of n queries (B batch rows, H query heads, the inputs' dtype).
  std::int64_t select_bytes_per_step(std::int64_t batch, std::int64_t n, DType dtype) const;
  std::int64_t merge_bytes_per_step(std::int64_t batch, std::int64_t n, std::int64_t heads, DType dtype) const;
  std::int64_t decode_bytes_per_step(std::int64_t batch, std::int64_t n, std::int64_t heads, DType dtype) const {
    return select_bytes_per_step(batch, n, dtype) + merge_bytes_per_step(batch, n, heads, dtype);
  }
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
