// Inference under context parallelism: the prompt's prefill under CP fills caches that stay sharded over the group,
// and each decode step attends the new tokens to them.
// Math and schedules: docs/design.md, "MHA decode over a sharded cache" (token sharding, the exact fp64 merge of the
// shards, bytes per step), "Persistent-cache prefill" (extend: pass-KV and pass-Q, bytes, the auto choice), "GDN
// decode" (head sharding of the state and of the short-conv tail), "Decode agreement and capacity".
//
// MHA / GQA: the K/V cache is sharded by token over groups.ring (CacheSharding: contiguous or interleave I); under
// USP the Ulysses group splits the heads (Hq divisible by ulysses_size; Hkv divisible by it, or dividing it: each KV
// head is then replicated to ulysses_size / Hkv ranks, as in training). GDN: the value heads are split over
// the whole CP group (Hv and Hk divisible by its size); decode sends no data message.
// Memory: caches in persistent_cache; buffers of a step in workspace / comm_buffer, freed at return.
// Kernels run on groups.stream.
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

// How a cache is sharded by token (docs/design.md, "MHA decode over a sharded cache").
enum class CacheShardKind : std::uint8_t { kContiguous, kInterleave };

// Names ("contiguous", "interleave") and their parser.
// Errors: the parser, for another name.
// Sync: host-only.
const char* cache_shard_name(CacheShardKind kind);
CacheShardKind parse_cache_shard(std::string_view name);

// The route of a persistent-cache prefill (docs/design.md, "Persistent-cache prefill").
enum class ChunkPrefillMode : std::uint8_t { kAuto, kPassKv, kPassQ };

// Names ("auto", "pass-kv", "pass-q") and their parser.
// Errors: the parser, for another name.
// Sync: host-only.
const char* chunk_prefill_mode_name(ChunkPrefillMode mode);
ChunkPrefillMode parse_chunk_prefill_mode(std::string_view name);

// Entries [begin, end) of dimension `dim` of t, copied: how a rank takes its heads (dim 2) or a step its tokens
// (dim 1).
// Returns: a new tensor (workspace, t's dtype).
// Errors: dim outside t's rank, or not 0 <= begin <= end <= t.dim(dim).
// Sync: gather_rows of runtime/tensor_ops.h on `stream`; no communication.
Tensor slice_dim(const TensorView& t, int dim, std::int64_t begin, std::int64_t end, Stream stream = Stream::cpu());

// Which rank of a group of num_ranks holds token t of a cache of `capacity` tokens (docs/design.md, "MHA decode over
// a sharded cache").
class CacheSharding {
 public:
  // Errors: capacity < 0, num_ranks < 1, interleave < 1.
  // Sync: host-only.
  CacheSharding(CacheShardKind kind, std::int64_t capacity, int num_ranks, std::int64_t interleave = 1);

  // Accessors: kind, the whole cache's capacity, the group size, I (1 for contiguous); owner(t): the rank holding
  // token t; local_capacity(rank): the number of tokens of [0, capacity) on `rank`; owned(rank, begin, end): the
  // tokens of [begin, end) that `rank` owns, increasing. All pure arithmetic, no checks.
  // Sync: host-only.
  CacheShardKind kind() const { return kind_; }
  std::int64_t capacity() const { return capacity_; }
  int num_ranks() const { return num_ranks_; }
  std::int64_t interleave() const { return interleave_; }
  int owner(std::int64_t t) const;
  std::int64_t local_capacity(int rank) const;
  std::vector<std::int64_t> owned(int rank, std::int64_t begin, std::int64_t end) const;

  // The sharding as text.
  // Returns: "contiguous" or "interleave 16", with " over P ranks, capacity C".
  // Sync: host-only.
  std::string str() const;
  bool operator==(const CacheSharding& o) const = default;

 private:
  CacheShardKind kind_;
  std::int64_t capacity_;
  int num_ranks_;
  std::int64_t interleave_;
  std::int64_t block_;  // contiguous: ceil(capacity / num_ranks)
};

// The checks of a sharded cache's construction.
// Args: capacity: the whole cache's.
// Errors: capacity not equal to the sharding's, rank outside [0, num_ranks); the messages name both.
// Sync: host-only.
void check_cache_shard(const CacheSharding& sharding, int rank, std::int64_t capacity);

// One layer's cache on one rank of a token-sharded group: the local shard (Local: attn::MhaKvCache or attn::DsaCache
// of local_capacity(rank) slots holding the rank's tokens at their global positions), the sharding, and the length
// of the whole cache. Only the decode layers (friends) write it.
template <typename Local, typename Spec>
class ShardedCache {
 public:
  // An empty shard; the local shard holds local_capacity(rank) slots.
  // Args: spec: B, the whole cache's capacity (= sharding.capacity()) and the per-token shape this rank stores
  //   (MHA: its Hkv / ulysses_size KV heads, D; DSA: Di, Dqk) with the dtype.
  // Errors: those of check_cache_shard and of Local's constructor.
  // Sync: host-only, no communication.
  ShardedCache(const CacheSharding& sharding, int rank, const Spec& spec)
      : sharding_(sharding), rank_(rank), spec_(spec), local_(local_spec(sharding, rank, spec)) {}

  // Accessors (host-only): the sharding; rank(); spec() with the whole cache's capacity; length(); num_steps();
  // the local shard.
  const CacheSharding& sharding() const { return sharding_; }
  int rank() const { return rank_; }                     // the rank in the sharding's group (MHA: ring, DSA: SP)
  const Spec& spec() const { return spec_; }             // capacity of the whole cache
  std::int64_t length() const { return length_; }        // tokens in the whole cache (the same on every rank)
  std::int64_t num_steps() const { return num_steps_; }  // decode steps since the prefill
  const Local& local() const { return local_; }

 private:
  friend class MhaDecodeCp;
  friend class DsaDecodeCp;
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
  std::int64_t kv_replication_ = 1;  // MHA: Ulysses ranks holding one KV head (ulysses_size / Hkv when Hkv < it)
};

// The K/V cache of MhaDecodeCp (sharded over the ring group; rank() is the ring rank).
using ShardedKvCache = ShardedCache<attn::MhaKvCache, attn::KvCacheSpec>;

// The configuration of MhaDecodeCp (the same on every rank).
struct MhaDecodeConfig {
  CacheShardKind shard = CacheShardKind::kInterleave;
  std::int64_t interleave = 1;  // I of the interleaved sharding (>= 1)
  double scale = 0.0;           // <= 0: 1 / sqrt(D)
  RingImpl prefill_impl = RingImpl::kP2P;
};

// What a decode step returns.
struct DecodeOutput {
  Tensor out;  // [B, n, H, D], this rank's heads (dtype of q): MHA Hq / ulysses_size, GDN Hv / P
  Tensor lse;  // MHA: [B, Hq / ulysses_size, n] accumulator dtype (fp32; fp64 for fp64); GDN: empty
};

// What a prefill returns.
struct PrefillOutput {
  Tensor out;  // the prompt's output in the compute layout: [B, S_local, H, D] (dtype of q)
  Tensor lse;  // MHA: [B, Hq, S_local] accumulator dtype; GDN: empty
};

// MHA / GQA causal attention for inference: the cache sharded by token over groups.ring, heads over groups.ulysses.
// Every prefill, fill, extend and decode checks, before any data moves, that the ranks pass the same shapes,
// dtypes, configuration, sharding, cache length and step count (one 24-byte all-reduce over the CP group), then
// the capacity; a refused call leaves every cache as it was.
class MhaDecodeCp {
 public:
  // Errors: interleave < 1, a non-finite scale.
  // Sync: host-only, no communication.
  MhaDecodeCp(const CpGroups& groups, const MhaDecodeConfig& config);

  // An empty cache of `capacity` tokens sharded by the configuration over the ring group, holding this rank's
  // kv_heads / ulysses_size heads, or one replica when kv_heads < ulysses_size, on `device`.
  // Devices: a cache on a CUDA device takes prefill, fill and decode inputs on that device (groups.stream on it;
  //   every other call refuses them by name before any message): the re-sharding, the cache append, each rank's
  //   attention of the new tokens to its shard (attn::mha_decode on CUDA tensors: cuDNN SDPA or the exact cuBLAS
  //   fallback, lowered as attention/lowering.h) and the merge of the ranks' partials (attn::lse_merge in rank order)
  //   run on the device; extend stays host-only. Compiled, never run on a GPU; the lowered test mode
  //   (SEQPAR_LOWERED_ATTENTION = 1) runs this device schedule of decode on the host.
  // Errors: kv_heads < 1; kv_heads neither divisible by ulysses_size nor dividing it; a CUDA device that is not
  //   usable (none present, a build without CUDA: the reason); the cache's allocation (an Error naming the cache, its
  //   shape and the bytes asked for, not std::bad_alloc).
  // Sync: host-only, collective-free.
  ShardedKvCache make_cache(std::int64_t batch, std::int64_t capacity, std::int64_t kv_heads, std::int64_t head_dim,
                            DType dtype, Device device = Device::cpu()) const;

  // The prompt; the cache then holds the T tokens on their owners.
  // Args: q [B, S_local, Hq, D], k, v [B, S_local, Hkv, D] (all heads) at layout.positions(cp_rank) (layout built
  //   for the groups, seq_len T = the prompt length). The cache must be empty and hold at least T tokens.
  // Returns: the prompt's out and lse (MhaCp::forward).
  // Errors (cache unchanged, every rank): a cache made with another sharding, shape or dtype; a non-empty cache;
  //   ranks disagreeing; T past the capacity; a layout packing several documents (one request per batch row);
  //   MhaCp::forward's.
  // Sync: collective over the CP group; host-synchronous; kernels on groups.stream.
  PrefillOutput prefill(ShardedKvCache& cache, const SequenceLayout& layout, const TensorView& q, const TensorView& k,
                        const TensorView& v);

  // prefill without the prompt's attention: the cache takes k, v re-sharded to their owners; for caches whose
  // prompt was computed elsewhere (or benchmarks of the decode step alone).
  // Args, Errors, Sync: as prefill (the same shapes and rules).
  void fill(ShardedKvCache& cache, const SequenceLayout& layout, const TensorView& k, const TensorView& v);
  // Persistent-cache prefill of a chunk of T_new = layout.seq_len() tokens after the cache's L; the cache then
  // holds L + T_new tokens.
  // Args: q [B, S_local, Hq, D], k, v [B, S_local, Hkv, D] (all heads) at L + layout.positions(cp_rank) (layout
  //   built for the groups); mode kAuto: choose_chunk_mode.
  // Returns: the chunk's out [B, S_local, Hq, D] and lse [B, Hq, S_local] in the compute layout (those of one
  //   prefill of the L + T_new tokens, rows L..).
  // Errors (cache unchanged, every rank): shapes, L + T_new past the capacity, ranks disagreeing on shapes, mode,
  //   length; a layout packing several documents.
  // Sync: collective over the CP group (the route over the ring group); host-synchronous.
  PrefillOutput extend(ShardedKvCache& cache, const SequenceLayout& layout, const TensorView& q, const TensorView& k,
                       const TensorView& v, ChunkPrefillMode mode = ChunkPrefillMode::kAuto);
  // The bytes each route sends per rank over the ring group (docs/design.md, "Persistent-cache prefill"; exactly
  // what chunk_route_bytes_sent() then measures), and the route kAuto takes (pass-Q iff fewer bytes).
  // Args: layout: extend's chunk (its padded ring shard, layout.ring_shard_len() rows, is what pass-Q sends);
  //   q_heads: all of the model's query heads; after `cache`'s length.
  // Returns: bytes per rank; the route.
  // Errors: none.
  // Sync: host-only, local arithmetic.
  std::int64_t pass_kv_bytes(const ShardedKvCache& cache) const;
  std::int64_t pass_q_bytes(const ShardedKvCache& cache, const SequenceLayout& layout, std::int64_t q_heads) const;
  ChunkPrefillMode choose_chunk_mode(const ShardedKvCache& cache, const SequenceLayout& layout,
                                     std::int64_t q_heads) const;
  // The bytes this rank sent over the ring group for the route of the last extend (CommMeter: the all-gather of the
  // shards, or of q and the all-to-all of the partials), to compare with pass_kv_bytes / pass_q_bytes.
  // Sync: host-only.
  std::int64_t chunk_route_bytes_sent() const { return chunk_route_bytes_sent_; }

  // One step of n >= 1 new tokens at positions cache.length() .. + n - 1.
  // Args: q_new [B, n, Hq, D], k_new, v_new [B, n, Hkv, D], all heads, identical on every rank.
  // Returns: out [B, n, Hq / Pu, D] and lse [B, Hq / Pu, n] of this rank's query heads (from q_head_offset())
  //   against every token so far, the new ones included (causally), identical on the ranks of a ring group.
  // Errors (cache unchanged, on every rank): a cache made with another sharding, shape or dtype than this object
  //   and the inputs; inputs on another device than the cache; ranks disagreeing on shapes, configuration, cache
  //   length or step; length + n past the capacity.
  // Sync: collective over the CP group (agreement) and the ring group (merge); host-synchronous.
  DecodeOutput decode(ShardedKvCache& cache, const TensorView& q_new, const TensorView& k_new, const TensorView& v_new);

  // merge_bytes (docs/design.md, "MHA decode over a sharded cache") for one step.
  // Args: n queries of B x Hq heads (all of the model's) of dimension D.
  // Sync: host-only, local arithmetic.
  std::int64_t decode_bytes_per_step(std::int64_t batch, std::int64_t n, std::int64_t q_heads, std::int64_t head_dim,
                                     DType dtype) const;
  // The first query head of decode's out on this rank: ulysses_rank * Hq / Pu.
  // Sync: host-only.
  std::int64_t q_head_offset(std::int64_t q_heads) const {
    return groups_.ulysses.rank() * (q_heads / groups_.ulysses_size());
  }
  // The counters (CpCounters) and reset_counters().
  // Sync: host-only.
  const CpCounters& counters() const { return counters_; }
  void reset_counters() { counters_.reset(); }
  // The stream of the next calls' kernels and copies (CpGroups::stream), as MhaCp::set_stream: a device cache's
  // calls need a stream of its device (the Python binding passes torch's current stream of the inputs' device).
  // Sync: host-only.
  void set_stream(Stream stream) { groups_.stream = stream; }

 private:
  // All KV heads of the model (the cache holds Hkv / Pu, or one replica when Hkv < Pu) and, when Hkv < Pu, k or v
  // [B, S, Hkv, D] with each head replicated to Pu / Hkv heads (training's replication, parallel/ulysses.h); else
  // an undefined tensor (use the input as it is).
  std::int64_t all_kv_heads(const ShardedKvCache& cache) const;
  Tensor replicated_kv(const ShardedKvCache& cache, const TensorView& kv) const;
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
  PrefillOutput merge_chunk(ChunkPass& c, const MhaCpOutput& own, const TensorView& q_in,
                            const UlyssesExchange& a2a);

  CpGroups groups_;
  MhaDecodeConfig config_;
  CpCounters counters_;
  std::int64_t chunk_route_bytes_sent_ = 0;
  AgreementCheck agreement_;
};

// The MhaDecodeCp::decode steps run by the device schedule in this process so far: every step on a device cache, and
// every step under the lowered test mode (SEQPAR_LOWERED_ATTENTION = 1, attention/lowering.h), which runs that
// schedule on the host (tests check that the mode was taken).
// Sync: host-only.
std::int64_t mha_decode_device_schedule_steps();

// GDN for inference with the value heads split over groups.cp (docs/design.md, "MHA decode over a sharded cache").
// Decode sends no data message; prefill and decode check the ranks' agreement before any data moves.
class GdnDecodeCp {
 public:
  // A decoder of a model with value_heads Hv and key_heads Hk.
  // Args: conv: the short conv's configuration (used only when prefill and decode get a conv_weight).
  // Errors: Hv or Hk not divisible by the CP group size, Hv not a multiple of Hk, config.chunk_size < 1, a
  //   non-finite config.scale.
  // Sync: host-only, no communication.
  GdnDecodeCp(const CpGroups& groups, const GdnCpConfig& config, std::int64_t value_heads,
                           std::int64_t key_heads, const ShortConvCpConfig& conv = {});

  // This rank's value and key head counts, and its first value head held.
  // Sync: host-only.
  std::int64_t local_value_heads() const { return hv_ / groups_.cp.size(); }
  std::int64_t local_key_heads() const { return hk_ / groups_.cp.size(); }
  std::int64_t head_offset() const { return groups_.cp_rank() * local_value_heads(); }

  // Bytes this rank sent in the last prefill's exchange of the conv tail (CommMeter over the CP group; 0 without
  // a conv): m B (C - C_r) bytes(x) (docs/design.md, "GDN decode").
  // Sync: host-only.
  std::int64_t conv_tail_bytes_sent() const { return conv_tail_bytes_sent_; }

  // The cache of this rank's heads (state dtype: accumulator_dtype(dtype)).
  // Args: conv_width W > 0: with the short conv's tail [B, W-1, C_r] of this rank's channels (dtype: that of the
  //   conv inputs); 0: no conv.
  // Errors: conv_width < 0; those of attn::GdnCache's constructor.
  // Sync: host-only, collective-free.
  attn::GdnCache make_cache(std::int64_t batch, std::int64_t key_dim, std::int64_t value_dim, DType dtype,
                            std::int64_t conv_width = 0) const;

  // The conv channels C = 2 Hk K + Hv V of the model, and those of CP rank `cp_rank`.
  // Returns: C; increasing indices into C: its key heads' q channels, their k channels, its value heads' v channels
  //   (C_r of them).
  // Sync: host-only.
  std::int64_t conv_channels(std::int64_t key_dim, std::int64_t value_dim) const;
  std::vector<std::int64_t> local_conv_channels(int cp_rank, std::int64_t key_dim, std::int64_t value_dim) const;

  // The prompt under CP (GdnCp over `layout`); the cache (length 0) takes the final state of its
  // heads, and with conv_weight also the tail of its channels.
  // Args: q, k [B, S_local, Hk, K], v [B, S_local, Hv, V], g, beta [B, S_local, Hv], initial_state empty or the
  //   full [B, Hv, K, V]; conv_weight [C, W] (dtype of q, k, v; the same on every rank): q, k, v are the conv's
  //   inputs (docs/design.md, "GDN decode") and the cache must be made with conv_width W; empty: no conv (the
  //   cache must have none).
  // Returns: the prompt's out in the compute layout.
  // Errors (cache unchanged, every rank): shapes and dtypes against the cache, conv_weight given to a cache without
  //   a tail or missing for one with a tail, a cache that is not empty, ranks disagreeing on any input's shape or
  //   the layout, a layout packing several documents (one request per batch row).
  // Sync: collective over the groups (GdnCp's; the tail by one all_to_all_v over the CP group);
  //   host-synchronous.
  PrefillOutput prefill(attn::GdnCache& cache, const SequenceLayout& layout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& g, const TensorView& beta,
                        const TensorView& initial_state = {}, const TensorView& conv_weight = {});
  // One step of n new tokens, all heads, identical on every rank.
  // Args: q_new, k_new [B, n, Hk, K], v_new [B, n, Hv, V], g_new, beta_new [B, n, Hv]; conv_weight as for prefill
  //   (then q_new, k_new, v_new are the conv's inputs).
  // Returns: out of this rank's heads [B, n, Hv / P, V]; lse empty.
  // Errors (cache unchanged): shapes against the cache, conv_weight given or missing against the cache's tail,
  //   ranks disagreeing on shapes, configuration or the cache length.
  // Sync: collective over the CP group (the agreement check only, no data message); host-synchronous.
  DecodeOutput decode(attn::GdnCache& cache, const TensorView& q_new, const TensorView& k_new, const TensorView& v_new,
                      const TensorView& g_new, const TensorView& beta_new, const TensorView& conv_weight = {});

 private:
  void agree(const attn::GdnCache& cache, std::string_view call, const SequenceLayout* layout,
             std::initializer_list<std::pair<std::string_view, TensorView>> tensors);
  // This rank's heads of a [B, n, H, X] (or [B, n, H]) tensor of `total` heads, `local` per rank.
  Tensor local_heads(const TensorView& t, std::int64_t total, std::int64_t local) const;
  // The checks of conv_weight against the cache and q, k, v (who: the calling function).
  void check_conv(const attn::GdnCache& cache, const char* who, const TensorView& q, const TensorView& k,
                  const TensorView& v, const TensorView& conv_weight) const;
  // Moves the prompt's last W-1 conv inputs (x [B, S_local, C] at layout's tokens) to every rank, each its channels
  // (one all_to_all_v over the CP group): [B, W-1, C_r].
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
