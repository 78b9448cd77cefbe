// MHA on CUDA tensors through the device-neutral fallback driver with cuBLAS GEMMs (mha_cuda.h).
#include "attention/cuda/mha_cuda.h"

#include <cublas_v2.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "attention/cuda/fallback_kernels.h"
#include "attention/cuda/row_kernels.h"
#if defined(SEQPAR_WITH_CUDNN_FRONTEND)
#include "attention/cuda/cudnn_sdpa_graphs.h"
#endif
#include "attention/boundary.h"
#include "attention/fallback_attention.h"
#include "attention/lowering.h"
#include "runtime/cuda_check.h"
#include "runtime/error.h"
#include "runtime/tensor_checks.h"
#include "runtime/tensor_ops.h"

namespace seqpar::attn::cuda {
namespace {

constexpr MemCategory kWs = MemCategory::kWorkspace;

// FallbackOps on one CUDA device and stream: cuBLAS GEMMs (row-major C = op(A) op(B) computed as the column-major
// C^T = op(B)^T op(A)^T), the row bodies launched per row, scratch from the memory ledger.
template <typename T>
class CudaFallbackOps final : public fallback::FallbackOps<T> {
 public:
  CudaFallbackOps(Device device, cudaStream_t stream) : device_(device), stream_(stream) {
    SEQPAR_CHECK_CUBLAS(cublasCreate(&handle_));
    SEQPAR_CHECK_CUBLAS(cublasSetStream(handle_, stream));
    SEQPAR_CHECK_CUBLAS(cublasSetMathMode(handle_, CUBLAS_PEDANTIC_MATH));  // fp32 stays fp32 (no TF32)
  }
  ~CudaFallbackOps() override { cublasDestroy(handle_); }
  CudaFallbackOps(const CudaFallbackOps&) = delete;
  CudaFallbackOps& operator=(const CudaFallbackOps&) = delete;

  void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a,
            std::int64_t lda, const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc) override {
    const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const auto i = [](std::int64_t x) { return static_cast<int>(x); };
    if constexpr (sizeof(T) == 4) {
      SEQPAR_CHECK_CUBLAS(
          cublasSgemm(handle_, op_b, op_a, i(n), i(m), i(k), &alpha, b, i(ldb), a, i(lda), &beta, c, i(ldc)));
    } else {
      SEQPAR_CHECK_CUBLAS(
          cublasDgemm(handle_, op_b, op_a, i(n), i(m), i(k), &alpha, b, i(ldb), a, i(lda), &beta, c, i(ldc)));
    }
  }
  void softmax_rows(const fallback::RowBand& band, const fallback::RowMods& mods, std::int64_t i0, std::int64_t rows,
                    T* s, T* lse) override {
    fallback_softmax_rows(band, mods, i0, rows, s, lse, stream_);
  }
  void grad_rows(const fallback::RowBand& band, const fallback::RowMods& mods, std::int64_t i0, std::int64_t rows,
                 const T* lse, const T* delta, T* s, T* dp) override {
    fallback_grad_rows(band, mods, i0, rows, lse, delta, s, dp, stream_);
  }
  void sink_rows(double sink, std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse) override {
    fallback_sink_rows(sink, rows, d, o, ldo, lse, 1, stream_);
  }
  void merge_rows(std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse, const T* o_b, std::int64_t ldo_b,
                  const T* lse_b) override {
    fallback_merge_rows(rows, d, o, ldo, lse, o_b, ldo_b, lse_b, stream_);
  }
  T* scratch(int slot, std::int64_t n) override {
    Tensor& t = buf_[slot];
    if (!t.defined() || t.numel() < n) {
      // the stream may still read the old buffer
      SEQPAR_CHECK_CUDA(cudaStreamSynchronize(stream_));
      t = Tensor::empty({n}, sizeof(T) == 4 ? DType::kFloat32 : DType::kFloat64, kWs, device_);
    }
    return t.data_as<T>();
  }

 private:
  Device device_;
  cudaStream_t stream_;
  cublasHandle_t handle_ = nullptr;
  Tensor buf_[8];
};

void check_on(const TensorView& t, Device d, const char* what, const char* fn) {
  SEQPAR_CHECK(t.device() == d, fn, ": ", what, " ", t.str(), " is on ", t.device().str(), ", expected ", d.str(),
               " (every tensor and the stream of one call on one device)");
  SEQPAR_CHECK(t.numel() == 0 || t.data() != nullptr, fn, ": ", what, " ", t.str(), " has no data");
}

// The rules of the CUDA path on the forward fields; returns the device.
Device check_fields(const MhaForwardArgs& a, const char* fn) {
  SEQPAR_CHECK(a.q.ndim() == 4 && a.k.ndim() == 4, fn, ": q must be [B, Sq, Hq, D] and k [B, Sk, Hkv, D], got q ",
               a.q.str(), ", k ", a.k.str());
  const Device d = a.q.device();
  SEQPAR_CHECK(d.is_cuda(), fn, ": q ", a.q.str(), " is on ", d.str(), ", expected a CUDA device");
  check_on(a.q, d, "q", fn);
  check_on(a.k, d, "k", fn);
  check_on(a.v, d, "v", fn);
  const std::int64_t Hq = a.q.dim(2), Hkv = a.k.dim(2);
  SEQPAR_CHECK(a.k.dim(0) == a.q.dim(0) && a.k.dim(3) == a.q.dim(3), fn, ": k ", a.k.str(), " must match q ", a.q.str(),
               " in batch and head_dim");
  check_shape(a.v, a.k.shape(), "v");
  SEQPAR_CHECK(a.k.dtype() == a.q.dtype() && a.v.dtype() == a.q.dtype() && is_floating(a.q.dtype()), fn,
               ": q, k, v must share one floating dtype");
  SEQPAR_CHECK(Hkv > 0 && Hq % Hkv == 0, fn, ": Hq = ", Hq, " must be a multiple of Hkv = ", Hkv);
  SEQPAR_CHECK(std::isfinite(a.scale), fn, ": scale ", a.scale, " must be finite");
  // score modifiers and dropout: their values are checked by MhaForwardArgs (host slopes and sinks); they run on
  // the fallback (has_variant)
  return d;
}

Device check_forward(const MhaForwardArgs& a, const char* fn, Stream stream) {
  const Device d = check_fields(a, fn);
  SEQPAR_CHECK(stream.device == d, fn, ": stream on ", stream.device.str(), ", tensors on ", d.str());
  return d;
}

std::vector<std::int64_t> positions(std::span<const std::int64_t> pos, std::int64_t n) {
  if (!pos.empty()) return {pos.begin(), pos.end()};
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), std::int64_t{0});
  return v;
}

std::vector<LoweredRect> lower(const MhaForwardArgs& a) {
  const std::vector<std::int64_t> qp = positions(a.q_pos, a.q.dim(1)), kp = positions(a.k_pos, a.k.dim(1));
  return lower_attention_block(qp, kp, a.mask);
}

// Soft-capping, ALiBi, sinks or dropout: the call runs the exact fallback, whose row bodies apply them
// (attention/fallback_rows.h); cuDNN is not asked (sdpa_variant_fallback_reason, attention/lowering.h, says why).
bool has_variant(const MhaForwardArgs& a) { return !sdpa_variant_fallback_reason(a).empty(); }

// The host values and device copies a problem's variants point at (alive for the call).
struct VariantData {
  std::vector<double> alibi, sinks;
  Tensor q_pos, k_pos, q_tokens;
};

std::vector<double> head_values(const TensorView& t) {  // a host [H] fp32 / fp64 vector (checked by MhaForwardArgs)
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::int64_t h = 0; h < t.numel(); ++h)
    v[static_cast<std::size_t>(h)] = t.dtype() == DType::kFloat64 ? static_cast<const double*>(t.data())[h]
                                                                  : static_cast<const float*>(t.data())[h];
  return v;
}

// A host int64 vector copied to the stream's device.
Tensor to_device(const std::vector<std::int64_t>& host, Stream stream) {
  const std::int64_t n = static_cast<std::int64_t>(host.size());
  const TensorView src(const_cast<std::int64_t*>(host.data()), DType::kInt64, {n});
  Tensor t = Tensor::empty({n}, DType::kInt64, kWs, stream.device);
  copy_convert(src, t.view(), stream);
  return t;
}

template <typename T>
void set_variants(const MhaForwardArgs& a, fallback::FallbackProblem<T>& p, VariantData& data, Stream stream) {
  p.softcap = attn::detail::real_option(a.mods.softcap, a.q.dtype());
  if (!a.mods.alibi_slopes.empty()) {
    data.alibi = head_values(a.mods.alibi_slopes);
    p.alibi = data.alibi.data();
  }
  if (!a.mods.sinks.empty()) {
    data.sinks = head_values(a.mods.sinks);
    p.sinks = data.sinks.data();
  }
  p.dropout = a.dropout;
  p.head_offset = a.head_offset;
  if (p.alibi == nullptr && a.dropout.p == 0.0) return;
  data.q_pos = to_device(positions(a.mod_q_pos.empty() ? a.q_pos : a.mod_q_pos, a.q.dim(1)), stream);
  data.k_pos = to_device(positions(a.mod_k_pos.empty() ? a.k_pos : a.mod_k_pos, a.k.dim(1)), stream);
  p.q_pos = data.q_pos.data_as<std::int64_t>();
  p.k_pos = data.k_pos.data_as<std::int64_t>();
  if (a.dropout.p > 0.0 && !a.q_tokens.empty()) {
    data.q_tokens = to_device(std::vector<std::int64_t>(a.q_tokens.begin(), a.q_tokens.end()), stream);
    p.q_tokens = data.q_tokens.data_as<std::int64_t>();
  }
}

template <typename T>
fallback::FallbackProblem<T> problem(const MhaForwardArgs& a, const Tensor& q, const Tensor& k, const Tensor& v) {
  fallback::FallbackProblem<T> p;
  p.batch = a.q.dim(0);
  p.sq = a.q.dim(1);
  p.sk = a.k.dim(1);
  p.hq = a.q.dim(2);
  p.hkv = a.k.dim(2);
  p.head_dim = a.q.dim(3);
  p.scale = static_cast<T>(a.scale > 0.0 ? attn::detail::real_option(a.scale, a.q.dtype())
                                         : 1.0 / std::sqrt(static_cast<double>(p.head_dim)));
  p.q = q.data_as<T>();
  p.k = k.data_as<T>();
  p.v = v.data_as<T>();
  return p;
}

#if defined(SEQPAR_WITH_CUDNN_FRONTEND)
// The cuDNN call of rectangle r (pointers left to the caller), or a reason to take the fallback instead.
cudnn::SdpaRectCall rect_call(const MhaForwardArgs& a, const LoweredRect& r, bool backward, std::string& reason) {
  cudnn::SdpaRectCall c;
  cudnn::SdpaGraphKey& k = c.key;
  k.backward = backward;
  k.dtype = a.q.dtype();
  k.batch = a.q.dim(0);
  k.hq = a.q.dim(2);
  k.hkv = a.k.dim(2);
  k.sq = r.sq();
  k.sk = r.sk();
  k.head_dim = a.q.dim(3);
  k.mask = r.mask;
  k.scale = static_cast<float>(a.scale);  // cuDNN's attn_scale is fp32; fp64 takes the fallback
  c.q_rows = a.q.dim(1);
  c.k_rows = a.k.dim(1);
  c.lse_rows = a.q.dim(1);
  reason = cudnn::sdpa_fallback_reason(k);
  if (reason.empty() && k.head_dim % 8 != 0) reason = "head dim not a multiple of 8";
  if (reason.empty() && backward && k.head_dim > 256) reason = "head dim > 256 backward";
  if (reason.empty() && k.dtype != DType::kBFloat16 && k.dtype != DType::kFloat16) reason = "not bf16 / fp16";
  return c;
}

const char* row_ptr(const TensorView& t, std::int64_t row) {  // row `row` of batch entry 0 of [B, S, H, D]
  return static_cast<const char*>(t.data()) +
         row * t.dim(2) * t.dim(3) * static_cast<std::int64_t>(dtype_size(t.dtype()));
}

// Runs the rectangles cuDNN takes (forward), each merged into (o, l) fp32; returns the others.
std::vector<LoweredRect> cudnn_forward(const MhaForwardArgs& a, const std::vector<LoweredRect>& rects, Tensor& o,
                                       Tensor& l, Stream stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  const std::int64_t B = a.q.dim(0), Sq = a.q.dim(1), Hq = a.q.dim(2), D = a.q.dim(3);
  std::vector<LoweredRect> rest;
  for (const LoweredRect& r : rects) {
    std::string why;
    cudnn::SdpaRectCall c = rect_call(a, r, false, why);
    if (!why.empty() || r.sq() == 0 || r.sk() == 0) {
      rest.push_back(r);
      continue;
    }
    Tensor o_rect = Tensor::empty({B, r.sq(), Hq, D}, a.q.dtype(), kWs, stream.device);
    Tensor stats = Tensor::empty({B, Hq, r.sq()}, DType::kFloat32, kWs, stream.device);
    c.q = row_ptr(a.q, r.q_begin);
    c.k = row_ptr(a.k, r.k_begin);
    c.v = row_ptr(a.v, r.k_begin);
    c.o = o_rect.data();
    c.stats = stats.data();
    if (!cudnn::run_sdpa(c, s, &why)) {
      rest.push_back(r);
      continue;
    }
    const Tensor o32 = Tensor::copy_of(o_rect.view(), DType::kFloat32, kWs, stream);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < Hq; ++h)
        fallback_merge_rows(r.sq(), D, o.data_as<float>() + ((b * Sq + r.q_begin) * Hq + h) * D, Hq * D,
                            l.data_as<float>() + (b * Hq + h) * Sq + r.q_begin,
                            o32.data_as<float>() + (b * r.sq() * Hq + h) * D, Hq * D,
                            stats.data_as<float>() + (b * Hq + h) * r.sq(), s);
    SEQPAR_CHECK_CUDA(cudaStreamSynchronize(s));  // o_rect, stats and o32 are freed on return
  }
  return rest;
}

// Adds rows [row0, row0 + rows) of src [B, rows, H, D] (fp32) into dst [B, S, H, D] (fp32).
void add_rows(const Tensor& src, float* dst, std::int64_t S, std::int64_t row0, Stream stream) {
  const std::int64_t B = src.dim(0), rows = src.dim(1), n = rows * src.dim(2) * src.dim(3), per = n / rows;
  for (std::int64_t b = 0; b < B; ++b) {
    const TensorView d(dst + (b * S + row0) * per, DType::kFloat32, {n}, stream.device);
    const TensorView x(src.data_as<float>() + b * n, DType::kFloat32, {n}, stream.device);
    add_inplace(d, x, stream);
  }
}

// The backward of the rectangles cuDNN takes, added into (dq, dk, dv) fp32; returns the others. out / dout /
// lse: the final ones (io dtype, io dtype, fp32).
std::vector<LoweredRect> cudnn_backward(const MhaForwardArgs& a, const std::vector<LoweredRect>& rects,
                                        const TensorView& out, const TensorView& dout, const Tensor& lse, float* dq,
                                        float* dk, float* dv, Stream stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  const std::int64_t B = a.q.dim(0), Hq = a.q.dim(2), Hkv = a.k.dim(2), D = a.q.dim(3);
  std::vector<LoweredRect> rest;
  for (const LoweredRect& r : rects) {
    std::string why;
    cudnn::SdpaRectCall c = rect_call(a, r, true, why);
    if (!why.empty() || r.sq() == 0 || r.sk() == 0) {
      rest.push_back(r);
      continue;
    }
    Tensor gq = Tensor::empty({B, r.sq(), Hq, D}, a.q.dtype(), kWs, stream.device);
    Tensor gk = Tensor::empty({B, r.sk(), Hkv, D}, a.q.dtype(), kWs, stream.device);
    Tensor gv = Tensor::empty({B, r.sk(), Hkv, D}, a.q.dtype(), kWs, stream.device);
    c.q = row_ptr(a.q, r.q_begin);
    c.k = row_ptr(a.k, r.k_begin);
    c.v = row_ptr(a.v, r.k_begin);
    c.o = const_cast<char*>(row_ptr(out, r.q_begin));
    c.dout = row_ptr(dout, r.q_begin);
    c.stats = lse.data_as<float>() + r.q_begin;
    c.dq = gq.data();
    c.dk = gk.data();
    c.dv = gv.data();
    if (!cudnn::run_sdpa(c, s, &why)) {
      rest.push_back(r);
      continue;
    }
    add_rows(Tensor::copy_of(gq.view(), DType::kFloat32, kWs, stream), dq, a.q.dim(1), r.q_begin, stream);
    add_rows(Tensor::copy_of(gk.view(), DType::kFloat32, kWs, stream), dk, a.k.dim(1), r.k_begin, stream);
    add_rows(Tensor::copy_of(gv.view(), DType::kFloat32, kWs, stream), dv, a.k.dim(1), r.k_begin, stream);
  }
  return rest;
}
#endif

template <typename T>
void forward_as(const MhaForwardArgs& a, const TensorView& out, const TensorView& lse, Stream stream, DType acc) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  const Tensor q = Tensor::copy_of(a.q, acc, kWs, stream), k = Tensor::copy_of(a.k, acc, kWs, stream),
               v = Tensor::copy_of(a.v, acc, kWs, stream);
  Tensor o = Tensor::zeros(a.q.shape(), acc, kWs, stream.device, stream);
  Tensor l = Tensor::empty(lse.shape(), acc, kWs, stream.device);
  fill(l.view(), -std::numeric_limits<double>::infinity(), stream);
  std::vector<LoweredRect> rects = lower(a);
#if defined(SEQPAR_WITH_CUDNN_FRONTEND)
  if constexpr (sizeof(T) == 4) {
    if (!has_variant(a)) rects = cudnn_forward(a, rects, o, l, stream);  // the rest: the fallback
  }
#endif
  CudaFallbackOps<T> ops(stream.device, s);
  fallback::FallbackProblem<T> p = problem<T>(a, q, k, v);
  VariantData variants;
  set_variants(a, p, variants, stream);
  fallback::fallback_forward(ops, p, rects, o.data_as<T>(), l.data_as<T>());
  copy_convert(o.view(), out, stream);
  copy_convert(l.view(), lse, stream);
  SEQPAR_CHECK_CUDA(cudaStreamSynchronize(s));
}

template <typename T>
void backward_as(const MhaBackwardArgs& b, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                 bool accumulate, Stream stream, DType acc) {
  const MhaForwardArgs& a = b.fwd;
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  const Tensor q = Tensor::copy_of(a.q, acc, kWs, stream), k = Tensor::copy_of(a.k, acc, kWs, stream),
               v = Tensor::copy_of(a.v, acc, kWs, stream), g = Tensor::copy_of(b.dout, acc, kWs, stream),
               l = Tensor::copy_of(b.lse, acc, kWs, stream);
  Tensor delta;
  if (b.delta.empty()) {
    const Tensor o = Tensor::copy_of(b.out, acc, kWs, stream);
    delta = Tensor::empty(b.lse.shape(), acc, kWs, stream.device);
    fallback_delta(a.q.dim(0), a.q.dim(1), a.q.dim(2), a.q.dim(3), o.data_as<T>(), g.data_as<T>(), delta.data_as<T>(),
                   s);
  } else {
    delta = Tensor::copy_of(b.delta, acc, kWs, stream);
  }
  // accumulate: dq, dk, dv have the accumulator dtype (the boundary's rule) and are added to in place
  Tensor gq, gk, gv;
  T *pq = nullptr, *pk = nullptr, *pv = nullptr;
  if (accumulate) {
    pq = dq.data_as<T>();
    pk = dk.data_as<T>();
    pv = dv.data_as<T>();
  } else {
    gq = Tensor::zeros(dq.shape(), acc, kWs, stream.device, stream);
    gk = Tensor::zeros(dk.shape(), acc, kWs, stream.device, stream);
    gv = Tensor::zeros(dv.shape(), acc, kWs, stream.device, stream);
    pq = gq.data_as<T>();
    pk = gk.data_as<T>();
    pv = gv.data_as<T>();
  }
  std::vector<LoweredRect> rects = lower(a);
#if defined(SEQPAR_WITH_CUDNN_FRONTEND)
  // cuDNN recomputes delta from the final out and dout in the io dtype: only when out is given
  if constexpr (sizeof(T) == 4) {
    if (!b.out.empty() && b.dlse.empty() && !has_variant(a)) {
      const Tensor o_io = Tensor::copy_of(b.out, a.q.dtype(), kWs, stream),
                   g_io = Tensor::copy_of(b.dout, a.q.dtype(), kWs, stream);
      rects = cudnn_backward(a, rects, o_io.view(), g_io.view(), l, pq, pk, pv, stream);
      SEQPAR_CHECK_CUDA(cudaStreamSynchronize(s));
    }
  }
#endif
  CudaFallbackOps<T> ops(stream.device, s);
  fallback::FallbackProblem<T> p = problem<T>(a, q, k, v);
  VariantData variants;
  set_variants(a, p, variants, stream);
  p.sinks = nullptr;  // the backward takes lse_total and reads no sink
  fallback::fallback_backward(ops, p, rects, g.data_as<T>(), l.data_as<T>(), delta.data_as<T>(), pq, pk, pv);
  if (!accumulate) {
    copy_convert(gq.view(), dq, stream);
    copy_convert(gk.view(), dk, stream);
    copy_convert(gv.view(), dv, stream);
  }
  SEQPAR_CHECK_CUDA(cudaStreamSynchronize(s));
}

}  // namespace

void check_forward_fields(const MhaForwardArgs& args) {
  (void)check_fields(args, "mha_forward (CUDA)");
  (void)lower(args);
}

void check_forward_call(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse, Stream stream) {
  const char* fn = "mha_forward (CUDA)";
  const Device d = check_forward(args, fn, stream);
  check_on(out, d, "out", fn);
  check_on(lse, d, "lse", fn);
  check_shape(out, args.q.shape(), "out");
  check_shape(lse, {args.q.dim(0), args.q.dim(2), args.q.dim(1)}, "lse");
  const DType acc = accumulator_dtype(args.q.dtype());
  SEQPAR_CHECK(lse.dtype() == acc || lse.dtype() == DType::kFloat64, fn, ": lse has dtype ", dtype_name(lse.dtype()),
               ", expected ", dtype_name(acc), " or fp64");
  (void)lower(args);  // the lowering's own checks (positions, mask) before any device work
}

void mha_forward_cuda(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse, Stream stream) {
  check_forward_call(args, out, lse, stream);
  const DType acc = accumulator_dtype(args.q.dtype());
  SEQPAR_CHECK_CUDA(cudaSetDevice(args.q.device().index));
  if (acc == DType::kFloat64) {
    forward_as<double>(args, out, lse, stream, acc);
  } else {
    forward_as<float>(args, out, lse, stream, acc);
  }
}

void check_backward_call(const MhaBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                         bool accumulate, Stream stream) {
  const char* fn = "mha_backward (CUDA)";
  const Device d = check_forward(args.fwd, fn, stream);
  SEQPAR_CHECK(args.dlse.empty(), fn, ": dlse is not supported on CUDA yet");
  check_on(args.dout, d, "dout", fn);
  check_on(args.lse, d, "lse", fn);
  check_shape(args.dout, args.fwd.q.shape(), "dout");
  check_shape(args.lse, {args.fwd.q.dim(0), args.fwd.q.dim(2), args.fwd.q.dim(1)}, "lse");
  if (args.delta.empty() || !args.out.empty()) {  // out is read for delta, and by cuDNN whenever it is given
    check_on(args.out, d, "out", fn);
    check_shape(args.out, args.fwd.q.shape(), "out");
  }
  if (!args.delta.empty()) {
    check_on(args.delta, d, "delta", fn);
    check_shape(args.delta, args.lse.shape(), "delta");
  }
  check_on(dq, d, "dq", fn);
  check_on(dk, d, "dk", fn);
  check_on(dv, d, "dv", fn);
  check_shape(dq, args.fwd.q.shape(), "dq");
  check_shape(dk, args.fwd.k.shape(), "dk");
  check_shape(dv, args.fwd.k.shape(), "dv");
  const DType acc = accumulator_dtype(args.fwd.q.dtype());
  if (accumulate) {
    for (const TensorView* t : {&dq, &dk, &dv})
      SEQPAR_CHECK(t->dtype() == acc, fn, ": accumulate needs gradients of the accumulator dtype ", dtype_name(acc),
                   ", got ", dtype_name(t->dtype()));
  }
  (void)lower(args.fwd);
}

void mha_backward_cuda(const MhaBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                       bool accumulate, Stream stream) {
  check_backward_call(args, dq, dk, dv, accumulate, stream);
  const DType acc = accumulator_dtype(args.fwd.q.dtype());
  SEQPAR_CHECK_CUDA(cudaSetDevice(args.fwd.q.device().index));
  if (acc == DType::kFloat64) {
    backward_as<double>(args, dq, dk, dv, accumulate, stream, acc);
  } else {
    backward_as<float>(args, dq, dk, dv, accumulate, stream, acc);
  }
}

void lse_merge_cuda(const TensorView& out, const TensorView& lse, const TensorView& out_b, const TensorView& lse_b,
                    Stream stream) {
  const char* fn = "lse_merge (CUDA)";
  const Device d = out.device();
  SEQPAR_CHECK(d.is_cuda() && stream.device == d, fn, ": out ", out.str(), " and the stream (", stream.device.str(),
               ") must be on one CUDA device");
  SEQPAR_CHECK(out.ndim() == 4, fn, ": out must be [B, S, H, D], got ", out.str());
  const Shape rows{out.dim(0), out.dim(2), out.dim(1)};
  for (auto [t, shape, what] : {std::tuple{&out, &out.shape(), "out"},
                                {&out_b, &out.shape(), "out_b"},
                                {&lse, &rows, "lse"},
                                {&lse_b, &rows, "lse_b"}}) {
    check_on(*t, d, what, fn);
    check_shape(*t, *shape, what);
    SEQPAR_CHECK(t->dtype() == DType::kFloat32 || t->dtype() == DType::kFloat64, fn, ": ", what, " has dtype ",
                 dtype_name(t->dtype()), ", expected fp32 or fp64");
  }
  SEQPAR_CHECK_CUDA(cudaSetDevice(d.index));
  LseMergeMixedParams p;
  p.out = out.data();
  p.lse = lse.data();
  p.out_b = out_b.data();
  p.lse_b = lse_b.data();
  p.out_fp64 = out.dtype() == DType::kFloat64;
  p.out_b_fp64 = out_b.dtype() == DType::kFloat64;
  p.lse_fp64 = lse.dtype() == DType::kFloat64;
  p.lse_b_fp64 = lse_b.dtype() == DType::kFloat64;
  p.batch = out.dim(0);
  p.seq = out.dim(1);
  p.heads = out.dim(2);
  p.head_dim = out.dim(3);
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  lse_merge_rows_mixed(p, s);
  SEQPAR_CHECK_CUDA(cudaStreamSynchronize(s));
}

void apply_sinks_cuda(const TensorView& out, const TensorView& lse, const std::vector<double>& sinks, Stream stream) {
  const char* fn = "mha_apply_sinks (CUDA)";
  const Device d = out.device();
  SEQPAR_CHECK(d.is_cuda() && stream.device == d, fn, ": out ", out.str(), " and the stream (", stream.device.str(),
               ") must be on one CUDA device");
  SEQPAR_CHECK(out.ndim() == 4, fn, ": out must be [B, S, H, D], got ", out.str());
  const std::int64_t B = out.dim(0), S = out.dim(1), H = out.dim(2), D = out.dim(3);
  for (auto [t, what] : {std::pair{&out, "out"}, {&lse, "lse"}}) {
    check_on(*t, d, what, fn);
    SEQPAR_CHECK(t->dtype() == DType::kFloat32 || t->dtype() == DType::kFloat64, fn, ": ", what, " has dtype ",
                 dtype_name(t->dtype()), ", expected fp32 or fp64");
  }
  check_shape(lse, {B, H, S}, "lse");
  SEQPAR_CHECK(static_cast<std::int64_t>(sinks.size()) == H, fn, ": ", sinks.size(), " sinks for H = ", H, " heads");
  SEQPAR_CHECK_CUDA(cudaSetDevice(d.index));
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  // in fp64, rounded once on store (as the host)
  Tensor o = Tensor::copy_of(out, DType::kFloat64, kWs, stream), l = Tensor::copy_of(lse, DType::kFloat64, kWs, stream);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      fallback_sink_rows(sinks[static_cast<std::size_t>(h)], S, D, o.data_as<double>() + (b * S * H + h) * D, H * D,
                         l.data_as<double>() + (b * H + h) * S, 1, s);
  copy_convert(o.view(), out, stream);
  copy_convert(l.view(), lse, stream);
  SEQPAR_CHECK_CUDA(cudaStreamSynchronize(s));
}

void mha_backward_delta_cuda(const TensorView& out, const TensorView& dout, const TensorView& delta, Stream stream) {
  const char* fn = "mha_backward_delta (CUDA)";
  const Device d = out.device();
  SEQPAR_CHECK(d.is_cuda() && stream.device == d, fn, ": out ", out.str(), " and the stream (", stream.device.str(),
               ") must be on one CUDA device");
  check_on(out, d, "out", fn);
  check_on(dout, d, "dout", fn);
  check_on(delta, d, "delta", fn);
  SEQPAR_CHECK(out.ndim() == 4 && is_floating(out.dtype()) && is_floating(dout.dtype()), fn,
               ": out must be [B, S, H, D] and out / dout floating, got out ", out.str(), ", dout ", dout.str());
  check_shape(dout, out.shape(), "dout");
  // fp64 when either input is fp64, as on the host
  const bool wide = out.dtype() == DType::kFloat64 || dout.dtype() == DType::kFloat64;
  const DType sum = wide ? DType::kFloat64 : DType::kFloat32;
  check_shape(delta, {out.dim(0), out.dim(2), out.dim(1)}, "delta");
  check_dtype(delta, sum, "delta");
  SEQPAR_CHECK_CUDA(cudaSetDevice(d.index));
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  const Tensor o = Tensor::copy_of(out, sum, kWs, stream), g = Tensor::copy_of(dout, sum, kWs, stream);
  if (wide) {
    fallback_delta(out.dim(0), out.dim(1), out.dim(2), out.dim(3), o.data_as<double>(), g.data_as<double>(),
                   delta.data_as<double>(), s);
  } else {
    fallback_delta(out.dim(0), out.dim(1), out.dim(2), out.dim(3), o.data_as<float>(), g.data_as<float>(),
                   delta.data_as<float>(), s);
  }
  SEQPAR_CHECK_CUDA(cudaStreamSynchronize(s));  // o and g are freed on return
}

}  // namespace seqpar::attn::cuda
