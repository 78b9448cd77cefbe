// The GDN inference cache and its decode steps (math and rules: attention/gdn_decode.h). Both steps run the
// kernels of attention/gdn.h from the cached state / tail into fresh buffers and copy those into the cache only
// once the kernel returned, so that a refused step leaves the cache unchanged.
#include "attention/gdn_decode.h"

#include "runtime/error.h"
#include "runtime/tensor_checks.h"
#include "runtime/tensor_ops.h"

namespace seqpar::attn {

std::int64_t gdn_cache_bytes(const GdnCacheSpec& s) {
  return s.batch * s.value_heads * s.key_dim * s.value_dim * static_cast<std::int64_t>(dtype_size(s.state_dtype)) +
         s.batch * (s.conv_width - 1) * s.conv_channels * static_cast<std::int64_t>(dtype_size(s.conv_dtype));
}

GdnCache::GdnCache(const GdnCacheSpec& spec) : spec_(spec) {
  SEQPAR_CHECK(spec.batch >= 1 && spec.value_heads >= 1 && spec.key_dim >= 1 && spec.value_dim >= 1, "GdnCache: batch ",
               spec.batch, ", value_heads ", spec.value_heads, ", key_dim ", spec.key_dim, " and value_dim ",
               spec.value_dim, " must be >= 1");
  SEQPAR_CHECK(spec.state_dtype == DType::kFloat32 || spec.state_dtype == DType::kFloat64, "GdnCache: state dtype ",
               dtype_name(spec.state_dtype), " must be fp32 or fp64");
  SEQPAR_CHECK(spec.conv_channels >= 0 && spec.conv_width >= 1, "GdnCache: conv_channels ", spec.conv_channels,
               " must be >= 0 and conv_width ", spec.conv_width, " >= 1");
  SEQPAR_CHECK(is_floating(spec.conv_dtype), "GdnCache: conv dtype ", dtype_name(spec.conv_dtype),
               " must be a floating dtype");
  const Shape state{spec.batch, spec.value_heads, spec.key_dim, spec.value_dim};
  const Shape conv{spec.batch, spec.conv_width - 1, spec.conv_channels};
  try {
    state_ = Tensor::zeros(state, spec.state_dtype, MemCategory::kPersistentCache);
    conv_state_ = Tensor::zeros(conv, spec.conv_dtype, MemCategory::kPersistentCache);
  } catch (const Error& e) {
    SEQPAR_THROW("GdnCache: state of ", shape_str(state), " ", dtype_name(spec.state_dtype),
                 " (batch, value_heads, key_dim, value_dim) and conv tail of ", shape_str(conv), " ",
                 dtype_name(spec.conv_dtype), ": ", e.message());
  }
}

void GdnCache::set_state(const TensorView& state, std::int64_t length) {
  check_shape(state, state_.shape(), "GdnCache::set_state state");
  SEQPAR_CHECK(is_floating(state.dtype()), "GdnCache::set_state: state dtype ", dtype_name(state.dtype()),
               " must be floating");
  SEQPAR_CHECK(length >= 0, "GdnCache::set_state: length ", length, " must be >= 0");
  copy_convert(state, state_);
  length_ = length;
}

void GdnCache::set_conv_state(const TensorView& tail) {
  check_shape(tail, conv_state_.shape(), "GdnCache::set_conv_state tail");
  SEQPAR_CHECK(is_floating(tail.dtype()), "GdnCache::set_conv_state: tail dtype ", dtype_name(tail.dtype()),
               " must be floating");
  if (conv_state_.numel() > 0) copy_convert(tail, conv_state_);
}

namespace {

GdnForwardArgs step_args(const GdnCache& cache, const GdnForwardArgs& args) {
  GdnForwardArgs a = args;
  a.initial_state = cache.state();
  a.chunk_size = 1;  // token by token: one chunk of one token is one step of the recurrence
  return a;
}

}  // namespace

void GdnForwardArgs::validate(const GdnCache& cache, const TensorView& out, Stream stream) const {
  const GdnForwardArgs& args = *this;
  const GdnCacheSpec& s = cache.spec();
  SEQPAR_CHECK(args.initial_state.empty(), "gdn_decode: args.initial_state must be empty (the cache holds the state)");
  SEQPAR_CHECK(args.chunk_size == kGdnDefaultChunkSize, "gdn_decode: args.chunk_size must be left at its default (",
               kGdnDefaultChunkSize, "): decode runs token by token");
  SEQPAR_CHECK(args.v.ndim() == 4 && args.q.ndim() == 4,
               "gdn_decode: q must be [B, n, Hk, K] and v [B, n, Hv, V], got ", shape_str(args.q.shape()), " and ",
               shape_str(args.v.shape()));
  SEQPAR_CHECK(args.q.dim(0) == s.batch && args.v.dim(2) == s.value_heads && args.q.dim(3) == s.key_dim &&
                   args.v.dim(3) == s.value_dim,
               "gdn_decode: q ", shape_str(args.q.shape()), " and v ", shape_str(args.v.shape()),
               " do not match the cache (B ", s.batch, ", Hv ", s.value_heads, ", K ", s.key_dim, ", V ", s.value_dim,
               ")");
  SEQPAR_CHECK(accumulator_dtype(args.q.dtype()) == s.state_dtype, "gdn_decode: q of dtype ",
               dtype_name(args.q.dtype()), " needs a ", dtype_name(accumulator_dtype(args.q.dtype())),
               " state, the cache holds ", dtype_name(s.state_dtype));
  step_args(cache, args).validate(out, cache.state(), stream);
}

void gdn_decode(GdnCache& cache, const GdnForwardArgs& args, const TensorView& out, Stream stream) {
  args.validate(cache, out, stream);
  Tensor next = Tensor::empty(cache.state_.shape(), cache.spec_.state_dtype, MemCategory::kWorkspace);
  gdn_forward(step_args(cache, args), out, next, stream);
  copy_convert(next, cache.state_, stream);
  cache.length_ += args.q.dim(1);
}

void short_conv_decode(GdnCache& cache, const ShortConvArgs& args, const TensorView& out, Stream stream) {
  const GdnCacheSpec& s = cache.spec();
  SEQPAR_CHECK(args.initial_conv_state.empty(),
               "short_conv_decode: args.initial_conv_state must be empty (the cache holds the tail)");
  SEQPAR_CHECK(s.conv_channels > 0, "short_conv_decode: the cache was built without a conv tail (conv_channels 0)");
  SEQPAR_CHECK(args.x.ndim() == 3 && args.x.dim(0) == s.batch && args.x.dim(2) == s.conv_channels &&
                   args.x.dtype() == s.conv_dtype,
               "short_conv_decode: x ", args.x.str(), " must be [", s.batch, ", n, ", s.conv_channels, "] of dtype ",
               dtype_name(s.conv_dtype), " (the cache's)");
  SEQPAR_CHECK(args.weight.ndim() == 2 && args.weight.dim(1) == s.conv_width, "short_conv_decode: weight ",
               shape_str(args.weight.shape()), " must have the cache's width W = ", s.conv_width);
  ShortConvArgs a = args;
  a.initial_conv_state = cache.conv_state();
  Tensor tail = Tensor::empty(cache.conv_state().shape(), s.conv_dtype, MemCategory::kWorkspace);
  a.validate(out, tail, stream);
  short_conv_forward(a, out, tail, stream);
  cache.set_conv_state(tail);
}

}  // namespace seqpar::attn
