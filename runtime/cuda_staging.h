// Pinned-host staging of CUDA device buffers for host-memory transports (the MPI backend), so that several ranks
// may share one GPU in tests and small runs (NCCL refuses two ranks on one device). CUDA builds only: the CPU build
// never includes the implementation, and its MPI backend refuses device buffers.
//
// Protocol, per communication operation: check_device_buffer() at the public boundary (before anything is
// posted); stage() for every device buffer, which returns the pinned host view that the transport uses (filled
// from the device first when the operation reads the buffer); finish() once the transport has completed, which
// copies written views back to their device buffers. Copies run on the caller's stream, ordered after the work
// already queued there, and are host-synchronous (the staged path is for correctness, not speed). The pinned bytes
// are counted as comm_buffer in the memory ledger.
#pragma once

#if defined(SEQPAR_WITH_CUDA)

#include <cstddef>
#include <vector>

#include "cuda_check.h"
#include "tensor.h"

namespace seqpar {

// Makes CUDA device `ordinal` current for the scope and restores the previous device (shared by the CUDA-aware
// communicators).
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) {
    SEQPAR_CHECK_CUDA(cudaGetDevice(&previous_));
    if (previous_ != ordinal) SEQPAR_CHECK_CUDA(cudaSetDevice(ordinal));
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

// Throws Error "<op>: the MPI backend takes host buffers, or CUDA device buffers staged through pinned host
// memory; got <t>, ..." when `t` is labelled as a CUDA tensor but its pointer is not memory of that device (or no
// CUDA device is usable).
void check_device_buffer(const TensorView& t, const char* op);

class DeviceStaging {
 public:
  DeviceStaging() = default;
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;
  // Frees the pinned buffers (after finish(), or when the operation never started). Never throws.
  ~DeviceStaging();

  // The pinned host mirror of device buffer `t` (same dtype and shape, on the CPU). `read`: copied from the device
  // now, after the work queued on `stream` (a stream of another device, or the CPU stream, means the device's
  // default stream). `write`: copied back to `t` by finish().
  TensorView stage(const TensorView& t, bool read, bool write, const Stream& stream);
  // Copies every written mirror back to its device buffer and waits for the copies. Idempotent.
  void finish();
  // The transport may still touch the mirrors (an abandoned operation): keep them allocated for the life of the
  // process instead of freeing memory that MPI could still read or write.
  void abandon();

 private:
  struct Entry {
    TensorView device;
    void* pinned = nullptr;
    bool write = false;
    Stream stream;
  };
  std::vector<Entry> entries_;
  bool finished_ = false;
};

}  // namespace seqpar

#endif  // SEQPAR_WITH_CUDA
