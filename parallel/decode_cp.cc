// Inference with sharded caches under context parallelism (math, bytes and rules: parallel/decode_cp.h).
#include "parallel/decode_cp.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <limits>

#include "attention/lowering.h"
#include "parallel/decode_shared.h"
#include "runtime/error.h"
#include "runtime/tensor_checks.h"
#include "runtime/tensor_ops.h"

namespace seqpar {
namespace {

// The inputs of a call live where the cache does (make_cache's device), and a device cache's kernels run on a
// stream of its device: checked by name before any message.
void check_cache_device(const char* who, const Device& cache, const Stream& stream,
                        std::initializer_list<std::pair<const char*, TensorView>> named) {
  for (const auto& [name, t] : named) {
    if (t.empty()) continue;
    SEQPAR_CHECK(t.device() == cache, who, ": ", name, " ", t.str(), " is on ", t.device().str(),
                 ", but the cache lives on ", cache.str(),
                 " (pass the inputs on the cache's device, or make the cache on theirs: make_cache's device)");
  }
  SEQPAR_CHECK(cache.is_cpu() || stream.device == cache, who, ": the cache lives on ", cache.str(),
               ", but the groups' stream is on ", stream.device.str(), " (the kernels of a device cache run on a ",
               "stream of its device)");
}

std::int64_t g_device_schedule_steps = 0;  // mha_decode_device_schedule_steps()

// The device schedule of a decode step keeps each rank's fp64 lse exact in transit: its 8 bytes per row take the
// slots of the host schedule's hi + lo pair (2 fp32, or an fp64 and a zero). pack_lse writes lse [B, H, n] fp64 into
// buf at element `offset` (buf's accumulator dtype); unpack_lse reads it back into an fp64 tensor. Copies of the
// buffer's own dtype only (no fp64 access at an fp32 offset, which a device would fault on).
void pack_lse(const TensorView& lse, const Tensor& buf, std::int64_t offset, Stream stream) {
  const std::int64_t rows = lse.numel();
  if (buf.dtype() == DType::kFloat64) {
    copy_convert(lse, decode_detail::sub_view(buf, offset, {rows}), stream);
    fill(decode_detail::sub_view(buf, offset + rows, {rows}), 0.0, stream);
  } else {
    copy_convert(TensorView(lse.data(), DType::kFloat32, {2 * rows}, lse.device()),
                 decode_detail::sub_view(buf, offset, {2 * rows}), stream);
  }
}
void unpack_lse(const Tensor& buf, std::int64_t offset, const Tensor& lse, Stream stream) {
  const std::int64_t rows = lse.numel();
  if (buf.dtype() == DType::kFloat64) {
    copy_convert(decode_detail::sub_view(buf, offset, {rows}), lse, stream);
  } else {
    copy_convert(decode_detail::sub_view(buf, offset, {2 * rows}),
                 TensorView(lse.data(), DType::kFloat32, {2 * rows}, lse.view().device()), stream);
  }
}

constexpr std::array<const char*, 2> kCacheShardNames = {"contiguous", "interleave"};
constexpr std::array<const char*, 3> kChunkModeNames = {"auto", "pass-kv", "pass-q"};

// The rows of this rank's padding slots (a padded chunk layout) get out 0 and lse -inf, as in training: the merge
// attended them to the cache like real rows.
void clear_padding_rows(const SequenceLayout& layout, int cp_rank, PrefillOutput& r) {
  const std::vector<std::int64_t> tokens = layout.token_index(cp_rank);
  const std::int64_t B = r.out.dim(0), sl = r.out.dim(1), H = r.out.dim(2), D = r.out.dim(3);
  const std::size_t out_row = static_cast<std::size_t>(H * D) * dtype_size(r.out.dtype());
  const std::size_t lse_el = dtype_size(r.lse.dtype());
  for (std::int64_t i = 0; i < sl; ++i) {
    if (tokens[i] >= 0) continue;
    for (std::int64_t b = 0; b < B; ++b) {
      auto* o = static_cast<char*>(r.out.data()) + static_cast<std::size_t>(b * sl + i) * out_row;
      fill(TensorView(o, r.out.dtype(), {H * D}), 0.0);
      for (std::int64_t h = 0; h < H; ++h) {
        auto* l = static_cast<char*>(r.lse.data()) + static_cast<std::size_t>((b * H + h) * sl + i) * lse_el;
        fill(TensorView(l, r.lse.dtype(), {1}), -std::numeric_limits<double>::infinity());
      }
    }
  }
}

// Shared with the DSA decode layer (parallel/decode_shared.h).
using decode_detail::add_cache_fields;
using decode_detail::iota_from;
using decode_detail::merge_shards;
using decode_detail::split_lse;
using decode_detail::sub_view;

}  // namespace

Tensor slice_dim(const TensorView& t, int dim, std::int64_t begin, std::int64_t end, Stream stream) {
  SEQPAR_CHECK(dim >= 0 && dim < t.ndim() && 0 <= begin && begin <= end && end <= t.dim(dim), "slice_dim: [", begin,
               ", ", end, ") of dimension ", dim, " of ", t.str());
  Shape shape = t.shape();
  shape[dim] = end - begin;
  Tensor out = Tensor::empty(shape, t.dtype(), MemCategory::kWorkspace, t.device());
  gather_rows(t, dim, iota_from(begin, end - begin), out, stream);
  return out;
}

const char* cache_shard_name(CacheShardKind kind) { return kCacheShardNames[static_cast<int>(kind)]; }
CacheShardKind parse_cache_shard(std::string_view name) {
  return static_cast<CacheShardKind>(parse_option_index(name, kCacheShardNames, "cache shard"));
}

const char* chunk_prefill_mode_name(ChunkPrefillMode mode) { return kChunkModeNames[static_cast<int>(mode)]; }
ChunkPrefillMode parse_chunk_prefill_mode(std::string_view name) {
  return static_cast<ChunkPrefillMode>(parse_option_index(name, kChunkModeNames, "chunk prefill mode"));
}

// ---- CacheSharding -----------------------------------------------------------------------------------------------

CacheSharding::CacheSharding(CacheShardKind kind, std::int64_t capacity, int num_ranks, std::int64_t interleave)
    : kind_(kind), capacity_(capacity), num_ranks_(num_ranks), interleave_(interleave), block_(1) {
  SEQPAR_CHECK(capacity >= 0, "CacheSharding: capacity ", capacity, " must be >= 0");
  SEQPAR_CHECK(num_ranks >= 1, "CacheSharding: num_ranks ", num_ranks, " must be >= 1");
  SEQPAR_CHECK(interleave >= 1, "CacheSharding: interleave ", interleave, " must be >= 1");
  if (kind == CacheShardKind::kContiguous) {
    interleave_ = 1;
    block_ = std::max<std::int64_t>(1, (capacity + num_ranks - 1) / num_ranks);
  }
}

int CacheSharding::owner(std::int64_t t) const {
  return kind_ == CacheShardKind::kContiguous ? static_cast<int>(t / block_)
                                              : static_cast<int>((t / interleave_) % num_ranks_);
}

std::int64_t CacheSharding::local_capacity(int rank) const {
  if (kind_ == CacheShardKind::kContiguous) return std::clamp<std::int64_t>(capacity_ - rank * block_, 0, block_);
  const std::int64_t cycle = interleave_ * num_ranks_;
  return capacity_ / cycle * interleave_ +
         std::clamp<std::int64_t>(capacity_ % cycle - rank * interleave_, 0, interleave_);
}

std::vector<std::int64_t> CacheSharding::owned(int rank, std::int64_t begin, std::int64_t end) const {
  std::vector<std::int64_t> out;
  for (std::int64_t t = begin; t < end; ++t) {
    if (owner(t) == rank) out.push_back(t);
  }
  return out;
}

std::string CacheSharding::str() const {
  return str_cat(cache_shard_name(kind_), kind_ == CacheShardKind::kInterleave ? str_cat(" ", interleave_) : "",
                 " over ", num_ranks_, " ranks, capacity ", capacity_);
}

// ---- ShardedKvCache ----------------------------------------------------------------------------------------------

void check_cache_shard(const CacheSharding& sharding, int rank, std::int64_t capacity) {
  SEQPAR_CHECK(capacity == sharding.capacity(), "sharded cache: spec capacity ", capacity,
               " differs from the sharding's ", sharding.capacity());
  SEQPAR_CHECK(rank >= 0 && rank < sharding.num_ranks(), "sharded cache: rank ", rank, " outside [0, ",
               sharding.num_ranks(), ")");
}

// ---- MHA ---------------------------------------------------------------------------------------------------------

MhaDecodeCp::MhaDecodeCp(const CpGroups& groups, const MhaDecodeConfig& config)
    : groups_(groups), config_(config) {
  SEQPAR_CHECK(config.interleave >= 1, "MhaDecodeCp: interleave ", config.interleave, " must be >= 1");
  SEQPAR_CHECK(std::isfinite(config.scale), "MhaDecodeCp: scale ", config.scale, " must be finite");
}

ShardedKvCache MhaDecodeCp::make_cache(std::int64_t batch, std::int64_t capacity, std::int64_t kv_heads,
                                                    std::int64_t head_dim, DType dtype, Device device) const {
  const int pu = groups_.ulysses_size();
  SEQPAR_CHECK(kv_heads >= 1, "MhaDecodeCp::make_cache: kv_heads Hkv = ", kv_heads, " must be >= 1");
  SEQPAR_CHECK(
      kv_heads % pu == 0 || pu % kv_heads == 0, "MhaDecodeCp::make_cache: ", "kv_heads Hkv = ", kv_heads,
      " must be divisible by ulysses_size ", pu,
      " (decode splits whole KV heads over the Ulysses group) or divide it (each KV head is then replicated to ",
      "ulysses_size / Hkv ranks, as in training)");
  SEQPAR_CHECK(device.is_cpu() || (device.index >= 0 && device.index < cuda_device_count()),
               "MhaDecodeCp::make_cache: device ", device.str(), " is not usable (",
               cuda_device_count() == 0 ? cuda_unavailable_reason()
                                        : str_cat(cuda_device_count(), " CUDA devices visible"),
               ")");
  const CacheSharding sharding(config_.shard, capacity, groups_.ring.size(), config_.interleave);
  const std::int64_t replication = kv_heads % pu == 0 ? 1 : pu / kv_heads;
  ShardedKvCache cache(sharding, groups_.ring.rank(),
                       attn::KvCacheSpec{batch, capacity, kv_heads * replication / pu, head_dim, dtype, device});
  cache.kv_replication_ = replication;
  return cache;
}

std::int64_t MhaDecodeCp::all_kv_heads(const ShardedKvCache& cache) const {
  return cache.spec().kv_heads * groups_.ulysses_size() / cache.kv_replication_;
}

Tensor MhaDecodeCp::replicated_kv(const ShardedKvCache& cache, const TensorView& kv) const {
  if (cache.kv_replication_ == 1) return {};
  const DeviceAlloc alloc{kv.device(), groups_.stream};
  Tensor out = alloc.empty({kv.dim(0), kv.dim(1), kv.dim(2) * cache.kv_replication_, kv.dim(3)}, kv.dtype(),
                           MemCategory::kWorkspace);
  replicate_kv_heads(kv, cache.kv_replication_, out.view(), groups_.stream);
  return out;
}

std::int64_t MhaDecodeCp::decode_bytes_per_step(std::int64_t batch, std::int64_t n, std::int64_t q_heads,
                                                             std::int64_t head_dim, DType dtype) const {
  return static_cast<std::int64_t>(groups_.ring.size() - 1) * batch * n * (q_heads / groups_.ulysses_size()) *
         (head_dim + 2) * static_cast<std::int64_t>(dtype_size(accumulator_dtype(dtype)));
}

void MhaDecodeCp::check_cache(const ShardedKvCache& cache, const char* call) const {
  const CacheSharding& s = cache.sharding();
  const CacheSharding mine(config_.shard, s.capacity(), groups_.ring.size(), config_.interleave);
  SEQPAR_CHECK(s == mine && cache.rank() == groups_.ring.rank(), call, ": the cache is sharded ", s.str(), " for rank ",
               cache.rank(), ", but this layer shards ", mine.str(), " and this is ring rank ", groups_.ring.rank(),
               " (make the cache with this layer's make_cache)");
}

void MhaDecodeCp::agree(const ShardedKvCache& cache, std::string_view call, const SequenceLayout* layout,
                                     std::initializer_list<std::pair<std::string_view, TensorView>> tensors) {
  Fingerprint fp(call);
  fp.add_real("scale", config_.scale)
      .add_text("prefill_impl", ring_impl_name(config_.prefill_impl))
      .add_int("kv_heads", cache.spec().kv_heads)
      .add_int("kv_replication", cache.kv_replication_)
      .add_int("head_dim", cache.spec().head_dim);
  decode_detail::agree_on_cache(agreement_, groups_, fp, cache, layout, tensors);
}

void MhaDecodeCp::check_prompt(const ShardedKvCache& cache, const SequenceLayout& layout, const char* who,
                                            const TensorView& q, const TensorView& k, const TensorView& v) {
  check_cache_device(who, cache.spec().device, groups_.stream, {{"q", q}, {"k", k}, {"v", v}});
  check_cache(cache, who);
  check_layout_matches(groups_, layout, who);
  const attn::KvCacheSpec& s = cache.spec();
  const Shape kv_shape{s.batch, layout.local_len(), all_kv_heads(cache), s.head_dim};
  check_shape(k, kv_shape, str_cat(who, " k (the cache's [B, S_local, Hkv, D])").c_str());
  check_shape(v, kv_shape, str_cat(who, " v (the cache's [B, S_local, Hkv, D])").c_str());
  SEQPAR_CHECK(k.dtype() == s.dtype && v.dtype() == s.dtype, who, ": k and v must have the cache's dtype ",
               dtype_name(s.dtype), ", got ", dtype_name(k.dtype()), " and ", dtype_name(v.dtype()));
  agree(cache, who, &layout, {{"q", q}, {"k", k}, {"v", v}});
  decode_detail::check_one_request(layout, who);
  SEQPAR_CHECK(cache.length() == 0, who, ": the cache already holds ", cache.length(),
               " tokens; a prompt continuation (persistent-cache prefill) is not supported yet");
  SEQPAR_CHECK(layout.seq_len() <= s.capacity, who, ": the prompt of ", layout.seq_len(),
               " tokens does not fit the cache capacity ", s.capacity);
}

PrefillOutput MhaDecodeCp::prefill(ShardedKvCache& cache, const SequenceLayout& layout,
                                                const TensorView& q, const TensorView& k, const TensorView& v) {
  check_prompt(cache, layout, "MhaDecodeCp::prefill", q, k, v);
  MhaCpConfig rc;
  rc.impl = config_.prefill_impl;
  rc.causal = true;
  rc.scale = config_.scale;
  MhaCp usp(groups_, layout, rc);  // a ring when ulysses_size = 1
  MhaCpOutput o = usp.forward(q, k, v);
  counters_ += usp.counters();
  reshard_prompt(cache, layout, k, v);
  cache.length_ = layout.seq_len();
  return {std::move(o.out), std::move(o.lse)};
}

void MhaDecodeCp::fill(ShardedKvCache& cache, const SequenceLayout& layout, const TensorView& k,
                                    const TensorView& v) {
  check_prompt(cache, layout, "MhaDecodeCp::fill", {}, k, v);
  reshard_prompt(cache, layout, k, v);
  cache.length_ = layout.seq_len();
}

void MhaDecodeCp::reshard_prompt(ShardedKvCache& cache, const SequenceLayout& layout, const TensorView& k,
                                              const TensorView& v, std::int64_t offset) {
  // CP rank d = ring_rank(d) Pu + ulysses_rank(d) stores the tokens ring_rank(d) owns, for the KV heads
  // [ulysses_rank(d) Hkv / Pu, (ulysses_rank(d) + 1) Hkv / Pu) (of the replicated heads when Hkv < Pu).
  const CommStreamScope stream_scope(groups_);
  const Tensor k_rep = replicated_kv(cache, k), v_rep = replicated_kv(cache, v);
  const decode_detail::StoredRows kv = decode_detail::reshard_to_owners(
      groups_, counters_, cache.sharding(), groups_.ulysses_size(), layout, offset,
      {k_rep.defined() ? k_rep.view() : k, v_rep.defined() ? v_rep.view() : v});
  cache.local_.append(kv.rows[0], kv.rows[1], kv.tokens, groups_.stream);
}

std::int64_t MhaDecodeCp::pass_kv_bytes(const ShardedKvCache& cache) const {
  const attn::KvCacheSpec& s = cache.spec();
  std::int64_t m_max = 0;
  for (int r = 0; r < groups_.ring.size(); ++r) {
    m_max =
        std::max<std::int64_t>(m_max, static_cast<std::int64_t>(cache.sharding().owned(r, 0, cache.length()).size()));
  }
  return static_cast<std::int64_t>(groups_.ring.size() - 1) * 2 * s.batch * m_max * s.kv_heads * s.head_dim *
         static_cast<std::int64_t>(dtype_size(s.dtype));
}

std::int64_t MhaDecodeCp::pass_q_bytes(const ShardedKvCache& cache, const SequenceLayout& layout,
                                                    std::int64_t q_heads) const {
  const attn::KvCacheSpec& s = cache.spec();
  const std::int64_t P = groups_.ring.size(), t_loc = layout.ring_shard_len();  // padding rows travel too
  return (P - 1) * s.batch * t_loc * (q_heads / groups_.ulysses_size()) *
         (s.head_dim * static_cast<std::int64_t>(dtype_size(s.dtype)) +
          (s.head_dim + 2) * static_cast<std::int64_t>(dtype_size(accumulator_dtype(s.dtype))));
}

ChunkPrefillMode MhaDecodeCp::choose_chunk_mode(const ShardedKvCache& cache, const SequenceLayout& layout,
                                                             std::int64_t q_heads) const {
  return pass_q_bytes(cache, layout, q_heads) < pass_kv_bytes(cache) ? ChunkPrefillMode::kPassQ
                                                                     : ChunkPrefillMode::kPassKv;
}

// One extend call's chunk: this rank's queries of it (its ring shard; under USP its Hq / Pu heads) and the partial
// results of its queries, P blocks (out, lse hi, lo) for the cached part and the chunk's own as block P.
struct MhaDecodeCp::ChunkPass {
  ShardedKvCache& cache;
  const SequenceLayout& layout;
  TensorView q;                                  // [B, t_loc, hq, D]
  std::int64_t L, B, D, t_loc, hq, rows, block;  // L: the cache's length before the chunk; block = rows * (D + 2)
  int P;                                         // ring ranks
  DType acc;
  Tensor parts;      // [block * (P + 1)] acc
  Tensor lse64;      // [B, hq, t_loc] fp64: one partial's lse
  CpCounters route;  // the bytes of the route alone (chunk_route_bytes_sent)

  // The chunk's positions on ring rank r (after the L cached tokens).
  std::vector<std::int64_t> chunk_positions(int r) const {
    std::vector<std::int64_t> pos = layout.ring_shard_positions(r);
    for (std::int64_t& t : pos) t += L;
    return pos;
  }
  // Writes one partial's lse (fp64 in lse64) into block `r` of `buf` after its out.
  void put_lse(const Tensor& buf, std::int64_t r) const {
    if (acc == DType::kFloat64) {
      double* b = buf.data_as<double>() + r * block + rows * D;
      split_lse(lse64.data_as<double>(), rows, b, b + rows);
    } else {
      float* b = buf.data_as<float>() + r * block + rows * D;
      split_lse(lse64.data_as<double>(), rows, b, b + rows);
    }
  }
};

PrefillOutput MhaDecodeCp::extend(ShardedKvCache& cache, const SequenceLayout& layout,
                                               const TensorView& q_in, const TensorView& k, const TensorView& v,
                                               ChunkPrefillMode mode) {
  check_extend(cache, layout, q_in, k, v, mode);
  const attn::KvCacheSpec& s = cache.spec();
  const int pu = groups_.ulysses_size();
  const std::int64_t B = s.batch, D = s.head_dim, t_new = layout.seq_len(), L = cache.length(), hq_all = q_in.dim(2);
  if (mode == ChunkPrefillMode::kAuto) mode = choose_chunk_mode(cache, layout, hq_all);
  const int P = groups_.ring.size();
  const DType acc = accumulator_dtype(s.dtype);
  const DeviceAlloc alloc{Device::cpu(), groups_.stream};
  // Under USP the Ulysses exchange first gives this rank its ring shard of the chunk for its query and KV heads
  // (hq = Hq / Pu of them, t_loc = the ring shard's rows), as in MhaCp; a group of one keeps q, k, v as they
  // are.
  const UlyssesExchange a2a(groups_, counters_);
  Tensor q_h, k_h, v_h;
  if (pu > 1) {
    q_h = a2a.to_heads(q_in);
    const Tensor k_rep = replicated_kv(cache, k), v_rep = replicated_kv(cache, v);
    k_h = a2a.to_heads(k_rep.defined() ? k_rep.view() : k);
    v_h = a2a.to_heads(v_rep.defined() ? v_rep.view() : v);
  }
  const TensorView q = pu > 1 ? q_h.view() : q_in;
  const std::int64_t t_loc = layout.ring_shard_len(), hq = hq_all / pu;
  const std::int64_t rows = B * t_loc * hq, block = rows * (D + 2);
  // 1. The chunk's own causal attention (the training forward over the chunk's ring shards; positions relative to L).
  MhaCpConfig rc;
  rc.impl = config_.prefill_impl;
  rc.scale = config_.scale;
  RingAttention ring(groups_, layout, rc);
  MhaCpOutput own = pu > 1 ? ring.forward(q, k_h, v_h) : ring.forward(q, k, v);
  counters_ += ring.counters();
  // 2. The cached part: P partial (out, lse hi, lo) blocks for this rank's queries, then the chunk's as block P.
  Tensor parts = alloc.empty({block * (P + 1)}, acc, MemCategory::kCommBuffer);
  Tensor lse64 = alloc.empty({B, hq, t_loc}, DType::kFloat64, MemCategory::kWorkspace);
  ChunkPass c{cache, layout, q, L, B, D, t_loc, hq, rows, block, P, acc, std::move(parts), std::move(lse64), {}};
  if (mode == ChunkPrefillMode::kPassKv) {
    extend_pass_kv(c);
  } else {
    extend_pass_q(c);
  }
  chunk_route_bytes_sent_ = c.route.bytes_sent;
  counters_ += c.route;
  // 3. Merge the P cached partials and the chunk's own.
  PrefillOutput result = merge_chunk(c, own, q_in, a2a);
  clear_padding_rows(layout, groups_.cp_rank(), result);
  // 4. The chunk's K/V join the cache on their owners.
  reshard_prompt(cache, layout, k, v, L);
  cache.length_ = L + t_new;
  return result;
}

// The checks of extend before any data moves (the agreement check included).
void MhaDecodeCp::check_extend(const ShardedKvCache& cache, const SequenceLayout& layout,
                                            const TensorView& q_in, const TensorView& k, const TensorView& v,
                                            ChunkPrefillMode mode) {
  const char* who = "MhaDecodeCp::extend";
  SEQPAR_CHECK(cache.spec().device.is_cpu(), who, ": the cache lives on ", cache.spec().device.str(),
               ", but a chunk prefill runs on the host only (no device implementation yet); prefill or fill a device ",
               "cache in one call, or keep the cache on the host");
  check_cache_device(who, cache.spec().device, groups_.stream, {{"q", q_in}, {"k", k}, {"v", v}});
  check_cache(cache, who);
  check_layout_matches(groups_, layout, who);
  const attn::KvCacheSpec& s = cache.spec();
  const std::int64_t B = s.batch, D = s.head_dim, sl = layout.local_len(), t_new = layout.seq_len();
  const std::int64_t hkv = all_kv_heads(cache);  // the cache holds Hkv / Pu of them (one replica when Hkv < Pu)
  const Shape kv_shape{B, sl, hkv, D};
  check_shape(k, kv_shape, "MhaDecodeCp::extend k (the cache's [B, S_local, Hkv, D])");
  check_shape(v, kv_shape, "MhaDecodeCp::extend v (the cache's [B, S_local, Hkv, D])");
  SEQPAR_CHECK(q_in.ndim() == 4 && q_in.dim(0) == B && q_in.dim(1) == sl && q_in.dim(3) == D && q_in.dim(2) % hkv == 0,
               who, ": q ", shape_str(q_in.shape()), " must be [", B, ", ", sl, ", Hq, ", D,
               "] with Hq a multiple of Hkv = ", hkv);
  SEQPAR_CHECK(q_in.dtype() == s.dtype && k.dtype() == s.dtype && v.dtype() == s.dtype, who,
               ": q, k, v must have the cache's dtype ", dtype_name(s.dtype));
  agree(cache, str_cat(who, " ", chunk_prefill_mode_name(mode)), &layout, {{"q", q_in}, {"k", k}, {"v", v}});
  decode_detail::check_one_request(layout, who);
  const std::int64_t L = cache.length();
  SEQPAR_CHECK(L + t_new <= s.capacity, who, ": a chunk of ", t_new, " tokens after ", L,
               " would run past the cache capacity ", s.capacity, ": make the cache with a capacity of at least ",
               L + t_new, " tokens (make_cache's capacity)");
}

// pass-kv: the ring all-gathers every rank's cached K/V, and each rank attends its queries to all of them.
void MhaDecodeCp::extend_pass_kv(ChunkPass& c) {
  ShardedKvCache& cache = c.cache;
  const attn::KvCacheSpec& s = cache.spec();
  const DeviceAlloc alloc{Device::cpu(), groups_.stream};
  const TensorView q = c.q;
  const std::int64_t B = c.B, D = c.D, L = c.L, t_loc = c.t_loc, hq = c.hq, block = c.block;
  const int P = c.P;
  const std::vector<std::int64_t> q_pos = c.chunk_positions(groups_.ring.rank());
  std::vector<std::vector<std::int64_t>> held(P);
  std::int64_t m_max = 0;
  for (int r = 0; r < P; ++r) {
    held[r] = cache.sharding().owned(r, 0, L);
    m_max = std::max<std::int64_t>(m_max, static_cast<std::int64_t>(held[r].size()));
  }
  const std::int64_t shard = B * m_max * s.kv_heads * D;  // elements of one of K, V, padded
  Tensor send = alloc.zeros({2 * shard}, s.dtype, MemCategory::kCommBuffer);
  Tensor recv = alloc.empty({P * 2 * shard}, s.dtype, MemCategory::kCommBuffer);
  const std::int64_t m_me = cache.local().length();
  for (std::int64_t b = 0; b < B; ++b) {
    const Shape rows_shape{1, m_me, s.kv_heads, D};
    copy_convert(cache.local().k_rows(b), sub_view(send, b * m_max * s.kv_heads * D, rows_shape));
    copy_convert(cache.local().v_rows(b), sub_view(send, shard + b * m_max * s.kv_heads * D, rows_shape));
  }
  {
    CommMeter meter(groups_, c.route);
    WorkHandle w = groups_.ring.all_gather(send, recv);
    timed_wait(groups_.ring, w, &counters_.exposed_comm_s);
  }
  ScopedTimer timer(counters_.compute_s);
  for (int r = 0; r < P; ++r) {
    const std::int64_t m_r = static_cast<std::int64_t>(held[r].size());
    for (std::int64_t b = 0; b < B; ++b) {
      attn::MhaForwardArgs a;
      a.q = q.slice0(b, b + 1);
      a.k = sub_view(recv, r * 2 * shard + b * m_max * s.kv_heads * D, {1, m_r, s.kv_heads, D});
      a.v = sub_view(recv, r * 2 * shard + shard + b * m_max * s.kv_heads * D, {1, m_r, s.kv_heads, D});
      a.q_pos = q_pos;
      a.k_pos = held[r];
      a.mask.causal = true;
      a.scale = config_.scale;
      attn::mha_forward(a, sub_view(c.parts, r * block + b * t_loc * hq * D, {1, t_loc, hq, D}),
                        c.lse64.view().slice0(b, b + 1), groups_.stream);
    }
    c.put_lse(c.parts, r);
  }
}

// pass-q: the ring all-gathers the chunk's queries, each rank attends them to its cache shard, and an all-to-all
// returns every rank its partial results.
void MhaDecodeCp::extend_pass_q(ChunkPass& c) {
  ShardedKvCache& cache = c.cache;
  const attn::KvCacheSpec& s = cache.spec();
  const DeviceAlloc alloc{Device::cpu(), groups_.stream};
  const TensorView q = c.q;
  const std::int64_t B = c.B, D = c.D, t_loc = c.t_loc, hq = c.hq, block = c.block;
  const int P = c.P;
  const DType acc = c.acc;
  Tensor q_all = alloc.empty({P * B * t_loc * hq * D}, s.dtype, MemCategory::kCommBuffer);
  Tensor send = alloc.empty({block * P}, acc, MemCategory::kCommBuffer);
  {
    CommMeter meter(groups_, c.route);
    WorkHandle w = groups_.ring.all_gather(q, q_all);
    timed_wait(groups_.ring, w, &counters_.exposed_comm_s);
  }
  {
    ScopedTimer timer(counters_.compute_s);
    for (int r = 0; r < P; ++r) {
      attn::mha_decode(cache.local(), sub_view(q_all, r * B * t_loc * hq * D, {B, t_loc, hq, D}), c.chunk_positions(r),
                       sub_view(send, r * block, {B, t_loc, hq, D}), c.lse64, config_.scale, groups_.stream);
      c.put_lse(send, r);
    }
  }
  CommMeter meter(groups_, c.route);
  WorkHandle w = groups_.ring.all_to_all(send, sub_view(c.parts, 0, {block * P}));
  timed_wait(groups_.ring, w, &counters_.exposed_comm_s);
}

// The merge of the P cached partials and the chunk's own (`own`, this rank's queries); under USP back to the compute
// layout ([B, S_local, Hq, D] and [B, Hq, S_local]).
PrefillOutput MhaDecodeCp::merge_chunk(ChunkPass& c, const MhaCpOutput& own, const TensorView& q_in,
                                                    const UlyssesExchange& a2a) {
  const DeviceAlloc alloc{Device::cpu(), groups_.stream};
  const TensorView q = c.q;
  const std::int64_t B = c.B, D = c.D, t_loc = c.t_loc, hq = c.hq, block = c.block;
  const std::int64_t hq_all = q_in.dim(2), sl = q_in.dim(1);
  const int P = c.P, pu = groups_.ulysses_size();
  const DType acc = c.acc;
  PrefillOutput result;
  {
    ScopedTimer timer(counters_.compute_s);
    copy_convert(own.out, sub_view(c.parts, P * block, {B, t_loc, hq, D}));
    copy_convert(own.lse, c.lse64);
    c.put_lse(c.parts, P);
    Tensor merged = alloc.empty({B, t_loc, hq, D}, acc, MemCategory::kWorkspace);
    result.lse = alloc.empty({B, hq, t_loc}, acc, MemCategory::kWorkspace);
    if (acc == DType::kFloat64) {
      merge_shards(c.parts.data_as<double>(), P + 1, B, t_loc, hq, D, merged.data_as<double>(),
                   result.lse.data_as<double>());
    } else {
      merge_shards(c.parts.data_as<float>(), P + 1, B, t_loc, hq, D, merged.data_as<float>(),
                   result.lse.data_as<float>());
    }
    result.out = alloc.copy_of(merged, q.dtype(), MemCategory::kWorkspace);
  }
  if (pu > 1) {  // back to the compute layout: [B, S_local, Hq, D] and [B, Hq, S_local]
    PrefillOutput seq;
    seq.out = alloc.empty(q_in.shape(), q_in.dtype(), MemCategory::kWorkspace);
    seq.lse = alloc.empty({B, hq_all, sl}, acc, MemCategory::kWorkspace);
    a2a.to_sequence(result.out, seq.out);
    a2a.lse_to_sequence(result.lse, seq.lse);
    result = std::move(seq);
  }
  return result;
}

DecodeOutput MhaDecodeCp::decode(ShardedKvCache& cache, const TensorView& q, const TensorView& k,
                                              const TensorView& v) {
  const char* who = "MhaDecodeCp::decode";
  check_cache_device(who, cache.spec().device, groups_.stream, {{"q_new", q}, {"k_new", k}, {"v_new", v}});
  check_cache(cache, who);
  const attn::KvCacheSpec& s = cache.spec();
  SEQPAR_CHECK(q.ndim() == 4 && q.dim(1) >= 1, who, ": q_new must be [B, n, Hq, D] with n >= 1, got ",
               shape_str(q.shape()));
  const int pu = groups_.ulysses_size();
  const std::int64_t n = q.dim(1), hq_all = q.dim(2), B = s.batch, D = s.head_dim, hq = hq_all / pu;
  const std::int64_t hkv = all_kv_heads(cache);
  const Shape kv_shape{B, n, hkv, D};
  check_shape(k, kv_shape, "MhaDecodeCp::decode k_new (the cache's [B, n, Hkv, D])");
  check_shape(v, kv_shape, "MhaDecodeCp::decode v_new (the cache's [B, n, Hkv, D])");
  SEQPAR_CHECK(q.dim(0) == B && q.dim(3) == D && hq_all % hkv == 0 && hq_all % pu == 0, who, ": q_new ",
               shape_str(q.shape()), " must be [", B, ", n, Hq, ", D, "] with Hq a multiple of Hkv = ", hkv,
               " (the cache's) and of ulysses_size ", pu);
  SEQPAR_CHECK(q.dtype() == s.dtype && k.dtype() == s.dtype && v.dtype() == s.dtype, who,
               ": q_new, k_new, v_new must have the cache's dtype ", dtype_name(s.dtype));
  agree(cache, who, nullptr, {{"q_new", q}, {"k_new", k}, {"v_new", v}});
  const std::int64_t L = cache.length();
  SEQPAR_CHECK(L + n <= s.capacity, who, ": ", n, " new tokens after ", L, " would run past the cache capacity ",
               s.capacity, ": make the cache with a capacity of at least ", L + n,
               " tokens (make_cache's capacity: the prompt and every token to decode)");
  const std::vector<std::int64_t> q_pos = iota_from(L, n);
  const DType acc = accumulator_dtype(s.dtype);
  const std::int64_t rows = B * n * hq, block = rows * (D + 2);
  // The device schedule: a device cache, or the host in the lowered test mode (attention/lowering.h), which runs the
  // same calls on the CPU.
  const bool device_schedule = !s.device.is_cpu() || attn::lowered_attention_enabled();
  const CommStreamScope stream_scope(groups_);
  const DeviceAlloc alloc{s.device, groups_.stream};
  Tensor send = alloc.empty({block}, acc, MemCategory::kCommBuffer);
  Tensor recv = alloc.empty({block * groups_.ring.size()}, acc, MemCategory::kCommBuffer);
  {
    ScopedTimer timer(counters_.compute_s);
    // The owner appends the new tokens it owns, then every rank attends the queries to its shard.
    // This rank's heads of the new tokens (all of them when ulysses_size = 1).
    const auto heads = [&](const TensorView& t, std::int64_t local) {
      const std::int64_t u = groups_.ulysses.rank();
      return slice_dim(t, 2, u * local, (u + 1) * local, groups_.stream);
    };
    const Tensor k_rep = replicated_kv(cache, k), v_rep = replicated_kv(cache, v);  // Hkv < Pu: one replica each
    const Tensor q_l = heads(q, hq), k_l = heads(k_rep.defined() ? k_rep.view() : k, s.kv_heads),
                 v_l = heads(v_rep.defined() ? v_rep.view() : v, s.kv_heads);
    std::vector<std::int64_t> idx, pos;
    for (std::int64_t t : cache.sharding().owned(cache.rank(), L, L + n)) {
      idx.push_back(t - L);
      pos.push_back(t);
    }
    if (!idx.empty()) {
      const Shape shape{B, static_cast<std::int64_t>(idx.size()), s.kv_heads, D};
      Tensor k_own = alloc.empty(shape, s.dtype, MemCategory::kWorkspace);
      Tensor v_own = alloc.empty(shape, s.dtype, MemCategory::kWorkspace);
      gather_rows(k_l, 1, idx, k_own, groups_.stream);
      gather_rows(v_l, 1, idx, v_own, groups_.stream);
      cache.local_.append(k_own, v_own, pos, groups_.stream);
    }
    Tensor lse_r = alloc.empty({B, hq, n}, DType::kFloat64, MemCategory::kWorkspace);
    const TensorView out_r = sub_view(send, 0, {B, n, hq, D});
    if (device_schedule) {
      // A shard with no token yet contributes nothing (lse -inf, out 0), without a kernel call on zero keys.
      if (cache.local_.length() == 0) {
        seqpar::fill(out_r, 0.0, groups_.stream);
        seqpar::fill(lse_r, -std::numeric_limits<double>::infinity(), groups_.stream);
      } else {
        attn::mha_decode(cache.local_, q_l, q_pos, out_r, lse_r, config_.scale, groups_.stream);
      }
      pack_lse(lse_r, send, rows * D, groups_.stream);
    } else {
      attn::mha_decode(cache.local_, q_l, q_pos, out_r, lse_r, config_.scale, groups_.stream);
      if (acc == DType::kFloat64) {
        split_lse(lse_r.data_as<double>(), rows, send.data_as<double>() + rows * D,
                  send.data_as<double>() + rows * D + rows);
      } else {
        split_lse(lse_r.data_as<double>(), rows, send.data_as<float>() + rows * D,
                  send.data_as<float>() + rows * D + rows);
      }
    }
  }
  {
    CommMeter meter(groups_, counters_);
    WorkHandle w = groups_.ring.all_gather(send, recv);
    timed_wait(groups_.ring, w, &counters_.exposed_comm_s);
  }
  cache.length_ += n;
  ++cache.num_steps_;
  DecodeOutput result;
  ScopedTimer timer(counters_.compute_s);
  Tensor merged = alloc.empty({B, n, hq, D}, acc, MemCategory::kWorkspace);
  if (device_schedule) {
    ++g_device_schedule_steps;
    // The ranks' partials merged in rank order by lse_merge (fp64 per row, rounded once per merge; out kept in the
    // accumulator dtype, the running lse in fp64), on the cache's device.
    Tensor lse64 = alloc.empty({B, hq, n}, DType::kFloat64, MemCategory::kWorkspace);
    Tensor lse_b = alloc.empty({B, hq, n}, DType::kFloat64, MemCategory::kWorkspace);
    alloc.copy_convert(sub_view(recv, 0, {B, n, hq, D}), merged);
    unpack_lse(recv, rows * D, lse64, groups_.stream);
    for (int r = 1; r < groups_.ring.size(); ++r) {
      unpack_lse(recv, r * block + rows * D, lse_b, groups_.stream);
      attn::lse_merge(merged, lse64, sub_view(recv, r * block, {B, n, hq, D}), lse_b, groups_.stream);
    }
    result.out = alloc.copy_of(merged, q.dtype(), MemCategory::kWorkspace);
    result.lse = alloc.copy_of(lse64, acc, MemCategory::kWorkspace);
    return result;
  }
  result.lse = alloc.empty({B, hq, n}, acc, MemCategory::kWorkspace);
  if (acc == DType::kFloat64) {
    merge_shards(recv.data_as<double>(), groups_.ring.size(), B, n, hq, D, merged.data_as<double>(),
                 result.lse.data_as<double>());
  } else {
    merge_shards(recv.data_as<float>(), groups_.ring.size(), B, n, hq, D, merged.data_as<float>(),
                 result.lse.data_as<float>());
  }
  result.out = alloc.copy_of(merged, q.dtype(), MemCategory::kWorkspace);
  return result;
}

std::int64_t mha_decode_device_schedule_steps() { return g_device_schedule_steps; }

// ---- GDN ---------------------------------------------------------------------------------------------------------

namespace {

// [B, S, h_i, d_i] tensors (one dtype) side by side along the channels: [B, S, sum_i h_i d_i] (workspace).
Tensor concat_channels(std::initializer_list<TensorView> parts, Stream stream) {
  const TensorView& first = *parts.begin();
  const std::int64_t B = first.dim(0), S = first.dim(1);
  std::int64_t channels = 0;
  for (const TensorView& t : parts) channels += t.dim(2) * t.dim(3);
  Tensor x = Tensor::empty({B, S, channels}, first.dtype(), MemCategory::kWorkspace, first.device());
  std::int64_t off = 0;
  for (const TensorView& t : parts) {
    const std::int64_t c = t.dim(2) * t.dim(3);
    scatter_rows(t.reshape({B, S, c}), 2, iota_from(off, c), x, stream);
    off += c;
  }
  return x;
}

// The inverse for one part: channels [off, off + h d) of x [B, S, C], copied into a new [B, S, h, d] tensor.
Tensor channels_as_heads(const TensorView& x, std::int64_t off, std::int64_t h, std::int64_t d, Stream stream) {
  Tensor t = Tensor::empty({x.dim(0), x.dim(1), h, d}, x.dtype(), MemCategory::kWorkspace, x.device());
  gather_rows(x, 2, iota_from(off, h * d), t.view().reshape({x.dim(0), x.dim(1), h * d}), stream);
  return t;
}

}  // namespace

GdnDecodeCp::GdnDecodeCp(const CpGroups& groups, const GdnCpConfig& config,
                                                   std::int64_t value_heads, std::int64_t key_heads,
                                                   const ShortConvCpConfig& conv)
    : groups_(groups), config_(config), hv_(value_heads), hk_(key_heads), conv_(conv) {
  // GdnCp's rules on its config (parallel/gdn_cp.cc), here at construction too, not at the first prefill.
  SEQPAR_CHECK(config.chunk_size >= 1, "GdnDecodeCp: chunk_size ", config.chunk_size, " must be >= 1");
  SEQPAR_CHECK(std::isfinite(config.scale), "GdnDecodeCp: scale ", config.scale,
               " must be finite (0 or less: 1/sqrt(K))");
  const int P = groups.cp.size();
  SEQPAR_CHECK(key_heads >= 1 && value_heads >= 1 && value_heads % key_heads == 0,
               "GdnDecodeCp: value_heads Hv = ", value_heads,
               " must be a positive multiple of key_heads Hk = ", key_heads);
  SEQPAR_CHECK(value_heads % P == 0 && key_heads % P == 0, "GdnDecodeCp: value_heads Hv = ", value_heads,
               " and key_heads Hk = ", key_heads, " must both be divisible by the CP group size ", P,
               " (decode splits whole heads over the group; a key head is not replicated)");
}

std::int64_t GdnDecodeCp::conv_channels(std::int64_t key_dim, std::int64_t value_dim) const {
  return 2 * hk_ * key_dim + hv_ * value_dim;
}

std::vector<std::int64_t> GdnDecodeCp::local_conv_channels(int cp_rank, std::int64_t key_dim,
                                                                        std::int64_t value_dim) const {
  const std::int64_t lk = local_key_heads() * key_dim, lv = local_value_heads() * value_dim;
  std::vector<std::int64_t> c = iota_from(cp_rank * lk, lk);  // q
  for (std::int64_t i : iota_from(hk_ * key_dim + cp_rank * lk, lk)) c.push_back(i);
  for (std::int64_t i : iota_from(2 * hk_ * key_dim + cp_rank * lv, lv)) c.push_back(i);
  return c;
}

attn::GdnCache GdnDecodeCp::make_cache(std::int64_t batch, std::int64_t key_dim, std::int64_t value_dim,
                                                    DType dtype, std::int64_t conv_width) const {
  SEQPAR_CHECK(conv_width >= 0, "GdnDecodeCp::make_cache: conv_width ", conv_width,
               " must be >= 0 (0: no short conv)");
  attn::GdnCacheSpec spec;
  spec.batch = batch;
  spec.value_heads = local_value_heads();
  spec.key_dim = key_dim;
  spec.value_dim = value_dim;
  spec.state_dtype = accumulator_dtype(dtype);
  if (conv_width > 0) {
    spec.conv_channels = 2 * local_key_heads() * key_dim + local_value_heads() * value_dim;
    spec.conv_width = conv_width;
    spec.conv_dtype = dtype;
  }
  return attn::GdnCache(spec);
}

void GdnDecodeCp::agree(const attn::GdnCache& cache, std::string_view call, const SequenceLayout* layout,
                        std::initializer_list<std::pair<std::string_view, TensorView>> tensors) {
  Fingerprint fp(call);
  fp.add_text("mode", gdn_cp_mode_name(config_.mode))
      .add_flag("use_qk_l2norm", config_.use_qk_l2norm)
      .add_real("scale", config_.scale)
      .add_int("chunk_size", config_.chunk_size)
      .add_int("value_heads", hv_)
      .add_int("key_heads", hk_)
      .add_flag("conv use_silu", conv_.use_silu)
      .add_tensor("cache state", cache.state())
      .add_tensor("cache conv tail", cache.conv_state());
  add_cache_fields(fp, cache.length(), 0);
  if (layout != nullptr) add_layout_fields(fp, *layout);
  fp.add_tensors(tensors);
  agreement_.run(groups_.cp, fp, groups_.stream);
}

Tensor GdnDecodeCp::local_heads(const TensorView& t, std::int64_t total, std::int64_t local) const {
  SEQPAR_CHECK(t.ndim() >= 3 && t.dim(2) == total, "GdnDecodeCp: ", t.str(), " must have ", total,
               " heads in dimension 2");
  return slice_dim(t, 2, groups_.cp_rank() * local, (groups_.cp_rank() + 1) * local, groups_.stream);
}

void GdnDecodeCp::check_conv(const attn::GdnCache& cache, const char* who, const TensorView& q,
                                          const TensorView& k, const TensorView& v,
                                          const TensorView& conv_weight) const {
  const attn::GdnCacheSpec& s = cache.spec();
  const bool has_tail = s.conv_channels > 0;
  SEQPAR_CHECK(conv_weight.empty() != has_tail, who, ": conv_weight is ", conv_weight.empty() ? "absent" : "given",
               ", but the cache was made ", has_tail ? "with" : "without",
               " a short-conv tail (make_cache's conv_width; the conv runs exactly when both have it)");
  if (!has_tail) return;
  const std::int64_t C = conv_channels(s.key_dim, s.value_dim);
  check_shape(conv_weight, {C, s.conv_width}, str_cat(who, " conv_weight ([C = 2 Hk K + Hv V, W])").c_str());
  SEQPAR_CHECK(q.dtype() == s.conv_dtype && k.dtype() == s.conv_dtype && v.dtype() == s.conv_dtype &&
                   conv_weight.dtype() == s.conv_dtype,
               who, ": with the short conv, q, k, v and conv_weight must have the cache's conv dtype ",
               dtype_name(s.conv_dtype), ", got ", dtype_name(q.dtype()), ", ", dtype_name(k.dtype()), ", ",
               dtype_name(v.dtype()), " and ", dtype_name(conv_weight.dtype()));
}

Tensor GdnDecodeCp::gather_conv_tail(const SequenceLayout& layout, const TensorView& x,
                                                  std::int64_t key_dim, std::int64_t value_dim, std::int64_t width) {
  const int P = groups_.cp.size(), me = groups_.cp_rank();
  const std::int64_t B = x.dim(0), keep = width - 1, first = layout.seq_len() - keep;
  // The rows of CP rank r's shard that hold tail tokens, and the tail rows they fill (tokens [first, T), >= 0).
  const auto tail_rows = [&](int r, std::vector<std::int64_t>* rows, std::vector<std::int64_t>* slots) {
    const std::vector<std::int64_t> tokens = layout.token_index(r);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] < 0 || tokens[i] < first) continue;
      if (rows != nullptr) rows->push_back(static_cast<std::int64_t>(i));
      slots->push_back(tokens[i] - first);
    }
  };
  std::vector<std::int64_t> rows, slots;
  tail_rows(me, &rows, &slots);
  const std::int64_t m = static_cast<std::int64_t>(rows.size());
  const DeviceAlloc alloc{Device::cpu(), groups_.stream};
  // Send: to each rank d, my tail rows restricted to d's channels, [B, m, C_d].
  std::vector<std::vector<std::int64_t>> channels(P);
  std::vector<std::int64_t> send_counts(P), recv_counts(P);
  std::int64_t send_total = 0;
  for (int d = 0; d < P; ++d) {
    channels[d] = local_conv_channels(d, key_dim, value_dim);
    send_total += send_counts[d] = B * m * static_cast<std::int64_t>(channels[d].size());
  }
  const std::int64_t c_me = static_cast<std::int64_t>(channels[me].size());
  Tensor mine = alloc.empty({B, m, x.dim(2)}, x.dtype(), MemCategory::kWorkspace);
  gather_rows(x, 1, rows, mine, groups_.stream);
  Tensor send = alloc.empty({send_total}, x.dtype(), MemCategory::kCommBuffer);
  std::int64_t off = 0;
  for (int d = 0; d < P; ++d) {
    gather_rows(mine, 2, channels[d], sub_view(send, off, {B, m, static_cast<std::int64_t>(channels[d].size())}),
                groups_.stream);
    off += send_counts[d];
  }
  // Receive: from each source, its tail rows (in its row order) of my channels.
  std::vector<std::vector<std::int64_t>> from(P);
  std::int64_t recv_total = 0;
  for (int src = 0; src < P; ++src) {
    tail_rows(src, nullptr, &from[src]);
    recv_total += recv_counts[src] = B * static_cast<std::int64_t>(from[src].size()) * c_me;
  }
  Tensor recv = alloc.empty({recv_total}, x.dtype(), MemCategory::kCommBuffer);
  {
    CpCounters counters;
    {
      CommMeter meter(groups_, counters);
      WorkHandle w = groups_.cp.all_to_all_v(send, send_counts, recv, recv_counts);
      timed_wait(groups_.cp, w, nullptr);
    }
    conv_tail_bytes_sent_ = counters.bytes_sent;
  }
  Tensor tail = alloc.zeros({B, keep, c_me}, x.dtype(), MemCategory::kWorkspace);  // zeros before token 0
  off = 0;
  for (int src = 0; src < P; ++src) {
    const std::int64_t m_src = static_cast<std::int64_t>(from[src].size());
    if (m_src > 0) scatter_rows(sub_view(recv, off, {B, m_src, c_me}), 1, from[src], tail, groups_.stream);
    off += recv_counts[src];
  }
  return tail;
}

PrefillOutput GdnDecodeCp::prefill(attn::GdnCache& cache, const SequenceLayout& layout,
                                                const TensorView& q, const TensorView& k, const TensorView& v,
                                                const TensorView& g, const TensorView& beta,
                                                const TensorView& initial_state, const TensorView& conv_weight) {
  const char* who = "GdnDecodeCp::prefill";
  const attn::GdnCacheSpec& s = cache.spec();
  SEQPAR_CHECK(q.ndim() == 4 && v.ndim() == 4 && q.dim(2) == hk_ && v.dim(2) == hv_ && q.dim(0) == s.batch &&
                   q.dim(3) == s.key_dim && v.dim(3) == s.value_dim && s.value_heads == local_value_heads(),
               who, ": q ", shape_str(q.shape()), " and v ", shape_str(v.shape()), " must be [", s.batch, ", S, ", hk_,
               ", ", s.key_dim, "] and [", s.batch, ", S, ", hv_, ", ", s.value_dim, "] for a cache of this layer (",
               s.value_heads, " of its heads per rank)");
  check_conv(cache, who, q, k, v, conv_weight);
  if (!conv_weight.empty()) check_shape(k, q.shape(), str_cat(who, " k (q's shape)").c_str());
  agree(cache, who, &layout,
        {{"q", q},
         {"k", k},
         {"v", v},
         {"g", g},
         {"beta", beta},
         {"initial_state", initial_state},
         {"conv_weight", conv_weight}});
  SEQPAR_CHECK(cache.length() == 0, who, ": the cache already holds ", cache.length(),
               " tokens; a prompt continuation is not supported yet");
  decode_detail::check_one_request(layout, who);
  GdnCpConfig forward_only = config_;
  forward_only.save_inputs = false;  // no backward: nothing to save
  GdnCp gdn(groups_, layout, forward_only);
  GdnCpOutput o;
  Tensor tail;
  conv_tail_bytes_sent_ = 0;
  if (conv_weight.empty()) {
    o = gdn.forward(q, k, v, g, beta, initial_state);
  } else {
    // The conv over x = [q | k | v] (one halo exchange for all channels), then the recurrence on its output.
    const Tensor x = concat_channels({q, k, v}, groups_.stream);
    ShortConvCp conv(groups_, layout, conv_);
    const Tensor y = conv.forward(x, conv_weight).out;
    const std::int64_t qk = hk_ * s.key_dim;
    const Tensor qc = channels_as_heads(y, 0, hk_, s.key_dim, groups_.stream);
    const Tensor kc = channels_as_heads(y, qk, hk_, s.key_dim, groups_.stream);
    const Tensor vc = channels_as_heads(y, 2 * qk, hv_, s.value_dim, groups_.stream);
    o = gdn.forward(qc, kc, vc, g, beta, initial_state);
    tail = gather_conv_tail(layout, x, s.key_dim, s.value_dim, s.conv_width);
  }
  const Tensor mine =
      local_heads(o.final_state.view().reshape({s.batch, 1, hv_, s.key_dim * s.value_dim}), hv_, local_value_heads());
  cache.set_state(mine.view().reshape(cache.state().shape()), layout.seq_len());
  if (!conv_weight.empty()) cache.set_conv_state(tail);
  return {std::move(o.out), Tensor()};
}

DecodeOutput GdnDecodeCp::decode(attn::GdnCache& cache, const TensorView& q, const TensorView& k,
                                              const TensorView& v, const TensorView& g, const TensorView& beta,
                                              const TensorView& conv_weight) {
  const char* who = "GdnDecodeCp::decode";
  const attn::GdnCacheSpec& s = cache.spec();
  SEQPAR_CHECK(q.ndim() == 4 && q.dim(1) >= 1, who, ": q_new must be [B, n, Hk, K] with n >= 1, got ",
               shape_str(q.shape()));
  const std::int64_t n = q.dim(1);
  check_shape(q, {s.batch, n, hk_, s.key_dim}, "GdnDecodeCp::decode q_new");
  check_shape(k, {s.batch, n, hk_, s.key_dim}, "GdnDecodeCp::decode k_new");
  check_shape(v, {s.batch, n, hv_, s.value_dim}, "GdnDecodeCp::decode v_new");
  check_shape(g, {s.batch, n, hv_}, "GdnDecodeCp::decode g_new");
  check_shape(beta, {s.batch, n, hv_}, "GdnDecodeCp::decode beta_new");
  SEQPAR_CHECK(s.value_heads == local_value_heads(), who, ": the cache holds ", s.value_heads,
               " value heads, this layer's ranks ", local_value_heads(), " (make it with this layer's make_cache)");
  check_conv(cache, who, q, k, v, conv_weight);
  agree(cache, who, nullptr,
        {{"q_new", q}, {"k_new", k}, {"v_new", v}, {"g_new", g}, {"beta_new", beta}, {"conv_weight", conv_weight}});
  const std::int64_t lv = local_value_heads(), lk = local_key_heads();
  Tensor ql = local_heads(q, hk_, lk), kl = local_heads(k, hk_, lk), vl = local_heads(v, hv_, lv);
  const Tensor gl = local_heads(g, hv_, lv), bl = local_heads(beta, hv_, lv);
  DecodeOutput result;
  result.out = Tensor::empty({s.batch, n, lv, s.value_dim}, q.dtype(), MemCategory::kWorkspace);
  const attn::GdnForwardArgs args = attn::gdn_args(ql, kl, vl, gl, bl, config_.use_qk_l2norm, config_.scale);
  if (!conv_weight.empty()) {
    // The recurrence's checks first (the convolved heads have these shapes), so that a refused step leaves the tail.
    args.validate(cache, result.out, groups_.stream);
    const Tensor x = concat_channels({ql, kl, vl}, groups_.stream);
    Tensor w = Tensor::empty({s.conv_channels, s.conv_width}, conv_weight.dtype(), MemCategory::kWorkspace);
    gather_rows(conv_weight, 0, local_conv_channels(groups_.cp_rank(), s.key_dim, s.value_dim), w, groups_.stream);
    Tensor y = Tensor::empty(x.shape(), x.dtype(), MemCategory::kWorkspace);
    attn::ShortConvArgs a;
    a.x = x;
    a.weight = w;
    a.use_silu = conv_.use_silu;
    attn::short_conv_decode(cache, a, y, groups_.stream);
    ql = channels_as_heads(y, 0, lk, s.key_dim, groups_.stream);
    kl = channels_as_heads(y, lk * s.key_dim, lk, s.key_dim, groups_.stream);
    vl = channels_as_heads(y, 2 * lk * s.key_dim, lv, s.value_dim, groups_.stream);
  }
  attn::gdn_decode(cache, attn::gdn_args(ql, kl, vl, gl, bl, config_.use_qk_l2norm, config_.scale), result.out,
                   groups_.stream);
  return result;
}

}  // namespace seqpar
