// Tensor views (non-owning) and owning tensors allocated through the memory ledger.
//
// A TensorView is a pointer, a dtype, a shape and a device: always contiguous, row-major. It never owns memory
// (TransformerEngine's SimpleTensor habit). A Tensor owns its buffer, which it took from `ledger_allocate` with a
// memory category, and hands out views. Activations are [B, S, H, D]; lse is [B, H, S] (docs/design.md, "Conventions").
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
// The element count of `shape` (1 for a 0-d shape).
// Errors: a negative dimension; a shape too large to address in bytes.
// Sync: host-only.
std::int64_t shape_numel(const Shape& shape);

// A shape as text.
// Returns: e.g. "[2, 1024, 8, 64]".
// Sync: host-only.
std::string shape_str(const Shape& shape);

// A non-owning view: pointer, dtype, shape, device; always contiguous, row-major.
class TensorView {
 public:
  // An empty view (no data); or a view of `data`, which the caller keeps alive.
  // Sync: host-only, no copy.
  TensorView() = default;
  TensorView(void* data, DType dtype, Shape shape, Device device = Device::cpu())
      : data_(data), dtype_(dtype), shape_(std::move(shape)), device_(device) {}

  // Accessors: pointer, dtype, shape, rank, one dimension (negative i counts from the end), element count,
  // byte count, device. data_as<T>() is the pointer typed as T.
  // Errors: data_as<T> on a view of another dtype (internal check); dim(i) out of range (std::out_of_range).
  // Sync: host-only.
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
  // Sync: host-only.
  bool empty() const { return data_ == nullptr || numel() == 0; }

  // The same memory seen with another shape of the same element count.
  // Errors: an element count different from this view's.
  // Sync: host-only, no copy.
  TensorView reshape(Shape shape) const;

  // Rows [begin, end) of the outermost dimension.
  // Errors: a 0-d view, or not 0 <= begin <= end <= dim(0).
  // Sync: host-only, no copy.
  TensorView slice0(std::int64_t begin, std::int64_t end) const;

  // The view as text.
  // Returns: e.g. "fp32[2, 16, 4, 64]@cpu".
  // Sync: host-only.
  std::string str() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kFloat32;
  Shape shape_;
  Device device_;
};

// An owning tensor: its buffer comes from ledger_allocate with a memory category; it hands out views.
class Tensor {
 public:
  // An undefined tensor (no storage).
  Tensor() = default;

  // Uninitialised storage of `shape` and `dtype`.
  // Args: category: the memory-ledger tag (runtime/memory.h); scratch buffers need not name one.
  // Errors: a negative or too large shape; out of memory.
  // Sync: host-synchronous allocation.
  static Tensor empty(const Shape& shape, DType dtype, MemCategory category = MemCategory::kWorkspace,
                      Device device = Device::cpu());
  // Zero-filled storage.
  // Args: stream: orders the fill (a device buffer's stream, or Stream::cpu()).
  // Errors: as empty().
  // Sync: the fill is ordered on `stream` (see fill_zero).
  static Tensor zeros(const Shape& shape, DType dtype, MemCategory category = MemCategory::kWorkspace,
                      Device device = Device::cpu(), Stream stream = Stream::cpu());
  // A copy of `src` on src's device, converted to `dtype`.
  // Errors: as empty(), and as copy_convert of runtime/tensor_ops.h.
  // Sync: the copy is copy_convert on `stream`.
  static Tensor copy_of(const TensorView& src, DType dtype, MemCategory category, Stream stream = Stream::cpu());

  // Move-only; a moved-from tensor is undefined. The destructor returns the buffer to the ledger.
  Tensor(Tensor&& other) noexcept { *this = std::move(other); }
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor() { release(); }

  // Accessors: the view of the whole buffer (also by implicit conversion), and its fields as in TensorView;
  // category() is the memory-ledger tag.
  // Sync: host-only.
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
  // Sync: host-only.
  bool defined() const { return owner_ != nullptr; }

  // Every byte set to zero.
  // Errors: a device buffer when seqpar was built without CUDA; a failed CUDA call.
  // Sync: ordered on `stream`; device buffers: cudaMemsetAsync, then the stream is synchronised.
  void fill_zero(Stream stream = Stream::cpu());

 private:
  void release();
  TensorView view_;
  void* owner_ = nullptr;
  std::size_t bytes_ = 0;
  MemCategory category_ = MemCategory::kWorkspace;
};

// The one device of `inputs`. A CP layer calls it on every input before anything is allocated or sent.
// Args: inputs: views without data are skipped; what: names the caller in the error.
// Returns: the common device; Device::cpu() when every view is without data.
// Errors: two inputs on different devices (the message names `what` and the two devices).
// Sync: host-only, no communication.
Device common_device(std::initializer_list<TensorView> inputs, const char* what);

}  // namespace seqpar
