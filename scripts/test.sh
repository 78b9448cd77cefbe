#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (ctest labels `unit`, `mpi`, `package` and `python`: pytest
# and the training example under mpirun). Exits non-zero on any failure. Extra arguments go to ctest (for example:
# scripts/test.sh -L unit, scripts/test.sh -R ring, scripts/test.sh -L python).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$build_dir"
ctest --output-on-failure --timeout 900 "$@"
