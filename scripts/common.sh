# Shared by demo.sh and test.sh: install what is missing, configure and build into $SEQPAR_BUILD_DIR.
# Environment: SEQPAR_BUILD_DIR (default build), SEQPAR_CMAKE_ARGS (extra configure flags), SEQPAR_JOBS.
# A caller may set, before sourcing: build_targets (an array; default: everything) and skip_python=1 (no pip
# installs: for a caller that runs no Python, as demo.sh).
set -euo pipefail
build_targets=("${build_targets[@]+"${build_targets[@]}"}")
skip_python=${skip_python:-0}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${SEQPAR_BUILD_DIR:-$root/build}
jobs=${SEQPAR_JOBS:-$(OMP_NUM_THREADS= nproc)}

"$root/scripts/install_deps.sh"

# The Python module and its tests (docs/python.md): pip installs, by name, the packages that do not import
# yet (torch from PyPI runs on the CPU). Without them the module or its tests are left out (CMake says which), and
# everything else still builds and runs.
python_missing=()
[ "$skip_python" = 1 ] || for p in torch pybind11 mpi4py numpy pytest; do
  python3 -c "import $p" 2>/dev/null || python_missing+=("$p")
done
if [ ${#python_missing[@]} -gt 0 ]; then
  echo "common.sh: pip installing ${python_missing[*]}"
  # (a Debian python3 marks its environment externally managed, PEP 668: the second try installs anyway)
  python3 -m pip install -q "${python_missing[@]}" ||
    python3 -m pip install -q --break-system-packages "${python_missing[@]}" ||
    echo "common.sh: warning: pip install ${python_missing[*]} failed; the Python module or its tests will be off" >&2
fi

# transformers, for the Hugging Face tests only (python/tests_hf, ctest python.hf.*, python.torchrun.hf.*): by name,
# pinned to the version they last passed with, separately, so that a failure leaves every other test as it was;
# those tests then skip and say why.
if [ "$skip_python" != 1 ] && ! python3 -c "import transformers" 2>/dev/null && python3 -c "import torch" 2>/dev/null; then
  echo "common.sh: pip installing transformers (for python/tests_hf)"
  python3 -m pip install -q "transformers==5.24.0" ||
    python3 -m pip install -q --break-system-packages "transformers==5.24.0" ||
    echo "common.sh: warning: pip install transformers failed; the Hugging Face tests will be skipped" >&2
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  # shellcheck disable=SC2086
  # The in-tree build is for this machine (-march=native; a later SEQPAR_CMAKE_ARGS=-DSEQPAR_NATIVE=OFF wins).
  cmake -S "$root" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DSEQPAR_NATIVE=ON ${SEQPAR_CMAKE_ARGS:-}
fi
if [ ${#build_targets[@]} -gt 0 ]; then
  cmake --build "$build_dir" -j "$jobs" --target "${build_targets[@]}"
else
  cmake --build "$build_dir" -j "$jobs"
fi

# mpirun as root and with more ranks than cores (OpenMPI); harmless elsewhere.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
# Large messages between local ranks: one copy by cross-memory attach where the machine allows it, else (containers
# without the ptrace permission) copy-in/copy-out through shared memory, slower and not overlapped with compute.
# (When the probe cannot run, e.g. a build without the benchmarks, the fallback is the setting that works everywhere.)
single_copy=$("$root/scripts/mpi_single_copy.sh" "$build_dir") || single_copy=none
if [ "$single_copy" = none ] && [ -z "${OMPI_MCA_btl_vader_single_copy_mechanism:-}" ]; then
  echo "common.sh: cross-memory attach is refused here (or could not be probed); OpenMPI copies large messages" \
    "through shared memory (OMPI_MCA_btl_vader_single_copy_mechanism=none): ring timings show more exposed" \
    "communication" >&2
  export OMPI_MCA_btl_vader_single_copy_mechanism=none
fi
