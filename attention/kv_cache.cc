// The MHA key-value cache and the decode kernel (math and rules: attention/kv_cache.h). The attention itself is
// attention/mha.h's mha_forward on the cache's rows: there is one attention kernel.
#include "attention/kv_cache.h"

#include "attention/boundary.h"
#include "attention/mha.h"
#include "runtime/error.h"
#include "runtime/tensor_checks.h"
#include "runtime/tensor_ops.h"

namespace seqpar::attn {
namespace {

constexpr const char* kFamily = "MHA";

}  // namespace

std::int64_t mha_kv_cache_bytes(const KvCacheSpec& s) {
  return 2 * s.batch * s.capacity * s.kv_heads * s.head_dim * static_cast<std::int64_t>(dtype_size(s.dtype));
}

MhaKvCache::MhaKvCache(const KvCacheSpec& spec) : spec_(spec), positions_(spec.capacity, "MhaKvCache") {
  SEQPAR_CHECK(spec.batch >= 1 && spec.kv_heads >= 1 && spec.head_dim >= 1, "MhaKvCache: batch ", spec.batch,
               ", kv_heads ", spec.kv_heads, " and head_dim ", spec.head_dim, " must be >= 1");
  check_cache_dtype(spec.dtype, "MhaKvCache");
  const Shape shape{spec.batch, spec.capacity, spec.kv_heads, spec.head_dim};
  try {
    k_ = Tensor::empty(shape, spec.dtype, MemCategory::kPersistentCache, spec.device);
    v_ = Tensor::empty(shape, spec.dtype, MemCategory::kPersistentCache, spec.device);
  } catch (const Error& e) {
    SEQPAR_THROW("MhaKvCache: K and V of ", shape_str(shape), " ", dtype_name(spec.dtype),
                 " (batch, capacity, kv_heads, ", "head_dim): ", e.message());
  }
  positions_.reserve();
}

TensorView MhaKvCache::k_rows(std::int64_t b) const {
  SEQPAR_CHECK(b >= 0 && b < spec_.batch, "MhaKvCache::k_rows: batch row ", b, " outside [0, ", spec_.batch, ")");
  return cache_rows(k_, b, 0, length());
}

TensorView MhaKvCache::v_rows(std::int64_t b) const {
  SEQPAR_CHECK(b >= 0 && b < spec_.batch, "MhaKvCache::v_rows: batch row ", b, " outside [0, ", spec_.batch, ")");
  return cache_rows(v_, b, 0, length());
}

void MhaKvCache::check_append(const TensorView& k_new, const TensorView& v_new,
                              std::span<const std::int64_t> positions) const {
  SEQPAR_CHECK(k_new.ndim() == 4, "MhaKvCache::append: k_new must be [B, n, Hkv, D], got ", shape_str(k_new.shape()));
  const std::int64_t n = k_new.dim(1);
  const Shape shape{spec_.batch, n, spec_.kv_heads, spec_.head_dim};
  detail::check_floating(k_new, "k_new", kFamily);
  detail::check_floating(v_new, "v_new", kFamily);
  check_shape(k_new, shape, "MhaKvCache::append k_new (the cache's [B, n, Hkv, D])");
  check_shape(v_new, shape, "MhaKvCache::append v_new (the cache's [B, n, Hkv, D])");
  for (const TensorView* t : {&k_new, &v_new}) {
    SEQPAR_CHECK(t->device() == spec_.device || (t->device().is_cpu() && t->dtype() == spec_.dtype),
                 "MhaKvCache::append: ", t->str(), " is on ", t->device().str(), ", the cache on ", spec_.device.str(),
                 " (new rows on the cache's device, or host rows of its dtype ", dtype_name(spec_.dtype), ")");
  }
  positions_.check_new(n, positions);
}

void MhaKvCache::append(const TensorView& k_new, const TensorView& v_new, std::span<const std::int64_t> positions,
                        Stream stream) {
  check_append(k_new, v_new, positions);
  const std::vector<std::int64_t> pos = positions_.check_new(k_new.dim(1), positions);
  write_cache_rows(k_, length(), k_new, stream);
  write_cache_rows(v_, length(), v_new, stream);
  positions_.push(pos);
}

namespace {

// The mha_forward arguments of batch row b (q, out, lse of that row; the cache's stored rows).
MhaForwardArgs row_args(const MhaKvCache& cache, const TensorView& q, std::span<const std::int64_t> q_pos, double scale,
                        std::int64_t b) {
  MhaForwardArgs a;
  a.q = q.slice0(b, b + 1);
  a.k = cache.k_rows(b);
  a.v = cache.v_rows(b);
  a.q_pos = q_pos;
  a.k_pos = cache.positions();
  a.mask.causal = true;
  a.scale = scale;
  return a;
}

void check_mha_decode(const MhaKvCache& cache, const TensorView& q, std::span<const std::int64_t> q_pos,
                      const TensorView& out, const TensorView& lse, double scale, Stream stream) {
  const KvCacheSpec& s = cache.spec();
  SEQPAR_CHECK(q.ndim() == 4, "mha_decode: q must be [B, n, Hq, D], got ", shape_str(q.shape()));
  SEQPAR_CHECK(q.dim(0) == s.batch && q.dim(3) == s.head_dim, "mha_decode: q ", shape_str(q.shape()),
               " must have the cache's batch ", s.batch, " and head_dim ", s.head_dim);
  SEQPAR_CHECK(q.device() == s.device, "mha_decode: q ", q.str(), " is on ", q.device().str(), ", the cache on ",
               s.device.str());
  SEQPAR_CHECK(q.dtype() == s.dtype, "mha_decode: q has dtype ", dtype_name(q.dtype()), ", the cache ",
               dtype_name(s.dtype), " (q, k and v share one dtype)");
  SEQPAR_CHECK(static_cast<std::int64_t>(q_pos.size()) == q.dim(1), "mha_decode: q_pos has ", q_pos.size(),
               " entries for n = ", q.dim(1), " queries");
  SEQPAR_CHECK(out.ndim() == 4 && out.dim(0) == s.batch, "mha_decode: out must be [B, n, Hq, D], got ",
               shape_str(out.shape()));
  SEQPAR_CHECK(lse.ndim() == 3 && lse.dim(0) == s.batch, "mha_decode: lse must be [B, Hq, n], got ",
               shape_str(lse.shape()));
  row_args(cache, q, q_pos, scale, 0).validate(out.slice0(0, 1), lse.slice0(0, 1), stream);
}

}  // namespace

void mha_decode(const MhaKvCache& cache, const TensorView& q, std::span<const std::int64_t> q_pos,
                const TensorView& out, const TensorView& lse, double scale, Stream stream) {
  check_mha_decode(cache, q, q_pos, out, lse, scale, stream);
  for (std::int64_t b = 0; b < cache.spec().batch; ++b) {
    mha_forward(row_args(cache, q, q_pos, scale, b), out.slice0(b, b + 1), lse.slice0(b, b + 1), stream);
  }
}

}  // namespace seqpar::attn
