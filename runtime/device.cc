#include "runtime/device.h"

#include "runtime/cuda_check.h"

namespace seqpar {

std::string Device::str() const { return is_cpu() ? std::string("cpu") : str_cat("cuda:", index); }

#if defined(SEQPAR_WITH_CUDA)
void Stream::synchronize() const {
  if (device.is_cuda()) SEQPAR_CHECK_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(handle)));
}
int cuda_device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}
std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) return str_cat("no usable CUDA device: ", cudaGetErrorString(rc));
  if (count == 0) return "no CUDA device is present";
  return {};
}
#else
void Stream::synchronize() const {
  SEQPAR_CHECK(device.is_cpu(), "stream on ", device.str(), ": seqpar was built without CUDA");
}
int cuda_device_count() { return 0; }
std::string cuda_unavailable_reason() { return "seqpar was built without CUDA (SEQPAR_WITH_CUDA=OFF or no nvcc)"; }
#endif

}  // namespace seqpar
