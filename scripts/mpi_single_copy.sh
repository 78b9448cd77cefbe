#!/usr/bin/env bash
# Which OpenMPI shared-memory single-copy mechanism works on this machine. Usage: mpi_single_copy.sh BUILD_DIR
# Prints "default" when messages between two local ranks work with OpenMPI's own choice (cross-memory attach, CMA, on
# Linux: the receiver reads the sender's buffer in one copy), or "none" when they do not (containers that refuse the
# ptrace permission CMA needs), then the caller sets OMPI_MCA_btl_vader_single_copy_mechanism=none: every large
# message is then copied twice through shared-memory fragments, and only while both ranks are inside MPI calls, so
# the ring's transfers no longer overlap compute (docs/operations.md, "MPI on one node"). A value the caller has already set is
# printed as it is, without probing. The probe: one 1 MiB sendrecv between 2 ranks (comm_bench, checked), at most
# 60 s, with OpenMPI's root and oversubscription permissions. Exit status 2, with a message and nothing on stdout,
# when it cannot probe: no BUILD_DIR, no comm_bench in it, or no mpirun.
set -uo pipefail
if [ $# -ne 1 ]; then
  echo "usage: mpi_single_copy.sh BUILD_DIR (the build directory holding benchmarks/comm_bench)" >&2
  exit 2
fi
comm_bench="$1/benchmarks/comm_bench"
if [ -n "${OMPI_MCA_btl_vader_single_copy_mechanism:-}" ]; then
  echo "$OMPI_MCA_btl_vader_single_copy_mechanism"
  exit 0
fi
if [ ! -x "$comm_bench" ]; then
  echo "mpi_single_copy.sh: cannot probe: $comm_bench is not an executable (build the benchmarks first)" >&2
  exit 2
fi
if ! command -v mpirun >/dev/null; then
  echo "mpi_single_copy.sh: cannot probe: mpirun is not on PATH" >&2
  exit 2
fi
if OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  timeout -k 5 60 mpirun -np 2 "$comm_bench" --ops sendrecv --groups ring --min-bytes 1M --max-bytes 1M --warmup 0 \
  --iters 1 </dev/null >/dev/null 2>&1; then
  echo default
else
  echo none
fi
