// One place that makes the world communicator for a backend name (for benchmarks and applications; tests may
// construct a backend directly). Adding a backend: its own files, plus one branch here. The third backend, over
// torch.distributed process groups, lives in the Python module (python/src/torch_comm.h, made by
// seqpar.torch_grid) so that this library never links torch.
#pragma once

#include <memory>
#include <string_view>

#include "comm.h"

namespace seqpar {

// The backends make_world_communicator knows, for help texts and errors: "mpi, nccl".
const char* communicator_backend_names();

// Throws Error "unknown communicator backend 'X': expected one of mpi, nccl" for a name make_world_communicator does
// not know (whether or not it is compiled in); no communication, so option parsers call it before the world exists.
void check_communicator_backend(std::string_view backend);

// check_communicator_backend, then names the build option for a backend this build lacks (nccl without NCCL); no
// communication. Programs call it once the ranks agree on the backend, so that ranks that disagree hear that first,
// and before a --dry-run's report, which refuses what the run would.
void check_communicator_backend_built(std::string_view backend);

// A communicator over every rank of the job, named "world", for `backend`:
//   "mpi"  - MpiCommunicator::world() (host buffers; CUDA builds also stage device buffers);
//   "nccl" - NcclCommunicator bootstrapped over MPI, on the CUDA device device_ordinal_from_local_rank() picks.
// Needs an initialised MPI (MpiSession / run_mpi_main). Collective over MPI_COMM_WORLD.
// Errors, raised on every rank alike: an unknown name and a backend not compiled into this build fail before any
// communication; "nccl" without a usable CUDA device on some rank fails on every rank after one agreement over MPI
// (before NCCL starts), the ranks without a device naming the reason.
std::unique_ptr<Communicator> make_world_communicator(std::string_view backend);

}  // namespace seqpar
