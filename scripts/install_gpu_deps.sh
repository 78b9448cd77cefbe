#!/usr/bin/env bash
# What a CUDA build of seqpar needs beyond the CUDA toolkit (which brings cuDNN): the header-only cuDNN frontend,
# from PyPI's nvidia-cudnn-frontend at a pinned version, installed by name into an ignored folder of the checkout
# (default .deps/cudnn_frontend, or $SEQPAR_DEPS_DIR/cudnn_frontend) so that it travels with the checkout to a GPU
# machine that has no registry. Only its include/ folder is kept (about 3 MB). CMake finds it there
# (attention/CMakeLists.txt). Safe to run any number of times; prints the include directory. CPU-only builds do not
# need it.
# Also FlashInfer's header-only top-k (flashinfer/topk.cuh and the five headers it includes, about 0.3 MB) from
# PyPI's flashinfer-python at a pinned version, into .deps/flashinfer/include (SEQPAR_SKIP_FLASHINFER=1 skips it): the
# CUDA ops table's topk_rows uses it for fp32 rows when it is there (attention/cuda/ops_cuda.h); only the wheel's
# data/include/flashinfer/ headers are kept, nothing of it is committed.
# Also fla's chunk GDN kernel for gpu_check.sh's comparison (scripts/gdn_fla_bench.py): fla-core and einops, pure
# Python, pinned, into .deps/fla (about 14 MB; it needs the GPU machine's PyTorch and Triton). SEQPAR_SKIP_FLA=1 skips
# it.
set -euo pipefail

version=1.32.0  # the frontend carries version-specific guards for cuDNN's backend: change it deliberately
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${SEQPAR_DEPS_DIR:-$root/.deps}/cudnn_frontend

fla_pins="fla-core==0.6.0 einops==0.8.2"  # fla's chunk_gated_delta_rule (GVA: Hv a multiple of Hk) and its one dependency
fla_dest=${SEQPAR_DEPS_DIR:-$root/.deps}/fla
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ "${SEQPAR_SKIP_FLA:-0}" != 1 ]; then
  if [ -f "$fla_dest/fla/__init__.py" ] && [ "$(cat "$fla_dest/VERSION" 2>/dev/null)" = "$fla_pins" ]; then
    echo "install_gpu_deps: $fla_pins already in $fla_dest"
  else
    # shellcheck disable=SC2086
    python3 -m pip install --quiet --no-deps --disable-pip-version-check --root-user-action=ignore --target "$tmp/fla" $fla_pins
    [ -f "$tmp/fla/fla/ops/gated_delta_rule/chunk.py" ] || { echo "install_gpu_deps: $fla_pins has no fla/ops/gated_delta_rule" >&2; exit 1; }
    rm -rf "$fla_dest" "$tmp/fla/bin"
    mkdir -p "$(dirname "$fla_dest")"
    mv "$tmp/fla" "$fla_dest"
    echo "$fla_pins" > "$fla_dest/VERSION"
    echo "install_gpu_deps: $fla_pins in $fla_dest (PYTHONPATH for scripts/gdn_fla_bench.py)"
  fi
fi
flashinfer_version=0.7.2.post1  # topk.cuh's API (FilteredTopK, TopKTieBreak::Small) changes between releases
flashinfer_dest=${SEQPAR_DEPS_DIR:-$root/.deps}/flashinfer
flashinfer_headers="topk.cuh topk_common.cuh utils.cuh vec_dtypes.cuh exception.h math.cuh"
if [ "${SEQPAR_SKIP_FLASHINFER:-0}" != 1 ]; then
  if [ -f "$flashinfer_dest/include/flashinfer/topk.cuh" ] &&
     [ "$(cat "$flashinfer_dest/VERSION" 2>/dev/null)" = "$flashinfer_version" ]; then
    echo "install_gpu_deps: FlashInfer $flashinfer_version top-k headers already in $flashinfer_dest/include"
  else
    # the wheel (about 60 MB) is downloaded by name and pinned, then only the top-k headers are extracted
    python3 -m pip download --quiet --no-deps --disable-pip-version-check --dest "$tmp/fi" \
      "flashinfer-python==$flashinfer_version"
    rm -rf "$flashinfer_dest"
    mkdir -p "$flashinfer_dest/include/flashinfer"
    for h in $flashinfer_headers; do
      python3 - "$tmp"/fi/flashinfer_python-*.whl "flashinfer/data/include/flashinfer/$h" \
        "$flashinfer_dest/include/flashinfer/$h" <<'PY' || { echo "install_gpu_deps: flashinfer-python $flashinfer_version has no include/flashinfer/$h" >&2; exit 1; }
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    done
    echo "$flashinfer_version" > "$flashinfer_dest/VERSION"
    echo "install_gpu_deps: FlashInfer $flashinfer_version top-k headers in $flashinfer_dest/include"
  fi
fi
if [ -f "$dest/include/cudnn_frontend.h" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$version" ]; then
  echo "install_gpu_deps: cuDNN frontend $version already in $dest/include"
  exit 0
fi
python3 -m pip install --quiet --no-deps --disable-pip-version-check --root-user-action=ignore --target "$tmp" "nvidia-cudnn-frontend==$version"
[ -f "$tmp/include/cudnn_frontend.h" ] || { echo "install_gpu_deps: nvidia-cudnn-frontend $version has no include/cudnn_frontend.h" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp/include" "$dest/include"
echo "$version" > "$dest/VERSION"
echo "install_gpu_deps: cuDNN frontend $version headers in $dest/include"
