#include "dlpack_bridge.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "runtime/error.h"

namespace py = pybind11;

namespace seqpar::python {
namespace {

// The DLPack ABI (dlpack.h, versions 0.5-0.8: the layout of the unversioned capsule "dltensor").
struct DLDevice {
  std::int32_t device_type;  // kDLCPU = 1
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;  // kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements; null means compact row-major
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
constexpr std::int32_t kDLCPU = 1, kDLCUDA = 2;
constexpr std::uint8_t kDLInt = 0, kDLFloat = 2, kDLBfloat = 4;
constexpr const char* kCapsuleName = "dltensor";
#if defined(SEQPAR_WITH_CUDA)
constexpr const char* kTakes = "CPU or CUDA";
#else
constexpr const char* kTakes = "CPU";
#endif

DType dtype_of_dl(const DLDataType& t, const char* what) {
  SEQPAR_CHECK(t.lanes == 1, what, ": vector dtypes (DLPack lanes ", t.lanes, ") are not supported");
  if (t.code == kDLFloat && t.bits == 64) return DType::kFloat64;
  if (t.code == kDLFloat && t.bits == 32) return DType::kFloat32;
  if (t.code == kDLFloat && t.bits == 16) return DType::kFloat16;
  if (t.code == kDLBfloat && t.bits == 16) return DType::kBFloat16;
  if (t.code == kDLInt && t.bits == 64) return DType::kInt64;
  if (t.code == kDLInt && t.bits == 32) return DType::kInt32;
  SEQPAR_THROW(what, ": dtype (DLPack code ", int{t.code}, ", ", int{t.bits},
               " bits) is not one of float64, float32, bfloat16, float16, int64, int32");
}

DLDataType dl_of_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return {kDLFloat, 64, 1};
    case DType::kFloat32: return {kDLFloat, 32, 1};
    case DType::kFloat16: return {kDLFloat, 16, 1};
    case DType::kBFloat16: return {kDLBfloat, 16, 1};
    case DType::kInt64: return {kDLInt, 64, 1};
    case DType::kInt32: return {kDLInt, 32, 1};
  }
  SEQPAR_THROW("unknown dtype ", static_cast<int>(dtype));
}

// What an exported tensor's DLManagedTensor owns.
struct Exported {
  Tensor tensor;
  Shape shape;
  DLManagedTensor managed{};
};

// What a borrowed view's DLManagedTensor owns: its shape only (the memory stays the caller's).
struct Borrowed {
  std::int64_t numel = 0;
  DLManagedTensor managed{};
};

// A capsule nobody consumed (torch renames the ones it takes to "used_dltensor") still owns its tensor.
void destroy_capsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kCapsuleName)) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

// Kept for the life of the process: a static py::object would be released after the interpreter has finalised.
const py::object& torch_from_dlpack() {
  static const py::object* fn = new py::object(py::module_::import("torch").attr("from_dlpack"));
  return *fn;
}

}  // namespace

TensorView view_of(py::handle tensor, const char* what) {
  if (tensor.is_none()) return {};
  SEQPAR_CHECK(py::hasattr(tensor, "__dlpack__"), what, ": expected a torch.Tensor, got ",
               std::string(py::str(py::type::of(tensor).attr("__name__"))));
  // torch's lazy negation (the negative bit of torch._neg_view, which some autograd formulas return): DLPack exports
  // the memory without the negation, so the layer would compute on -x without a word.
  SEQPAR_CHECK(!py::hasattr(tensor, "is_neg") || !tensor.attr("is_neg")().cast<bool>(), what,
               ": the tensor has torch's negative bit set (a lazy negation, e.g. torch._neg_view): DLPack would hand "
               "over its memory without the negation; call .resolve_neg() first");
  py::object capsule;
  try {
    capsule = tensor.attr("__dlpack__")();
  } catch (py::error_already_set& e) {
    // torch raises BufferError for tensors DLPack cannot carry (the meta device, tensors that need a gradient
    // conjugation...): seqpar.Error naming the tensor, its device and torch's reason.
    if (!e.matches(PyExc_BufferError)) throw;
    const std::string device =
        py::hasattr(tensor, "device") ? std::string(py::str(tensor.attr("device"))) : std::string("unknown");
    const std::string reason = py::str(e.value());
    SEQPAR_THROW(what, ": a tensor on device '", device, "' cannot be viewed through DLPack (torch: ", reason,
                 "); seqpar's Python layers take CPU tensors with storage");
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), kCapsuleName));
  if (managed == nullptr) throw py::error_already_set();
  const DLTensor& t = managed->dl_tensor;
  Device device = Device::cpu();
  if (t.device.device_type == kDLCUDA) {
#if defined(SEQPAR_WITH_CUDA)
    device = Device::cuda(t.device.device_id);
#else
    SEQPAR_THROW(what, ": a CUDA tensor (cuda:", t.device.device_id,
                 "), but this seqpar was built without CUDA (SEQPAR_WITH_CUDA=OFF): its layers take CPU tensors only; "
                 "move the tensor with .cpu() or use a CUDA build");
#endif
  } else {
    SEQPAR_CHECK(t.device.device_type == kDLCPU, what, ": seqpar's Python layers take ", kTakes,
                 " tensors (DLPack device type ", t.device.device_type, ")");
  }
  const DType dtype = dtype_of_dl(t.dtype, what);
  Shape shape(t.shape, t.shape + t.ndim);
  // A tensor without elements addresses no memory: any strides are fine (torch gives such tensors strides that
  // are not row-major); the layers' shape checks name the empty dimension.
  const bool empty = std::find(shape.begin(), shape.end(), std::int64_t{0}) != shape.end();
  if (t.strides != nullptr && !empty) {
    std::int64_t expected = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      SEQPAR_CHECK(shape[d] == 1 || t.strides[d] == expected, what, ": tensor of shape ", shape_str(shape),
                   " is not contiguous (stride ", t.strides[d], " in dim ", d, " where ", expected,
                   " was expected); seqpar takes contiguous row-major tensors: call .contiguous() first");
      expected *= shape[d];
    }
  }
  SEQPAR_CHECK(t.byte_offset % dtype_size(dtype) == 0, what, ": byte offset ", t.byte_offset,
               " is not a multiple of the element size");
  // The view outlives the capsule (dropped here): the memory stays the caller's tensor's.
  return TensorView(static_cast<char*>(t.data) + t.byte_offset, dtype, std::move(shape), device);
}

Stream current_stream(const TensorView& t) {
  if (t.device().is_cpu()) return Stream::cpu();
  // torch.cuda.current_stream(index).cuda_stream: the cudaStream_t as an integer (torch is not linked)
  const py::object s = py::module_::import("torch").attr("cuda").attr("current_stream")(t.device().index);
  const auto handle = s.attr("cuda_stream").cast<std::uintptr_t>();
  return Stream{t.device(), reinterpret_cast<void*>(handle)};
}

// Hands `owner` (an Exported or a Borrowed) to torch.from_dlpack as a dense tensor of `data`: ndim dimensions of
// `shape` (owned by `owner`), dtype, device; torch's drop of the tensor deletes the owner.
template <typename Owner>
py::object hand_to_torch(std::unique_ptr<Owner> owner, void* data, const Device& device, DType dtype, int ndim,
                         std::int64_t* shape) {
  DLTensor& t = owner->managed.dl_tensor;
  t.data = data;
  t.device = device.is_cpu() ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, device.index};
  t.ndim = static_cast<std::int32_t>(ndim);
  t.dtype = dl_of_dtype(dtype);
  t.shape = shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  owner->managed.manager_ctx = owner.get();
  owner->managed.deleter = [](DLManagedTensor* self) { delete static_cast<Owner*>(self->manager_ctx); };
  DLManagedTensor* managed = &owner.release()->managed;
  py::capsule capsule(managed, kCapsuleName, &destroy_capsule);
  return torch_from_dlpack()(capsule);
}

py::object to_torch(Tensor&& tensor) {
  auto owner = std::make_unique<Exported>();
  owner->tensor = std::move(tensor);
  owner->shape = owner->tensor.shape();
  void* data = owner->tensor.data();
  const Device device = owner->tensor.view().device();
  const DType dtype = owner->tensor.dtype();
  const int ndim = static_cast<int>(owner->shape.size());
  std::int64_t* shape = owner->shape.data();
  return hand_to_torch(std::move(owner), data, device, dtype, ndim, shape);
}

py::object borrow_torch(const TensorView& view) {
  auto owner = std::make_unique<Borrowed>();
  owner->numel = view.numel();
  std::int64_t* shape = &owner->numel;
  return hand_to_torch(std::move(owner), view.data(), view.device(), view.dtype(), 1, shape);
}

py::object int64_tensor(const std::vector<std::int64_t>& values) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(values.size())}, DType::kInt64, MemCategory::kWorkspace);
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(std::int64_t));
  return to_torch(std::move(t));
}

}  // namespace seqpar::python
