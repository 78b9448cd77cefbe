// NCCL backend of the Communicator interface. The class and its factory exist in every build so that callers
// can name it; until the CUDA + NCCL issue lands, constructing it throws "not built", and in a build without
// NCCL it throws saying so. Bootstrap (when built): rank 0 makes the unique id, `bootstrap` broadcasts it.
#pragma once

#include <memory>

#include "runtime/comm.h"

namespace seqpar {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `bootstrap`; binds this rank to CUDA device `device_ordinal`.
  NcclCommunicator(Communicator& bootstrap, int device_ordinal);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return "nccl"; }

  WorkHandle isend(const TensorView& buffer, int peer, int tag = 0) override;
  WorkHandle irecv(const TensorView& buffer, int peer, int tag = 0) override;
  WorkHandle batch_isend_irecv(const std::vector<P2POp>& ops) override;
  WorkHandle all_to_all(const TensorView& send, const TensorView& recv) override;
  WorkHandle all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_counts,
                          const TensorView& recv, const std::vector<std::int64_t>& recv_counts) override;
  WorkHandle all_gather(const TensorView& send, const TensorView& recv) override;
  WorkHandle reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) override;
  WorkHandle all_reduce(const TensorView& buffer, ReduceOp op) override;
  WorkHandle broadcast(const TensorView& buffer, int root) override;
  WorkHandle barrier() override;
  std::unique_ptr<Communicator> split(int color, int key) override;

 private:
  int rank_ = 0;
  int size_ = 1;
};

// True when this build contains the NCCL backend's implementation.
bool nccl_backend_built();

}  // namespace seqpar
