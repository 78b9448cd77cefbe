"""A failure on one rank must stop the job (ctest python.fail_one_rank, run under mpirun with SEQPAR_COMM_TIMEOUT_S
above the test's time limit): the last rank raises, the others wait in a collective that rank never joins, and
seqpar's excepthook must end the job with MPI_Abort, with the exception's message, well before any timeout."""

import sys

import seqpar

world = seqpar.world()
grid = seqpar.CpGrid(1, 1, world.size)
if world.rank == world.size - 1:
    raise RuntimeError(f"deliberate failure on rank {world.rank} alone")
grid.cp.barrier()  # never completes: the last rank is gone
print("error: the barrier completed", file=sys.stderr)
sys.exit(0)  # a zero exit fails the test
