#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (ctest labels `unit`, `mpi`, `package` and `python`: pytest
# and the training example under mpirun). Exits non-zero on any failure. Extra arguments go to ctest (for example:
# scripts/test.sh -L unit, scripts/test.sh -R ring, scripts/test.sh -L python).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$build_dir"
# Tests run side by side, one per core (SEQPAR_TEST_JOBS overrides): a multi-rank test counts as one, since its
# ranks mostly wait on each other (OMPI_MCA_mpi_yield_when_idle); the few that measure time against a deadline run alone
# (RUN_SERIAL).
ctest --output-on-failure --timeout 900 -j "${SEQPAR_TEST_JOBS:-$jobs}" "$@"
