#include "runtime/comm.h"

namespace seqpar {

void wait_all(std::vector<WorkHandle>& works) {
  for (auto& w : works) {
    if (w) w->wait();
  }
}

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "max"; }

void check_peer(const Communicator& comm, int peer, const char* op) {
  SEQPAR_CHECK(0 <= peer && peer < comm.size(), op, ": peer ", peer, " is outside the communicator of size ",
               comm.size());
}

}  // namespace seqpar
