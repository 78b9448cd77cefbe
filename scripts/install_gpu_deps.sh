#!/usr/bin/env bash
# What a CUDA build of seqpar needs beyond the CUDA toolkit (which brings cuDNN): the header-only cuDNN frontend,
# from PyPI's nvidia-cudnn-frontend at a pinned version, installed by name into an ignored folder of the checkout
# (default .deps/cudnn_frontend, or $SEQPAR_DEPS_DIR/cudnn_frontend) so that it travels with the checkout to a GPU
# machine that has no registry. Only its include/ folder is kept (about 3 MB). CMake finds it there
# (attention/CMakeLists.txt). Safe to run any number of times; prints the include directory. CPU-only builds do not
# need it.
set -euo pipefail

version=1.32.0  # the frontend carries version-specific guards for cuDNN's backend: change it deliberately
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${SEQPAR_DEPS_DIR:-$root/.deps}/cudnn_frontend

if [ -f "$dest/include/cudnn_frontend.h" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$version" ]; then
  echo "install_gpu_deps: cuDNN frontend $version already in $dest/include"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip install --quiet --no-deps --disable-pip-version-check --root-user-action=ignore --target "$tmp" "nvidia-cudnn-frontend==$version"
[ -f "$tmp/include/cudnn_frontend.h" ] || { echo "install_gpu_deps: nvidia-cudnn-frontend $version has no include/cudnn_frontend.h" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp/include" "$dest/include"
echo "$version" > "$dest/VERSION"
echo "install_gpu_deps: cuDNN frontend $version headers in $dest/include"
