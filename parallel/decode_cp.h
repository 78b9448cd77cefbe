// Inference under context parallelism: the prompt's prefill under CP fills caches that stay sharded over the group,
// and each decode step attends the new tokens to them (docs/design.md section 16).
//
// MHA / GQA: the K/V cache of a CP group of P ranks (groups.ring) is sharded by token (CacheSharding): `contiguous`
// (blocks of ceil(capacity / P) tokens, rank r holding [r blk, (r+1) blk)) or `interleave I` (token t on rank (t / I)
// mod P, I >= 1: the scheme of vLLM's decode context parallelism, which keeps appends balanced). A token's K/V is
// stored only on its owner. Under USP (ulysses_size Pu > 1) the Ulysses group splits the heads: SP rank (ring r,
// Ulysses u) stores, for the tokens ring rank r owns, the KV heads [u Hkv / Pu, (u+1) Hkv / Pu) and attends the query
// heads [u Hq / Pu, (u+1) Hq / Pu) (Hkv and Hq divisible by Pu, Error otherwise: KV heads are not replicated); the
// merge runs over the ring group only.
//   prefill: the prompt's training forward under CP (UspAttention over `layout`: a ring when Pu = 1; any layout kind
//     and ring impl) gives the prompt's out and lse in the compute layout; then one all_to_all_v over the SP group
//     moves every prompt token's K and V (of each head) from the rank that computed it to the rank that stores it
//     (re-sharding from the compute layout to the cache layout). Bytes sent by a rank: 2 B (Hkv / Pu) D bytes(dtype)
//     per (token, destination) pair it sends to another rank.
//   decode step of n new tokens at positions L..L+n-1 (L = the cache's length; q, k, v of the new tokens identical
//     on every rank): the owner of each new token appends its K/V; every rank attends the n queries to its shard
//     (attn::mha_decode: out_r, lse_r, with lse_r = -inf where it holds nothing visible), and one all-gather of
//     (out_r, lse_r) over the group lets every rank merge exactly, in fp64, in rank order:
//       m = max_r lse_r,  l = sum_r exp(lse_r - m),  out = sum_r exp(lse_r - m) out_r / l,  lse = m + log l
//     (with out_r = u_r / l_r the local normalised output, exp(lse_r) = exp(m_r) l_r: the global softmax of the
//     shards' m_r, l_r, u_r). Every rank of a ring group ends with the same out and lse of its query heads.
//     Bytes per step (CpCounters::bytes_sent, and bytes_received the same), accumulator dtype a (4; 8 for fp64):
//       merge_bytes = (Pr - 1) B n (Hq / Pu) (D + 2) bytes(a)       (Pr = ring_size, Pu = ulysses_size)
//     (each rank's out_r and its lse as two numbers of dtype a, hi + lo, so that fp32 carries the fp64 lse of the
//     merge to 2^-48: the weights exp(lse_r - m) keep fp64 accuracy). Before it, the ranks' agreement check (one
//     24-byte all-reduce, AgreementCheck) runs on every step, since the step's fingerprint holds the cache length;
//     it is not counted in CpCounters.
//   Chosen over an all-reduce of the max then of (exp(lse_r - m) out_r, exp(lse_r - m)): one collective instead of
//   two dependent ones, the same bytes order (P - 1 blocks in, a ring all-reduce 2 (P - 1) / P twice), and an
//   order-fixed fp64 merge that is bitwise identical on every rank.
//
// Persistent-cache prefill (extend): a further prompt chunk of T_new tokens at positions L..L+T_new-1 (L = the
// cache's length; q, k, v in a layout of T_new tokens over the groups, its positions shifted by L) attends to the
// cache and, causally, to itself; then its K/V join the cache on their owners. Under USP the Ulysses exchange first
// gives each rank the ring shard of the chunk for its heads (Hq / Pu query heads, the Hkv / Pu KV heads its cache
// holds), as UspAttention does; everything below then runs over the ring group (P = Pr ranks) with those heads, and
// the inverse exchange returns out and lse to the compute layout (Ulysses bytes: UspAttention's for q, k, v, out and
// lse). The chunk's own part is the training forward (RingAttention on the ring shards); the cached part takes one of
// two routes (after Meta's "Context Parallelism for Scalable Million-Token Inference", MLSys 2025):
//   pass-KV: every rank's cache shard goes to every rank of its ring group (one all-gather of the shards, padded to
//     the longest, m_max rows); each rank attends its queries to every shard. Bytes sent per rank:
//     (Pr - 1) 2 B m_max (Hkv / Pu) D bytes(dtype), m_max ~ L / Pr.
//   pass-Q: the queries go to the cache instead: one all-gather of the chunk's q over the ring group, each rank attends
//     every rank's queries to its own shard, and one all-to-all returns each partial (out, lse hi, lo) to the queries'
//     owner. Bytes sent per rank: (Pr - 1) B T_loc (Hq / Pu) (D bytes(dtype) + (D + 2) bytes(a)), T_loc = the chunk
//     layout's ring_shard_len() (padded_len / Pr, ~ T_new / Pr: a padded layout sends its padding rows too).
// Every query then merges its Pr cached partials and the chunk's own (out, lse) with the formulas above. Both routes
// give the same result (to rounding); auto takes the one that sends fewer bytes (pass-Q iff its bytes are fewer:
// a short chunk after a long cache, the case of multi-turn prompts), as the paper's heuristic on the cache-miss rate.
//
// GDN: the state [B, Hv, K, V] does not grow with the context, so there is nothing to shard by token: the value heads
// are split over the whole SP group (P = groups.sp.size(), rank r holding heads [r Hv / P, (r+1) Hv / P) and key heads
// [r Hk / P, (r+1) Hk / P)); Hv and Hk must both be divisible by P (Error otherwise, naming both: a key head is never
// replicated). Prefill runs GdnContextParallel (chain or scan, any layout and grid it accepts), whose final_state is
// full on every rank: each rank keeps the slice of its heads (the states move to their head owners without a
// message). A decode step slices the new tokens' heads and runs attn::gdn_decode on them: no data message (only the
// agreement check), out of its heads [B, n, Hv / P, V].
// The short conv (optional: conv_weight [C, W] given to prefill and decode, the cache made with conv_width W): the
// layer's q, k, v are then the conv's inputs x = [q | k | v] over C = 2 Hk K + Hv V channels (rows of conv_weight
// in that order: q's Hk K channels, k's, then v's Hv V; Qwen3-Next's conv1d over the concatenated projections), and
// the recurrence reads silu(conv(x)) (ShortConvCpConfig::use_silu) split back into q, k, v. The conv is depthwise, so
// a rank needs only the channels of its heads: C_r = 2 (Hk / P) K + (Hv / P) V, the q and k channels of its key heads
// and the v channels of its value heads (in that order in its cache's tail).
//   prefill: ShortConvContextParallel over `layout` (its halo exchange), then the recurrence under CP as above. The
//     tail, the last W-1 conv inputs of the whole prompt (tokens [T - W + 1, T); zeros before token 0 when T < W - 1),
//     may lie on several ranks (or a rank may hold none of it): one all_to_all_v over the SP group sends each rank
//     the rows of the tail this rank holds, restricted to the receiver's channels. Bytes sent by a rank holding m of
//     the tail tokens: m B (C - C_r) bytes(x) (its own block stays local); over the group min(W-1, T) B C (P-1) / P.
//   decode step: attn::short_conv_decode on the rank's C_r channels of the new tokens (the cached tail before
//     them), then attn::gdn_decode on the convolved heads: still no data message.
//
// Ranks' agreement: every prefill and decode checks, before any data moves, that the ranks of the group pass the
// same shapes and dtypes, the same configuration and sharding, and caches of the same length and step count
// (AgreementCheck over the SP group: one 24-byte all-reduce; Error on every rank naming the field, for example
// "... disagree on cache_length: 96 on sp rank(s) 1-3; 0 on sp rank(s) 0"; SEQPAR_AGREEMENT_CHECK=off skips it and
// with it this protection). Then the capacity check (the same on every rank). A refused call leaves every cache as it
// was.
// Synchronisation: every public call is collective over its group and host-synchronous; kernels on groups.stream
// (host). Memory: caches in persistent_cache; buffers of a step in workspace / comm_buffer, freed at return.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "../attention/gdn_decode.h"
#include "../attention/kv_cache.h"
#include "cp_common.h"
#include "gdn_cp.h"
#include "layout.h"
#include "ring_attention.h"
#include "usp.h"

namespace seqpar {

enum class CacheShardKind : std::uint8_t { kContiguous, kInterleave };
const char* cache_shard_name(CacheShardKind kind);  // "contiguous", "interleave"
CacheShardKind parse_cache_shard(std::string_view name);

// The route of a persistent-cache prefill (see the header comment).
enum class ChunkPrefillMode : std::uint8_t { kAuto, kPassKv, kPassQ };
const char* chunk_prefill_mode_name(ChunkPrefillMode mode);  // "auto", "pass-kv", "pass-q"
ChunkPrefillMode parse_chunk_prefill_mode(std::string_view name);

// Entries [begin, end) of dimension `dim` of t, copied into a new tensor (workspace, t's dtype; gather_rows of
// runtime/tensor_ops.h on `stream`): how a rank takes its heads (dim 2) or a step its tokens (dim 1).
Tensor slice_dim(const TensorView& t, int dim, std::int64_t begin, std::int64_t end, Stream stream = Stream::cpu());

// Which rank of a group of num_ranks holds token t of a cache of `capacity` tokens (see the header comment).
class CacheSharding {
 public:
  // Errors: capacity < 0, num_ranks < 1, interleave < 1.
  CacheSharding(CacheShardKind kind, std::int64_t capacity, int num_ranks, std::int64_t interleave = 1);

  CacheShardKind kind() const { return kind_; }
  std::int64_t capacity() const { return capacity_; }
  int num_ranks() const { return num_ranks_; }
  std::int64_t interleave() const { return interleave_; }  // I (interleave); 1 for contiguous
  int owner(std::int64_t t) const;
  // The number of tokens of [0, capacity) on `rank`.
  std::int64_t local_capacity(int rank) const;
  // The tokens of [begin, end) that `rank` owns, increasing.
  std::vector<std::int64_t> owned(int rank, std::int64_t begin, std::int64_t end) const;
  std::string str() const;  // "contiguous" or "interleave 16", with " over P ranks, capacity C"
  bool operator==(const CacheSharding& o) const = default;

 private:
  CacheShardKind kind_;
  std::int64_t capacity_;
  int num_ranks_;
  std::int64_t interleave_;
  std::int64_t block_;  // contiguous: ceil(capacity / num_ranks)
};

// The checks of a sharded cache's construction: `capacity` (the whole cache's) equal to the sharding's, rank inside
// [0, num_ranks). Errors name both.
void check_cache_shard(const CacheSharding& sharding, int rank, std::int64_t capacity);

// One layer's cache on one rank of a token-sharded group: the local shard (Local: attn::MhaKvCache or attn::DsaCache
// of local_capacity(rank) slots holding the rank's tokens at their global positions), the sharding, and the length
// of the whole cache. Only the decode layers (friends) write it.
template <typename Local, typename Spec>
class ShardedCache {
 public:
  // spec: B, the whole cache's capacity (= sharding.capacity()) and the per-token shape this rank stores (MHA: its
  // Hkv / ulysses_size KV heads, D; DSA: Di, Dqk) with the dtype; the local shard holds local_capacity(rank) slots.
  ShardedCache(const CacheSharding& sharding, int rank, const Spec& spec)
      : sharding_(sharding), rank_(rank), spec_(spec), local_(local_spec(sharding, rank, spec)) {}
  const CacheSharding& sharding() const { return sharding_; }
  int rank() const { return rank_; }                     // the rank in the sharding's group (MHA: ring, DSA: SP)
  const Spec& spec() const { return spec_; }             // capacity of the whole cache
  std::int64_t length() const { return length_; }        // tokens in the whole cache (the same on every rank)
  std::int64_t num_steps() const { return num_steps_; }  // decode steps since the prefill
  const Local& local() const { return local_; }

 private:
  friend class MhaDecodeContextParallel;
  friend class DsaDecodeContextParallel;
  static Spec local_spec(const CacheSharding& sharding, int rank, Spec spec) {
    check_cache_shard(sharding, rank, spec.capacity);
    spec.capacity = sharding.local_capacity(rank);
    return spec;
  }
  CacheSharding sharding_;
  int rank_;
  Spec spec_;
  Local local_;
  std::int64_t length_ = 0, num_steps_ = 0;
};

// The K/V cache of MhaDecodeContextParallel (sharded over the ring group; rank() is the ring rank).
using ShardedKvCache = ShardedCache<attn::MhaKvCache, attn::KvCacheSpec>;

struct MhaDecodeConfig {
  CacheShardKind shard = CacheShardKind::kInterleave;
  std::int64_t interleave = 1;  // I of the interleaved sharding (>= 1)
  float scale = 0.0f;           // <= 0: 1 / sqrt(D)
  RingImpl prefill_impl = RingImpl::kP2P;
};

struct DecodeOutput {
  Tensor out;  // [B, n, H, D], this rank's heads (dtype of q): MHA Hq / ulysses_size, GDN Hv / P
  Tensor lse;  // MHA: [B, Hq / ulysses_size, n] accumulator dtype (fp32; fp64 for fp64); GDN: empty
};

struct PrefillOutput {
  Tensor out;  // the prompt's output in the compute layout: [B, S_local, H, D] (dtype of q)
  Tensor lse;  // MHA: [B, Hq, S_local] accumulator dtype; GDN: empty
};

// MHA / GQA causal attention for inference: the cache sharded by token over groups.ring, heads over groups.ulysses.
class MhaDecodeContextParallel {
 public:
  // Errors: interleave < 1, a non-finite scale.
  MhaDecodeContextParallel(const CpGroups& groups, const MhaDecodeConfig& config);

  // An empty cache of `capacity` tokens sharded by the configuration over the ring group, holding this rank's
  // kv_heads / ulysses_size heads (collective-free). Errors: kv_heads not divisible by ulysses_size.
  ShardedKvCache make_cache(std::int64_t batch, std::int64_t capacity, std::int64_t kv_heads, std::int64_t head_dim,
                            DType dtype) const;

  // The prompt: q [B, S_local, Hq, D], k, v [B, S_local, Hkv, D] (all heads) at layout.positions(sp_rank) (layout
  // built for the groups, seq_len T = the prompt length). The cache must be empty and hold at least T tokens.
  // Returns the prompt's out and lse (UspAttention::forward); the cache then holds the T tokens on their owners.
  PrefillOutput prefill(ShardedKvCache& cache, const SequenceLayout& layout, const TensorView& q, const TensorView& k,
                        const TensorView& v);
  // prefill without the prompt's attention: the cache takes k, v (the same shapes and rules as prefill) re-sharded
  // to their owners; for caches whose prompt was computed elsewhere (or benchmarks of the decode step alone).
  void fill(ShardedKvCache& cache, const SequenceLayout& layout, const TensorView& k, const TensorView& v);
  // Persistent-cache prefill: a chunk of T_new = layout.seq_len() tokens after the cache's L; q [B, S_local, Hq, D],
  // k, v [B, S_local, Hkv, D] (all heads) at L + layout.positions(sp_rank) (layout built for the groups). Returns the
  // chunk's out [B, S_local, Hq, D] and lse [B, Hq, S_local] in the compute layout (those of one prefill of the
  // L + T_new tokens, rows L..); the cache then holds L + T_new tokens. mode kAuto: choose_chunk_mode. Errors (cache
  // unchanged, every rank): shapes, L + T_new past the capacity, ranks disagreeing on shapes, mode, length.
  PrefillOutput extend(ShardedKvCache& cache, const SequenceLayout& layout, const TensorView& q, const TensorView& k,
                       const TensorView& v, ChunkPrefillMode mode = ChunkPrefillMode::kAuto);
  // The bytes each route sends per rank over the ring group (the header comment's formulas; exactly what
  // chunk_route_bytes_sent() then measures) for the chunk of `layout` (extend's; its padded ring shard, layout.
  // ring_shard_len() rows, is what pass-Q sends) with q_heads query heads (all of the model's) after `cache`'s length,
  // and the route kAuto takes (pass-Q iff fewer bytes). Local arithmetic; errors: none.
  std::int64_t pass_kv_bytes(const ShardedKvCache& cache) const;
  std::int64_t pass_q_bytes(const ShardedKvCache& cache, const SequenceLayout& layout, std::int64_t q_heads) const;
  ChunkPrefillMode choose_chunk_mode(const ShardedKvCache& cache, const SequenceLayout& layout,
                                     std::int64_t q_heads) const;
  // The bytes this rank sent over the ring group for the route of the last extend (CommMeter: the all-gather of the
  // shards, or of q and the all-to-all of the partials), to compare with pass_kv_bytes / pass_q_bytes.
  std::int64_t chunk_route_bytes_sent() const { return chunk_route_bytes_sent_; }

  // One step of n >= 1 new tokens at positions cache.length() .. + n - 1: q_new [B, n, Hq, D], k_new, v_new
  // [B, n, Hkv, D], all heads, identical on every rank. Returns out [B, n, Hq / Pu, D] and lse [B, Hq / Pu, n] of
  // this rank's query heads (from q_head_offset()) against every token so far, the new ones included (causally),
  // identical on the ranks of a ring group. Errors (cache unchanged, on every
  // rank): a cache made with another sharding, shape or dtype than this object and the inputs; ranks disagreeing on
  // shapes, configuration, cache length or step; length + n past the capacity.
  DecodeOutput decode(ShardedKvCache& cache, const TensorView& q_new, const TensorView& k_new, const TensorView& v_new);

  // merge_bytes of the header comment for one step of n queries of B x Hq heads (all of the model's) of dimension D.
  std::int64_t decode_bytes_per_step(std::int64_t batch, std::int64_t n, std::int64_t q_heads, std::int64_t head_dim,
                                     DType dtype) const;
  // The first query head of decode's out on this rank: ulysses_rank * Hq / Pu.
  std::int64_t q_head_offset(std::int64_t q_heads) const {
    return groups_.ulysses.rank() * (q_heads / groups_.ulysses_size());
  }
  const CpCounters& counters() const { return counters_; }
  void reset_counters() { counters_.reset(); }

 private:
  void check_cache(const ShardedKvCache& cache, const char* call) const;
  // Every check of prefill / fill before any data moves (the agreement check included).
  void check_prompt(const ShardedKvCache& cache, const SequenceLayout& layout, const char* who, const TensorView& q,
                    const TensorView& k, const TensorView& v);
  void agree(const ShardedKvCache& cache, std::string_view call, const SequenceLayout* layout,
             std::initializer_list<std::pair<std::string_view, TensorView>> tensors);
  // Moves the prompt's (or a chunk's) k, v from the compute layout (positions offset by `offset`) to the ranks that
  // store them and appends them.
  void reshard_prompt(ShardedKvCache& cache, const SequenceLayout& layout, const TensorView& k, const TensorView& v,
                      std::int64_t offset = 0);
  struct ChunkPass;
  void check_extend(const ShardedKvCache& cache, const SequenceLayout& layout, const TensorView& q, const TensorView& k,
                    const TensorView& v, ChunkPrefillMode mode);
  void extend_pass_kv(ChunkPass& c);
  void extend_pass_q(ChunkPass& c);
  PrefillOutput merge_chunk(ChunkPass& c, const AttentionOutput& own, const TensorView& q_in,
                            const UlyssesExchange& a2a);

  CpGroups groups_;
  MhaDecodeConfig config_;
  CpCounters counters_;
  std::int64_t chunk_route_bytes_sent_ = 0;
  AgreementCheck agreement_;
};

// GDN for inference with the value heads split over groups.sp (see the header comment).
class GdnDecodeContextParallel {
 public:
  // value_heads Hv and key_heads Hk of the model; conv: the short conv's configuration (used only when prefill and
  // decode get a conv_weight). Errors: Hv or Hk not divisible by the SP group size, Hv not a multiple of Hk.
  GdnDecodeContextParallel(const CpGroups& groups, const GdnCpConfig& config, std::int64_t value_heads,
                           std::int64_t key_heads, const ShortConvCpConfig& conv = {});

  std::int64_t local_value_heads() const { return hv_ / groups_.sp.size(); }
  std::int64_t local_key_heads() const { return hk_ / groups_.sp.size(); }
  std::int64_t head_offset() const { return groups_.sp_rank() * local_value_heads(); }  // first value head held
  // Bytes this rank sent in the last prefill's exchange of the conv tail (CommMeter over the SP group; 0 without
  // a conv): m B (C - C_r) bytes(x) of the header comment.
  std::int64_t conv_tail_bytes_sent() const { return conv_tail_bytes_sent_; }

  // The cache of this rank's heads (state dtype: accumulator_dtype(dtype)), collective-free. conv_width W > 0: with
  // the short conv's tail [B, W-1, C_r] of this rank's channels (dtype: that of the conv inputs); 0: no conv.
  // Errors: conv_width < 0.
  attn::GdnCache make_cache(std::int64_t batch, std::int64_t key_dim, std::int64_t value_dim, DType dtype,
                            std::int64_t conv_width = 0) const;
  // The conv channels C = 2 Hk K + Hv V of the model, and those of SP rank `sp_rank` (increasing indices into C:
  // its key heads' q channels, their k channels, its value heads' v channels; C_r of them).
  std::int64_t conv_channels(std::int64_t key_dim, std::int64_t value_dim) const;
  std::vector<std::int64_t> local_conv_channels(int sp_rank, std::int64_t key_dim, std::int64_t value_dim) const;

  // The prompt under CP (GdnContextParallel over `layout`: q, k [B, S_local, Hk, K], v [B, S_local, Hv, V], g, beta
  // [B, S_local, Hv], initial_state empty or the full [B, Hv, K, V]); the cache (length 0) takes the final state of
  // its heads. conv_weight [C, W] (dtype of q, k, v; the same on every rank): q, k, v are the conv's inputs (see the
  // header comment) and the cache (made with conv_width W) also takes the tail of its channels; empty: no conv (the
  // cache must have none). Returns the prompt's out in the compute layout.
  // Errors (cache unchanged, every rank): shapes and dtypes against the cache, conv_weight given to a cache without
  // a tail or missing for one with a tail, a cache that is not empty, ranks disagreeing on any input's shape.
  PrefillOutput prefill(attn::GdnCache& cache, const SequenceLayout& layout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& g, const TensorView& beta,
                        const TensorView& initial_state = {}, const TensorView& conv_weight = {});
  // One step of n new tokens, all heads, identical on every rank: q_new, k_new [B, n, Hk, K], v_new [B, n, Hv, V],
  // g_new, beta_new [B, n, Hv]; conv_weight as for prefill (then q_new, k_new, v_new are the conv's inputs). Returns
  // out of this rank's heads [B, n, Hv / P, V]. Errors (cache unchanged): shapes against the cache, conv_weight given
  // or missing against the cache's tail, ranks disagreeing on shapes, configuration or the cache length.
  DecodeOutput decode(attn::GdnCache& cache, const TensorView& q_new, const TensorView& k_new, const TensorView& v_new,
                      const TensorView& g_new, const TensorView& beta_new, const TensorView& conv_weight = {});

 private:
  void agree(const attn::GdnCache& cache, std::string_view call,
             std::initializer_list<std::pair<std::string_view, TensorView>> tensors);
  // This rank's heads of a [B, n, H, X] (or [B, n, H]) tensor of `total` heads, `local` per rank.
  Tensor local_heads(const TensorView& t, std::int64_t total, std::int64_t local) const;
  // The checks of conv_weight against the cache and q, k, v (who: the calling function).
  void check_conv(const attn::GdnCache& cache, const char* who, const TensorView& q, const TensorView& k,
                  const TensorView& v, const TensorView& conv_weight) const;
  // Moves the prompt's last W-1 conv inputs (x [B, S_local, C] at layout's tokens) to every rank, each its channels
  // (one all_to_all_v over the SP group): [B, W-1, C_r].
  Tensor gather_conv_tail(const SequenceLayout& layout, const TensorView& x, std::int64_t key_dim,
                          std::int64_t value_dim, std::int64_t width);

  CpGroups groups_;
  GdnCpConfig config_;
  std::int64_t hv_, hk_;
  ShortConvCpConfig conv_;
  std::int64_t conv_tail_bytes_sent_ = 0;
  AgreementCheck agreement_;
};

}  // namespace seqpar
