// Tensor views (non-owning) and owning tensors allocated through the memory ledger.
//
// A TensorView is a pointer, a dtype, a shape and a device: always contiguous, row-major. It never owns memory
// (TransformerEngine's SimpleTensor habit). A Tensor owns its buffer, which it took from `ledger_allocate` with a
// memory category, and hands out views. Activations are [B, S, H, D]; lse is [B, H, S] (docs/design.md section 3).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "device.h"
#include "dtype.h"
#include "error.h"
#include "memory.h"

namespace seqpar {

using Shape = std::vector<std::int64_t>;
std::int64_t shape_numel(const Shape& shape);
std::string shape_str(const Shape& shape);  // "[2, 1024, 8, 64]"

class TensorView {
 public:
  TensorView() = default;
  TensorView(void* data, DType dtype, Shape shape, Device device = Device::cpu())
      : data_(data), dtype_(dtype), shape_(std::move(shape)), device_(device) {}

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    SEQPAR_ASSERT(dtype_v<T> == dtype_, "data_as<", dtype_name(dtype_v<T>), "> on a ", dtype_name(dtype_), " view");
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  std::int64_t dim(int i) const { return shape_.at(i < 0 ? i + ndim() : i); }
  std::int64_t numel() const { return shape_numel(shape_); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  Device device() const { return device_; }
  // True when the view has no elements to read: a default-constructed view, or a zero-size shape.
  bool empty() const { return data_ == nullptr || numel() == 0; }

  // The same memory seen with another shape of the same element count.
  TensorView reshape(Shape shape) const;
  // Rows [begin, end) of the outermost dimension.
  TensorView slice0(std::int64_t begin, std::int64_t end) const;
  std::string str() const;  // "fp32[2, 16, 4, 64]@cpu"

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kFloat32;
  Shape shape_;
  Device device_;
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised storage of `shape` and `dtype`, tagged `category`.
  static Tensor empty(const Shape& shape, DType dtype, MemCategory category, Device device = Device::cpu());
  // Zero-filled storage; the fill is ordered on `stream` (a device buffer's stream, or Stream::cpu()).
  static Tensor zeros(const Shape& shape, DType dtype, MemCategory category, Device device = Device::cpu(),
                      Stream stream = Stream::cpu());
  // A copy of `src` on src's device, converted to `dtype` (copy_convert of runtime/tensor_ops.h, on `stream`).
  static Tensor copy_of(const TensorView& src, DType dtype, MemCategory category, Stream stream = Stream::cpu());

  Tensor(Tensor&& other) noexcept { *this = std::move(other); }
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor() { release(); }

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  void* data() const { return view_.data(); }
  template <typename T>
  T* data_as() const {
    return view_.data_as<T>();
  }
  DType dtype() const { return view_.dtype(); }
  const Shape& shape() const { return view_.shape(); }
  std::int64_t dim(int i) const { return view_.dim(i); }
  std::int64_t numel() const { return view_.numel(); }
  std::size_t nbytes() const { return view_.nbytes(); }
  MemCategory category() const { return category_; }
  // True when this tensor owns storage (also for zero-size and 0-d shapes); false when default-constructed or
  // moved from.
  bool defined() const { return owner_ != nullptr; }

  // Every byte set to zero, ordered on `stream` (device buffers: cudaMemsetAsync, then the stream is synchronised).
  void fill_zero(Stream stream = Stream::cpu());

 private:
  void release();
  TensorView view_;
  void* owner_ = nullptr;
  std::size_t bytes_ = 0;
  MemCategory category_ = MemCategory::kWorkspace;
};

// Checks used at public boundaries: throw Error naming `what` and the mismatch.
void check_shape(const TensorView& t, const Shape& expected, const char* what);
void check_dtype(const TensorView& t, DType expected, const char* what);
void check_cpu(const TensorView& t, const char* what);
// The one device of `inputs` (views without data are skipped; Device::cpu() when all are); Error naming `what`
// and the two devices when they differ. A CP layer calls it on every input before anything is allocated or sent.
Device common_device(std::initializer_list<TensorView> inputs, const char* what);

}  // namespace seqpar
