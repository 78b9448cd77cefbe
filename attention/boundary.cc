#include "attention/boundary.h"

#include <numeric>

#include "runtime/error.h"
#include "runtime/tensor_checks.h"

namespace seqpar::attn::detail {

namespace {
thread_local bool t_accept = false;
thread_local Device t_accepted;
bool accepted(const Device& d) { return d.is_cpu() || (t_accept && d == t_accepted); }
}  // namespace

AcceptDevice::AcceptDevice(Device device) : had_(t_accept), previous_(t_accepted) {
  t_accept = true;
  t_accepted = device;
}
AcceptDevice::~AcceptDevice() {
  t_accept = had_;
  t_accepted = previous_;
}

void check_stream(const Stream& stream, const char* fn, const char* family) {
  SEQPAR_CHECK(accepted(stream.device), fn, ": stream on ", stream.device.str(), ", but ", family,
               " kernels have no CUDA implementation yet (pass host tensors and Stream::cpu())");
}

void check_host(const TensorView& t, const char* what, const char* family) {
  if (t_accept)
    SEQPAR_CHECK(accepted(t.device()), what, " ", t.str(), " is on ", t.device().str(), ", but this ", family,
                 " call runs on the stream's device ", t_accepted.str(), " (pass tensors on it or on the host)");
  SEQPAR_CHECK(accepted(t.device()), what, " ", t.str(), " is on ", t.device().str(), ", but ", family,
               " kernels have no CUDA implementation yet (pass host tensors)");
  SEQPAR_CHECK(t.numel() == 0 || t.data() != nullptr, what, " ", t.str(), " has no data");
}

void check_floating(const TensorView& t, const char* what, const char* family) {
  check_host(t, what, family);
  SEQPAR_CHECK(is_floating(t.dtype()), what, " has dtype ", dtype_name(t.dtype()),
               ", expected a floating dtype (fp32, bf16, fp16 or fp64)");
}

void check_host_tensor(const TensorView& t, const Shape& shape, DType dtype, const char* what, const char* family) {
  check_host(t, what, family);
  check_shape(t, shape, what);
  check_dtype(t, dtype, what);
}

std::vector<std::int64_t> positions_or_iota(std::span<const std::int64_t> pos, std::int64_t len, const char* what,
                                            const char* len_name) {
  std::vector<std::int64_t> out;
  if (pos.empty()) {
    out.resize(static_cast<std::size_t>(len));
    std::iota(out.begin(), out.end(), std::int64_t{0});
  } else {
    SEQPAR_CHECK(static_cast<std::int64_t>(pos.size()) == len, what, " has ", pos.size(),
                 " entries, expected 0 (meaning 0..", len - 1, ") or ", len_name, " = ", len);
    out.assign(pos.begin(), pos.end());
  }
  return out;
}

void check_non_decreasing(std::span<const std::int64_t> pos, const char* what) {
  for (std::size_t i = 1; i < pos.size(); ++i) {
    SEQPAR_CHECK(pos[i - 1] <= pos[i], what, " must be non-decreasing, but ", what, "[", i - 1, "] = ", pos[i - 1],
                 " > ", what, "[", i, "] = ", pos[i]);
  }
}

void check_strictly_increasing(std::span<const std::int64_t> pos, const char* what) {
  for (std::size_t i = 1; i < pos.size(); ++i) {
    SEQPAR_CHECK(pos[i] > pos[i - 1], what, " must be strictly increasing, but ", what, "[", i, "] = ", pos[i],
                 " follows ", pos[i - 1]);
  }
}

}  // namespace seqpar::attn::detail
