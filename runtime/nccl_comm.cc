#include "runtime/nccl_comm.h"

namespace seqpar {
namespace {
[[noreturn]] void not_built(const char* op) {
#if defined(SEQPAR_WITH_NCCL)
  SEQPAR_THROW("backend nccl does not support ", op, " yet: the NCCL backend is not built (it lands with the CUDA "
               "issue); use the MPI backend");
#else
  SEQPAR_THROW("backend nccl does not support ", op, ": seqpar was built without NCCL (SEQPAR_WITH_NCCL=OFF, no "
               "CUDA toolkit, or nccl.h not found)");
#endif
}
}  // namespace

bool nccl_backend_built() { return false; }

NcclCommunicator::NcclCommunicator(Communicator&, int) { not_built("construction"); }
NcclCommunicator::~NcclCommunicator() = default;
WorkHandle NcclCommunicator::isend(const TensorView&, int, int) { not_built("isend"); }
WorkHandle NcclCommunicator::irecv(const TensorView&, int, int) { not_built("irecv"); }
WorkHandle NcclCommunicator::batch_isend_irecv(const std::vector<P2POp>&) { not_built("batch_isend_irecv"); }
WorkHandle NcclCommunicator::all_to_all(const TensorView&, const TensorView&) { not_built("all_to_all"); }
WorkHandle NcclCommunicator::all_to_all_v(const TensorView&, const std::vector<std::int64_t>&, const TensorView&,
                                          const std::vector<std::int64_t>&) {
  not_built("all_to_all_v");
}
WorkHandle NcclCommunicator::all_gather(const TensorView&, const TensorView&) { not_built("all_gather"); }
WorkHandle NcclCommunicator::reduce_scatter(const TensorView&, const TensorView&, ReduceOp) {
  not_built("reduce_scatter");
}
WorkHandle NcclCommunicator::all_reduce(const TensorView&, ReduceOp) { not_built("all_reduce"); }
WorkHandle NcclCommunicator::broadcast(const TensorView&, int) { not_built("broadcast"); }
WorkHandle NcclCommunicator::barrier() { not_built("barrier"); }
std::unique_ptr<Communicator> NcclCommunicator::split(int, int) { not_built("split"); }

}  // namespace seqpar
