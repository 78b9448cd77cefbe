// The CUDA ops table's factory in a build without CUDA: it refuses with the reason (ops_cuda.h).
#include "attention/cuda/ops_cuda.h"
#include "runtime/error.h"

namespace seqpar::attn::ops {

template <typename T>
std::unique_ptr<Ops<T>> cuda_ops(Device device, Stream) {
  SEQPAR_CHECK(false, "cuda_ops: seqpar was built without CUDA (SEQPAR_WITH_CUDA=OFF); no CUDA table for ",
               device.str());
  return nullptr;
}
template std::unique_ptr<Ops<float>> cuda_ops<float>(Device, Stream);
template std::unique_ptr<Ops<double>> cuda_ops<double>(Device, Stream);

bool cuda_ops_built() { return false; }

}  // namespace seqpar::attn::ops
