// DSA inference with a token-sharded cache under context parallelism (math, bytes and rules:
// parallel/dsa_decode_cp.h).
#include "parallel/dsa_decode_cp.h"

#include <cmath>
#include <cstring>

#include "parallel/decode_shared.h"
#include "runtime/error.h"
#include "runtime/tensor_checks.h"
#include "runtime/tensor_ops.h"

namespace seqpar {
namespace {

using decode_detail::iota_from;
using decode_detail::sub_view;

std::int64_t acc_bytes(DType dtype) { return static_cast<std::int64_t>(dtype_size(accumulator_dtype(dtype))); }

}  // namespace

DsaDecodeCp::DsaDecodeCp(const CpGroups& groups, const DsaDecodeConfig& config)
    : groups_(groups), config_(config) {
  const char* who = "DsaDecodeCp";
  SEQPAR_CHECK(config.interleave >= 1, who, ": interleave ", config.interleave, " must be >= 1");
  SEQPAR_CHECK(config.topk >= 1, who, ": topk ", config.topk, " must be >= 1");
  SEQPAR_CHECK(config.dim_v >= 1, who, ": dim_v ", config.dim_v, " must be >= 1");
  SEQPAR_CHECK(config.window >= 0, who, ": window ", config.window, " must be >= 0 (0: none)");
  SEQPAR_CHECK(std::isfinite(config.scale), who, ": scale ", config.scale, " must be finite");
}

ShardedDsaCache DsaDecodeCp::make_cache(std::int64_t batch, std::int64_t capacity, std::int64_t index_dim,
                                                     std::int64_t latent_dim, DType dtype) const {
  const CacheSharding sharding(config_.shard, capacity, groups_.cp.size(), config_.interleave);
  return ShardedDsaCache(sharding, groups_.cp_rank(),
                         attn::DsaCacheSpec{batch, capacity, index_dim, latent_dim, dtype});
}

std::int64_t DsaDecodeCp::select_bytes_per_step(std::int64_t batch, std::int64_t n, DType dtype) const {
  return static_cast<std::int64_t>(groups_.cp.size() - 1) * batch * n * config_.topk * (8 + acc_bytes(dtype));
}

std::int64_t DsaDecodeCp::merge_bytes_per_step(std::int64_t batch, std::int64_t n, std::int64_t heads,
                                                            DType dtype) const {
  return static_cast<std::int64_t>(groups_.cp.size() - 1) * batch * n * heads * (config_.dim_v + 2) * acc_bytes(dtype);
}

void DsaDecodeCp::check_cache(const ShardedDsaCache& cache, const char* call) const {
  const CacheSharding& s = cache.sharding();
  const CacheSharding mine(config_.shard, s.capacity(), groups_.cp.size(), config_.interleave);
  SEQPAR_CHECK(s == mine && cache.rank() == groups_.cp_rank(), call, ": the cache is sharded ", s.str(), " for rank ",
               cache.rank(), ", but this layer shards ", mine.str(), " and this is cp rank ", groups_.cp_rank(),
               " (make the cache with this layer's make_cache)");
  SEQPAR_CHECK(config_.dim_v <= cache.spec().latent_dim, call, ": dim_v ", config_.dim_v,
               " must be <= the cache's latent_dim Dqk ", cache.spec().latent_dim);
}

void DsaDecodeCp::agree(const ShardedDsaCache& cache, std::string_view call, const SequenceLayout* layout,
                                     std::initializer_list<std::pair<std::string_view, TensorView>> tensors) {
  Fingerprint fp(call);
  fp.add_int("topk", config_.topk)
      .add_int("dim_v", config_.dim_v)
      .add_real("scale", config_.scale)
      .add_int("window", config_.window)
      .add_text("prefill_select", dsa_select_mode_name(config_.prefill_select))
      .add_int("index_dim", cache.spec().index_dim)
      .add_int("latent_dim", cache.spec().latent_dim);
  decode_detail::agree_on_cache(agreement_, groups_, fp, cache, layout, tensors);
}

void DsaDecodeCp::check_prompt(const ShardedDsaCache& cache, const SequenceLayout& layout, const char* who,
                                            const TensorView& q, const TensorView& q_idx, const TensorView& w,
                                            const TensorView& k_idx, const TensorView& c) {
  check_cache(cache, who);
  check_layout_matches(groups_, layout, who);
  const attn::DsaCacheSpec& s = cache.spec();
  check_shape(k_idx, {s.batch, layout.local_len(), s.index_dim},
              str_cat(who, " k_idx (the cache's [B, S_local, Di])").c_str());
  check_shape(c, {s.batch, layout.local_len(), s.latent_dim},
              str_cat(who, " c (the cache's [B, S_local, Dqk])").c_str());
  SEQPAR_CHECK(k_idx.dtype() == s.dtype && c.dtype() == s.dtype, who, ": k_idx and c must have the cache's dtype ",
               dtype_name(s.dtype), ", got ", dtype_name(k_idx.dtype()), " and ", dtype_name(c.dtype()));
  agree(cache, who, &layout, {{"q", q}, {"c", c}, {"q_idx", q_idx}, {"k_idx", k_idx}, {"w", w}});
  decode_detail::check_one_request(layout, who);
  SEQPAR_CHECK(cache.length() == 0, who, ": the cache already holds ", cache.length(),
               " tokens; a prompt continuation (persistent-cache prefill) is not supported for DSA");
  SEQPAR_CHECK(layout.seq_len() <= s.capacity, who, ": the prompt of ", layout.seq_len(),
               " tokens does not fit the cache capacity ", s.capacity);
}

void DsaDecodeCp::store_prompt(ShardedDsaCache& cache, const SequenceLayout& layout,
                                            const TensorView& k_idx, const TensorView& c) {
  const decode_detail::StoredRows rows =
      decode_detail::reshard_to_owners(groups_, counters_, cache.sharding(), 1, layout, 0, {k_idx, c});
  cache.local_.append(rows.rows[0], rows.rows[1], rows.tokens);
  cache.length_ = layout.seq_len();
}

DsaPrefillOutput DsaDecodeCp::prefill(ShardedDsaCache& cache, const SequenceLayout& layout,
                                                   const TensorView& q, const TensorView& c, const TensorView& q_idx,
                                                   const TensorView& k_idx, const TensorView& w) {
  check_prompt(cache, layout, "DsaDecodeCp::prefill", q, q_idx, w, k_idx, c);
  DsaCpConfig dc;
  dc.select = config_.prefill_select;
  dc.topk = config_.topk;
  dc.dim_v = config_.dim_v;
  dc.scale = config_.scale;
  dc.window = config_.window;
  DsaCp dsa(groups_, layout, dc);
  DsaCpOutput o = dsa.forward(q, c, q_idx, k_idx, w);
  counters_ += dsa.counters();
  dsa_topk_slots_to_tokens(layout, o.topk_indices);
  store_prompt(cache, layout, k_idx, c);
  DsaPrefillOutput result;
  result.out = std::move(o.out);
  result.lse = std::move(o.lse);
  result.topk_indices = std::move(o.topk_indices);
  return result;
}

void DsaDecodeCp::fill(ShardedDsaCache& cache, const SequenceLayout& layout, const TensorView& k_idx,
                                    const TensorView& c) {
  check_prompt(cache, layout, "DsaDecodeCp::fill", {}, {}, {}, k_idx, c);
  store_prompt(cache, layout, k_idx, c);
}

// Every check of decode before any data moves (the agreement check included).
void DsaDecodeCp::check_decode(const ShardedDsaCache& cache, const TensorView& q, const TensorView& c,
                                            const TensorView& q_idx, const TensorView& k_idx, const TensorView& w) {
  const char* who = "DsaDecodeCp::decode";
  check_cache(cache, who);
  const attn::DsaCacheSpec& s = cache.spec();
  SEQPAR_CHECK(q.ndim() == 4 && q.dim(1) >= 1 && q_idx.ndim() == 4, who,
               ": q_new and q_idx_new must be [B, n, H, Dqk] and [B, n, Hi, Di] with n >= 1, got ",
               shape_str(q.shape()), " and ", shape_str(q_idx.shape()));
  const std::int64_t B = s.batch, n = q.dim(1), H = q.dim(2), hi = q_idx.dim(2);
  check_shape(q, {B, n, H, s.latent_dim}, "DsaDecodeCp::decode q_new (the cache's [B, n, H, Dqk])");
  check_shape(c, {B, n, s.latent_dim}, "DsaDecodeCp::decode c_new (the cache's [B, n, Dqk])");
  check_shape(q_idx, {B, n, hi, s.index_dim},
              "DsaDecodeCp::decode q_idx_new (the cache's [B, n, Hi, Di])");
  check_shape(k_idx, {B, n, s.index_dim}, "DsaDecodeCp::decode k_idx_new (the cache's [B, n, Di])");
  check_shape(w, {B, n, hi}, "DsaDecodeCp::decode w_new ([B, n, Hi])");
  for (const TensorView* t : {&q, &c, &q_idx, &k_idx, &w}) {
    SEQPAR_CHECK(t->dtype() == s.dtype, who, ": every new token's input must have the cache's dtype ",
                 dtype_name(s.dtype), "; got ", t->str());
  }
  agree(cache, who, nullptr, {{"q_new", q}, {"c_new", c}, {"q_idx_new", q_idx}, {"k_idx_new", k_idx}, {"w_new", w}});
  const std::int64_t L = cache.length();
  SEQPAR_CHECK(L + n <= s.capacity, who, ": ", n, " new tokens after ", L, " would run past the cache capacity ",
               s.capacity, ": make the cache with a capacity of at least ", L + n,
               " tokens (make_cache's capacity: the prompt and every token to decode)");
}

DsaDecodeOutput DsaDecodeCp::decode(ShardedDsaCache& cache, const TensorView& q, const TensorView& c,
                                                 const TensorView& q_idx, const TensorView& k_idx,
                                                 const TensorView& w) {
  check_decode(cache, q, c, q_idx, k_idx, w);
  const attn::DsaCacheSpec& s = cache.spec();
  const std::int64_t B = s.batch, n = q.dim(1), H = q.dim(2), k = config_.topk, dv = config_.dim_v;
  const std::int64_t L = cache.length();
  const std::vector<std::int64_t> q_pos = iota_from(L, n);
  const attn::DsaDecodeArgs args{q, q_idx, w, q_pos, config_.window, dv, config_.scale};
  const DType acc = accumulator_dtype(s.dtype);
  const int P = groups_.cp.size();
  const std::int64_t rows = B * n * H, block = rows * (dv + 2), cand = B * n * k, a = acc_bytes(s.dtype);
  const DeviceAlloc alloc{Device::cpu(), groups_.stream};
  DsaDecodeOutput result;
  allocate_naming_topk("DsaDecodeCp::decode", k, s.capacity, [&] {
    result.topk_indices = alloc.empty({B, n, k}, DType::kInt64, MemCategory::kWorkspace);
  });
  Tensor send = alloc.empty({block}, acc, MemCategory::kCommBuffer);
  Tensor recv = alloc.empty({block * P}, acc, MemCategory::kCommBuffer);
  Tensor lse_r = alloc.empty({B, H, n}, DType::kFloat64, MemCategory::kWorkspace);
  const TensorView out_r = sub_view(send, 0, {B, n, H, dv});
  // The kernels' checks on this rank's shard, before the cache is written.
  args.validate(cache.local_, result.topk_indices, out_r, lse_r, groups_.stream);

  // The owners append the new tokens; every rank proposes its local top-k (positions, then scores, as raw words).
  const Shape state_shape{B, n, k};
  const std::int64_t words = cand * (8 + a) / 4;
  Tensor scores, positions, cand_send, cand_recv;
  allocate_naming_topk("DsaDecodeCp::decode", k, s.capacity, [&] {
    scores = alloc.empty(state_shape, acc, MemCategory::kWorkspace);
    positions = alloc.empty(state_shape, DType::kInt64, MemCategory::kWorkspace);
    cand_send = alloc.empty({words}, DType::kInt32, MemCategory::kCommBuffer);
    cand_recv = alloc.empty({words * P}, DType::kInt32, MemCategory::kCommBuffer);
  });
  {
    ScopedTimer timer(counters_.compute_s);
    std::vector<std::int64_t> idx, pos;
    for (std::int64_t t : cache.sharding().owned(cache.rank(), L, L + n)) {
      idx.push_back(t - L);
      pos.push_back(t);
    }
    if (!idx.empty()) {
      const std::int64_t m = static_cast<std::int64_t>(idx.size());
      Tensor k_own = alloc.empty({B, m, s.index_dim}, s.dtype, MemCategory::kWorkspace);
      Tensor c_own = alloc.empty({B, m, s.latent_dim}, s.dtype, MemCategory::kWorkspace);
      gather_rows(k_idx, 1, idx, k_own, groups_.stream);
      gather_rows(c, 1, idx, c_own, groups_.stream);
      cache.local_.append(k_own, c_own, pos);
    }
    const attn::DsaTopkState local{scores, positions};
    attn::dsa_topk_init(local, groups_.stream);
    attn::dsa_decode_select(cache.local_, args, local, groups_.stream);
    auto* bytes = static_cast<char*>(cand_send.data());
    std::memcpy(bytes, positions.data(), static_cast<std::size_t>(cand * 8));
    std::memcpy(bytes + cand * 8, scores.data(), static_cast<std::size_t>(cand * a));
  }
  {
    CommMeter meter(groups_, counters_);
    WorkHandle h = groups_.cp.all_gather(cand_send, cand_recv);
    timed_wait(groups_.cp, h, &counters_.exposed_comm_s);
  }
  {
    // The global top-k: every rank's candidates merged in rank order (the training tie rule), then each rank attends
    // to the selected positions it stores.
    ScopedTimer timer(counters_.compute_s);
    Tensor g_scores = alloc.empty(state_shape, acc, MemCategory::kWorkspace);
    Tensor g_positions = alloc.empty(state_shape, DType::kInt64, MemCategory::kWorkspace);
    const attn::DsaTopkState global{g_scores, g_positions}, other{scores, positions};
    attn::dsa_topk_init(global, groups_.stream);
    for (int r = 0; r < P; ++r) {
      const char* bytes = static_cast<const char*>(cand_recv.data()) + r * words * 4;
      std::memcpy(positions.data(), bytes, static_cast<std::size_t>(cand * 8));
      std::memcpy(scores.data(), bytes + cand * 8, static_cast<std::size_t>(cand * a));
      attn::dsa_topk_merge(global, other, groups_.stream);
    }
    attn::dsa_topk_finalize(global, result.topk_indices, groups_.stream);
    attn::dsa_decode_attend(cache.local_, args, result.topk_indices, out_r, lse_r, groups_.stream);
    decode_detail::split_lse_into(lse_r, send, rows * dv);
  }
  {
    CommMeter meter(groups_, counters_);
    WorkHandle h = groups_.cp.all_gather(send, recv);
    timed_wait(groups_.cp, h, &counters_.exposed_comm_s);
  }
  cache.length_ += n;
  ++cache.num_steps_;
  ScopedTimer timer(counters_.compute_s);
  Tensor merged = alloc.empty({B, n, H, dv}, acc, MemCategory::kWorkspace);
  result.lse = alloc.empty({B, H, n}, acc, MemCategory::kWorkspace);
  decode_detail::merge_shards_into(recv, P, merged, result.lse);
  result.out = alloc.copy_of(merged, q.dtype(), MemCategory::kWorkspace);
  return result;
}

}  // namespace seqpar
