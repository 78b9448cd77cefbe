#!/usr/bin/env bash
# The Python module built without MPI (SEQPAR_WITH_MPI=OFF, MPI hidden from CMake) runs seqpar's layers under
# torchrun over gloo: configure <build dir> (Release, only the module: no tests, benchmarks or examples), build the
# module, check that neither it nor anything it loads needs an MPI library (readelf, ldd), that the C++ communicator
# factory and the module's MPI entry points raise seqpar.Error naming the option, then torchrun_layers.py and the
# Hugging Face tests at 2 processes (mpi4py blocked).
#   no_mpi_build.sh <source dir> <build dir> <python> [cmake arguments: generator, compiler launcher...]
set -euo pipefail
src=$1 build=$2 python=$3
shift 3
cmake -S "$src" -B "$build" "$@" -DCMAKE_BUILD_TYPE=Release -DSEQPAR_WITH_MPI=OFF -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON \
  -DSEQPAR_BUILD_PYTHON=ON -DSEQPAR_BUILD_TESTS=OFF -DSEQPAR_BUILD_BENCHMARKS=OFF -DSEQPAR_BUILD_EXAMPLES=OFF \
  -DSEQPAR_INSTALL=OFF -DSEQPAR_WITH_CUDA=OFF -DPython3_EXECUTABLE="$python" >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" --target _seqpar -j "${SEQPAR_NO_MPI_BUILD_JOBS:-2}"

module=$(ls "$build"/python/seqpar/_seqpar*.so)
echo "module: $module"
readelf -d "$module" | grep NEEDED
if readelf -d "$module" | grep NEEDED | grep -i mpi; then echo "FAIL: the module needs an MPI library"; exit 1; fi
if ldd "$module" | grep -i 'libmpi\|libopen-rte\|libopen-pal\|libpmix'; then
  echo "FAIL: an MPI library is loaded with the module"; exit 1
fi

# The C++ runtime alone: links without MPI, and its communicator factory refuses both backends naming the option.
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
"$cxx" -std=c++20 -I"$src" -I"$build/generated" -x c++ - -x none "$build/runtime/libseqpar_runtime.a" -lpthread \
  -o "$build/factory_without_mpi" <<'CXX'
#include <cstdio>
#include <string>
#include "runtime/comm_factory.h"
int main() {
  for (const char* backend : {"mpi", "nccl"}) {
    try {
      seqpar::make_world_communicator(backend);
      std::printf("FAIL: backend %s made a communicator without MPI\n", backend);
      return 1;
    } catch (const seqpar::Error& e) {
      if (std::string(e.what()).find("SEQPAR_WITH_MPI=OFF") == std::string::npos) return 1;
      std::printf("backend %s refused: %s\n", backend, e.what());
    }
  }
}
CXX
"$build/factory_without_mpi"

no_mpi4py=$src/python/torch_tests/no_mpi4py
export PYTHONPATH=$build/python:$no_mpi4py PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1
cd "$build"  # not the ctest directory, whose seqpar/ (the build with MPI) `python -` would import first
"$python" - <<'PY'
import seqpar
assert seqpar._seqpar.with_mpi is False, f"{seqpar._seqpar.__file__} was built with MPI"
assert not seqpar._seqpar.mpi_initialized()
for name, call in (("world", seqpar.world), ("CpGrid", lambda: seqpar.CpGrid(1, 1, 2)),
                   ("from_mpi4py", lambda: seqpar.from_mpi4py(object()))):
    try:
        call()
    except seqpar.Error as e:
        assert "SEQPAR_WITH_MPI=OFF" in str(e) and "torch.distributed group" in str(e), str(e)
    else:
        raise AssertionError(f"seqpar.{name} did not raise in a build without MPI")
print("without MPI: seqpar.world(), CpGrid over MPI and from_mpi4py raise seqpar.Error naming SEQPAR_WITH_MPI=OFF")
PY
"$python" -m torch.distributed.run --standalone --nproc-per-node 2 "$src/python/torch_tests/torchrun_layers.py"
# The Hugging Face tests (skipped with the reason when transformers does not import).
exec "$python" -m torch.distributed.run --standalone --nproc-per-node 2 -m pytest -q -rs -p no:cacheprovider \
  "$src/python/tests_hf"
