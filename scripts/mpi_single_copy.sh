#!/usr/bin/env bash
# Which OpenMPI shared-memory single-copy mechanism works on this machine. Usage: mpi_single_copy.sh BUILD_DIR
# Prints "default" when messages between two local ranks work with OpenMPI's own choice (cross-memory attach, CMA, on
# Linux: the receiver reads the sender's buffer in one copy), or "none" when they do not (containers that refuse the
# ptrace permission CMA needs), then the caller sets OMPI_MCA_btl_vader_single_copy_mechanism=none: every large
# message is then copied twice through shared-memory fragments, and only while both ranks are inside MPI calls, so
# the ring's transfers no longer overlap compute (README, "MPI on one node"). A value the caller has already set is
# printed as it is, without probing. The probe: one 1 MiB sendrecv between 2 ranks (comm_bench, checked), at most
# 60 s. Needs OpenMPI's root / oversubscribe variables in the environment when run as root.
set -uo pipefail
build_dir=${1:?usage: mpi_single_copy.sh BUILD_DIR}
if [ -n "${OMPI_MCA_btl_vader_single_copy_mechanism:-}" ]; then
  echo "$OMPI_MCA_btl_vader_single_copy_mechanism"
  exit 0
fi
if timeout 60 mpirun -np 2 "$build_dir/benchmarks/comm_bench" --ops sendrecv --groups ring --min-bytes 1M \
  --max-bytes 1M --warmup 0 --iters 1 >/dev/null 2>&1; then
  echo default
else
  echo none
fi
