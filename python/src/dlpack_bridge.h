// Zero-copy exchange of tensors between PyTorch and seqpar through DLPack (the stable C ABI of dmlc/dlpack's
// dlpack.h, unversioned "dltensor" capsules, which torch.Tensor.__dlpack__() makes and torch.from_dlpack() takes).
//
// In:  view_of(t) wraps the memory of a torch tensor (or any object with __dlpack__) in a TensorView: no copy. The
//      caller keeps the tensor alive for as long as the view is used (seqpar's layers copy what they save).
// Out: to_torch(tensor) hands an owning seqpar Tensor to torch: the DLPack deleter frees it when torch drops its
//      last reference (memory ledger category as allocated). No copy.
// Dtypes: fp64, fp32, bf16, fp16, int32, int64 (int64 for topk_indices and positions). CPU memory; in a CUDA build
// also CUDA device memory (DLPack kDLCUDA, the view on Device::cuda(device_id); exported the same way).
// Errors (seqpar::Error, naming `what`): a tensor on another device (a CUDA tensor in a build without CUDA names
// the rule: "built without CUDA (SEQPAR_WITH_CUDA=OFF)"), a dtype outside the list, a tensor that is not
// contiguous row-major (seqpar's views have no strides; call .contiguous() first), a non-zero byte offset that
// breaks the dtype's alignment, a tensor with torch's negative bit (a lazy negation DLPack does not carry).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "runtime/tensor.h"

namespace seqpar::python {

// A view of `tensor` (a torch.Tensor, detached; None gives an empty view).
TensorView view_of(pybind11::handle tensor, const char* what);
// The stream a layer call on `t` should run on: torch.cuda.current_stream(t's device) for a CUDA view (asked of
// torch through Python: torch is not linked), Stream::cpu() for a host view.
Stream current_stream(const TensorView& t);
// A torch.Tensor owning `tensor`'s buffer.
pybind11::object to_torch(Tensor&& tensor);
// A flat torch.Tensor over the memory of `view` (host or CUDA: DLPack kDLCUDA on its device), not owning it: the
// caller keeps the memory alive while torch uses the tensor (the torch.distributed communicator's device buffers).
pybind11::object borrow_torch(const TensorView& view);
// A torch int64 tensor holding `values` (copied once).
pybind11::object int64_tensor(const std::vector<std::int64_t>& values);

}  // namespace seqpar::python
