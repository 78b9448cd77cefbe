// The torch.distributed backend of the Communicator interface (runtime/comm.h), beside MPI and NCCL. It lives in
// the Python module, not in runtime/, so that the C++ library never links torch: every operation calls
// torch.distributed through Python (holding the GIL), on a ProcessGroup the user made: gloo (or mpi) for host
// buffers; nccl for CUDA buffers, which pass to the group as they are (no staging through the host; a group with
// nccl alone puts its own buffers, the agreement checks', on the current CUDA device). A buffer the group's backend
// cannot take (a device buffer on gloo, a host buffer on nccl alone) is refused naming the backend and the rule, on
// each rank before its message. Device buffers: posted after the caller's stream (set_stream) has finished its
// work, and wait() returns once torch's current stream has finished the operation. Compiled, never run on a GPU.
//
// Operations: isend / irecv (torch.distributed.isend / irecv with seqpar's tag), batch_isend_irecv (receives
// posted first), all_to_all and all_to_all_v (all_to_all_single), all_gather (all_gather_into_tensor),
// reduce_scatter (reduce_scatter_tensor), all_reduce, broadcast, barrier; all asynchronous (async_op=True). Buffers
// cross as torch tensors over seqpar's memory (host: torch.frombuffer; device: DLPack; no copy). split() is not supported: a grid over
// torch groups is built from the groups themselves (make_torch_grid).
//
// Work::wait(timeout) waits with torch's Work.wait(timeout) (the GIL released meanwhile); a failed or timed-out
// operation throws seqpar::Error naming the group, the operation, the bytes and the peers, as the MPI backend's do,
// followed by torch's own message. Gloo cannot cancel a pending receive: a timeout closes the connection to that
// peer (the peer's own operations then fail at once instead of waiting), so after a timeout the group is not usable.
// Buffers of an abandoned operation are kept alive (runtime/comm_keepalive.h), as in the MPI backend.
//
// A group of one rank needs no ProcessGroup: its collectives are local copies (point-to-point messages to itself
// are refused; seqpar's layers send none within a group of one rank).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "runtime/cp_grid.h"

namespace seqpar::python {

// A communicator over `process_group` (a torch.distributed ProcessGroup, or None for this rank alone), named
// `name`, whose group rank r is torch's global rank world_ranks[r] (the group's rank order:
// torch.distributed.get_process_group_ranks); this rank is group rank `rank`.
// Errors: rank outside [0, world_ranks.size()); None with more than one rank.
// Sync: host-only, no communication.
std::unique_ptr<Communicator> make_torch_communicator(pybind11::object process_group, std::vector<int> world_ranks,
                                                      int rank, std::string name);

// make_torch_communicator from a tuple (process_group or None, world_ranks, rank), as seqpar/distributed.py passes
// each group of a grid after checking across ranks that the groups form a dp x ulysses x ring grid.
// Errors: a tuple of another shape; as make_torch_communicator.
// Sync: host-only, no communication.
std::unique_ptr<Communicator> torch_communicator_from_spec(pybind11::handle spec, const char* name);

}  // namespace seqpar::python
