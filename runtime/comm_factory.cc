#include "runtime/comm_factory.h"

#if SEQPAR_WITH_MPI
#include "runtime/mpi_comm.h"
#endif
#include "runtime/nccl_comm.h"

namespace seqpar {

const char* communicator_backend_names() { return "mpi, nccl"; }

void check_communicator_backend(std::string_view backend) {
  SEQPAR_CHECK(backend == "mpi" || backend == "nccl", "unknown communicator backend '", backend, "': expected one of ",
               communicator_backend_names());
}

void check_communicator_backend_built(std::string_view backend) {
  check_communicator_backend(backend);
  SEQPAR_CHECK(backend != "nccl" || nccl_backend_built(), "backend nccl is not compiled into this build of seqpar ",
               "(SEQPAR_WITH_NCCL=OFF, no CUDA toolkit, or nccl.h not found); use --backend mpi");
}

std::unique_ptr<Communicator> make_world_communicator(std::string_view backend) {
  check_communicator_backend(backend);
#if SEQPAR_WITH_MPI
  if (backend == "mpi") return MpiCommunicator::world();
  if (backend == "nccl") {
    check_communicator_backend_built(backend);
    // The NCCL constructor agrees over the MPI bootstrap that every rank has its own usable device before NCCL
    // starts; a rank without one passes ordinal 0 and reports why.
    auto bootstrap = MpiCommunicator::world();
    const int ordinal = cuda_device_count() > 0 ? device_ordinal_from_local_rank() : 0;
    return std::make_unique<NcclCommunicator>(*bootstrap, ordinal);
  }
#else
  // Both backends start from MPI (NCCL bootstraps over it).
  SEQPAR_THROW("communicator backend '", backend, "' needs MPI, and this build of seqpar has none (configured with ",
               "SEQPAR_WITH_MPI=OFF; reconfigure with -DSEQPAR_WITH_MPI=ON, or use torch.distributed groups from ",
               "the Python module)");
#endif
  SEQPAR_ASSERT(false, "backend '", backend, "' passed check_communicator_backend but has no branch here");
}

}  // namespace seqpar
