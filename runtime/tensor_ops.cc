#include "runtime/tensor_ops.h"
#include "runtime/elementwise.h"
#include "runtime/tensor_checks.h"

#include <cstring>
#include <type_traits>

namespace seqpar {

#if defined(SEQPAR_WITH_CUDA)
// runtime/tensor_ops_cuda.cu
void cuda_copy(void* dst, const void* src, std::size_t bytes, void* stream);
void cuda_convert(const void* src, int src_kind, void* dst, int dst_kind, std::int64_t n,
                  void* stream);  // kind: 0 fp64, 1 fp32, 2 bf16, 3 fp16, 4 int64
std::int64_t cuda_count_nonnegative(const std::int64_t* src, std::int64_t n, void* stream);
void cuda_add_inplace(void* dst, const void* src, std::int64_t n, bool fp64, void* stream);
void cuda_add_scaled(void* dst, const void* src, std::int64_t n, bool fp64, double alpha, void* stream);
void cuda_fill(void* dst, int kind, std::int64_t n, double value, void* stream);
void cuda_move_rows(const void* src, void* dst, std::int64_t outer, std::int64_t src_len, std::int64_t dst_len,
                    std::size_t row_bytes, const std::int64_t* index, std::int64_t n, bool gather, void* stream);
void cuda_index_add_rows(const void* src, void* dst, std::int64_t outer, std::int64_t src_len, std::int64_t dst_len,
                         std::int64_t row_elems, bool fp64, const std::int64_t* index, std::int64_t n, void* stream);
void cuda_swap_outer_dims(const void* src, void* dst, std::int64_t a, std::int64_t b, std::size_t rest_bytes,
                          void* stream);
#endif

namespace {

// Both tensors on the CPU (false) or both on one CUDA device (true); a mix is an error naming `op`.
bool on_device(const TensorView& a, const TensorView& b, const char* op) {
  SEQPAR_CHECK(a.device() == b.device(), op, ": ", a.str(), " and ", b.str(), " are on different devices");
  if (a.device().is_cpu()) return false;
#if defined(SEQPAR_WITH_CUDA)
  return true;
#else
  SEQPAR_THROW(op, " on ", a.str(), ": seqpar was built without CUDA");
#endif
}

// The dtype code of the CUDA kernels: 0 fp64, 1 fp32, 2 bf16, 3 fp16, 4 int64 (others: Error naming `op`).
[[maybe_unused]] int device_dtype_kind(const TensorView& t, const char* op) {
  switch (t.dtype()) {
    case DType::kFloat64: return 0;
    case DType::kFloat32: return 1;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 3;
    case DType::kInt64: return 4;
    default: SEQPAR_THROW(op, " on ", t.str(), ": dtype not supported on a CUDA device");
  }
}

struct RowGeometry {
  std::int64_t outer = 1;
  std::size_t row_bytes = 0;
  std::int64_t row_elems = 1;
};

// Checks src / dst for a row operation along `dim` and returns the [outer, len, inner] geometry.
RowGeometry row_geometry(const TensorView& src, const TensorView& dst, int dim, std::size_t index_len,
                         bool index_on_src, const char* op) {
  SEQPAR_CHECK(src.dtype() == dst.dtype() && src.ndim() == dst.ndim() && dim >= 0 && dim < src.ndim(), op, ": ",
               src.str(), " and ", dst.str(), " must share dtype and rank, with dim ", dim, " inside it");
  for (int d = 0; d < src.ndim(); ++d) {
    if (d == dim) continue;
    SEQPAR_CHECK(src.dim(d) == dst.dim(d), op, ": ", src.str(), " and ", dst.str(), " differ in dim ", d);
  }
  const TensorView& indexed = index_on_src ? src : dst;
  SEQPAR_CHECK(indexed.dim(dim) == static_cast<std::int64_t>(index_len), op, ": ", indexed.str(), " has ",
               indexed.dim(dim), " rows along dim ", dim, ", the index ", index_len);
  const TensorView& addressed = index_on_src ? dst : src;
  RowGeometry g;
  for (int d = 0; d < dim; ++d) g.outer *= src.dim(d);
  for (int d = dim + 1; d < src.ndim(); ++d) g.row_elems *= src.dim(d);
  g.row_bytes = static_cast<std::size_t>(g.row_elems) * dtype_size(src.dtype());
  (void)addressed;
  return g;
}

void check_index(std::span<const std::int64_t> index, std::int64_t len, const char* op) {
  for (std::int64_t p : index) SEQPAR_CHECK(0 <= p && p < len, op, ": index ", p, " outside [0, ", len, ")");
}

}  // namespace

void copy_convert(const TensorView& src, const TensorView& dst, Stream stream) {
  SEQPAR_CHECK(src.numel() == dst.numel(), "copy_convert: ", src.str(), " and ", dst.str(),
               " have different element counts");
  if (src.device().is_cpu() && dst.device().is_cpu()) {
    convert(src.data(), src.dtype(), dst.data(), dst.dtype(), static_cast<std::size_t>(src.numel()));
    return;
  }
  const bool one_device = src.device() == dst.device();
  SEQPAR_CHECK(one_device || src.dtype() == dst.dtype(), "copy_convert between devices needs one dtype: ", src.str(),
               " -> ", dst.str());
#if defined(SEQPAR_WITH_CUDA)
  if (one_device && src.dtype() != dst.dtype()) {
    cuda_convert(src.data(), device_dtype_kind(src, "copy_convert"), dst.data(), device_dtype_kind(dst, "copy_convert"),
                 src.numel(), stream.handle);
  } else {
    cuda_copy(dst.data(), src.data(), src.nbytes(), stream.handle);
  }
#else
  (void)stream;
  SEQPAR_THROW("copy_convert ", src.str(), " -> ", dst.str(), ": seqpar was built without CUDA");
#endif
}

std::int64_t count_nonnegative(const TensorView& t, Stream stream) {
  check_dtype(t, DType::kInt64, "count_nonnegative input");
  if (on_device(t, t, "count_nonnegative")) {
#if defined(SEQPAR_WITH_CUDA)
    return cuda_count_nonnegative(static_cast<const std::int64_t*>(t.data()), t.numel(), stream.handle);
#endif
  }
  (void)stream;
  const std::int64_t* p = static_cast<const std::int64_t*>(t.data());
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) n += p[i] >= 0;
  return n;
}

void add_inplace(const TensorView& dst, const TensorView& src, Stream stream) {
  SEQPAR_CHECK(src.numel() == dst.numel() && src.dtype() == dst.dtype() &&
                   (dst.dtype() == DType::kFloat32 || dst.dtype() == DType::kFloat64),
               "add_inplace: ", dst.str(), " += ", src.str(), " needs equal counts and one fp32/fp64 dtype");
  const std::int64_t n = dst.numel();
  if (on_device(dst, src, "add_inplace")) {
#if defined(SEQPAR_WITH_CUDA)
    cuda_add_inplace(dst.data(), src.data(), n, dst.dtype() == DType::kFloat64, stream.handle);
#endif
    return;
  }
  (void)stream;
  if (dst.dtype() == DType::kFloat32) {
    float* d = static_cast<float*>(dst.data());
    const float* s = static_cast<const float*>(src.data());
    for (std::int64_t i = 0; i < n; ++i) d[i] += s[i];
  } else {
    double* d = static_cast<double*>(dst.data());
    const double* s = static_cast<const double*>(src.data());
    for (std::int64_t i = 0; i < n; ++i) d[i] += s[i];
  }
}

void add_scaled_inplace(const TensorView& dst, const TensorView& src, double alpha, Stream stream) {
  SEQPAR_CHECK(src.numel() == dst.numel() && src.dtype() == dst.dtype() &&
                   (dst.dtype() == DType::kFloat32 || dst.dtype() == DType::kFloat64),
               "add_scaled_inplace: ", dst.str(), " += alpha * ", src.str(),
               " needs equal counts and one fp32/fp64 dtype");
  const std::int64_t n = dst.numel();
  if (on_device(dst, src, "add_scaled_inplace")) {
#if defined(SEQPAR_WITH_CUDA)
    cuda_add_scaled(dst.data(), src.data(), n, dst.dtype() == DType::kFloat64, alpha, stream.handle);
#endif
    return;
  }
  (void)stream;
  auto run = [&](auto* d, const auto* s) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(s)>>;
    const T a = static_cast<T>(alpha);
    for (std::int64_t i = 0; i < n; ++i) d[i] = elementwise::add_scaled(d[i], s[i], a);
  };
  if (dst.dtype() == DType::kFloat32) {
    run(static_cast<float*>(dst.data()), static_cast<const float*>(src.data()));
  } else {
    run(static_cast<double*>(dst.data()), static_cast<const double*>(src.data()));
  }
}

void fill(const TensorView& dst, double value, Stream stream) {
  SEQPAR_CHECK(is_floating(dst.dtype()), "fill: ", dst.str(), " must have a floating dtype");
  if (on_device(dst, dst, "fill")) {
#if defined(SEQPAR_WITH_CUDA)
    cuda_fill(dst.data(), device_dtype_kind(dst, "fill"), dst.numel(), value, stream.handle);
#endif
    return;
  }
  (void)stream;
  dispatch_floating(dst.dtype(), [&](auto t) {
    using T = decltype(t);
    T* d = static_cast<T*>(dst.data());
    const T v = std::is_same_v<T, double> ? T(value) : T(static_cast<float>(value));
    for (std::int64_t i = 0; i < dst.numel(); ++i) d[i] = v;
  });
}

namespace {

// gather = true: dst[o, i] = src[o, index[i]]; false: dst[o, index[i]] = src[o, i].
void move_rows(const TensorView& src, int dim, std::span<const std::int64_t> index, const TensorView& dst, bool gather,
               Stream stream, const char* op) {
  const RowGeometry g = row_geometry(src, dst, dim, index.size(), !gather, op);
  const std::int64_t src_len = src.dim(dim), dst_len = dst.dim(dim);
  check_index(index, gather ? src_len : dst_len, op);
  const std::int64_t n = static_cast<std::int64_t>(index.size());
  if (on_device(src, dst, op)) {
#if defined(SEQPAR_WITH_CUDA)
    cuda_move_rows(src.data(), dst.data(), g.outer, src_len, dst_len, g.row_bytes, index.data(), n, gather,
                   stream.handle);
#endif
    return;
  }
  (void)stream;
  const char* s = static_cast<const char*>(src.data());
  char* d = static_cast<char*>(dst.data());
  for (std::int64_t o = 0; o < g.outer; ++o) {
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t si = gather ? index[i] : i, di = gather ? i : index[i];
      std::memcpy(d + (o * dst_len + di) * g.row_bytes, s + (o * src_len + si) * g.row_bytes, g.row_bytes);
    }
  }
}

}  // namespace

void gather_rows(const TensorView& src, int dim, std::span<const std::int64_t> index, const TensorView& dst,
                 Stream stream) {
  move_rows(src, dim, index, dst, true, stream, "gather_rows");
}

void scatter_rows(const TensorView& src, int dim, std::span<const std::int64_t> index, const TensorView& dst,
                  Stream stream) {
  move_rows(src, dim, index, dst, false, stream, "scatter_rows");
}

void index_add_rows(const TensorView& src, int dim, std::span<const std::int64_t> index, const TensorView& dst,
                    Stream stream) {
  const RowGeometry g = row_geometry(src, dst, dim, index.size(), true, "index_add_rows");
  SEQPAR_CHECK(dst.dtype() == DType::kFloat32 || dst.dtype() == DType::kFloat64, "index_add_rows: ", dst.str(),
               " must be fp32 or fp64");
  const std::int64_t src_len = src.dim(dim), dst_len = dst.dim(dim), n = static_cast<std::int64_t>(index.size());
  check_index(index, dst_len, "index_add_rows");
  const bool fp64 = dst.dtype() == DType::kFloat64;
  if (on_device(src, dst, "index_add_rows")) {
#if defined(SEQPAR_WITH_CUDA)
    cuda_index_add_rows(src.data(), dst.data(), g.outer, src_len, dst_len, g.row_elems, fp64, index.data(), n,
                        stream.handle);
#endif
    return;
  }
  (void)stream;
  auto run = [&](auto* d, const auto* s) {
    for (std::int64_t o = 0; o < g.outer; ++o)
      for (std::int64_t i = 0; i < n; ++i) {
        auto* dr = d + (o * dst_len + index[i]) * g.row_elems;
        const auto* sr = s + (o * src_len + i) * g.row_elems;
        for (std::int64_t e = 0; e < g.row_elems; ++e) dr[e] += sr[e];
      }
  };
  if (fp64) {
    run(static_cast<double*>(dst.data()), static_cast<const double*>(src.data()));
  } else {
    run(static_cast<float*>(dst.data()), static_cast<const float*>(src.data()));
  }
}

void swap_outer_dims(const TensorView& src, std::int64_t a, std::int64_t b, const TensorView& dst, Stream stream) {
  SEQPAR_CHECK(
      src.dtype() == dst.dtype() && src.numel() == dst.numel() && a >= 1 && b >= 1 && src.numel() % (a * b) == 0,
      "swap_outer_dims: ", src.str(), " -> ", dst.str(), " needs one dtype, one element count, divisible by ", a, " x ",
      b);
  const std::size_t rest = src.nbytes() / static_cast<std::size_t>(a * b);
  if (on_device(src, dst, "swap_outer_dims")) {
#if defined(SEQPAR_WITH_CUDA)
    cuda_swap_outer_dims(src.data(), dst.data(), a, b, rest, stream.handle);
#endif
    return;
  }
  (void)stream;
  const char* s = static_cast<const char*>(src.data());
  char* d = static_cast<char*>(dst.data());
  for (std::int64_t i = 0; i < a; ++i)
    for (std::int64_t j = 0; j < b; ++j) std::memcpy(d + (j * a + i) * rest, s + (i * b + j) * rest, rest);
}

}  // namespace seqpar
