#include "runtime/tensor.h"

#include <cstdint>
#include <cstring>
#include <sstream>

#include "runtime/tensor_checks.h"
#include "runtime/tensor_ops.h"

namespace seqpar {

std::int64_t shape_numel(const Shape& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

TensorView TensorView::reshape(Shape shape) const {
  SEQPAR_CHECK(shape_numel(shape) == numel(), "reshape of ", str(), " to ", shape_str(shape),
               ": element counts differ");
  return TensorView(data_, dtype_, std::move(shape), device_);
}

TensorView TensorView::slice0(std::int64_t begin, std::int64_t end) const {
  SEQPAR_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= dim(0), "slice0 [", begin, ", ", end, ") of ",
               str());
  Shape s = shape_;
  s[0] = end - begin;
  const std::size_t row_bytes =
      static_cast<std::size_t>(shape_numel(Shape(shape_.begin() + 1, shape_.end()))) * dtype_size(dtype_);
  return TensorView(static_cast<char*>(data_) + begin * row_bytes, dtype_, std::move(s), device_);
}

std::string TensorView::str() const { return str_cat(dtype_name(dtype_), shape_str(shape_), "@", device_.str()); }

Tensor Tensor::empty(const Shape& shape, DType dtype, MemCategory category, Device device) {
  std::int64_t numel = 1;
  for (std::int64_t d : shape) {
    SEQPAR_CHECK(d >= 0, "tensor shape ", shape_str(shape), " has a negative dimension");
    SEQPAR_CHECK(d == 0 || numel <= INT64_MAX / 8 / d, "tensor shape ", shape_str(shape), " is too large");
    numel *= d;
  }
  Tensor t;
  t.bytes_ = static_cast<std::size_t>(shape_numel(shape)) * dtype_size(dtype);
  t.category_ = category;
  t.owner_ = ledger_allocate(t.bytes_, category, device);
  t.view_ = TensorView(t.owner_, dtype, shape, device);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, MemCategory category, Device device, Stream stream) {
  Tensor t = empty(shape, dtype, category, device);
  t.fill_zero(stream);
  return t;
}

Tensor Tensor::copy_of(const TensorView& src, DType dtype, MemCategory category, Stream stream) {
  Tensor t = empty(src.shape(), dtype, category, src.device());
  copy_convert(src, t.view(), stream);
  return t;
}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    release();
    view_ = other.view_;
    owner_ = other.owner_;
    bytes_ = other.bytes_;
    category_ = other.category_;
    other.owner_ = nullptr;
    other.bytes_ = 0;
    other.view_ = TensorView();
  }
  return *this;
}

void Tensor::release() {
  if (owner_) ledger_free(owner_, bytes_, category_, view_.device());
  owner_ = nullptr;
  bytes_ = 0;
}

#if defined(SEQPAR_WITH_CUDA)
void cuda_memset_zero(void* ptr, std::size_t bytes, int ordinal, void* stream);
#endif

void Tensor::fill_zero(Stream stream) {
  if (nbytes() == 0) return;
  if (view_.device().is_cpu()) {
    std::memset(data(), 0, nbytes());
  } else {
#if defined(SEQPAR_WITH_CUDA)
    cuda_memset_zero(data(), nbytes(), view_.device().index, stream.handle);
#else
    (void)stream;
    SEQPAR_THROW("fill_zero on ", view_.str(), ": seqpar was built without CUDA");
#endif
  }
}

void check_shape(const TensorView& t, const Shape& expected, const char* what) {
  SEQPAR_CHECK(t.shape() == expected, what, " has shape ", shape_str(t.shape()), ", expected ", shape_str(expected));
}
void check_dtype(const TensorView& t, DType expected, const char* what) {
  SEQPAR_CHECK(t.dtype() == expected, what, " has dtype ", dtype_name(t.dtype()), ", expected ", dtype_name(expected));
}
void check_cpu(const TensorView& t, const char* what) {
  SEQPAR_CHECK(t.device().is_cpu(), what, " is on ", t.device().str(), "; this path takes host tensors only");
}

Device common_device(std::initializer_list<TensorView> inputs, const char* what) {
  const TensorView* first = nullptr;
  for (const TensorView& t : inputs) {
    if (t.data() == nullptr) continue;
    if (first == nullptr) {
      first = &t;
      continue;
    }
    SEQPAR_CHECK(t.device() == first->device(), what, ": every input must be on one device; ", first->str(), " and ",
                 t.str(), " differ");
  }
  return first == nullptr ? Device::cpu() : first->device();
}

}  // namespace seqpar
