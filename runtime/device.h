// Devices and streams. On the CPU a stream is a no-op ordering token, so that every kernel and communication
// call can take a stream from the start and the CUDA path uses the same signatures (stream last).
#pragma once

#include <string>

namespace seqpar {

enum class DeviceType : unsigned char { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static Device cpu() { return {}; }
  static Device cuda(int ordinal) { return {DeviceType::kCUDA, ordinal}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu" or "cuda:N"
};

// A stream: `handle` is a cudaStream_t on CUDA (nullptr = the default stream) and unused on the CPU, where all
// work is synchronous with the calling thread.
struct Stream {
  Device device;
  void* handle = nullptr;

  static Stream cpu() { return {}; }
  // Blocks until the work queued on this stream has finished (no-op on the CPU).
  void synchronize() const;
};

// Number of CUDA devices visible to this process; 0 when CUDA is not built or no device/driver is present.
int cuda_device_count();
// Why no CUDA device is usable ("seqpar was built without CUDA", the driver's error, ...); empty when one is.
std::string cuda_unavailable_reason();

}  // namespace seqpar
