#include "runtime/tensor_ops.h"

namespace seqpar {

#if defined(SEQPAR_WITH_CUDA)
void cuda_copy(void* dst, const void* src, std::size_t bytes);
#endif

void copy_convert(const TensorView& src, const TensorView& dst) {
  SEQPAR_CHECK(src.numel() == dst.numel(), "copy_convert: ", src.str(), " and ", dst.str(),
               " have different element counts");
  if (!src.device().is_cpu() || !dst.device().is_cpu()) {
    SEQPAR_CHECK(src.dtype() == dst.dtype(), "copy_convert between devices needs one dtype: ", src.str(), " -> ",
                 dst.str());
#if defined(SEQPAR_WITH_CUDA)
    cuda_copy(dst.data(), src.data(), src.nbytes());
    return;
#else
    SEQPAR_THROW("copy_convert ", src.str(), " -> ", dst.str(), ": seqpar was built without CUDA");
#endif
  }
  convert(src.data(), src.dtype(), dst.data(), dst.dtype(), static_cast<std::size_t>(src.numel()));
}

void add_inplace(const TensorView& dst, const TensorView& src) {
  check_cpu(src, "add_inplace source");
  check_cpu(dst, "add_inplace destination");
  SEQPAR_CHECK(src.numel() == dst.numel() && src.dtype() == dst.dtype() &&
                   (dst.dtype() == DType::kFloat32 || dst.dtype() == DType::kFloat64),
               "add_inplace: ", dst.str(), " += ", src.str(), " needs equal counts and one fp32/fp64 dtype");
  const std::int64_t n = dst.numel();
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

void fill(const TensorView& dst, double value) {
  check_cpu(dst, "fill");
  dispatch_floating(dst.dtype(), [&](auto t) {
    using T = decltype(t);
    T* d = static_cast<T*>(dst.data());
    const T v = std::is_same_v<T, double> ? T(value) : T(static_cast<float>(value));
    for (std::int64_t i = 0; i < dst.numel(); ++i) d[i] = v;
  });
}

}  // namespace seqpar
