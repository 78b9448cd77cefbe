// Pinned-host staging of device buffers for the MPI backend (CUDA builds only).
#include "runtime/cuda_staging.h"

#include <cuda_runtime_api.h>

#include "runtime/logging.h"

namespace seqpar {
namespace {

constexpr const char* kTakes =
    "the MPI backend takes host buffers, or CUDA device buffers staged through pinned host memory";

cudaStream_t stream_for(const TensorView& t, const Stream& stream) {
  return stream.device == t.device() ? static_cast<cudaStream_t>(stream.handle) : nullptr;
}

}  // namespace

void check_device_buffer(const TensorView& t, const char* op) {
  if (t.device().is_cpu()) return;
  const int count = cuda_device_count();
  SEQPAR_CHECK(count > 0, op, ": ", kTakes, "; got ", t.str(), ", and ", cuda_unavailable_reason());
  SEQPAR_CHECK(t.device().index >= 0 && t.device().index < count, op, ": ", kTakes, "; got ", t.str(), ", but only ",
               count, " CUDA device(s) are visible");
  if (t.nbytes() == 0) return;  // nothing is copied; an empty tensor's pointer is a placeholder
  cudaPointerAttributes attr{};
  const cudaError_t rc = cudaPointerGetAttributes(&attr, t.data());
  if (rc != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) error so that later calls do not report it
    SEQPAR_THROW(op, ": ", kTakes, "; got ", t.str(), ", whose pointer CUDA cannot inspect: ", cudaGetErrorString(rc));
  }
  const bool device_memory = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  SEQPAR_CHECK(device_memory && attr.device == t.device().index, op, ": ", kTakes, "; got ", t.str(),
               ", whose pointer is ", device_memory ? str_cat("memory of cuda:", attr.device) : "not device memory");
}

DeviceStaging::~DeviceStaging() {
  for (Entry& e : entries_) {
    if (e.pinned == nullptr) continue;
    cudaFreeHost(e.pinned);  // destructor: report nothing, never throw
    memory_ledger().on_free(MemCategory::kCommBuffer, static_cast<std::int64_t>(e.device.nbytes()));
  }
}

TensorView DeviceStaging::stage(const TensorView& t, bool read, bool write, const Stream& stream) {
  SEQPAR_ASSERT(t.device().is_cuda(), "stage() of ", t.str());
  Entry e;
  e.device = t;
  e.write = write;
  e.stream = stream;
  const std::size_t bytes = t.nbytes();
  SEQPAR_CHECK_CUDA(cudaMallocHost(&e.pinned, bytes > 0 ? bytes : 1));
  memory_ledger().on_alloc(MemCategory::kCommBuffer, static_cast<std::int64_t>(bytes));  // pinned comm buffer
  entries_.push_back(e);  // owned from here, so that a failing copy does not leak the buffer
  if (read && bytes > 0) {
    DeviceScope scope(t.device().index);
    const cudaStream_t s = stream_for(t, stream);
    SEQPAR_CHECK_CUDA(cudaMemcpyAsync(e.pinned, t.data(), bytes, cudaMemcpyDeviceToHost, s));
    SEQPAR_CHECK_CUDA(cudaStreamSynchronize(s));
  }
  return TensorView(e.pinned, t.dtype(), t.shape(), Device::cpu());
}

void DeviceStaging::finish() {
  if (finished_) return;
  finished_ = true;
  for (const Entry& e : entries_) {
    if (!e.write || e.device.nbytes() == 0) continue;
    DeviceScope scope(e.device.device().index);
    const cudaStream_t s = stream_for(e.device, e.stream);
    SEQPAR_CHECK_CUDA(cudaMemcpyAsync(e.device.data(), e.pinned, e.device.nbytes(), cudaMemcpyHostToDevice, s));
    SEQPAR_CHECK_CUDA(cudaStreamSynchronize(s));
  }
}

void DeviceStaging::abandon() {
  finished_ = true;
  std::size_t bytes = 0;
  for (Entry& e : entries_) {
    bytes += e.device.nbytes();
    e.pinned = nullptr;  // intentionally kept (and still counted by the ledger): MPI may still use it
  }
  if (bytes > 0) {
    try {
      SEQPAR_LOG(kDebug) << "keeping " << bytes << " bytes of pinned staging memory of an abandoned operation";
    } catch (...) {
    }
  }
}

}  // namespace seqpar
