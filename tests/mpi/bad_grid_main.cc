// A program that must fail: under run_mpi_main it builds a bad CpGrid (argv[1] = "product": dp x ulysses x ring
// != world size; "disagree": rank 0 passes another grid than the others) or, with "one_rank", fails on rank 0
// alone while the other ranks wait in a barrier that would last 10 minutes. In every case the job must end
// within seconds with a non-zero status, each failed rank printing "rank R: error: <message>".
#include <cstdio>
#include <string>

#include "runtime/mpi_comm.h"
#include "runtime/cp_grid.h"

int main(int argc, char** argv) {
  return seqpar::run_mpi_main(argc, argv, [](int argc, char** argv) {
    const std::string mode = argc > 1 ? argv[1] : "";
    auto world = seqpar::MpiCommunicator::world();
    const int p = world->size(), rank = world->rank();
    seqpar::CpGridConfig config;
    if (mode == "product") {
      config.ulysses_size = p + 1;
    } else if (mode == "disagree") {
      config.ring_size = p;
      if (rank == 0) config = {1, p, 1, seqpar::Placement::kUlyssesInner};
    } else if (mode == "one_rank") {
      if (rank == 0) SEQPAR_THROW("deliberate failure on rank 0 only");
      world->barrier()->wait(600.0);
      return 0;
    } else {
      SEQPAR_THROW("usage: bad_grid_main product|disagree|one_rank (got '", mode, "')");
    }
    seqpar::CpGrid grid(*world, config);
    std::printf("rank %d: grid %s was accepted, which is a bug\n", rank, grid.str().c_str());
    return 0;
  });
}
