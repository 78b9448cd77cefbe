// The DSA cache and its decode step (math and rules: attention/dsa_cache.h). The selection and the attention are
// attention/dsa.h's training kernels on the cache's rows.
#include "attention/dsa_cache.h"

#include "attention/boundary.h"
#include "runtime/error.h"
#include "runtime/tensor_checks.h"
#include "runtime/tensor_ops.h"

namespace seqpar::attn {
namespace {

constexpr const char* kFamily = "DSA";

// The kernels' arguments of batch row b: the new queries of that row against the cache's stored rows.
DsaIndexerArgs row_indexer_args(const DsaCache& cache, const DsaDecodeArgs& a, std::int64_t b) {
  DsaIndexerArgs r{a.q_idx.slice0(b, b + 1), a.w.slice0(b, b + 1), cache.k_idx_rows(b), a.q_pos, cache.positions()};
  r.window = a.window;
  return r;
}

DsaAttentionArgs row_attention_args(const DsaCache& cache, const DsaDecodeArgs& a, const TensorView& topk_indices,
                                    std::int64_t b) {
  DsaAttentionArgs r;
  r.q = a.q.slice0(b, b + 1);
  r.c = cache.c_rows(b);
  r.topk_indices = topk_indices.slice0(b, b + 1);
  r.q_pos = a.q_pos;
  r.c_pos = cache.positions();
  r.dim_v = a.dim_v;
  r.scale = a.scale;
  return r;
}

// The new queries against the cache: shapes, dtypes, q_pos, window (everything but the outputs).
void check_queries(const DsaCache& cache, const DsaDecodeArgs& a, const char* fn) {
  const DsaCacheSpec& s = cache.spec();
  SEQPAR_CHECK(a.q.ndim() == 4 && a.q.dim(1) >= 1, fn, ": q must be [B, n, H, Dqk] with n >= 1, got ",
               shape_str(a.q.shape()));
  const std::int64_t B = s.batch, n = a.q.dim(1);
  SEQPAR_CHECK(a.q.dim(0) == B && a.q.dim(3) == s.latent_dim, fn, ": q ", shape_str(a.q.shape()),
               " must have the cache's batch ", B, " and latent_dim Dqk ", s.latent_dim);
  SEQPAR_CHECK(a.q_idx.ndim() == 4, fn, ": q_idx must be [B, n, Hi, Di], got ", shape_str(a.q_idx.shape()));
  check_shape(a.q_idx, {B, n, a.q_idx.dim(2), s.index_dim}, str_cat(fn, " q_idx (the cache's [B, n, Hi, Di])").c_str());
  check_shape(a.w, {B, n, a.q_idx.dim(2)}, str_cat(fn, " w ([B, n, Hi])").c_str());
  for (const auto& [t, what] : {std::pair{&a.q, "q"}, std::pair{&a.q_idx, "q_idx"}, std::pair{&a.w, "w"}}) {
    detail::check_floating(*t, what, kFamily);
    SEQPAR_CHECK(t->dtype() == s.dtype, fn, ": ", what, " has dtype ", dtype_name(t->dtype()), ", the cache ",
                 dtype_name(s.dtype), " (the queries and the cache share one dtype)");
  }
  SEQPAR_CHECK(static_cast<std::int64_t>(a.q_pos.size()) == n, fn, ": q_pos has ", a.q_pos.size(),
               " entries for n = ", n, " queries");
  SEQPAR_CHECK(a.window >= 0, fn, ": window ", a.window, " must be >= 0 (0: none)");
}

}  // namespace

std::int64_t dsa_cache_bytes(const DsaCacheSpec& s) {
  return s.batch * s.capacity * (s.index_dim + s.latent_dim) * static_cast<std::int64_t>(dtype_size(s.dtype));
}

DsaCache::DsaCache(const DsaCacheSpec& spec) : spec_(spec), positions_(spec.capacity, "DsaCache") {
  SEQPAR_CHECK(spec.batch >= 1 && spec.index_dim >= 1 && spec.latent_dim >= 1, "DsaCache: batch ", spec.batch,
               ", index_dim ", spec.index_dim, " and latent_dim ", spec.latent_dim, " must be >= 1");
  check_cache_dtype(spec.dtype, "DsaCache");
  try {
    k_idx_ = Tensor::empty({spec.batch, spec.capacity, spec.index_dim}, spec.dtype, MemCategory::kPersistentCache);
    c_ = Tensor::empty({spec.batch, spec.capacity, spec.latent_dim}, spec.dtype, MemCategory::kPersistentCache);
  } catch (const Error& e) {
    SEQPAR_THROW("DsaCache: batch ", spec.batch, ", capacity ", spec.capacity, ", index_dim ", spec.index_dim,
                 " + latent_dim ", spec.latent_dim, " ", dtype_name(spec.dtype), ": ", e.message());
  }
  positions_.reserve();
}

TensorView DsaCache::k_idx_rows(std::int64_t b) const {
  SEQPAR_CHECK(b >= 0 && b < spec_.batch, "DsaCache::k_idx_rows: batch row ", b, " outside [0, ", spec_.batch, ")");
  return cache_rows(k_idx_, b, 0, length());
}

TensorView DsaCache::c_rows(std::int64_t b) const {
  SEQPAR_CHECK(b >= 0 && b < spec_.batch, "DsaCache::c_rows: batch row ", b, " outside [0, ", spec_.batch, ")");
  return cache_rows(c_, b, 0, length());
}

void DsaCache::check_append(const TensorView& k_idx_new, const TensorView& c_new,
                            std::span<const std::int64_t> positions) const {
  SEQPAR_CHECK(k_idx_new.ndim() == 3, "DsaCache::append: k_idx_new must be [B, n, Di], got ",
               shape_str(k_idx_new.shape()));
  const std::int64_t n = k_idx_new.dim(1);
  detail::check_floating(k_idx_new, "k_idx_new", kFamily);
  detail::check_floating(c_new, "c_new", kFamily);
  check_shape(k_idx_new, {spec_.batch, n, spec_.index_dim}, "DsaCache::append k_idx_new (the cache's [B, n, Di])");
  check_shape(c_new, {spec_.batch, n, spec_.latent_dim}, "DsaCache::append c_new (the cache's [B, n, Dqk])");
  positions_.check_new(n, positions);
}

void DsaCache::append(const TensorView& k_idx_new, const TensorView& c_new, std::span<const std::int64_t> positions) {
  check_append(k_idx_new, c_new, positions);
  const std::vector<std::int64_t> pos = positions_.check_new(k_idx_new.dim(1), positions);
  write_cache_rows(k_idx_, length(), k_idx_new);
  write_cache_rows(c_, length(), c_new);
  positions_.push(pos);
}

void DsaDecodeArgs::validate(const DsaCache& cache, const TensorView& topk_indices, const TensorView& out,
                             const TensorView& lse, Stream stream) const {
  const DsaDecodeArgs& args = *this;
  check_queries(cache, args, "dsa_decode");
  const std::int64_t B = cache.spec().batch, n = args.q.dim(1);
  SEQPAR_CHECK(
      topk_indices.ndim() == 3 && topk_indices.dim(0) == B && topk_indices.dim(1) == n && topk_indices.dim(2) >= 1,
      "dsa_decode: topk_indices must be [B, n, k] = [", B, ", ", n, ", k >= 1], got ", shape_str(topk_indices.shape()));
  detail::check_host_tensor(topk_indices, topk_indices.shape(), DType::kInt64, "dsa_decode topk_indices", kFamily);
  SEQPAR_CHECK(out.ndim() == 4 && out.dim(0) == B, "dsa_decode: out must be [B, n, H, Dv], got ",
               shape_str(out.shape()));
  SEQPAR_CHECK(lse.ndim() == 3 && lse.dim(0) == B, "dsa_decode: lse must be [B, H, n], got ", shape_str(lse.shape()));
  SEQPAR_CHECK(out.dim(3) == args.dim_v, "dsa_decode: out ", shape_str(out.shape()), " must have Dv = dim_v ",
               args.dim_v, " columns");
  // The kernels' own checks on batch row 0 (the rows share their shapes), with an empty selection in place of the
  // topk_indices still to be written.
  row_indexer_args(cache, args, 0).validate();
  std::vector<std::int64_t> none(static_cast<std::size_t>(n * topk_indices.dim(2)), -1);
  const TensorView none_view(none.data(), DType::kInt64, {1, n, topk_indices.dim(2)});
  row_attention_args(cache, args, none_view, 0).validate(out.slice0(0, 1), lse.slice0(0, 1), stream);
}

void dsa_decode_select(const DsaCache& cache, const DsaDecodeArgs& args, const DsaTopkState& state, Stream stream) {
  check_queries(cache, args, "dsa_decode_select");
  for (std::int64_t b = 0; b < cache.spec().batch; ++b) {
    row_indexer_args(cache, args, b)
        .validate({state.scores.slice0(b, b + 1), state.positions.slice0(b, b + 1)}, stream);
  }
  for (std::int64_t b = 0; b < cache.spec().batch; ++b) {
    dsa_indexer_topk_block(row_indexer_args(cache, args, b),
                           {state.scores.slice0(b, b + 1), state.positions.slice0(b, b + 1)}, stream);
  }
}

void dsa_decode_attend(const DsaCache& cache, const DsaDecodeArgs& args, const TensorView& topk_indices,
                       const TensorView& out, const TensorView& lse, Stream stream) {
  check_queries(cache, args, "dsa_decode_attend");
  SEQPAR_CHECK(topk_indices.ndim() == 3 && topk_indices.dim(0) == cache.spec().batch && out.ndim() == 4 &&
                   lse.ndim() == 3 && out.dim(0) == cache.spec().batch && lse.dim(0) == cache.spec().batch,
               "dsa_decode_attend: topk_indices ", shape_str(topk_indices.shape()), ", out ", shape_str(out.shape()),
               " and lse ", shape_str(lse.shape()),
               " must be [B, n, k], [B, n, H, Dv] and [B, H, n] with B = ", cache.spec().batch);
  for (std::int64_t b = 0; b < cache.spec().batch; ++b) {
    row_attention_args(cache, args, topk_indices, b).validate(out.slice0(b, b + 1), lse.slice0(b, b + 1), stream);
  }
  for (std::int64_t b = 0; b < cache.spec().batch; ++b) {
    dsa_attention_forward(row_attention_args(cache, args, topk_indices, b), out.slice0(b, b + 1), lse.slice0(b, b + 1),
                          stream);
  }
}

void dsa_decode(const DsaCache& cache, const DsaDecodeArgs& args, const TensorView& topk_indices, const TensorView& out,
                const TensorView& lse, Stream stream) {
  args.validate(cache, topk_indices, out, lse, stream);
  const Shape shape = topk_indices.shape();
  Tensor scores = Tensor::empty(shape, accumulator_dtype(cache.spec().dtype), MemCategory::kWorkspace);
  Tensor positions = Tensor::empty(shape, DType::kInt64, MemCategory::kWorkspace);
  const DsaTopkState state{scores, positions};
  dsa_topk_init(state, stream);
  dsa_decode_select(cache, args, state, stream);
  dsa_topk_finalize(state, topk_indices, stream);
  dsa_decode_attend(cache, args, topk_indices, out, lse, stream);
}

}  // namespace seqpar::attn
