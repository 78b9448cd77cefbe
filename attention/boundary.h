// Internal to attention/: argument checks shared by the public boundary files (mha.cc, dsa.cc, gdn.cc, rope.cc).
// Not a public header. Every check throws seqpar::Error naming the value and the rule.
//
// TensorViews are contiguous and row-major by construction, so the boundaries check shapes, dtypes, devices and
// data pointers only. The kernels exist for host memory; a CUDA tensor or stream is rejected with
// "<family> kernels have no CUDA implementation yet" until attention/cuda/ exists.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "../runtime/device.h"
#include "../runtime/tensor.h"

namespace seqpar::attn::detail {

// While an AcceptDevice is alive on this thread, check_stream and the tensor checks below also accept streams and
// tensors on `device` (a CUDA device): the ops-table route of a family (gdn.cc's CUDA route) validates its arguments
// with the same checks. Values the checks read on the host (cu_seqlens) are checked for the host by their caller.
class AcceptDevice {
 public:
  explicit AcceptDevice(Device device);
  ~AcceptDevice();
  AcceptDevice(const AcceptDevice&) = delete;
  AcceptDevice& operator=(const AcceptDevice&) = delete;

 private:
  bool had_ = false;
  Device previous_;
};

// A real-valued option (scale, softcap, grad_scale; held in double) as the kernels of `dtype` read it: fp64 keeps the
// double; every other dtype takes its fp32 rounding, the precision those kernels compute in.
inline double real_option(double value, DType dtype) {
  return dtype == DType::kFloat64 ? value : static_cast<double>(static_cast<float>(value));
}

// fn: the public function ("dsa_attention_forward"); family: "MHA", "DSA", "GDN" or "RoPE".
void check_stream(const Stream& stream, const char* fn, const char* family);
// A host tensor with data (or no elements).
void check_host(const TensorView& t, const char* what, const char* family);
// check_host and a floating dtype.
void check_floating(const TensorView& t, const char* what, const char* family);
// check_host, `shape` and `dtype`.
void check_host_tensor(const TensorView& t, const Shape& shape, DType dtype, const char* what, const char* family);

// The positions `pos` of `len` tokens: the span, or 0..len-1 when it is empty; any other size is an error naming
// `what` and `len_name`.
std::vector<std::int64_t> positions_or_iota(std::span<const std::int64_t> pos, std::int64_t len, const char* what,
                                            const char* len_name);
void check_non_decreasing(std::span<const std::int64_t> pos, const char* what);
void check_strictly_increasing(std::span<const std::int64_t> pos, const char* what);

}  // namespace seqpar::attn::detail
