#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job under mpirun: a distributed run checked against the
# single-rank reference of the same problem.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
np=${SEQPAR_DEMO_RANKS:-2}
echo "== demo: $np ranks =="
mpirun -np "$np" "$build_dir/tests/mpi/test_comm"
